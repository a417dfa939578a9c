//! The sandbox user: parsed from the sandbox root's /etc/passwd and /etc/group (never NSS, so
//! the static binary behaves the same in every image).

use std::fmt;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (including the primary one).
    pub groups: Vec<u32>,
    pub home: String,
    pub shell: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownUser(pub String);

impl fmt::Display for UnknownUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown user {:?} (not in /etc/passwd)", self.0)
    }
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
    shell: &'a str,
}

fn parse_passwd_line(line: &str) -> Option<PasswdEntry<'_>> {
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 || line.starts_with('#') {
        return None;
    }
    Some(PasswdEntry {
        name: f[0],
        uid: f[2].parse().ok()?,
        gid: f[3].parse().ok()?,
        home: f[5],
        shell: f[6],
    })
}

/// Finds `spec` (a name, or a numeric uid) in passwd/group contents. A numeric uid missing from
/// passwd is still accepted (gid = uid, home = /), as container runtimes do.
pub fn resolve(spec: &str, passwd: &str, group: &str) -> Result<User, UnknownUser> {
    let spec = spec.trim();
    let by_uid: Option<u32> = spec.parse().ok();
    let found = passwd
        .lines()
        .filter_map(parse_passwd_line)
        .find(|e| match by_uid {
            Some(u) => e.uid == u,
            None => e.name == spec,
        });
    let (name, uid, gid, home, shell) = match (found, by_uid) {
        (Some(e), _) => (
            e.name.to_string(),
            e.uid,
            e.gid,
            e.home.to_string(),
            e.shell.to_string(),
        ),
        (None, Some(u)) => (u.to_string(), u, u, "/".to_string(), String::new()),
        (None, None) => return Err(UnknownUser(spec.to_string())),
    };
    let mut groups = vec![gid];
    for line in group.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(g) = f[2].parse::<u32>() else { continue };
        if f[3].split(',').any(|m| m.trim() == name) && !groups.contains(&g) {
            groups.push(g);
        }
    }
    let home = if home.is_empty() {
        "/".to_string()
    } else {
        home
    };
    Ok(User {
        name,
        uid,
        gid,
        groups,
        home,
        shell,
    })
}

/// Resolves against the files of the current root.
pub fn resolve_here(spec: &str) -> Result<User, UnknownUser> {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
    resolve(spec, &passwd, &group)
}

/// The user aether itself runs as (bare mode).
pub fn current() -> User {
    let (uid, gid) = crate::sys::getuid_gid();
    match resolve_here(&uid.to_string()) {
        Ok(mut u) => {
            if u.home == "/" {
                if let Ok(h) = std::env::var("HOME") {
                    u.home = h;
                }
            }
            u
        }
        Err(_) => User {
            name: uid.to_string(),
            uid,
            gid,
            groups: vec![gid],
            home: std::env::var("HOME").unwrap_or_else(|_| "/".into()),
            shell: String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# comment\nbroken line\nalice:x:1000:1000:Alice,,,:/home/alice:/bin/zsh\nnohome:x:1001:1001:::\n";
    const GROUP: &str =
        "root:x:0:\nwheel:x:10:alice,bob\nalice:x:1000:\ndocker:x:999:bob, alice\nbad:x:zz:alice\n";

    #[test]
    fn by_name_with_groups() {
        let u = resolve("alice", PASSWD, GROUP).unwrap();
        assert_eq!(u.uid, 1000);
        assert_eq!(u.gid, 1000);
        assert_eq!(u.home, "/home/alice");
        assert_eq!(u.shell, "/bin/zsh");
        assert_eq!(u.groups, vec![1000, 10, 999]);
    }

    #[test]
    fn by_uid() {
        let u = resolve("0", PASSWD, GROUP).unwrap();
        assert_eq!(u.name, "root");
        let u = resolve("4242", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (4242, 4242, "/"));
    }

    #[test]
    fn unknown_and_empty_home() {
        assert!(resolve("mallory", PASSWD, GROUP).is_err());
        assert_eq!(resolve("nohome", PASSWD, GROUP).unwrap().home, "/");
    }
}
