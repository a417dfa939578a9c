//! Garbage collection of the virtio-pmem layer copies (`pmem_copy` in the module root).
//!
//! A layer attached as virtio-pmem needs its file padded to [`super::qemu::PMEM_ALIGN`], so
//! the substrate keeps one padded copy per layer file in the pmem directory
//! (`<cache>/pmem-layers/<layer file name>.pmem`), shared by every edge of the host. Each copy
//! has a sidecar `<copy>.src` listing the layer files (one absolute path a line) it was made
//! from: the image store of every edge that used it.
//!
//! A copy is garbage when **every** layer file it was made from is gone — the image store
//! deletes a layer file only when no registered image uses it and no sandbox holds a lease on
//! it (`image rm` refuses while leased), so a paused VM's layers stay — **and** no QEMU
//! process names it on its command line (a running VM, a template being built) **and** no
//! small file under the protected directories names it (the edge's sandboxes: `qemu.args` of
//! paused VMs). A microVM template does not keep its copies: it is only used for a create of
//! the same layers, and every create makes (or finds) the copies of its layers, at the same
//! paths, before it restores a template.
//!
//! The sweep runs after every image removal of the edge and once at edge start (copies left by
//! image removals on an edge that was down, or by templates since dropped): a periodic timer
//! would find nothing new between those events, since a copy only becomes garbage when a
//! layer file is deleted or a template/VM goes, and copies of dropped templates are bounded by
//! the template cap.
//!
//! Copies without a sidecar (made by edges before sidecars existed; 18 GB of them on the
//! development host) have unknown sources: the first sweep that sees one adopts it by writing
//! a sidecar with only `# adopted <unix time>`. Every create that uses it from then on records
//! its layer file, so it follows the rule above; one that no create used within the grace
//! period (`legacy_grace`) and that nothing names is removed (it is a cache: a later create
//! makes it again).

use std::collections::HashSet;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Suffix of the copy files.
pub const COPY_SUFFIX: &str = ".pmem";
/// Suffix of the sidecar listing a copy's source layer files.
pub const SOURCES_SUFFIX: &str = ".pmem.src";
/// Files larger than this under the protected directories are not scanned (snapshots, disks).
const MAX_SCANNED: u64 = 256 * 1024;

/// What a sweep found and did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PmemSweep {
    /// Copies removed (their layer files are all gone and nothing uses them).
    pub removed: Vec<PathBuf>,
    pub removed_bytes: u64,
    /// Copies kept, and their total size on disk (allocated blocks: the padding is sparse).
    pub kept: usize,
    pub kept_bytes: u64,
    /// Copies kept only because something still names them (a VM or template).
    pub in_use: usize,
    /// Copies whose sources are unknown (no sidecar yet, or adopted within the grace period).
    pub unknown: usize,
}

/// The sidecar of `copy`.
pub fn sources_file(copy: &Path) -> PathBuf {
    let mut s = copy.as_os_str().to_os_string();
    s.push(".src");
    PathBuf::from(s)
}

/// Records that `copy` was made from (or is used for) the layer file `src`: appended to the
/// sidecar unless listed already. Appends of one short line are atomic, so concurrent creates
/// (several edges) do not mix their lines.
pub fn record_source(copy: &Path, src: &Path) -> io::Result<()> {
    let side = sources_file(copy);
    let src = std::path::absolute(src)?;
    let line = src.to_string_lossy();
    if line.contains('\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "layer path with a newline",
        ));
    }
    match std::fs::read_to_string(&side) {
        Ok(s) if s.lines().any(|l| l == line) => return Ok(()),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&side)?;
    f.write_all(format!("{line}\n").as_bytes())
}

/// The command lines of every running QEMU on the host, joined (NUL-separated arguments).
fn qemu_command_lines() -> Vec<u8> {
    let mut all = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return all;
    };
    for p in procs.flatten() {
        if !p
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let Ok(cmd) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let exe = cmd.split(|b| *b == 0).next().unwrap_or_default();
        if exe.windows(11).any(|w| w == b"qemu-system") {
            all.extend_from_slice(&cmd);
            all.push(b'\n');
        }
    }
    all
}

