//! `dsec vm prepare-image|image import|image ls|image rm`: disk images for the full-VM
//! substrate (`substrate: "vm"`).
//!
//! `prepare-image` injects the static aether binary and its boot hook into a Linux disk image
//! (raw or qcow2): the image is converted to a private raw copy, attached to a loop device with
//! the partition's offset (from `sfdisk --json`; this machine's kernel has no `nbd` module,
//! loop partition scanning creates no devices here, and libguestfs is not needed), the
//! partition holding the root (the one with `/etc/os-release`)
//! is mounted and gets
//! * `/usr/local/sbin/dsec-aether` — aether, started in bare mode on the virtio-serial port
//!   named `dsec.aether`;
//! * `/usr/local/sbin/dsec-init` — the boot hook: as `init=/usr/local/sbin/dsec-init` (PID 1,
//!   no systemd: fastest under emulation) it mounts `/proc`, `/sys`, `/dev/pts`, ... first;
//!   with `--service` it only waits for the port;
//! * `/etc/systemd/system/dsec-aether.service` (enabled) when the image has systemd.
//!
//! Registered images live in `<data-dir>/vm-images/<name>.qcow2`; the edge also finds images
//! built by `scripts/vm/build-disk.sh` in `${DSEC_CACHE:-/var/cache/dsec}/vm/<name>.qcow2`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum VmCommand {
    /// Inject aether and its boot hook into a Linux disk image (raw or qcow2).
    PrepareImage(PrepareArgs),
    /// Registered VM disk images (`run_vm(image=NAME)`).
    #[command(subcommand)]
    Image(VmImageCommand),
}

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// The input disk image (raw or qcow2; left unchanged).
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Where to write the prepared image.
    #[arg(long)]
    pub out: PathBuf,
    /// Output format: raw or qcow2 (default: qcow2 when --out ends in .qcow2, else raw).
    #[arg(long)]
    pub format: Option<String>,
    /// The static aether binary (default: $DSEC_AETHER, then dsec-aether next to this binary).
    #[arg(long)]
    pub aether: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum VmImageCommand {
    /// Register a prepared disk image under NAME (copied, as qcow2).
    Import(VmImportArgs),
    /// List registered VM images.
    Ls(VmDirArgs),
    /// Remove a registered VM image.
    Rm(VmRmArgs),
}

