//! Landlock (kernel ABI ≥ 6 here: 7): protected paths stay read-only even to root inside, and
//! the sandbox cannot reach abstract unix sockets or signal processes outside its domain.
//!
//! Landlock rules only grant, so "everything writable except P" is built by walking from `/`
//! down to each protected path and granting the handled (write-type) rights on every sibling
//! entry that is neither protected nor an ancestor of a protected path. Consequences, by
//! design: ancestors of a protected path accept no new entries and no removals directly in
//! them (e.g. protecting `/usr/bin/bash` freezes the entry list of `/` , `/usr` and `/usr/bin`,
//! while every other directory stays fully writable). Reading and executing stay allowed
//! everywhere (they are not handled).
//!
//! Applied to aether itself at the end of setup (after no_new_privs, before seccomp), so
//! every command and aether's own file API are bound by it.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

const CREATE_RULESET_VERSION: u32 = 1;
const RULE_PATH_BENEATH: u32 = 1;

const WRITE_FILE: u64 = 1 << 1;
const REMOVE_DIR: u64 = 1 << 4;
const REMOVE_FILE: u64 = 1 << 5;
const MAKE_CHAR: u64 = 1 << 6;
const MAKE_DIR: u64 = 1 << 7;
const MAKE_REG: u64 = 1 << 8;
const MAKE_SOCK: u64 = 1 << 9;
const MAKE_FIFO: u64 = 1 << 10;
const MAKE_BLOCK: u64 = 1 << 11;
const MAKE_SYM: u64 = 1 << 12;
const REFER: u64 = 1 << 13;
const TRUNCATE: u64 = 1 << 14;

/// Write-type rights this ruleset handles (denied unless granted).
const HANDLED: u64 = WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_CHAR
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SOCK
    | MAKE_FIFO
    | MAKE_BLOCK
    | MAKE_SYM
    | REFER
    | TRUNCATE;
/// The subset that applies to a non-directory.
const FILE_RIGHTS: u64 = WRITE_FILE | TRUNCATE;

const SCOPE_ABSTRACT_UNIX_SOCKET: u64 = 1;
const SCOPE_SIGNAL: u64 = 2;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The running kernel's Landlock ABI version (0: unavailable).
pub fn abi() -> i32 {
    // SAFETY: with a NULL attr, size 0 and the VERSION flag, the call only returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if v < 0 {
        0
    } else {
        v as i32
    }
}

/// Lists a directory: each entry and whether it is a directory.
pub type Lister<'a> = &'a dyn Fn(&Path) -> io::Result<Vec<(PathBuf, bool)>>;

/// What to grant: (path, rights) for every entry that stays writable.
pub fn plan(protected: &[PathBuf], list: Lister<'_>) -> io::Result<Vec<(PathBuf, u64)>> {
    let protected: BTreeSet<PathBuf> = protected.iter().cloned().collect();
    let mut ancestors: BTreeSet<PathBuf> = BTreeSet::new();
    for p in &protected {
        let mut a = p.parent();
        while let Some(x) = a {
            ancestors.insert(x.to_path_buf());
            a = x.parent();
        }
    }
    let mut grants = Vec::new();
    for dir in &ancestors {
        if protected.iter().any(|p| dir.starts_with(p)) {
            continue; // inside a protected tree: nothing below is granted
        }
        for (entry, is_dir) in list(dir)? {
            if protected.contains(&entry) || ancestors.contains(&entry) {
                continue;
            }
            grants.push((entry, if is_dir { HANDLED } else { FILE_RIGHTS }));
        }
    }
    Ok(grants)
}

/// Entries of `dir` with whether each is a directory; symlinks are skipped (writing through
/// one lands on its target, which has its own grant or none).
fn list_dir(dir: &Path) -> io::Result<Vec<(PathBuf, bool)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ty = e.file_type()?;
        if ty.is_symlink() {
            continue;
        }
        out.push((e.path(), ty.is_dir()));
    }
    Ok(out)
}

