#!/usr/bin/env bash
# Build (once, cached) the layer tree of the `scipy` toolkit: numpy, pandas and scipy (and
# their pure-Python dependencies) as manylinux wheels for the debian image's CPython 3.11,
# installed under usr/local/lib/python3.11/dist-packages (on Debian's python3 sys.path).
#
# Output: ${DSEC_CACHE:-/var/cache/dsec}/scipy-toolkit/   (a directory tree)
#   - built in a temporary directory and renamed at the very end, so an interrupted build
#     leaves no output and is simply redone next time;
#   - if the output already exists, nothing is done.
#
# The wheels come through pip's normal configured index (pip.conf / PIP_* environment); no
# index is named here. When pip cannot fetch them the script exits with status 3 and a
# message, and writes nothing.
#
# Import the result as a toolkit image and compose it on debian:
#   dsec image import scipy-toolkit --dir /var/cache/dsec/scipy-toolkit
#   (SDK) DSecMicroVMRunArgs(container_image="debian", toolkits=["scipy-toolkit"])
#
# Environment:
#   DSEC_CACHE          cache directory (default /var/cache/dsec)
#   DSEC_SCIPY_REQS     requirement specifiers (default: pinned numpy, pandas, scipy)
#   DSEC_PIP            pip command (default: python3 -m pip)
set -euo pipefail

CACHE="${DSEC_CACHE:-/var/cache/dsec}"
OUT="$CACHE/scipy-toolkit"
REQS="${DSEC_SCIPY_REQS:-numpy==1.26.4 pandas==2.2.3 scipy==1.13.1}"
PIP="${DSEC_PIP:-python3 -m pip}"
# The debian (bookworm) image's interpreter.
PYVER=3.11
SITE="usr/local/lib/python$PYVER/dist-packages"

log() { printf '[build-scipy-toolkit] %s\n' "$*"; }

if [[ -d "$OUT/$SITE" ]]; then
    log "cached: $OUT already exists, nothing to do (delete it to rebuild)"
    exit 0
fi

mkdir -p "$CACHE"
TMP="$(mktemp -d "$CACHE/scipy-toolkit.tmp.XXXXXX")"
trap 'rm -rf --one-file-system "$TMP"' EXIT

log "fetching wheels for CPython $PYVER (manylinux x86_64): $REQS"
# Binary wheels only, for the guest's interpreter and platform (not the host's), so the
# result does not depend on which Python runs this script.
# shellcheck disable=SC2086
if ! $PIP install --quiet --no-compile --no-cache-dir --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --target "$TMP/root/$SITE" $REQS; then
    log "skipped: pip could not fetch the wheels (no package index reachable?); nothing written"
    exit 3
fi

R="$TMP/root"
# pip's --target leaves a bin/ of console scripts with the host's interpreter path: not
# usable in the guest, and not needed by `import`.
rm -rf "$R/$SITE/bin"
# Byte-compile with the guest's interpreter version in mind: without .pyc files every VM would
# compile (and cache in its writable layer) the same modules. Only when the host runs 3.11.
if python3 -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)"; then
    log "byte-compiling (host python3 is $PYVER)"
    python3 -m compileall -q -j 0 "$R/$SITE" >/dev/null || log "warning: compileall reported errors"
fi
chmod -R u+rwX,go+rX,go-w "$R"
mv "$R" "$OUT"
log "done: $OUT ($(du -sh "$OUT" | cut -f1))"