#[derive(Args, Debug)]
pub struct VmDirArgs {
    /// The node's data directory (as given to `dsec up --data-dir`).
    #[arg(long, default_value = "/var/lib/dsec")]
    pub data_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct VmImportArgs {
    /// Image name: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-'.
    pub name: String,
    /// The disk image file (raw or qcow2).
    pub file: PathBuf,
    /// Boot this kernel directly (no firmware boot loader), the disk as root.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Initramfs for --kernel.
    #[arg(long, requires = "kernel")]
    pub initrd: Option<PathBuf>,
    /// Kernel command line for --kernel (default: root=/dev/vda1 rw console=ttyS0
    /// init=/usr/local/sbin/dsec-init ...).
    #[arg(long, requires = "kernel")]
    pub cmdline: Option<String>,
    #[command(flatten)]
    pub dir: VmDirArgs,
}

#[derive(Args, Debug)]
pub struct VmRmArgs {
    pub name: String,
    #[command(flatten)]
    pub dir: VmDirArgs,
}

pub async fn vm(c: VmCommand) -> anyhow::Result<()> {
    // Everything here is blocking process and file work.
    tokio::task::spawn_blocking(move || match c {
        VmCommand::PrepareImage(a) => prepare(&a),
        VmCommand::Image(VmImageCommand::Import(a)) => import(&a),
        VmCommand::Image(VmImageCommand::Ls(a)) => ls(&a),
        VmCommand::Image(VmImageCommand::Rm(a)) => rm(&a),
    })
    .await
    .context("VM image task")?
}

/// The boot hook installed as `/usr/local/sbin/dsec-init`: its head, the network functions of
/// `scripts/vm/guest-net.sh` (the same semantics as the dsec guests' own init), its body.
pub const DSEC_INIT: &str = concat!(
    r#"#!/bin/sh
# dsec boot hook (installed by `dsec vm prepare-image`). As init= (PID 1) it mounts the kernel
# file systems first; with --service (systemd unit dsec-aether.service) it does not. Then it
# finds the virtio-serial port named dsec.aether, waits for the host's sync byte (a read of a
# port whose host side is not connected yet returns EOF) and becomes aether in bare mode.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
say() { echo "dsec-init: $*" > /dev/console 2>/dev/null || echo "dsec-init: $*"; }
# As PID 1, exiting panics the kernel (panic=-1 and QEMU's -no-reboot then end the VM).
fail() { say "$*"; say FAILED; exit 1; }
if [ "$1" != --service ]; then
    mount -t proc proc /proc 2>/dev/null
    mount -t sysfs sysfs /sys 2>/dev/null
    mount -t devtmpfs devtmpfs /dev 2>/dev/null
    mkdir -p /dev/pts /dev/shm /run /tmp
    mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts 2>/dev/null
    ln -sf pts/ptmx /dev/ptmx 2>/dev/null
    mount -t tmpfs -o mode=1777 shm /dev/shm 2>/dev/null
    mount -t tmpfs -o mode=0755 run /run 2>/dev/null
    mount -t tmpfs -o mode=1777 tmp /tmp 2>/dev/null
    mount -o remount,rw / 2>/dev/null
    [ -s /etc/hostname ] && hostname "$(cat /etc/hostname)" 2>/dev/null
    ip link set lo up 2>/dev/null
    modprobe virtio_console 2>/dev/null
fi
"#,
    include_str!("../../../../scripts/vm/guest-net.sh"),
    r#"
# A networked VM: the edge passes the NIC's configuration as the fw_cfg item opt/dsec/net
# (IPV4,GATEWAY,IPV6|-,MTU,MAC). The drivers come from the image's own kernel modules (built in
# is fine); the card is configured with the image's own `ip`, unless the image's initramfs did.
dsec_net() {
    modprobe qemu_fw_cfg 2>/dev/null
    _f=/sys/firmware/qemu_fw_cfg/by_name/opt/dsec/net/raw
    _i=0
    while [ ! -e "$_f" ] && [ -d /sys/firmware/qemu_fw_cfg ] && [ $_i -lt 50 ]; do
        _i=$((_i + 1))
        sleep 0.01
    done
    [ -r "$_f" ] || return 0
    _cfg=$(cat "$_f")
    [ -n "$_cfg" ] || return 0
    modprobe virtio_net 2>/dev/null
    _addr=${_cfg%%,*}
    _rest=${_cfg#*,}
    # Already a local address (the image's initramfs, e.g. scripts/vm/build-disk.sh's, did it).
    if awk -v a="$_addr" '$1 == "|--" && $2 == a { f = 1 } END { exit !f }' /proc/net/fib_trie 2>/dev/null; then
        dsec_gateway=${_rest%%,*}
        say "network: $_addr already configured (by the image's initramfs)"
    else
        command -v ip >/dev/null 2>&1 || fail "this VM has a network but the image has no ip command (install iproute2)"
        dsec_net_up "$_cfg"
        say "network on $dsec_nic: $_addr via $dsec_gateway"
    fi
    dsec_net_resolv ""
}
dsec_net
say "$(cut -d' ' -f1 /proc/uptime) looking for the dsec.aether port"
port=
i=0
while [ $i -lt 1000 ]; do
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = dsec.aether ] && port=/dev/${p##*/}
    done
    [ -n "$port" ] && [ -c "$port" ] && break
    i=$((i + 1))
    sleep 0.01
done
[ -n "$port" ] && [ -c "$port" ] || fail "no virtio-serial port named dsec.aether"
exec 3<>"$port" || fail "open $port"
i=0
synced=
while [ $i -lt 3000 ]; do
    if [ -n "$(dd bs=1 count=1 <&3 2>/dev/null)" ]; then synced=1; break; fi
    i=$((i + 1))
    sleep 0.01
done
[ -n "$synced" ] || fail "the host never connected to $port"
say "$(cut -d' ' -f1 /proc/uptime) starting aether on $port"
cd /
exec /usr/local/sbin/dsec-aether --mode bare --fd 3
"#
);

/// The systemd unit installed (and enabled) when the image has systemd.
pub const DSEC_UNIT: &str = "[Unit]
Description=dsec aether (sandbox agent on the virtio-serial port dsec.aether)
After=local-fs.target

[Service]
ExecStart=/usr/local/sbin/dsec-init --service
Restart=no

[Install]
WantedBy=multi-user.target
";

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The format `qemu-img info` reports for a file (`raw`, `qcow2`, ...).
fn image_format(path: &Path) -> anyhow::Result<String> {
    let out = run(Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(path))?;
    let v: serde_json::Value = serde_json::from_str(&out).context("parse qemu-img info")?;
    match v.get("format").and_then(|f| f.as_str()) {
        Some(f @ ("raw" | "qcow2")) => Ok(f.to_string()),
        Some(f) => bail!(
            "{}: format {f} is not supported (raw or qcow2)",
            path.display()
        ),
        None => bail!("{}: qemu-img info gave no format", path.display()),
    }
}

fn aether_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = given {
        candidates.push(p.to_path_buf());
    } else if let Some(p) = std::env::var_os("DSEC_AETHER") {
        candidates.push(PathBuf::from(p));
    } else if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        candidates.push(dir.join("dsec-aether"));
        candidates.push(dir.join("../x86_64-unknown-linux-gnu/release/dsec-aether"));
        candidates.push(PathBuf::from("/usr/local/lib/dsec/dsec-aether"));
    }
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .with_context(|| {
            format!(
                "the static aether binary was not found (looked at {candidates:?}); pass --aether"
            )
        })
}

