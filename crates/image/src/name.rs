//! Image references: `name[:tag]`, normalised to `name:tag`.

use crate::ImageError;

/// Longest accepted reference, tag included.
pub const MAX_REF_LEN: usize = 128;
/// Tag used when a reference has none.
pub const DEFAULT_TAG: &str = "latest";

/// Validates `reference` and returns its canonical `name:tag` form
/// (`debian` becomes `debian:latest`).
///
/// Names match `[a-z0-9][a-z0-9._/-]*`, tags `[A-Za-z0-9._-]+`; the whole
/// reference is at most [`MAX_REF_LEN`] characters and must not contain `..`.
pub fn canonical(reference: &str) -> Result<String, ImageError> {
    let bad = || ImageError::InvalidName(reference.to_string());
    if reference.is_empty() || reference.len() > MAX_REF_LEN || reference.contains("..") {
        return Err(bad());
    }
    let (name, tag) = match reference.split_once(':') {
        Some((n, t)) => (n, t),
        None => (reference, DEFAULT_TAG),
    };
    let mut name_chars = name.bytes();
    match name_chars.next() {
        Some(c) if c.is_ascii_lowercase() || c.is_ascii_digit() => {}
        _ => return Err(bad()),
    }
    if !name_chars.all(|c| {
        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'/' | b'-')
    }) {
        return Err(bad());
    }
    // A trailing or doubled slash would make an odd-looking, ambiguous name.
    if name.ends_with('/') || name.contains("//") {
        return Err(bad());
    }
    if tag.is_empty()
        || !tag
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
    {
        return Err(bad());
    }
    let out = format!("{name}:{tag}");
    if out.len() > MAX_REF_LEN {
        return Err(bad());
    }
    Ok(out)
}

/// True if `digest` looks like a layer digest (64 lowercase hex characters).
pub fn is_digest(digest: &str) -> bool {
    digest.len() == 64
        && digest
            .bytes()
            .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_tag() {
        assert_eq!(canonical("debian").unwrap(), "debian:latest");
        assert_eq!(canonical("debian:latest").unwrap(), "debian:latest");
        assert_eq!(
            canonical("swe/sphinx-9658:official").unwrap(),
            "swe/sphinx-9658:official"
        );
        assert_eq!(canonical("a.b_c-d:V1.2_x-y").unwrap(), "a.b_c-d:V1.2_x-y");
        assert_eq!(canonical("0abc").unwrap(), "0abc:latest");
    }

    #[test]
    fn rejects_bad_names() {
        for bad in [
            "", "Debian", "-x", ".x", "/x", "_x", "a..b", "a/../b", "a:", ":tag", "a:b:c", "a:t/g",
            "a b", "a/", "a//b", "a:..", "ä",
        ] {
            assert!(canonical(bad).is_err(), "{bad:?} accepted");
        }
        let long = "a".repeat(MAX_REF_LEN);
        assert!(
            canonical(&long).is_err(),
            "adding :latest exceeds the limit"
        );
        let ok = "a".repeat(MAX_REF_LEN - ":latest".len());
        assert!(canonical(&ok).is_ok());
        assert!(canonical(&"a".repeat(MAX_REF_LEN + 1)).is_err());
    }

    #[test]
    fn digests() {
        assert!(is_digest(&"ab".repeat(32)));
        assert!(!is_digest(&"AB".repeat(32)));
        assert!(!is_digest("../../etc"));
        assert!(!is_digest(&"a".repeat(63)));
    }
}
