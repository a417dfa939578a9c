#!/bin/sh
# /init of the dsec microVM guest (busybox). The edge attaches, per image layer i (0 = top-most),
# a read-only virtio disk with serial dsec-m<i> (EROFS metadata image) and, when the layer keeps
# its data in a separate blob, one with serial dsec-b<i>. Kernel command line:
#   dsec.nlayers=N   number of layers
#   dsec.net=IPV4,GATEWAY,IPV6|-,MTU,MAC   the NIC's configuration (only with a NIC: network
#                    mode allowlist/open; the sandbox's address and its default gateway, which
#                    is also the edge's DNS proxy; see crates/runtime/src/microvm/net.rs)
# The root is an overlay of the layers whose upper/work directories live on the per-VM writable
# disk (serial dsec-upper: a raw ext4 image on the host; tmpfs when there is none); aether (prepended to the initramfs by
# the edge as /dsec-aether, with the sandbox's env in /dsec-env) becomes PID 1 of the new root
# and talks to the edge over the virtio-serial port named dsec.aether.
PATH=/bin
# Stage timestamps (guest uptime) on the serial console: <sandbox dir>/vm/console.log.
t() {
    u=$(cut -d" " -f1 /proc/uptime 2>/dev/null || cut -d" " -f1 /newroot/proc/uptime 2>/dev/null)
    echo "dsec-init: $u $*"
}
export PATH
fail() {
    echo "dsec-init: $*" >&2
    echo "dsec-init: FAILED" >&2
    # PID 1 exiting panics the kernel; with panic=-1 and -no-reboot QEMU then exits.
    exit 1
}
mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
# QEMU's microvm machine has virtio-mmio devices instead of PCI. It describes them in its ACPI
# tables (devices LNRO0005, the default) or, with acpi=off, on the kernel command line; insmod
# (unlike modprobe) does not read module parameters from there, so hand them over.
# Only the modules this VM's devices need (each insmod costs tens of ms under TCG): virtio_mmio
# on the microvm machine only, virtio_pci only with a PCI bus that has devices besides host
# bridges, the pmem stack only with pmem regions, the balloon driver only with a balloon
# (`dsec.balloon=1`).
mmio=
pmem=
balloon=
netcfg=
for a in $(cat /proc/cmdline); do
    case $a in
        virtio_mmio.device=*) mmio="$mmio device=${a#virtio_mmio.device=}" ;;
        dsec.pmem=*) pmem=1 ;;
        dsec.balloon=1) balloon=1 ;;
        dsec.net=*) netcfg=${a#dsec.net=} ;;
    esac
done
for d in /sys/bus/acpi/devices/LNRO0005:*; do
    [ -e "$d" ] && mmio=${mmio:- }
done
pci=
for d in /sys/bus/pci/devices/*; do
    [ -e "$d/class" ] || continue
    # 0x0600xx: host bridge (microvm's PCIe root); anything else needs virtio_pci.
    case $(cat "$d/class") in
        0x0600*) ;;
        *) pci=1 ;;
    esac
done
while read -r m; do
    case $m in
        */virtio_mmio.ko) [ -n "$mmio" ] && { insmod "$m" $mmio || fail "insmod $m"; } ;;
        */virtio_pci.ko|*/virtio_pci_modern_dev.ko|*/virtio_pci_legacy_dev.ko)
            [ -n "$pci" ] && { insmod "$m" || fail "insmod $m"; } ;;
        */libnvdimm.ko|*/nd_btt.ko|*/nd_pmem.ko|*/nd_virtio.ko|*/virtio_pmem.ko)
            [ -n "$pmem" ] && { insmod "$m" || fail "insmod $m"; } ;;
        */virtio_balloon.ko) [ -n "$balloon" ] && { insmod "$m" || fail "insmod $m"; } ;;
        */failover.ko|*/net_failover.ko|*/virtio_net.ko)
            [ -n "$netcfg" ] && { insmod "$m" || fail "insmod $m"; } ;;
        *) insmod "$m" || fail "insmod $m" ;;
    esac
done < /modules.order

t modules-loaded
# The NIC of a VM with network (scripts/vm/guest-net.sh).
if [ -n "$netcfg" ]; then
    . /dsec-net.sh
    dsec_net_up "$netcfg"
    t "network on $dsec_nic via $dsec_gateway"
fi
n=0
for a in $(cat /proc/cmdline); do
    case $a in
        dsec.nlayers=*) n=${a#dsec.nlayers=} ;;
    esac
done
[ "$n" -gt 0 ] 2>/dev/null || fail "no dsec.nlayers= on the kernel command line"
pmemmap=
for a in $(cat /proc/cmdline); do
    case $a in
        dsec.pmem=*) pmemmap=$(echo "${a#dsec.pmem=}" | tr , ' ') ;;
    esac
done