/// The aether binary without debug info (`strip`; as it is when strip is missing).
fn stripped(path: &Path) -> anyhow::Result<Vec<u8>> {
    let tmp = std::env::temp_dir().join(format!("dsec-aether.{}.stripped", std::process::id()));
    let ok = Command::new("strip")
        .arg("-o")
        .arg(&tmp)
        .arg(path)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let r = if ok {
        std::fs::read(&tmp)
    } else {
        std::fs::read(path)
    };
    let _ = std::fs::remove_file(&tmp);
    r.with_context(|| format!("read {}", path.display()))
}

/// Undoes loop attachments and mounts, and removes the scratch copy, on every path.
struct Scratch {
    raw: PathBuf,
    loopdev: Option<String>,
    mounted: Option<PathBuf>,
    /// The mount point directory, removed at the end.
    mnt: Option<PathBuf>,
    keep_raw: bool,
}

impl Scratch {
    /// Unmounts and detaches the loop device (the raw copy stays).
    fn release(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = Command::new("umount").arg(&m).status();
        }
        if let Some(l) = self.loopdev.take() {
            let _ = Command::new("losetup").arg("-d").arg(&l).status();
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        self.release();
        if let Some(m) = self.mnt.take() {
            let _ = std::fs::remove_dir(&m);
        }
        if !self.keep_raw {
            let _ = std::fs::remove_file(&self.raw);
        }
    }
}

/// Byte ranges `(offset, size)` of the image's partitions from its partition table
/// (`sfdisk --json`, MBR or GPT); the whole image when it has none. (Loop partition scanning,
/// `losetup -P`, creates no partition devices on every kernel; an offset loop always works.)
fn partitions(raw: &Path) -> Vec<(u64, Option<u64>)> {
    let table = Command::new("sfdisk")
        .arg("--json")
        .arg(raw)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok());
    let mut out = Vec::new();
    if let Some(t) = table.as_ref().and_then(|v| v.get("partitiontable")) {
        let sector = t.get("sectorsize").and_then(|s| s.as_u64()).unwrap_or(512);
        for p in t
            .get("partitions")
            .and_then(|p| p.as_array())
            .into_iter()
            .flatten()
        {
            if let (Some(start), Some(size)) = (
                p.get("start").and_then(|v| v.as_u64()),
                p.get("size").and_then(|v| v.as_u64()),
            ) {
                out.push((start * sector, Some(size * sector)));
            }
        }
    }
    if out.is_empty() {
        out.push((0, None));
    }
    out
}

