#!/usr/bin/env bash
# Builds the microVM guest: Debian's cloud kernel and a busybox initramfs whose /init mounts the
# sandbox's EROFS layers (read-only virtio disks) under an overlay and hands over to aether.
# Idempotent; the result is cached in ${DSEC_CACHE:-/var/cache/dsec}/guest/:
#   vmlinuz          the kernel (from the versioned linux-image-*-cloud-amd64 package)
#   initrd.img       gzip'ed newc cpio: busybox, modules, /init (aether is NOT in it: the edge
#                    prepends a small cpio with /dsec-aether and the sandbox's env per VM)
#   kernel-version   uname -r of the guest kernel
# Run as root. Needs apt-get (package registry access), dpkg-deb, depmod, cpio, busybox-static.
set -euo pipefail
CACHE=${DSEC_CACHE:-/var/cache/dsec}
OUT=$CACHE/guest
INIT_SRC=$(cd "$(dirname "$0")" && pwd)/init.sh
NET_SRC=$(dirname "$INIT_SRC")/guest-net.sh
# ext4 (the writable disk) is built into Debian's cloud kernel. virtio_balloon: free page
# reporting; virtio_pmem + nd_pmem: read-only layers mapped with DAX from the host's page cache.
# virtio_net (with failover, net_failover): the NIC of VMs with network mode allowlist/open.
MODULES=(virtio_mmio virtio_pci virtio_blk virtio_console erofs overlay virtio_balloon virtio_pmem nd_pmem virtio_net)

# Rebuild when the /init script changed since the last build.
stamp=$(cat "$INIT_SRC" "$NET_SRC" "$0" | sha256sum | cut -c1-16)
if [[ -s $OUT/vmlinuz && -s $OUT/initrd.img && "$(cat "$OUT/stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "[dsec] microVM guest present in $OUT (kernel $(cat "$OUT/kernel-version"))"
    exit 0
fi
for t in dpkg-deb depmod cpio gzip python3; do
    command -v "$t" >/dev/null || { echo "[dsec] build-guest: $t not found" >&2; exit 1; }
done
BUSYBOX=$(command -v busybox || true)
[[ -x /bin/busybox ]] && BUSYBOX=/bin/busybox
[[ -n $BUSYBOX ]] && file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' \
    || { echo "[dsec] build-guest: need a static busybox (apt-get install busybox-static)" >&2; exit 1; }

mkdir -p "$OUT"
work=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The meta package only depends on the versioned kernel package: resolve and fetch that one.
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null \
      | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1)
if [[ -z $pkg ]]; then
    apt-get update -qq
    pkg=$(apt-cache depends linux-image-cloud-amd64 \
          | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1)
fi
[[ -n $pkg ]] || { echo "[dsec] build-guest: cannot resolve linux-image-cloud-amd64" >&2; exit 1; }
echo "[dsec] fetching $pkg"
debdir=$CACHE/guest-debs
mkdir -p "$debdir"
if ! ls "$debdir/${pkg}_"*.deb >/dev/null 2>&1; then
    (cd "$work" && apt-get download "$pkg" >/dev/null) \
        || { echo "[dsec] build-guest: apt-get download $pkg failed" >&2; exit 1; }
    mv "$work/${pkg}_"*.deb "$debdir/"
fi
deb=$(ls "$debdir/${pkg}_"*.deb | head -n1)
dpkg-deb -x "$deb" "$work/k"
kver=${pkg#linux-image-}
[[ -d $work/k/lib/modules/$kver ]] || { echo "[dsec] build-guest: no modules for $kver in $deb" >&2; exit 1; }
depmod -b "$work/k" "$kver"

# initramfs tree
R=$work/root
mkdir -p "$R"/{bin,dev,proc,sys,newroot,layers,rw,lib/modules/"$kver"}
cp "$BUSYBOX" "$R/bin/busybox"
for a in sh mount umount mkdir insmod modprobe switch_root cat ls sleep echo hostname cp chmod ln dd seq cut sync tr readlink ip rm printf; do
    ln -s busybox "$R/bin/$a"
done
install -m 0755 "$INIT_SRC" "$R/init"
install -m 0644 "$NET_SRC" "$R/dsec-net.sh"

# Modules and their dependencies, in load order (modules.dep lists dependencies of each).
mdir=$work/k/lib/modules/$kver
declare -A seen=()
order=()
add_mod() {
    local rel=$1 dep
    [[ -n ${seen[$rel]:-} ]] && return
    seen[$rel]=1
    for dep in $(awk -v m="$rel:" '$1 == m { for (i = 2; i <= NF; i++) print $i }' "$mdir/modules.dep"); do
        add_mod "$dep"
    done
    order+=("$rel")
}
for m in "${MODULES[@]}"; do
    rel=$(grep -E "(^|/)$m\.ko(\.(xz|zst|gz))?:" "$mdir/modules.dep" | head -n1 | cut -d: -f1 || true)
    if [[ -z $rel ]]; then
        if grep -qw "$m" "$mdir/modules.builtin" 2>/dev/null; then continue; fi
        echo "[dsec] build-guest: module $m not found in $kver" >&2; exit 1
    fi
    add_mod "$rel"
done
# Debian signs its modules; the guest kernel then hashes each module and checks an RSA signature
# at insmod (slow under TCG). The initramfs is built here from the verified package and is part of
# the host's trusted artefacts, so drop the appended signature: the kernel (no
# CONFIG_MODULE_SIG_FORCE, no lockdown without secure boot) loads it unverified (tainted "E").
strip_signature() {
    python3 - "$1" <<'PY'
import struct, sys
p = sys.argv[1]
b = open(p, "rb").read()
magic = b"~Module signature appended~\n"
if b.endswith(magic):
    sig_len = struct.unpack(">I", b[-len(magic) - 4:-len(magic)])[0]
    open(p, "wb").write(b[:len(b) - len(magic) - 12 - sig_len])
PY
}
: > "$R/modules.order"
for rel in "${order[@]}"; do
    name=$(basename "$rel")
    case $name in
        *.ko.xz) xz -dc "$mdir/$rel" > "$R/lib/modules/$kver/${name%.xz}"; name=${name%.xz} ;;
        *.ko.zst) zstd -qdc "$mdir/$rel" > "$R/lib/modules/$kver/${name%.zst}"; name=${name%.zst} ;;
        *) cp "$mdir/$rel" "$R/lib/modules/$kver/$name" ;;
    esac
    strip_signature "$R/lib/modules/$kver/$name"
    echo "/lib/modules/$kver/$name" >> "$R/modules.order"
done
echo "[dsec] guest modules: $(tr '\n' ' ' < "$R/modules.order")"

(cd "$R" && find . -print0 | sort -z | cpio --null -o -H newc --quiet -R 0:0) | gzip -9 > "$work/initrd.img"
cp "$work/k/boot/vmlinuz-$kver" "$work/vmlinuz"
echo "$kver" > "$work/kernel-version"
for f in vmlinuz initrd.img kernel-version; do mv -f "$work/$f" "$OUT/$f"; done
echo "$stamp" > "$OUT/stamp"
echo "[dsec] microVM guest built in $OUT (kernel $kver, initrd $(stat -c %s "$OUT/initrd.img") bytes)"
