#!/usr/bin/env bash
# One command: install what is needed, build, start a single-node dsec, run the demo.
#   sudo ./scripts/setup.sh        (as root on Debian)
# Leaves `dsec up` running in the background (log: $DATA/up.log, stop: kill $(cat $DATA/up.pid)).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DATA=${DSEC_DATA_DIR:-/var/lib/dsec}
LISTEN=${DSEC_LISTEN:-127.0.0.1:7480}
[[ $(id -u) == 0 ]] || { echo "run as root (dsec creates namespaces, cgroups and mounts)" >&2; exit 1; }

bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/images/build-debian.sh
echo "[dsec] installing the Python SDK"
python3 -m pip install -q ./sdk/python 2>/dev/null || python3 -m pip install -q --break-system-packages ./sdk/python

mkdir -p "$DATA"
if [[ -f $DATA/up.pid ]] && kill -0 "$(cat "$DATA/up.pid")" 2>/dev/null; then
    echo "[dsec] dsec up already running (pid $(cat "$DATA/up.pid"))"
else
    rm -f "$DATA/env.ready"
    echo "[dsec] starting dsec up on $LISTEN (data: $DATA, log: $DATA/up.log)"
    nohup "$ROOT/target/release/dsec" up --data-dir "$DATA" --listen "$LISTEN" >"$DATA/up.out" 2>"$DATA/up.log" &
    echo $! >"$DATA/up.pid"
    for _ in $(seq 1 300); do
        grep -q '^DSEC_API_KEY=' "$DATA/up.out" 2>/dev/null && break
        kill -0 "$(cat "$DATA/up.pid")" 2>/dev/null || { echo "dsec up exited; see $DATA/up.log" >&2; tail -20 "$DATA/up.log" >&2; exit 1; }
        sleep 0.2
    done
fi
set -a; source "$DATA/env"; set +a
cat "$DATA/env"

if ! "$ROOT/target/release/dsec" image ls --json | grep -q '"debian:latest"'; then
    echo "[dsec] importing the debian image"
    "$ROOT/target/release/dsec" image import debian --tar "${DSEC_CACHE:-/var/cache/dsec}/debian-bookworm.tar"
fi

echo "[dsec] running the demo (examples/demo.py)"
python3 examples/demo.py
echo
echo "dsec is running. Try:  source $DATA/env && target/release/dsec run debian"
