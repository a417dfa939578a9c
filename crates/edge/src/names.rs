//! Checks of names a user gives: users (uids) and hostnames. Pure; used by the create
//! validation and by commands that run as a user.

use crate::error::EdgeError;

/// Checks a user name or uid (`root`, `1000`, `agent`).
pub fn validate_user(key: &str, u: &str) -> Result<(), EdgeError> {
    let numeric = !u.is_empty()
        && u.len() <= 10
        && u.bytes().all(|b| b.is_ascii_digit())
        && u.parse::<u32>().is_ok();
    let mut bytes = u.bytes();
    let name = matches!(bytes.next(), Some(b) if b.is_ascii_lowercase() || b == b'_')
        && u.len() <= 32
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b));
    if numeric || name {
        Ok(())
    } else {
        Err(EdgeError::BadRequest(format!(
            "{key} {u:?} must be a user name ([a-z_][a-z0-9_.-]{{0,31}}) or a numeric uid"
        )))
    }
}

/// Checks a hostname: dot-separated labels of `[A-Za-z0-9-]`, at most 64 characters.
pub fn validate_hostname(h: &str) -> Result<(), EdgeError> {
    let ok = !h.is_empty()
        && h.len() <= 64
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(EdgeError::BadRequest(format!(
            "hostname {h:?} must be at most 64 characters of dot-separated labels [A-Za-z0-9-] not starting or ending with '-'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_hostnames() {
        for ok in ["root", "1000", "agent", "_svc", "a.b-c"] {
            validate_user("init_user", ok).unwrap();
        }
        for bad in ["", "Root", "1a b", "x/y", "99999999999"] {
            assert!(validate_user("init_user", bad).is_err(), "{bad}");
        }
        for ok in ["box", "a-b.example.test", "X1"] {
            validate_hostname(ok).unwrap();
        }
        for bad in ["", "a..b", "a_b", &"a".repeat(65)] {
            assert!(validate_hostname(bad).is_err(), "{bad}");
        }
    }
}
