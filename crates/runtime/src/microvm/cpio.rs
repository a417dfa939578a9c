//! A minimal `newc` cpio writer: the per-VM initramfs part (aether, env, hostname) that is
//! prepended to the guest's cached initramfs (the kernel unpacks concatenated archives).

/// One regular file of the archive.
pub struct Entry<'a> {
    pub name: &'a str,
    pub mode: u32,
    pub data: &'a [u8],
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn header(out: &mut Vec<u8>, ino: u32, mode: u32, size: usize, name: &str) {
    let fields = [
        ino,
        mode,
        0, // uid
        0, // gid
        1, // nlink
        0, // mtime
        size as u32,
        0,
        0,
        0,
        0,
        name.len() as u32 + 1,
        0, // check
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
}

/// Builds an archive of regular files (each at most 4 GiB), terminated by `TRAILER!!!`.
pub fn archive(entries: &[Entry<'_>]) -> Vec<u8> {
    let total: usize = entries.iter().map(|e| e.data.len() + 128).sum();
    let mut out = Vec::with_capacity(total + 256);
    for (i, e) in entries.iter().enumerate() {
        header(
            &mut out,
            i as u32 + 1,
            0o100000 | (e.mode & 0o7777),
            e.data.len(),
            e.name,
        );
        out.extend_from_slice(e.data);
        pad4(&mut out);
    }
    header(&mut out, 0, 0, 0, "TRAILER!!!");
    // The kernel skips zero padding between archives; keep whole 512-byte blocks like cpio(1).
    while !out.len().is_multiple_of(512) {
        out.push(0);
    }
    out
}

pub use crate::qemu::args::shell_quote;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout() {
        let a = archive(&[Entry {
            name: "x",
            mode: 0o755,
            data: b"hello",
        }]);
        assert!(a.starts_with(b"070701"));
        // header 110 bytes + "x\0" = 112 (aligned), then data at 112.
        assert_eq!(&a[112..117], b"hello");
        assert_eq!(&a[6..14], b"00000001");
        assert_eq!(&a[14..22], b"000081ED");
        let t = a.windows(10).position(|w| w == b"TRAILER!!!");
        assert!(t.is_some());
        assert_eq!(a.len() % 512, 0);
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("a'b"), "'a'\\''b'");
        assert_eq!(shell_quote(""), "''");
    }
}