# /dev/pmemN of the virtio-pmem device in PCI slot $1 (hex).
find_pmem_slot() {
    for b in /sys/block/pmem*; do
        [ -e "$b" ] || continue
        case $(readlink -f "$b") in
            */0000:00:$1.0/*) echo "/dev/${b##*/}"; return 0 ;;
        esac
    done
    return 1
}
# The device of layer file $1 (m<i> or b<i>): its pmem region if mapped, else its disk.
layer_dev() {
    for e in $pmemmap; do
        if [ "${e%@*}" = "$1" ]; then
            for t in $(seq 1 1000); do
                find_pmem_slot "${e#*@}" && return 0
                sleep 0.01
            done
            return 1
        fi
    done
    dev_of "dsec-$1"
}
has_layer_file() {
    for e in $pmemmap; do [ "${e%@*}" = "$1" ] && return 0; done
    find_dev "dsec-$1" >/dev/null
}

# Disk by serial (the probe order of virtio-mmio devices is not the command line's order).
find_dev() {
    for b in /sys/block/vd*; do
        [ -e "$b/serial" ] || continue
        if [ "$(cat "$b/serial")" = "$1" ]; then
            echo "/dev/${b##*/}"
            return 0
        fi
    done
    return 1
}
dev_of() {
    for t in $(seq 1 1000); do
        find_dev "$1" && return 0
        sleep 0.01
    done
    return 1
}

lower=
i=0
while [ "$i" -lt "$n" ]; do
    meta=$(layer_dev "m$i") || fail "no disk or pmem region for layer file m$i (block devices: $(ls /sys/block))"
    opts=ro
    # All disks are probed together, so once the metadata disk is there its blob disk is too.
    if has_layer_file "b$i"; then
        blob=$(layer_dev "b$i") || fail "no disk or pmem region for layer file b$i"
        opts="ro,device=$blob"
    fi
    mkdir -p "/layers/$i"
    case $meta in
        /dev/pmem*)
            # DAX: file data is read straight from the mapped region (the host's page cache).
            mount -t erofs -o "$opts,dax=always" "$meta" "/layers/$i" 2>/dev/null \
                || { echo "dsec-init: layer $i: no DAX, mounting without"; \
                     mount -t erofs -o "$opts" "$meta" "/layers/$i"; } \
                || fail "mount layer $i ($meta, $opts)" ;;
        *) mount -t erofs -o "$opts" "$meta" "/layers/$i" || fail "mount layer $i ($meta, $opts)" ;;
    esac
    lower=${lower:+$lower:}/layers/$i
    i=$((i + 1))
done

# The port's name arrives from the host over the control queue, shortly after the probe.
t layers-mounted
port=
for t in $(seq 1 1000); do
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = dsec.aether ] && port=/dev/${p##*/}
    done
    [ -n "$port" ] && break
    sleep 0.01
done
[ -n "$port" ] || fail "no virtio-serial port named dsec.aether"
for t in $(seq 1 50); do
    [ -c "$port" ] && break
    sleep 0.01
done
[ -c "$port" ] || fail "$port is not a character device"
t port-found
exec 3<>"$port" || fail "open $port"
# A read of a virtio-serial port whose host side is not (yet) connected returns EOF at once,
# which aether would take for the end of its channel. The edge sends one sync byte as soon as
# QEMU connected (`S`); wait until it arrives (a read blocks once the host side is open).
synced=
for t in $(seq 1 300); do
    if [ -n "$(dd bs=1 count=1 <&3 2>/dev/null)" ]; then
        synced=1
        break
    fi
    sleep 0.01
done
[ -n "$synced" ] || fail "the host never connected to $port"

t synced
if upper=$(find_dev dsec-upper); then
    mount -t ext4 -o rw,noatime,discard,noinit_itable "$upper" /rw || fail "mount the writable disk $upper"
else
    mount -t tmpfs -o mode=0755 rw /rw || fail "mount tmpfs upper"
fi
mkdir -p /rw/upper /rw/work
mount -t overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot \
    || fail "mount overlay"
for d in proc sys dev tmp run .dsec; do
    mkdir -p "/newroot/$d"
done
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
mount -t tmpfs -o mode=1777 tmp /newroot/tmp
mount -t tmpfs -o mode=0755 run /newroot/run
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
ln -sf pts/ptmx /newroot/dev/ptmx 2>/dev/null
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
mount -t tmpfs -o mode=0755 dsec /newroot/.dsec
cp /dsec-aether /newroot/.dsec/aether || fail "no /dsec-aether in the initramfs"
chmod 0755 /newroot/.dsec/aether
[ -f /dsec-hostname ] && hostname "$(cat /dsec-hostname)"
[ -n "$netcfg" ] && dsec_net_resolv /newroot
[ -f /dsec-env ] && . /dsec-env

# The sandbox user and sandbox-wide environment reach aether as --user / --env-file (the
# environment file lives on aether's own tmpfs, readable by root only).
set -- --mode bare --fd 3
[ -s /dsec-user ] && set -- "$@" --user "$(cat /dsec-user)"
if [ -f /dsec-environ ]; then
    cp /dsec-environ /newroot/.dsec/environ && chmod 0600 /newroot/.dsec/environ || fail "copy /dsec-environ"
    set -- "$@" --env-file /.dsec/environ
fi
t "root ready, starting aether on $port"
exec switch_root /newroot /.dsec/aether "$@"
