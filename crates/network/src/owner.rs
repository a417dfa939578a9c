//! One edge per nftables table on a host.
//!
//! An edge's network objects are named by its `table` and `veth_prefix`, and crash recovery
//! removes every object with those prefixes that no re-adopted sandbox owns. Two edges on one
//! host configured with the same names would therefore tear down each other's namespaces,
//! veths and table. Before it touches any of them, an edge takes an exclusive `flock` on
//! `/run/dsec/network-<table>.lock` (released by the kernel when the process ends, so a
//! crashed edge's successor gets it); an edge that cannot take it neither reaps nor builds
//! networks, and says which process holds the names.

use std::fs::File;
use std::io::{Read as _, Seek as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use crate::NetError;

/// Where the lock files live (`DSEC_RUN_DIR` overrides, for tests).
fn run_dir() -> PathBuf {
    std::env::var_os("DSEC_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/dsec"))
}

/// The held lock; dropping it releases the names.
#[derive(Debug)]
pub struct Ownership {
    _file: File,
}

/// Takes the names of `table` for this process, or says who holds them.
pub fn claim(table: &str) -> Result<Ownership, NetError> {
    claim_in(&run_dir(), table)
}

fn claim_in(dir: &Path, table: &str) -> Result<Ownership, NetError> {
    let err = |m: String| NetError::Tool {
        tool: "network lock",
        message: m,
    };
    std::fs::create_dir_all(dir).map_err(|e| err(format!("create {}: {e}", dir.display())))?;
    let path = dir.join(format!("network-{table}.lock"));
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| err(format!("open {}: {e}", path.display())))?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(NetError::InUse(format!(
                "network table `{table}` and its name prefixes are in use by another edge on this host (pid {}); give each edge its own [edge.network] table, veth_prefix, gateway_interface and subnets",
                holder.trim()
            )));
        }
        return Err(err(format!("lock {}: {e}", path.display())));
    }
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "{}", std::process::id());
    Ok(Ownership { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = claim_in(dir.path(), "t1").unwrap();
        // flock locks belong to the open file description: a second open in the same process
        // conflicts just as another process's would.
        let e = claim_in(dir.path(), "t1").unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("pid {}", std::process::id())),
            "{e}"
        );
        assert!(claim_in(dir.path(), "t2").is_ok(), "other names are free");
        drop(first);
        // Another test of this binary may be spawning a process right now: until its child
        // execs, the child's copy of the fd table still refers to the lock's open file
        // description (closed at exec: O_CLOEXEC), so the lock can outlive `first` briefly.
        let mut again = claim_in(dir.path(), "t1");
        for _ in 0..200 {
            if again.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            again = claim_in(dir.path(), "t1");
        }
        assert!(again.is_ok(), "{:?}", again.err().map(|e| e.to_string()));
    }
}
