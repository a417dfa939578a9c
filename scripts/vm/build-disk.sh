#!/usr/bin/env bash
# Builds a bootable Linux disk image for the full-VM substrate (issue 9), once, cached in
# ${DSEC_CACHE:-/var/cache/dsec}/vm/:
#   debian.qcow2   raw disk converted to qcow2: MBR (syslinux mbr.bin), one bootable ext4 partition holding the
#                  Debian root (from debian-bookworm.tar), /boot/vmlinuz + /boot/initrd.img
#                  (the microVM guest's kernel; a busybox initramfs that mounts root=), and
#                  extlinux in /boot/extlinux — SeaBIOS boots it like any PC disk
#                  — after `dsec vm prepare-image` injected aether and its boot hook
#                  (init=/usr/local/sbin/dsec-init on the kernel command line)
#   direct/        vmlinuz + initrd.img (the disk's own) for direct kernel boot
#   kernel-version uname -r of the guest kernel
# Run as root. Needs: build-guest.sh's cached kernel .deb, sfdisk, mkfs.ext4, losetup, extlinux,
# syslinux-common, qemu-img, and the dsec binary ($DSEC_BIN or target/release/dsec).
set -euo pipefail
CACHE=${DSEC_CACHE:-/var/cache/dsec}
OUT=$CACHE/vm
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT_TAR=${DSEC_ROOT_TAR:-$CACHE/debian-bookworm.tar}
DSEC=${DSEC_BIN:-$HERE/../../target/release/dsec}
SIZE_MB=${DSEC_DISK_MB:-1536}
# qemu_fw_cfg + virtio_net: a networked VM's NIC and its configuration (fw_cfg opt/dsec/net,
# see crates/runtime/src/fullvm/qemu.rs); virtio_net is loaded only when that item exists.
MODULES=(virtio_pci virtio_blk virtio_console qemu_fw_cfg virtio_net)

# Rebuilt when this script, the root tarball or the aether binary (it is baked in) changed.
AETHER=${DSEC_AETHER:-$(dirname "$DSEC")/dsec-aether}
stamp=$( (cat "$0" "$HERE/guest-net.sh"; stat -c %s "$ROOT_TAR"; stat -c %Y "$ROOT_TAR"; sha256sum < "$AETHER" 2>/dev/null) \
         | sha256sum | cut -c1-16)
if [[ -s $OUT/debian.qcow2 && "$(cat "$OUT/stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "[dsec] VM disk image present: $OUT/debian.qcow2 (kernel $(cat "$OUT/kernel-version"))"
    exit 0
fi
for t in sfdisk mkfs.ext4 losetup extlinux qemu-img cpio gzip depmod dpkg-deb; do
    command -v "$t" >/dev/null || { echo "[dsec] build-disk: $t not found (scripts/install-deps.sh)" >&2; exit 1; }
done
MBR=/usr/lib/syslinux/mbr/mbr.bin
[[ -f $MBR ]] || { echo "[dsec] build-disk: $MBR missing (apt-get install syslinux-common)" >&2; exit 1; }
[[ -f $ROOT_TAR ]] || { echo "[dsec] build-disk: $ROOT_TAR missing (scripts/images/build-debian.sh)" >&2; exit 1; }
[[ -x $DSEC ]] || { echo "[dsec] build-disk: $DSEC missing (scripts/build.sh)" >&2; exit 1; }
[[ -f $AETHER ]] || { echo "[dsec] build-disk: $AETHER missing (scripts/build.sh; or set DSEC_AETHER)" >&2; exit 1; }
BUSYBOX=$(command -v busybox || true)
[[ -x /bin/busybox ]] && BUSYBOX=/bin/busybox
[[ -n $BUSYBOX ]] && file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' \
    || { echo "[dsec] build-disk: need a static busybox (apt-get install busybox-static)" >&2; exit 1; }

# The guest kernel package (fetched and cached by build-guest.sh).
bash "$HERE/build-guest.sh" >/dev/null
kver=$(cat "$CACHE/guest/kernel-version")
deb=$(ls "$CACHE/guest-debs/linux-image-${kver}_"*.deb | head -n1)

mkdir -p "$OUT"
work=$(mktemp -d "$OUT/.build.XXXXXX")
mnt=$work/mnt
loop=
cleanup() {
    mountpoint -q "$mnt" 2>/dev/null && umount "$mnt"
    [[ -n $loop ]] && losetup -d "$loop" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

# --- initramfs: busybox + virtio modules; /init mounts root= and switch_roots to init= -----
dpkg-deb -x "$deb" "$work/k"
depmod -b "$work/k" "$kver"
mdir=$work/k/lib/modules/$kver
R=$work/initrd
mkdir -p "$R"/{bin,dev,proc,sys,newroot,lib/modules/"$kver"}
cp "$BUSYBOX" "$R/bin/busybox"
for a in sh mount umount mkdir insmod switch_root cat sleep echo seq ip rm printf; do ln -s busybox "$R/bin/$a"; done
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
for m in "${MODULES[@]}" ext4; do
    rel=$(grep -E "(^|/)$m\.ko(\.(xz|zst|gz))?:" "$mdir/modules.dep" | head -n1 | cut -d: -f1 || true)
    if [[ -z $rel ]]; then
        grep -qE "(^|/)$m\.ko$" "$mdir/modules.builtin" && continue
        echo "[dsec] build-disk: module $m not found in $kver" >&2; exit 1
    fi
    add_mod "$rel"
done
: > "$R/modules.order"
for rel in "${order[@]}"; do
    name=$(basename "$rel")
    case $name in
        *.ko.xz) xz -dc "$mdir/$rel" > "$R/lib/modules/$kver/${name%.xz}"; name=${name%.xz} ;;
        *.ko.zst) zstd -qdc "$mdir/$rel" > "$R/lib/modules/$kver/${name%.zst}"; name=${name%.zst} ;;
        *) cp "$mdir/$rel" "$R/lib/modules/$kver/$name" ;;
    esac
    echo "/lib/modules/$kver/$name" >> "$R/modules.order"
