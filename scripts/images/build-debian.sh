#!/usr/bin/env bash
# Build (once, cached) the root filesystem tarball of the `debian` image.
#
# Output: ${DSEC_CACHE:-/var/cache/dsec}/debian-bookworm.tar
#   - written to a temporary name and renamed at the very end, so an
#     interrupted build leaves no output and is simply redone next time;
#   - if the output already exists, nothing is done.
#
# The Debian mirror is read from this machine's apt sources (the first `deb`
# URI serving the main archive for the suite); no mirror is hardcoded.
#
# Import the result with dsec's image store (ImageStore::import_tar), e.g.
# `dsec image import debian /var/cache/dsec/debian-bookworm.tar`.
#
# Environment:
#   DSEC_CACHE       cache directory (default /var/cache/dsec)
#   DSEC_SUITE       Debian suite (default bookworm)
#   DSEC_MIRROR      override the mirror URI (default: from apt sources)
#   DSEC_INCLUDE     extra packages (default python3,git,gcc,libc6-dev)
#   DSEC_APT_DIR     where to read apt sources from (default /etc/apt)
#   DSEC_OUT         output tarball (default $DSEC_CACHE/debian-$DSEC_SUITE.tar)
#   DSEC_POST_HOOK   a script run with the root filesystem's path before it is archived
#                    (scripts/images/build-e2b-base.sh uses both)
set -euo pipefail

CACHE="${DSEC_CACHE:-/var/cache/dsec}"
SUITE="${DSEC_SUITE:-bookworm}"
INCLUDE="${DSEC_INCLUDE:-python3,git,gcc,libc6-dev}"
OUT="${DSEC_OUT:-$CACHE/debian-$SUITE.tar}"
WORK="${OUT%.tar}.build"
DEBS="$CACHE/debs-$SUITE"
APT_DIR="${DSEC_APT_DIR:-/etc/apt}"

log() { printf '[build-debian] %s\n' "$*"; }
die() { printf '[build-debian] error: %s\n' "$*" >&2; exit 1; }

if [[ -f "$OUT" ]]; then
    log "cached: $OUT already exists, nothing to do (delete it to rebuild)"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap needs it)"

# --- debootstrap -------------------------------------------------------------
if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap >/dev/null \
        || die "could not install debootstrap (apt-get install debootstrap)"
fi

# --- mirror from the apt sources ----------------------------------------------
# Prints "URI SUITES..." for every `deb` entry, in file order: one-line
# *.list format and deb822 *.sources format.
apt_entries() {
    local f
    for f in "$APT_DIR/sources.list" "$APT_DIR"/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk '
            { sub(/#.*/, "") }
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if (i + 1 <= NF) print $i, $(i + 1)
            }' "$f"
    done
    for f in "$APT_DIR"/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "")
                    { n = split(uris, u, " "); for (k = 1; k <= n; k++) print u[k], suites }
                types = ""; uris = ""; suites = ""; enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                line = $0
                key = tolower(line); sub(/:.*/, "", key)
                val = line; sub(/^[^:]*:[ \t]*/, "", val)
                if (key == "types") types = val
                else if (key == "uris") uris = val
                else if (key == "suites") suites = val
                else if (key == "enabled") enabled = tolower(val)
            }
            END { flush() }' "$f"
    done
}

find_mirror() {
    local uri suites s
    # First choice: an entry that serves exactly the suite we want.
    while read -r uri suites; do
        for s in $suites; do
            if [[ "$s" == "$SUITE" ]]; then
                echo "$uri"
                return 0
            fi
        done
    done < <(apt_entries)
    # Fallback: first URI that looks like the main Debian archive.
    while read -r uri suites; do
        case "$uri" in
        */debian | */debian/) echo "$uri"; return 0 ;;
        esac
    done < <(apt_entries)
    return 1
}

MIRROR="${DSEC_MIRROR:-}"
if [[ -z "$MIRROR" ]]; then
    MIRROR="$(find_mirror)" || die "no 'deb' entry for suite $SUITE in $APT_DIR/sources.list{,.d}; set DSEC_MIRROR"
fi
log "suite $SUITE, mirror $MIRROR, extra packages $INCLUDE"

# --- build ---------------------------------------------------------------------
mkdir -p "$CACHE" "$DEBS"

# Unmount anything a previous (interrupted) debootstrap left mounted in WORK.
unmount_work() {
    [[ -d "$WORK" ]] || return 0
    local m
    # Deepest first.
    awk -v w="$WORK/" 'index($5, w) == 1 { print $5 }' /proc/self/mountinfo \
        | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
}

cleanup() {
    unmount_work
    rm -f "$OUT.tmp.$$"
}
trap cleanup EXIT

unmount_work
if [[ -d "$WORK" ]]; then
    log "removing leftovers of an interrupted build: $WORK"
    rm -rf --one-file-system "$WORK"
fi
mkdir -p "$WORK"

log "running debootstrap (minbase) into $WORK — this downloads packages and takes a few minutes"
debootstrap --variant=minbase --include="$INCLUDE" --cache-dir="$DEBS" \
    "$SUITE" "$WORK" "$MIRROR" 2>&1 | sed -u 's/^/[debootstrap] /'
[[ ${PIPESTATUS[0]} -eq 0 ]] || die "debootstrap failed (see output above)"
unmount_work

log "configuring the root filesystem"
R="$WORK"
if ! grep -q '^user:' "$R/etc/passwd"; then
    echo 'user:x:1000:1000::/home/user:/bin/bash' >>"$R/etc/passwd"
fi
if ! grep -q '^user:' "$R/etc/group"; then
    echo 'user:x:1000:' >>"$R/etc/group"
fi
if [[ -f "$R/etc/shadow" ]] && ! grep -q '^user:' "$R/etc/shadow"; then
    echo 'user:*:19000:0:99999:7:::' >>"$R/etc/shadow"
fi
if [[ -f "$R/etc/gshadow" ]] && ! grep -q '^user:' "$R/etc/gshadow"; then
    echo 'user:*::' >>"$R/etc/gshadow"
fi
mkdir -p "$R/home/user"
cp -a "$R/etc/skel/." "$R/home/user/" 2>/dev/null || true
chown -R 1000:1000 "$R/home/user"
chmod 0755 "$R/home/user"
echo dsec >"$R/etc/hostname"
# Do not ship this machine's resolver configuration; the runtime provides one.
rm -f "$R/etc/resolv.conf"
: >"$R/etc/resolv.conf"
# Package caches and lists are dead weight in the image.
rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/cache/apt/*.bin "$R"/var/lib/apt/lists/*
mkdir -p "$R/var/lib/apt/lists/partial"
rm -rf "$R"/tmp/* "$R"/var/tmp/* "$R"/var/log/*.log 2>/dev/null || true

if [[ -n "${DSEC_POST_HOOK:-}" ]]; then
    log "running $DSEC_POST_HOOK on the root filesystem"
    bash "$DSEC_POST_HOOK" "$R" || die "$DSEC_POST_HOOK failed"
fi

log "writing tarball"
TMP="$OUT.tmp.$$"
tar --create --file "$TMP" --directory "$R" \
    --numeric-owner --xattrs --xattrs-include='*' --sort=name \
    --one-file-system .
sync "$TMP" 2>/dev/null || sync
mv -f "$TMP" "$OUT"
rm -rf --one-file-system "$WORK"

log "done: $OUT ($(du -h "$OUT" | cut -f1))"