/// Creates the directories of `rel` (relative, `/`-separated) under `root`, refusing any
/// component that is a symlink: the image is untrusted and mounted on the host, where an
/// absolute link (`usr/local -> /usr`) would point into the host's own tree.
fn safe_dirs(root: &Path, rel: &str) -> anyhow::Result<PathBuf> {
    let mut p = root.to_path_buf();
    for c in rel.split('/').filter(|c| !c.is_empty()) {
        if c == "." || c == ".." {
            bail!("path {rel:?} is not plain");
        }
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => bail!(
                "/{rel}: /{} is a symlink in the image; refusing to follow it on the host",
                p.strip_prefix(root).unwrap_or(&p).display()
            ),
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!(
                "/{} is not a directory in the image",
                p.strip_prefix(root).unwrap_or(&p).display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&p).with_context(|| format!("create {}", p.display()))?
            }
            Err(e) => return Err(e).with_context(|| format!("stat {}", p.display())),
        }
    }
    Ok(p)
}

fn write_file(root: &Path, rel: &str, data: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let (dir, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let p = safe_dirs(root, dir)?.join(name);
    // Replace rather than write through: the path could be a symlink in the image.
    match std::fs::remove_file(&p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("remove {}", p.display())),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&p)
        .and_then(|mut f| f.write_all(data))
        .with_context(|| format!("write {}", p.display()))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", p.display()))?;
    Ok(())
}

/// Installs aether, the boot hook and the systemd unit into a mounted root.
fn inject(root: &Path, aether: &[u8]) -> anyhow::Result<Vec<&'static str>> {
    let mut done = vec!["/usr/local/sbin/dsec-aether", "/usr/local/sbin/dsec-init"];
    write_file(root, "usr/local/sbin/dsec-aether", aether, 0o755)?;
    write_file(
        root,
        "usr/local/sbin/dsec-init",
        DSEC_INIT.as_bytes(),
        0o755,
    )?;
    let systemd = ["lib/systemd/systemd", "usr/lib/systemd/systemd"]
        .iter()
        .any(|p| root.join(p).exists());
    if systemd {
        write_file(
            root,
            "etc/systemd/system/dsec-aether.service",
            DSEC_UNIT.as_bytes(),
            0o644,
        )?;
        let wants = safe_dirs(root, "etc/systemd/system/multi-user.target.wants")?;
        let link = wants.join("dsec-aether.service");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/etc/systemd/system/dsec-aether.service", &link)
            .with_context(|| format!("enable {}", link.display()))?;
        done.push("/etc/systemd/system/dsec-aether.service (enabled)");
    }
    Ok(done)
}

