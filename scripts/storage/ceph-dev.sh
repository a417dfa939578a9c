#!/usr/bin/env bash
# A single-node Ceph for development and tests, from Debian's packages: one monitor, one
# manager, one OSD on a file-backed BlueStore, one MDS with a CephFS (mounted with ceph-fuse:
# the kernel may have no Ceph client) and radosgw (S3, beast frontend on a loopback port) with a
# user and a bucket. Run as root.
#
#   scripts/storage/ceph-dev.sh start  [DATA_DIR]   # idempotent; prints and writes DATA_DIR/env
#   scripts/storage/ceph-dev.sh status [DATA_DIR]   # HEALTH, CephFS mounted?, S3 answering?
#   scripts/storage/ceph-dev.sh stop   [DATA_DIR]   # daemons by recorded PID, the mount, DATA_DIR
#
# DATA_DIR defaults to $DSEC_CEPH_DIR or /var/tmp/dsec-ceph. After `start`, `source DATA_DIR/env`
# gives CEPH_CONF, CEPHFS_MOUNT, S3_ENDPOINT, S3_ACCESS_KEY, S3_SECRET_KEY, S3_BUCKET, S3_REGION.
# Memory is bounded for a small machine: osd_memory_target 900 MB, MDS cache 128 MB, one OSD op
# shard; all daemons together use ~510 MiB. The OSD's block file is sparse (10 GiB apparent).
# A `start` that fails leaves its logs in DATA_DIR/log; `stop` cleans up after it.
set -euo pipefail

CMD=${1:-}
D=${2:-${DSEC_CEPH_DIR:-/var/tmp/dsec-ceph}}
D=$(realpath -m "$D")
MARK="$D/.dsec-ceph-dev"
CONF="$D/ceph.conf"
RUN="$D/run"
PKGS=(ceph-mon ceph-mgr ceph-osd ceph-mds radosgw ceph-fuse ceph-common)
# Bounds on every wait, so a broken daemon fails `start` instead of hanging it.
WAIT_S=${DSEC_CEPH_WAIT_S:-120}