/// The contents of the small regular files under `root` (at most `depth` levels down).
fn small_files(root: &Path, depth: usize, out: &mut Vec<u8>) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() && depth > 0 {
            small_files(&e.path(), depth - 1, out);
        } else if ft.is_file() && e.metadata().is_ok_and(|m| m.len() <= MAX_SCANNED) {
            if let Ok(b) = std::fs::read(e.path()) {
                out.extend_from_slice(&b);
                out.push(b'\n');
            }
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Sweeps `dir` (see the module docs); `protect` are the directories whose small files may
/// name copies in use (the edge's sandboxes directory); copies of unknown
/// source become candidates `legacy_grace` after their adoption.
pub fn sweep(
    dir: &Path,
    protect: &[PathBuf],
    legacy_grace: std::time::Duration,
) -> io::Result<PmemSweep> {
    let mut out = PmemSweep::default();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    // Read lazily: only when a copy is a candidate.
    let mut users: Option<Vec<u8>> = None;
    let mut seen = HashSet::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(COPY_SUFFIX) || name.starts_with('.') {
            continue;
        }
        let copy = e.path();
        seen.insert(name.clone());
        let size = e
            .metadata()
            .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
            .unwrap_or(0);
        let sidecar = match std::fs::read_to_string(sources_file(&copy)) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Adopt it (append: a create may be recording its source right now).
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(sources_file(&copy))
                    .and_then(|mut f| {
                        f.write_all(format!("# adopted {}\n", now_secs()).as_bytes())
                    })?;
                out.unknown += 1;
                out.kept += 1;
                out.kept_bytes += size;
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut sources = sidecar
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .peekable();
        let alive = if sources.peek().is_none() {
            let adopted = sidecar
                .lines()
                .find_map(|l| l.strip_prefix("# adopted "))
                .and_then(|t| t.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let young = now_secs().saturating_sub(adopted) < legacy_grace.as_secs();
            if young {
                out.unknown += 1;
            }
            young
        } else {
            sources.any(|l| Path::new(l).exists())
        };
        if alive {
            out.kept += 1;
            out.kept_bytes += size;
            continue;
        }
        let users = users.get_or_insert_with(|| {
            let mut u = qemu_command_lines();
            for p in protect {
                small_files(p, 3, &mut u);
            }
            u
        });
        if contains(users, name.as_bytes()) {
            out.in_use += 1;
            out.kept += 1;
            out.kept_bytes += size;
            continue;
        }
        // A create may have claimed it since (a layer of that digest registered again).
        let claimed = std::fs::read_to_string(sources_file(&copy)).is_ok_and(|now| {
            now != sidecar
                || now
                    .lines()
                    .any(|l| !l.is_empty() && !l.starts_with('#') && Path::new(l).exists())
        });
        if claimed {
            out.kept += 1;
            out.kept_bytes += size;
            continue;
        }
        match std::fs::remove_file(&copy) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
        let _ = std::fs::remove_file(sources_file(&copy));
        out.removed_bytes += size;
        out.removed.push(copy);
    }
    // Sidecars whose copy is gone (a copy that failed to be made, or removed by hand).
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(copy) = name.strip_suffix(".src") {
                if copy.ends_with(COPY_SUFFIX) && !seen.contains(copy) && !dir.join(copy).exists() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_go_when_all_their_layers_are_gone_and_nothing_names_them() {
        let t = tempfile::tempdir().unwrap();
        let store_a = t.path().join("a/layers");
        let store_b = t.path().join("b/layers");
        let pmem = t.path().join("pmem-layers");
        let protect = t.path().join("templates/k1");
        for d in [&store_a, &store_b, &pmem, &protect] {
            std::fs::create_dir_all(d).unwrap();
        }
        let layer = |store: &Path, n: &str| {
            let p = store.join(n);
            std::fs::write(&p, b"erofs").unwrap();
            p
        };
        let copy = |n: &str| {
            let p = pmem.join(format!("{n}.pmem"));
            std::fs::write(&p, vec![0u8; 8192]).unwrap();
            p
        };
        // x: used by two stores; y: one store; z: one store, named by a template; w: legacy.
        let (xa, xb) = (layer(&store_a, "x.erofs"), layer(&store_b, "x.erofs"));
        let y = layer(&store_a, "y.erofs");
        let z = layer(&store_a, "z.erofs");
        let (cx, cy, cz, cw) = (
            copy("x.erofs"),
            copy("y.erofs"),
            copy("z.erofs"),
            copy("w.erofs"),
        );
        record_source(&cx, &xa).unwrap();
        record_source(&cx, &xb).unwrap();
        record_source(&cx, &xb).unwrap(); // listed once
        record_source(&cy, &y).unwrap();
        record_source(&cz, &z).unwrap();
        assert_eq!(
            std::fs::read_to_string(sources_file(&cx))
                .unwrap()
                .lines()
                .count(),
            2
        );
        std::fs::write(protect.join("qemu.args"), format!("[\"{}\"]", cz.display())).unwrap();
        let protect = [t.path().join("templates")];

        let grace = std::time::Duration::from_secs(3600);
        let s = sweep(&pmem, &protect, grace).unwrap();
        assert!(
            s.removed.is_empty() && s.kept == 4 && s.unknown == 1,
            "{s:?}"
        );
        // The legacy copy was adopted.
        assert!(std::fs::read_to_string(sources_file(&cw))
            .unwrap()
            .starts_with("# adopted "));

        // Store a removes its layers: x is still used by store b, y goes, z is named.
        for p in [&xa, &y, &z] {
            std::fs::remove_file(p).unwrap();
        }
        let s = sweep(&pmem, &protect, grace).unwrap();
        assert_eq!(s.removed, vec![cy.clone()], "{s:?}");
        assert!(s.removed_bytes > 0);
        assert!(!sources_file(&cy).exists());
        assert_eq!((s.kept, s.in_use, s.unknown), (3, 1, 1));
        assert!(cx.exists() && cz.exists() && cw.exists());

        // The template goes, store b removes x: both copies go; the legacy one stays.
        std::fs::remove_dir_all(t.path().join("templates")).unwrap();
        std::fs::remove_file(&xb).unwrap();
        let mut s = sweep(&pmem, &protect, grace).unwrap();
        s.removed.sort();
        assert_eq!(s.removed, vec![cx, cz]);
        assert_eq!((s.kept, s.unknown), (1, 1));
        // A legacy copy used by a create within the grace follows the source rule; one used
        // by none goes after the grace.
        let cv = copy("v.erofs");
        let v = layer(&store_b, "v.erofs");
        sweep(&pmem, &protect, grace).unwrap();
        record_source(&cv, &v).unwrap();
        let s = sweep(&pmem, &[], std::time::Duration::ZERO).unwrap();
        assert_eq!(s.removed, vec![cw.clone()], "{s:?}");
        assert!(cv.exists());
        std::fs::remove_file(&cv).unwrap();
        std::fs::remove_file(sources_file(&cv)).unwrap();
        let left: Vec<_> = std::fs::read_dir(&pmem)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // A missing directory is an empty one.
        assert_eq!(
            sweep(&t.path().join("none"), &[], grace).unwrap(),
            PmemSweep::default()
        );
    }
}