fn prepare(a: &PrepareArgs) -> anyhow::Result<()> {
    let format = match a.format.as_deref() {
        Some(f @ ("raw" | "qcow2")) => f.to_string(),
        Some(f) => bail!("--format {f}: raw or qcow2"),
        None if a.out.extension().is_some_and(|e| e == "qcow2") => "qcow2".into(),
        None => "raw".into(),
    };
    let aether_path = aether_binary(a.aether.as_deref())?;
    let aether = stripped(&aether_path)?;
    let in_fmt = image_format(&a.input)?;
    let out_dir = a
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let mut s = Scratch {
        raw: out_dir.join(format!(".dsec-prepare.{}.raw", std::process::id())),
        loopdev: None,
        mounted: None,
        mnt: None,
        keep_raw: false,
    };
    // A private raw copy: the input is never modified, and loop devices need raw.
    run(Command::new("qemu-img")
        .args(["convert", "-f", &in_fmt, "-O", "raw"])
        .arg(&a.input)
        .arg(&s.raw))?;
    let mnt = out_dir.join(format!(".dsec-prepare.{}.mnt", std::process::id()));
    std::fs::create_dir_all(&mnt).with_context(|| format!("create {}", mnt.display()))?;
    s.mnt = Some(mnt.clone());
    let parts = partitions(&s.raw);
    let mut root_part = None;
    for (i, (offset, size)) in parts.iter().enumerate() {
        let mut l = Command::new("losetup");
        l.args(["-f", "--show", "-o", &offset.to_string()]);
        if let Some(sz) = size {
            l.args(["--sizelimit", &sz.to_string()]);
        }
        let dev = run(l.arg(&s.raw))?.trim().to_string();
        if dev.is_empty() {
            bail!("losetup printed no device");
        }
        s.loopdev = Some(dev.clone());
        if Command::new("mount")
            .args(["-o", "nosuid,nodev,noexec"])
            .arg(&dev)
            .arg(&mnt)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|st| st.success())
        {
            s.mounted = Some(mnt.clone());
            if mnt.join("etc/os-release").exists() || mnt.join("usr/lib/os-release").exists() {
                root_part = Some(i + 1);
                break;
            }
        }
        s.release();
    }
    let Some(root_part) = root_part else {
        bail!(
            "{}: no partition with a Linux root (etc/os-release) among {} candidate(s)",
            a.input.display(),
            parts.len()
        );
    };
    let done = inject(&mnt, &aether)?;
    // Unmount (flushes the file system) and detach before converting.
    s.release();
    if format == "qcow2" {
        run(Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&s.raw)
            .arg(&a.out))?;
    } else {
        std::fs::rename(&s.raw, &a.out)
            .with_context(|| format!("move the image to {}", a.out.display()))?;
        s.keep_raw = true;
    }
    println!(
        "prepared {} ({format}) from {} (root: partition {root_part}): {}",
        a.out.display(),
        a.input.display(),
        done.join(", ")
    );
    Ok(())
}

// The same name rule as the full-VM substrate that looks the images up.
use dsec_runtime::fullvm::substrate::valid_name;

fn images_dir(d: &VmDirArgs) -> PathBuf {
    dsec_runtime::fullvm::substrate::registered_dir(&d.data_dir)
}

fn import(a: &VmImportArgs) -> anyhow::Result<()> {
    if !valid_name(&a.name) {
        bail!(
            "image name {:?}: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-'",
            a.name
        );
    }
    let fmt = image_format(&a.file)?;
    let dir = images_dir(&a.dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let dst = dir.join(format!("{}.qcow2", a.name));
    let tmp = dir.join(format!(".{}.{}.tmp", a.name, std::process::id()));
    let r = run(Command::new("qemu-img")
        .args(["convert", "-f", &fmt, "-O", "qcow2"])
        .arg(&a.file)
        .arg(&tmp))
    .and_then(|_| {
        std::fs::rename(&tmp, &dst).with_context(|| format!("move to {}", dst.display()))
    });
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r?;
    // Direct kernel boot files beside the disk (`<name>.kernel|initrd|cmdline`), or none.
    let side = |ext: &str| dir.join(format!("{}.{ext}", a.name));
    for (ext, src) in [("kernel", &a.kernel), ("initrd", &a.initrd)] {
        match src {
            Some(p) => {
                std::fs::copy(p, side(ext))
                    .with_context(|| format!("copy {} to {}", p.display(), side(ext).display()))?;
            }
            None => remove_if_present(&side(ext))?,
        }
    }
    match &a.cmdline {
        Some(c) => std::fs::write(side("cmdline"), format!("{c}\n"))
            .with_context(|| format!("write {}", side("cmdline").display()))?,
        None => remove_if_present(&side("cmdline"))?,
    }
    let boot = if a.kernel.is_some() {
        "direct kernel boot"
    } else {
        "firmware boot"
    };
    println!("{} -> {} ({boot})", a.name, dst.display());
    Ok(())
}

fn remove_if_present(p: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("remove {}", p.display())),
    }
}

