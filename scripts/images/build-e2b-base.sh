#!/usr/bin/env bash
# Build (once, cached) the root filesystem tarball of the `e2b-base` image: a Debian system like
# E2B's default `base` template, for code written against E2B (issue 19).
#
# Output: ${DSEC_CACHE:-/var/cache/dsec}/e2b-base-bookworm.tar (nothing is done if it exists;
# delete it to rebuild). Built with debootstrap by scripts/images/build-debian.sh (same mirror
# lookup, same package cache, same temporary-name-then-rename so an interrupted build is
# simply redone), with:
#   - the user `user` (uid 1000, home /home/user, bash, passwordless sudo);
#   - `python` -> python3, with pip and venv; git, curl, wget, sudo, procps, less, unzip,
#     xz-utils, iproute2, netcat, file, ca-certificates.
#
# Register it in a running dsec under the template name `base`:
#   dsec image import e2b-base --tar /var/cache/dsec/e2b-base-bookworm.tar
#   dsec image alias base e2b-base
# (tests/test_e2b_api.py does this on its node.)
#
# Note: dsec runs commands with no_new_privs, so `sudo` inside a container sandbox refuses to
# run; create the sandbox as root (or run the command as root) for what needs it.
#
# Environment: DSEC_CACHE, DSEC_SUITE, DSEC_MIRROR, DSEC_APT_DIR as for build-debian.sh.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DSEC_CACHE:-/var/cache/dsec}"
SUITE="${DSEC_SUITE:-bookworm}"
OUT="$CACHE/e2b-base-$SUITE.tar"

if [[ -f "$OUT" ]]; then
    printf '[build-e2b-base] cached: %s already exists, nothing to do (delete it to rebuild)\n' "$OUT"
    exit 0
fi

HOOK="$(mktemp /tmp/e2b-base-hook.XXXXXX.sh)"
trap 'rm -f "$HOOK"' EXIT
cat >"$HOOK" <<'HOOK_EOF'
set -euo pipefail
R="$1"
# `user` (build-debian.sh made it): bash, the sudo group, passwordless sudo.
sed -i 's#^user:x:1000:1000::/home/user:.*#user:x:1000:1000::/home/user:/bin/bash#' "$R/etc/passwd"
if line="$(grep '^sudo:' "$R/etc/group")"; then
    members="${line##*:}"
    case ",$members," in
        *,user,*) ;;
        *) [[ -z "$members" ]] && new="${line}user" || new="${line},user"
           sed -i "s/^sudo:.*/$new/" "$R/etc/group" ;;
    esac
fi
mkdir -p "$R/etc/sudoers.d"
printf 'user ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$R/etc/sudoers.d/90-e2b-user"
chmod 0440 "$R/etc/sudoers.d/90-e2b-user"
# `python` and `pip` for code that calls them by those names.
[[ -e "$R/usr/bin/python" ]] || ln -s python3 "$R/usr/bin/python"
[[ -e "$R/usr/bin/pip" || ! -e "$R/usr/bin/pip3" ]] || ln -s pip3 "$R/usr/bin/pip"
# pip may install into the system Python (E2B's template allows it).
printf '[global]\nbreak-system-packages = true\n' >"$R/etc/pip.conf"
echo e2b >"$R/etc/hostname"
HOOK_EOF

DSEC_OUT="$OUT" \
DSEC_INCLUDE="python3,python3-pip,python3-venv,python-is-python3,git,curl,wget,ca-certificates,sudo,procps,less,unzip,xz-utils,iproute2,netcat-openbsd,file" \
DSEC_POST_HOOK="$HOOK" \
    bash "$HERE/build-debian.sh"