done
cat > "$R/init" <<'EOF'
#!/bin/sh
# initramfs of the dsec full-VM disk: loads the virtio modules, mounts root= and hands over to
# init= (default /sbin/init) on it.
PATH=/bin
export PATH
fail() { echo "dsec-initrd: $*"; echo "dsec-initrd: FAILED"; exit 1; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
netcfg_file=/sys/firmware/qemu_fw_cfg/by_name/opt/dsec/net/raw
while read -r m; do
    case $m in
        # The NIC's drivers only for a VM with network (its fw_cfg item, qemu_fw_cfg is earlier).
        */failover.ko|*/net_failover.ko|*/virtio_net.ko) [ -f $netcfg_file ] || continue ;;
    esac
    insmod "$m" || fail "insmod $m"
done < /modules.order
# A networked VM (fw_cfg item IPV4,GATEWAY,IPV6|-,MTU,MAC; scripts/vm/guest-net.sh).
netcfg=
[ -f $netcfg_file ] && netcfg=$(cat $netcfg_file)
if [ -n "$netcfg" ]; then
    . /dsec-net.sh
    dsec_net_up "$netcfg"
    echo "dsec-initrd: network on $dsec_nic via $dsec_gateway"
fi
root=; init=/sbin/init; rootfstype=ext4; ro=rw
for a in $(cat /proc/cmdline); do
    case $a in
        root=*) root=${a#root=} ;;
        init=*) init=${a#init=} ;;
        rootfstype=*) rootfstype=${a#rootfstype=} ;;
        ro) ro=ro ;;
    esac
done
[ -n "$root" ] || fail "no root= on the kernel command line"
for t in $(seq 1 500); do [ -b "$root" ] && break; sleep 0.01; done
[ -b "$root" ] || fail "root device $root did not appear"
mount -t "$rootfstype" -o "$ro" "$root" /newroot || fail "mount $root"
[ -n "$netcfg" ] && [ "$ro" = rw ] && dsec_net_resolv /newroot
mount --move /dev /newroot/dev 2>/dev/null || umount /dev
umount /sys
umount /proc
exec switch_root /newroot "$init"
EOF
chmod 0755 "$R/init"
install -m 0644 "$HERE/guest-net.sh" "$R/dsec-net.sh"
(cd "$R" && find . -print0 | sort -z | cpio --null -o -H newc --quiet -R 0:0) | gzip -9 > "$work/initrd.img"

# --- the disk: MBR + one bootable ext4 partition ----------------------------------------
raw=$work/debian.raw
truncate -s "${SIZE_MB}M" "$raw"
echo 'start=2048, type=83, bootable' | sfdisk -q "$raw"
dd if="$MBR" of="$raw" bs=440 count=1 conv=notrunc status=none
# The partition through an offset loop (loop partition scanning creates no devices here).
loop=$(losetup -f --show -o $((2048 * 512)) --sizelimit $(( (SIZE_MB * 2048 - 2048) * 512 )) "$raw")
mkfs.ext4 -q -L dsec-root "$loop"
mkdir -p "$mnt"
mount "$loop" "$mnt"
tar -xf "$ROOT_TAR" -C "$mnt" --numeric-owner
mkdir -p "$mnt/boot/extlinux" "$mnt/proc" "$mnt/sys" "$mnt/dev" "$mnt/run" "$mnt/tmp"
cp "$work/k/boot/vmlinuz-$kver" "$mnt/boot/vmlinuz"
cp "$work/initrd.img" "$mnt/boot/initrd.img"
cat > "$mnt/boot/extlinux/extlinux.conf" <<EOF
DEFAULT dsec
PROMPT 0
TIMEOUT 1
LABEL dsec
    LINUX /boot/vmlinuz
    INITRD /boot/initrd.img
    APPEND root=/dev/vda1 rw console=ttyS0 panic=-1 quiet loglevel=4 no_timer_check init=/usr/local/sbin/dsec-init
EOF
echo 'dsec-vm' > "$mnt/etc/hostname"
printf '/dev/vda1 / ext4 rw 0 1\n' > "$mnt/etc/fstab"
extlinux --install "$mnt/boot/extlinux" >/dev/null 2>&1 \
    || { echo "[dsec] build-disk: extlinux --install failed" >&2; exit 1; }
umount "$mnt"
losetup -d "$loop"
loop=

# --- aether + boot hook, then qcow2 -------------------------------------------------------
"$DSEC" vm prepare-image --in "$raw" --out "$work/debian.qcow2" --format qcow2 --aether "$AETHER"
echo "$kver" > "$work/kernel-version"
# The same kernel and initramfs outside the disk, for direct kernel boot (`dsec vm image
# import NAME FILE --kernel direct/vmlinuz --initrd direct/initrd.img`).
mkdir -p "$OUT/direct"
cp "$work/k/boot/vmlinuz-$kver" "$OUT/direct/vmlinuz"
cp "$work/initrd.img" "$OUT/direct/initrd.img"
for f in debian.qcow2 kernel-version; do mv -f "$work/$f" "$OUT/$f"; done
echo "$stamp" > "$OUT/stamp"
echo "[dsec] VM disk image built: $OUT/debian.qcow2 (kernel $kver, $(stat -c %s "$OUT/debian.qcow2") bytes)"