/// Restricts this process (and everything it starts): scoping always when the kernel has ABI
/// 6, write protection of `protected` (paths resolved inside the current root) when non-empty.
/// Fails if protection was asked for and the kernel cannot give it.
pub fn apply(protected: &[String]) -> io::Result<()> {
    let abi = abi();
    if abi < 6 {
        if protected.is_empty() {
            eprintln!("dsec-aether: Landlock ABI {abi} < 6: no socket/signal scoping");
            return Ok(());
        }
        return Err(io::Error::other(format!(
            "protected_paths need Landlock (ABI >= 6), this kernel has ABI {abi}"
        )));
    }
    let mut resolved = Vec::new();
    for p in protected {
        let r = std::fs::canonicalize(p)
            .map_err(|e| io::Error::new(e.kind(), format!("protected path {p}: {e}")))?;
        resolved.push(r);
    }
    let attr = RulesetAttr {
        handled_access_fs: if resolved.is_empty() { 0 } else { HANDLED },
        handled_access_net: 0,
        scoped: SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL,
    };
    // SAFETY: attr is a valid ruleset_attr of the size passed; the result is a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd was just created and is owned by nobody else.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    if !resolved.is_empty() {
        for (path, rights) in plan(&resolved, &list_dir)? {
            add_rule(&ruleset, &path, rights)?;
        }
    }
    // SAFETY: restricts the calling thread (aether is single-threaded at setup) with a valid
    // ruleset fd; no_new_privs is already set.
    if unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn add_rule(ruleset: &OwnedFd, path: &Path, rights: u64) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: open(2) on a NUL-terminated path; O_PATH opens without reading.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::NotFound {
            return Ok(()); // vanished between listing and opening
        }
        return Err(io::Error::new(
            e.kind(),
            format!("open {}: {e}", path.display()),
        ));
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let attr = PathBeneathAttr {
        allowed_access: rights,
        parent_fd: fd.as_raw_fd(),
    };
    // SAFETY: attr is a valid landlock_path_beneath_attr; the ruleset fd is valid.
    let r = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset.as_raw_fd(),
            RULE_PATH_BENEATH,
            &attr as *const PathBeneathAttr,
            0u32,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("landlock rule for {}: {e}", path.display()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_skips_protected_and_ancestors() {
        let tree = |d: &Path| -> io::Result<Vec<(PathBuf, bool)>> {
            Ok(match d.to_str().unwrap() {
                "/" => vec![
                    ("/usr".into(), true),
                    ("/tmp".into(), true),
                    ("/etc".into(), true),
                ],
                "/usr" => vec![("/usr/bin".into(), true), ("/usr/lib".into(), true)],
                "/usr/bin" => vec![
                    ("/usr/bin/bash".into(), false),
                    ("/usr/bin/ls".into(), false),
                ],
                _ => vec![],
            })
        };
        let g = plan(&["/usr/bin/bash".into(), "/etc".into()], &tree).unwrap();
        let paths: Vec<&str> = g.iter().map(|(p, _)| p.to_str().unwrap()).collect();
        assert_eq!(paths, vec!["/tmp", "/usr/lib", "/usr/bin/ls"]);
        assert_eq!(g[0].1, HANDLED);
        assert_eq!(g[2].1, FILE_RIGHTS);
    }

    #[test]
    fn protects_in_a_child() {
        if abi() < 6 {
            eprintln!("skipping: Landlock ABI {} < 6", abi());
            return;
        }
        let d = tempfile_dir();
        std::fs::write(d.join("keep"), "orig").unwrap();
        std::fs::create_dir_all(d.join("free")).unwrap();
        let keep = d.join("keep").to_string_lossy().into_owned();
        let free = d.join("free").join("x");
        // SAFETY: fork in a test; the child only runs the restriction and file calls, then exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: prctl on the child itself.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let ok = apply(std::slice::from_ref(&keep)).is_ok()
                && std::fs::write(&keep, "evil").is_err()
                && std::fs::remove_file(&keep).is_err()
                && std::fs::write(&free, "fine").is_ok();
            // SAFETY: exit the forked child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(std::fs::read_to_string(d.join("keep")).unwrap(), "orig");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child status {status}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("dsec-landlock-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