log() { echo "[ceph-dev] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

install_pkgs() {
    local missing=()
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
}

ceph_() { timeout 30 ceph -c "$CONF" --connect-timeout 10 "$@"; }

free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Runs a daemon in the foreground of its own session, logging to log/NAME.out; records its PID.
spawn() {
    local name=$1
    shift
    setsid "$@" -f </dev/null >"$D/log/$name.out" 2>&1 &
    echo $! >"$RUN/$name.pid"
}

alive() { [[ -f "$RUN/$1.pid" ]] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

wait_for() {
    local what=$1
    shift
    local deadline=$((SECONDS + WAIT_S))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${WAIT_S}s waiting for $what (logs: $D/log)"
        sleep 1
    done
}

mounted() { grep -qs " $D/mnt fuse.ceph-fuse " /proc/self/mounts; }

# S3 request signed with AWS signature v2 (radosgw accepts it): s3 METHOD /bucket[/key]
s3() {
    local method=$1 path=$2 date sig
    date=$(LC_ALL=C date -u '+%a, %d %b %Y %H:%M:%S GMT')
    sig=$(printf '%s\n\n\n%s\n%s' "$method" "$date" "$path" |
        openssl dgst -sha1 -hmac "$S3_SECRET_KEY" -binary | base64)
    curl -sS -o /dev/null -w '%{http_code}' --max-time 10 -X "$method" \
        -H "Date: $date" -H "Authorization: AWS $S3_ACCESS_KEY:$sig" "$S3_ENDPOINT$path"
}

s3_ok() { [[ "$(s3 GET "/$S3_BUCKET")" == 200 ]]; }

all_up() {
    [[ -f "$D/env" ]] || return 1
    local n
    for n in mon.a mgr.a osd.0 mds.a rgw ceph-fuse; do alive "$n" || return 1; done
    mounted
}

write_conf() {
    cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:$MON_PORT
mon initial members = a
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
run dir = $RUN
admin socket = $RUN/\$name.asok
log file = $D/log/\$name.log
log to stderr = false
err to stderr = true
mon cluster log file = $D/log/cluster.log
# One OSD: pools of size 1, placement on that one OSD.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
# A shared development disk is often more than 70% full: warn only when it is nearly full.
mon data avail warn = 5
mon data avail crit = 2
# Only the manager's always-on modules and iostat (no dashboard, restful or nfs).
mgr initial modules = iostat

[mon]
mon data = $D/mon/\$cluster-\$id
keyring = \$mon_data/keyring

[mgr]
mgr data = $D/mgr/\$cluster-\$id
keyring = \$mgr_data/keyring

[osd]
osd data = $D/osd/\$cluster-\$id
keyring = \$osd_data/keyring
osd objectstore = bluestore
# The block file lies outside the OSD data dir: inside it, BlueStore's own "block" symlink
# would point at itself.
bluestore block path = $D/osd-block/\$id.block
bluestore block create = true
bluestore block size = 10737418240
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mount = false
osd memory target = 943718400
osd memory cache min = 134217728
osd op num shards = 1
osd op num threads per shard = 2

[mds]
mds data = $D/mds/\$cluster-\$id
keyring = \$mds_data/keyring
mds cache memory limit = 134217728

[client]
keyring = $D/keyring
# ceph-fuse and every ceph CLI call are client.admin: one socket each.
admin socket = $RUN/\$name.\$pid.asok
client cache size = 4096

[client.rgw.a]
admin socket = $RUN/\$name.asok
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $D/rgw
rgw thread pool size = 32
rgw enable usage log = false
EOF
}

start() {
    [[ $EUID -eq 0 ]] || die "run as root"
    if all_up; then
        log "already running in $D"
        cat "$D/env"
        return 0
    fi
    if [[ -e "$D" ]]; then
        [[ -f "$MARK" ]] || die "$D exists and is not a ceph-dev data dir; choose another DATA_DIR"
        log "partial or stale cluster in $D: tearing it down first"
        stop
    fi
    install_pkgs
    local t0=$SECONDS
    mkdir -p "$D"/{run,log,mon,mgr/ceph-a,osd,osd-block,mds/ceph-a,rgw,mnt}
    touch "$MARK"
    FSID=$(uuidgen)
    MON_PORT=$(free_port)
    RGW_PORT=$(free_port)
    write_conf

    # Keys: monitor and admin; the admin keyring is the one every client uses.
    ceph-authtool --create-keyring "$D/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool --create-keyring "$D/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
    ceph-authtool "$D/mon.keyring" --import-keyring "$D/keyring" >/dev/null
    monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$D/monmap" >/dev/null

    log "monitor on 127.0.0.1:$MON_PORT"
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$D/monmap" --keyring "$D/mon.keyring" >/dev/null
    spawn mon.a ceph-mon -c "$CONF" -i a
    wait_for "the monitor" ceph_ mon stat

    log "manager"
    ceph_ auth get-or-create mgr.a mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
        -o "$D/mgr/ceph-a/keyring" >/dev/null
    spawn mgr.a ceph-mgr -c "$CONF" -i a

    log "OSD on a file-backed BlueStore ($D/osd-block)"
    local uuid id secret
    uuid=$(uuidgen)
    secret=$(ceph-authtool --gen-print-key)
    id=$(echo "{\"cephx_secret\": \"$secret\"}" | ceph_ osd new "$uuid" -i -)
    [[ "$id" == 0 ]] || die "expected osd id 0, got $id"
    mkdir -p "$D/osd/ceph-$id"
    ceph-authtool --create-keyring "$D/osd/ceph-$id/keyring" --name "osd.$id" --add-key "$secret" >/dev/null
    ceph-osd -c "$CONF" -i "$id" --mkfs --osd-uuid "$uuid" >"$D/log/osd-mkfs.out" 2>&1 ||
        die "ceph-osd --mkfs failed: $(tail -5 "$D/log/osd-mkfs.out")"
    spawn "osd.$id" ceph-osd -c "$CONF" -i "$id"
    wait_for "the OSD to come up" bash -c "ceph -c '$CONF' --connect-timeout 10 osd dump | grep -q '^osd.0 up'"

    log "CephFS (pools cephfs_metadata + cephfs_data) and its MDS"
    ceph_ osd pool create cephfs_metadata 8 >/dev/null 2>&1
    ceph_ osd pool create cephfs_data 8 >/dev/null 2>&1
    ceph_ fs new cephfs cephfs_metadata cephfs_data >/dev/null 2>&1
    ceph_ auth get-or-create mds.a mon 'allow profile mds' osd 'allow rwx' mds 'allow *' \
        mgr 'allow profile mds' -o "$D/mds/ceph-a/keyring" >/dev/null
    spawn mds.a ceph-mds -c "$CONF" -i a

    log "radosgw on 127.0.0.1:$RGW_PORT"
    ceph_ auth get-or-create client.rgw.a mon 'allow rw' osd 'allow rwx' mgr 'allow rw' \
        -o "$D/rgw/keyring" >/dev/null
    spawn rgw radosgw -c "$CONF" -n client.rgw.a --keyring "$D/rgw/keyring"

    wait_for "the MDS to become active" bash -c "ceph -c '$CONF' --connect-timeout 10 fs status cephfs | grep -q active"
    log "mounting CephFS on $D/mnt with ceph-fuse"
    spawn ceph-fuse ceph-fuse -c "$CONF" --id admin "$D/mnt"
    wait_for "the ceph-fuse mount" mounted

    S3_ENDPOINT="http://127.0.0.1:$RGW_PORT"
    S3_ACCESS_KEY=$(openssl rand -hex 10 | tr a-f A-F)
    S3_SECRET_KEY=$(openssl rand -hex 20)
    S3_BUCKET=dsec
    wait_for "radosgw to answer" curl -sf --max-time 5 -o /dev/null "$S3_ENDPOINT/"
    timeout 60 radosgw-admin -c "$CONF" user create --uid=dsec --display-name="dsec dev" \
        --access-key="$S3_ACCESS_KEY" --secret="$S3_SECRET_KEY" >/dev/null
    local code
    code=$(s3 PUT "/$S3_BUCKET")
    [[ "$code" == 200 ]] || die "creating bucket $S3_BUCKET returned HTTP $code"

    cat >"$D/env" <<EOF
CEPH_CONF=$CONF
CEPH_KEYRING=$D/keyring
CEPHFS_MOUNT=$D/mnt
S3_ENDPOINT=$S3_ENDPOINT
S3_REGION=default
S3_BUCKET=$S3_BUCKET
S3_ACCESS_KEY=$S3_ACCESS_KEY
S3_SECRET_KEY=$S3_SECRET_KEY
EOF
    chmod 600 "$D/env"
    wait_for "HEALTH_OK" bash -c "ceph -c '$CONF' --connect-timeout 10 health | grep -q '^HEALTH_OK'"
    log "up in $((SECONDS - t0)) s; daemons use $(rss_mib) MiB; source $D/env"
    cat "$D/env"
}

rss_mib() {
    local total=0 n pid kb
    for n in mon.a mgr.a osd.0 mds.a rgw ceph-fuse; do
        alive "$n" || continue
        pid=$(cat "$RUN/$n.pid")
        kb=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        total=$((total + ${kb:-0}))
    done
    echo $((total / 1024))
}

status() {
    [[ -f "$MARK" ]] || { echo "not running (no cluster in $D)"; return 1; }
    local rc=0 n
    echo "data dir: $D"
    for n in mon.a mgr.a osd.0 mds.a rgw ceph-fuse; do
        if alive "$n"; then echo "$n: running (pid $(cat "$RUN/$n.pid"))"; else echo "$n: not running"; rc=1; fi
    done
    echo "health: $(ceph_ health 2>/dev/null || echo unreachable)"
    if mounted; then echo "cephfs: mounted on $D/mnt"; else echo "cephfs: not mounted"; rc=1; fi
    if [[ -f "$D/env" ]]; then
        # shellcheck disable=SC1091
        source "$D/env"
        if s3_ok; then echo "s3: answering at $S3_ENDPOINT (bucket $S3_BUCKET)"; else echo "s3: not answering at $S3_ENDPOINT"; rc=1; fi
        echo "env file: $D/env"
    else
        echo "s3: not configured"
        rc=1
    fi
    echo "memory (RSS of the daemons): $(rss_mib) MiB"
    return $rc
}

# Ends recorded daemons together: SIGTERM to each, up to 20 s for all, then SIGKILL. Only the
# PIDs we recorded, and only while they still run one of ours (a recycled PID is left alone).
end_daemons() {
    local n pid i
    local -A pids=()
    for n in "$@"; do
        [[ -f "$RUN/$n.pid" ]] || continue
        pid=$(cat "$RUN/$n.pid")
        # Every daemon runs with `-c $CONF`: a PID whose command line lacks it was recycled.
        if grep -qsF "$CONF" "/proc/$pid/cmdline"; then
            pids[$n]=$pid
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for ((i = 0; i < 200 && ${#pids[@]}; i++)); do
        for n in "${!pids[@]}"; do
            if ! kill -0 "${pids[$n]}" 2>/dev/null; then
                ((i < 30)) || log "$n (pid ${pids[$n]}) took $((i / 10)) s to exit"
                unset "pids[$n]"
            fi
        done
        ((${#pids[@]})) && sleep 0.1
    done
    for n in "${!pids[@]}"; do
        log "$n (pid ${pids[$n]}) ignored SIGTERM for 20 s; killing it"
        kill -KILL "${pids[$n]}" 2>/dev/null || true
    done
    for n in "$@"; do rm -f "$RUN/$n.pid"; done
}

stop() {
    [[ -e "$D" ]] || { log "nothing to stop in $D"; return 0; }
    [[ -f "$MARK" ]] || die "$D is not a ceph-dev data dir; not touching it"
    if mounted; then
        fusermount -u "$D/mnt" 2>/dev/null || fusermount -u -z "$D/mnt" 2>/dev/null || umount -l "$D/mnt" || true
    fi
    # The client first, then the daemons that talk to the monitor, then the monitor.
    end_daemons ceph-fuse
    end_daemons rgw mds.a osd.0 mgr.a
    end_daemons mon.a
    mounted && die "$D/mnt is still mounted"
    rm -rf "$D"
    log "stopped; removed $D"
}

case "$CMD" in
start) start ;;
stop) stop ;;
status) status ;;
*) echo "usage: $0 start|stop|status [DATA_DIR]" >&2; exit 2 ;;
esac
