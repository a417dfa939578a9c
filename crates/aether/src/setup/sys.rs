//! The privileged operations container setup makes, behind a small trait so that the order
//! and arguments of mounts can be unit-tested with a recording fake.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use nix::mount::{MntFlags, MsFlags};

/// What a path is, for masking decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    Other,
}

pub trait Sys {
    fn mount(
        &mut self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> io::Result<()>;
    /// `chdir(dir); pivot_root(".", "."); umount2(".", MNT_DETACH); chdir("/")`.
    fn pivot_into(&mut self, dir: &Path) -> io::Result<()>;
    fn mkdir_all(&mut self, path: &Path, mode: u32) -> io::Result<()>;
    fn mknod_char(&mut self, path: &Path, mode: u32, major: u64, minor: u64) -> io::Result<()>;
    fn symlink(&mut self, target: &str, link: &Path) -> io::Result<()>;
    /// `None` when the path does not exist.
    fn kind(&mut self, path: &Path) -> io::Result<Option<Kind>>;
    fn read_to_string(&mut self, path: &Path) -> io::Result<String>;
}

fn nix_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// The real thing.
pub struct RealSys;

impl Sys for RealSys {
    fn mount(
        &mut self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> io::Result<()> {
        nix::mount::mount(source, target, fstype, flags, data).map_err(nix_err)
    }

    fn pivot_into(&mut self, dir: &Path) -> io::Result<()> {
        nix::unistd::chdir(dir).map_err(nix_err)?;
        nix::unistd::pivot_root(".", ".").map_err(nix_err)?;
        // The old root is now stacked on top of the new one at "/": detach it.
        nix::mount::umount2(".", MntFlags::MNT_DETACH).map_err(nix_err)?;
        nix::unistd::chdir("/").map_err(nix_err)
    }

    fn mkdir_all(&mut self, path: &Path, mode: u32) -> io::Result<()> {
        if path.is_dir() {
            return Ok(());
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(path)
    }

    fn mknod_char(&mut self, path: &Path, mode: u32, major: u64, minor: u64) -> io::Result<()> {
        nix::sys::stat::mknod(
            path,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(mode),
            nix::sys::stat::makedev(major, minor),
        )
        .map_err(nix_err)?;
        // mknod honours the umask: set the mode explicitly.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }

    fn symlink(&mut self, target: &str, link: &Path) -> io::Result<()> {
        std::os::unix::fs::symlink(target, link)
    }

    fn kind(&mut self, path: &Path) -> io::Result<Option<Kind>> {
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => Ok(Some(Kind::Dir)),
            Ok(_) => Ok(Some(Kind::Other)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn read_to_string(&mut self, path: &Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }
}

#[cfg(test)]
pub mod fake {
    //! A recording fake of [`Sys`].
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Default)]
    pub struct FakeSys {
        pub calls: Vec<String>,
        pub kinds: BTreeMap<String, Kind>,
        pub files: BTreeMap<String, String>,
    }

    impl Sys for FakeSys {
        fn mount(
            &mut self,
            source: Option<&str>,
            target: &Path,
            fstype: Option<&str>,
            flags: MsFlags,
            data: Option<&str>,
        ) -> io::Result<()> {
            let names: Vec<&str> = flags.iter_names().map(|(n, _)| n).collect();
            let flags = if names.is_empty() {
                "(empty)".to_string()
            } else {
                names.join(" | ")
            };
            self.calls.push(format!(
                "mount {} {} {} {flags} {}",
                source.unwrap_or("-"),
                target.display(),
                fstype.unwrap_or("-"),
                data.unwrap_or("-")
            ));
            Ok(())
        }
        fn pivot_into(&mut self, dir: &Path) -> io::Result<()> {
            self.calls.push(format!("pivot {}", dir.display()));
            Ok(())
        }
        fn mkdir_all(&mut self, path: &Path, mode: u32) -> io::Result<()> {
            self.calls
                .push(format!("mkdir {} {mode:o}", path.display()));
            Ok(())
        }
        fn mknod_char(&mut self, path: &Path, mode: u32, major: u64, minor: u64) -> io::Result<()> {
            self.calls
                .push(format!("mknod {} {mode:o} {major}:{minor}", path.display()));
            Ok(())
        }
        fn symlink(&mut self, target: &str, link: &Path) -> io::Result<()> {
            self.calls
                .push(format!("symlink {} -> {target}", link.display()));
            Ok(())
        }
        fn kind(&mut self, path: &Path) -> io::Result<Option<Kind>> {
            Ok(self.kinds.get(path.to_str().unwrap_or_default()).copied())
        }
        fn read_to_string(&mut self, path: &Path) -> io::Result<String> {
            self.files
                .get(path.to_str().unwrap_or_default())
                .cloned()
                .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
        }
    }
}
