# Sourced by the dsec guests' /init (busybox sh): the microVM's (scripts/vm/init.sh) and the
# full-VM disk's initramfs (scripts/vm/build-disk.sh), installed there as /dsec-net.sh. Expects
# the caller's `fail` function. See crates/runtime/src/microvm/net.rs for the host side.

# dsec_net_up IPV4,GATEWAY,IPV6|-,MTU,MAC
# Configures the NIC with that MAC: the sandbox's own address as a /32 (/128) behind the gateway,
# which answers for everything (the host side routes and filters); no DAD (nobody else can hold
# the address on this link). Sets $dsec_gateway (also the edge's DNS proxy) and $dsec_nic.
dsec_net_up() {
    _ifs=$IFS
    IFS=,
    # shellcheck disable=SC2086
    set -- $1
    IFS=$_ifs
    _v4=$1 dsec_gateway=$2 _v6=$3 _mtu=$4 _mac=$5
    dsec_nic=
    for _t in $(seq 1 500); do
        for _l in /sys/class/net/*; do
            [ "$(cat "$_l/address" 2>/dev/null)" = "$_mac" ] && dsec_nic=${_l##*/}
        done
        [ -n "$dsec_nic" ] && break
        sleep 0.01
    done
    [ -n "$dsec_nic" ] || fail "no network interface with MAC $_mac"
    ip link set lo up
    echo 0 > "/proc/sys/net/ipv6/conf/$dsec_nic/accept_dad" 2>/dev/null
    ip link set "$dsec_nic" mtu "$_mtu" up || fail "bring $dsec_nic up (MTU $_mtu)"
    ip addr add "$_v4/32" dev "$dsec_nic" || fail "address $_v4 on $dsec_nic"
    ip route add "$dsec_gateway/32" dev "$dsec_nic" || fail "route to $dsec_gateway"
    ip route add default via "$dsec_gateway" dev "$dsec_nic" || fail "default route via $dsec_gateway"
    if [ "$_v6" != - ]; then
        ip -6 addr add "$_v6/128" dev "$dsec_nic" || fail "address $_v6 on $dsec_nic"
        ip -6 route add default via fe80::1 dev "$dsec_nic" || fail "IPv6 default route"
    fi
}

# dsec_net_resolv ROOT: ROOT/etc/resolv.conf names the gateway (the edge's DNS proxy, which
# answers only names the sandbox may resolve).
dsec_net_resolv() {
    mkdir -p "$1/etc"
    rm -f "$1/etc/resolv.conf"
    printf '# written by dsec: the edge DNS proxy answers only allowed names\nnameserver %s\noptions attempts:1 timeout:1\n' \
        "$dsec_gateway" > "$1/etc/resolv.conf" || fail "write /etc/resolv.conf"
}