fn ls(a: &VmDirArgs) -> anyhow::Result<()> {
    let dir = images_dir(a);
    let mut rows = Vec::new();
    match std::fs::read_dir(&dir) {
        Ok(d) => {
            for e in d.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if let Some(name) = n.strip_suffix(".qcow2").filter(|n| valid_name(n)) {
                    let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                    rows.push((name.to_string(), size));
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", dir.display())),
    }
    rows.sort();
    println!("{:<32} {:>12}", "NAME", "SIZE");
    for (n, s) in rows {
        println!("{n:<32} {:>12}", crate::parse::human_bytes(s));
    }
    Ok(())
}

fn rm(a: &VmRmArgs) -> anyhow::Result<()> {
    if !valid_name(&a.name) {
        bail!("image name {:?} is not valid", a.name);
    }
    let p = images_dir(&a.dir).join(format!("{}.qcow2", a.name));
    std::fs::remove_file(&p).with_context(|| format!("remove {}", p.display()))?;
    for ext in ["kernel", "initrd", "cmdline"] {
        remove_if_present(&images_dir(&a.dir).join(format!("{}.{ext}", a.name)))?;
    }
    println!("removed {}", a.name);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("debian"));
        assert!(valid_name("deb-12.1_x"));
        assert!(!valid_name(""));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("-x"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"a".repeat(65)));
    }

    #[test]
    fn inject_installs_the_hook_and_enables_the_unit_only_with_systemd() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        let done = inject(root, b"ELF").unwrap();
        assert_eq!(done.len(), 2);
        assert_eq!(
            std::fs::read(root.join("usr/local/sbin/dsec-aether")).unwrap(),
            b"ELF"
        );
        let mode = std::fs::metadata(root.join("usr/local/sbin/dsec-init"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        assert!(!root.join("etc/systemd/system/dsec-aether.service").exists());
        std::fs::create_dir_all(root.join("lib/systemd")).unwrap();
        std::fs::write(root.join("lib/systemd/systemd"), b"").unwrap();
        let done = inject(root, b"ELF").unwrap();
        assert_eq!(done.len(), 3);
        let link = root.join("etc/systemd/system/multi-user.target.wants/dsec-aether.service");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("/etc/systemd/system/dsec-aether.service")
        );
        // A symlinked directory in the (untrusted) image is not followed on the host.
        let t2 = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t2.path().join("usr")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t2.path().join("usr/local")).unwrap();
        let e = inject(t2.path(), b"ELF").unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        // Again: idempotent.
        inject(root, b"ELF2").unwrap();
        assert_eq!(
            std::fs::read(root.join("usr/local/sbin/dsec-aether")).unwrap(),
            b"ELF2"
        );
    }

    #[test]
    fn init_hook_execs_aether_in_bare_mode_on_fd_3() {
        assert!(DSEC_INIT.starts_with("#!/bin/sh\n"));
        assert!(DSEC_INIT.contains("exec /usr/local/sbin/dsec-aether --mode bare --fd 3"));
        assert!(DSEC_UNIT.contains("ExecStart=/usr/local/sbin/dsec-init --service"));
    }

    #[test]
    fn init_hook_configures_the_network_from_fw_cfg_and_parses() {
        // The functions of scripts/vm/guest-net.sh are inlined, and called before aether.
        assert!(DSEC_INIT.contains("dsec_net_up() {"));
        let net = DSEC_INIT.find("\ndsec_net\n").expect("dsec_net is called");
        assert!(net < DSEC_INIT.find("exec /usr/local/sbin/dsec-aether").unwrap());
        assert!(DSEC_INIT.contains("/sys/firmware/qemu_fw_cfg/by_name/opt/dsec/net/raw"));
        assert!(
            DSEC_INIT.contains("modprobe qemu_fw_cfg") && DSEC_INIT.contains("modprobe virtio_net")
        );
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("dsec-init");
        std::fs::write(&f, DSEC_INIT).unwrap();
        match Command::new("sh").arg("-n").arg(&f).output() {
            Ok(o) => assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => eprintln!("skip: no sh to check the hook's syntax: {e}"),
        }
    }
}
