#!/usr/bin/env bash
# Build (once, cached) the toolkit layers of the function-call languages from Debian packages:
# one directory tree per toolkit, composed by the edge on the `debian` image for the pools of
# the languages that need it (crates/functions/src/languages.rs, the `toolkit` column).
#
# Output: ${DSEC_CACHE:-/var/cache/dsec}/function-toolkits/NAME/   (one per toolkit)
#   - each built in a temporary directory and renamed at the very end, so an interrupted build
#     leaves no output and is simply redone next time;
#   - a toolkit whose output already exists is not rebuilt (delete it to rebuild).
#
# How: the packages are resolved by this machine's apt against the debian image's own dpkg
# status (so only what the image lacks is fetched), downloaded through apt's configured
# sources into a package cache, and unpacked with `dpkg -x` into the toolkit's tree. Maintainer
# scripts do not run; what they would set up and a program needs (the alternatives symlinks
# such as /usr/bin/java or /usr/bin/lua) is made here. The host must run the image's suite
# (Debian bookworm).
#
# `dsec up` picks the toolkits up: a call in a language whose toolkit is not yet an image
# imports DIR/NAME the first time ([edge.functions] toolkit_dir, default the output above).
#
# Usage: build-function-toolkits.sh [NAME...]   (default: every toolkit below)
#   fn-python  numpy, pandas, scipy, requests, pytest, sympy (python3-* packages)
#   fn-gxx     g++              fn-java  OpenJDK 17 (headless JDK)
#   fn-go      Go               fn-node  Node.js and TypeScript (tsc)
#   fn-rust    rustc and cargo  fn-lua   Lua 5.4
#   fn-php     PHP (cli)        fn-ruby  Ruby
#   fn-r       R (r-base-core, Rscript)
# (bash, perl and C need no toolkit: the debian image has them.)
#
# Environment:
#   DSEC_CACHE       cache directory (default /var/cache/dsec)
#   DSEC_DEBIAN_TAR  the debian image tarball (default $DSEC_CACHE/debian-bookworm.tar)
set -euo pipefail

CACHE="${DSEC_CACHE:-/var/cache/dsec}"
OUT_ROOT="$CACHE/function-toolkits"
TAR="${DSEC_DEBIAN_TAR:-$CACHE/debian-bookworm.tar}"
DEBS="$CACHE/function-toolkits.debs"

log() { printf '[build-function-toolkits] %s\n' "$*"; }
die() { printf '[build-function-toolkits] error: %s\n' "$*" >&2; exit 1; }

declare -A PKGS=(
    [fn-python]="python3-numpy python3-pandas python3-scipy python3-requests python3-pytest python3-sympy"
    [fn-gxx]="g++"
    [fn-java]="openjdk-17-jdk-headless"
    [fn-go]="golang-go"
    [fn-node]="nodejs node-typescript"
    [fn-rust]="rustc cargo"
    [fn-lua]="lua5.4"
    [fn-php]="php-cli"
    [fn-ruby]="ruby"
    [fn-r]="r-base-core"
)
ORDER=(fn-python fn-gxx fn-java fn-go fn-node fn-rust fn-lua fn-php fn-ruby fn-r)

[[ $(id -u) -eq 0 ]] || die "must run as root (apt-get download into $DEBS)"
command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "needs apt-get and dpkg (Debian)"
[[ -f "$TAR" ]] || die "$TAR is absent: build it first with scripts/images/build-debian.sh"

names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("${ORDER[@]}")
for n in "${names[@]}"; do
    [[ -n "${PKGS[$n]:-}" ]] || die "unknown toolkit $n (known: ${ORDER[*]})"
done

todo=()
for n in "${names[@]}"; do
    if [[ -d "$OUT_ROOT/$n" ]]; then
        log "cached: $OUT_ROOT/$n exists, nothing to do for $n"
    else
        todo+=("$n")
    fi
done
[[ ${#todo[@]} -gt 0 ]] || exit 0

mkdir -p "$OUT_ROOT" "$DEBS/partial"
STATE="$(mktemp -d "$CACHE/function-toolkits.state.XXXXXX")"
TMP=""
cleanup() {
    rm -rf --one-file-system "$STATE"
    [[ -z "$TMP" ]] || rm -rf --one-file-system "$TMP"
}
trap cleanup EXIT

# The image's dpkg status: apt resolves against what the image already has.
tar -xf "$TAR" -C "$STATE" ./var/lib/dpkg/status 2>/dev/null \
    || tar -xf "$TAR" -C "$STATE" var/lib/dpkg/status \
    || die "no var/lib/dpkg/status in $TAR"
APT=(apt-get -q -y --no-install-recommends
     -o "Dir::State::status=$STATE/var/lib/dpkg/status"
     -o "Dir::Cache::archives=$DEBS"
     -o Debug::NoLocking=1
     -o APT::Install-Suggests=0)

# Links a package's maintainer script would make: LINK -> TARGET inside the tree, only when
# LINK is absent and TARGET exists.
link() {
    local root="$1" lnk="$2" target="$3"
    if [[ ! -e "$root$lnk" && ! -L "$root$lnk" && -e "$root$target" ]]; then
        mkdir -p "$(dirname "$root$lnk")"
        ln -s "$target" "$root$lnk"
    fi
}

fixups() {
    local n="$1" r="$2" f
    # update-alternatives calls with literal paths in the unpacked maintainer scripts.
    # (BLAS/LAPACK for numpy, lua, ...): install LINK NAME PATH PRIO
    while read -r lnk path; do
        link "$r" "$lnk" "$path"
    done < <(grep -rhoE 'update-alternatives +--install +/[^ ]+ +[^ ]+ +/[^ ]+' "$r/.ctl" 2>/dev/null \
                 | awk '{print $3, $5}' | grep -v '\$' || true)
    case "$n" in
        fn-java)
            for f in "$r"/usr/lib/jvm/java-17-openjdk-amd64/bin/*; do
                [[ -e "$f" ]] && link "$r" "/usr/bin/$(basename "$f")" "${f#"$r"}"
            done ;;
        fn-lua) link "$r" /usr/bin/lua /usr/bin/lua5.4 ;;
        fn-php)
            for f in "$r"/usr/bin/php[0-9]*; do
                [[ -e "$f" ]] && link "$r" /usr/bin/php "${f#"$r"}"
            done ;;
        fn-ruby)
            for f in "$r"/usr/bin/ruby[0-9]*; do
                [[ -e "$f" ]] && link "$r" /usr/bin/ruby "${f#"$r"}"
            done ;;
        fn-python)
            for lib in blas lapack; do
                for f in "$r"/usr/lib/x86_64-linux-gnu/$lib/lib*.so.*; do
                    [[ -e "$f" ]] && link "$r" "/usr/lib/x86_64-linux-gnu/$(basename "$f")" "${f#"$r"}"
                done
            done ;;
    esac
    rm -rf "$r/.ctl"
}

# The image has merged /usr (/bin, /lib, ... are symbolic links into /usr): a package's files
# under /lib or /bin go into usr/, or the layer's real directory would hide the image's link
# (and with it the dynamic loader).
merge_usr() {
    local r="$1" d
    for d in bin sbin lib lib32 lib64 libx32; do
        if [[ -d "$r/$d" && ! -L "$r/$d" ]]; then
            mkdir -p "$r/usr/$d"
            cp -a "$r/$d/." "$r/usr/$d/"
            rm -rf "$r/$d"
        fi
    done
}

for n in "${todo[@]}"; do
    started=$(date +%s)
    log "$n: resolving and downloading ${PKGS[$n]}"
    # shellcheck disable=SC2086
    list="$("${APT[@]}" install --simulate ${PKGS[$n]} 2>&1)" \
        || { printf '%s\n' "$list" >&2; die "$n: apt cannot resolve ${PKGS[$n]}"; }
    # shellcheck disable=SC2086
    "${APT[@]}" install --download-only ${PKGS[$n]} >/dev/null \
        || die "$n: downloading ${PKGS[$n]} failed (apt sources reachable?)"
    files=()
    while read -r f; do
        files+=("$DEBS/$f")
    # "Inst PKG (VERSION SOURCE [ARCH])" -> the archive's file name PKG_VERSION_ARCH.deb (an
    # epoch's colon is stored as %3a).
    done < <(printf '%s\n' "$list" | awk '$1 == "Inst" {
                 for (i = 3; i <= NF && substr($i, 1, 1) != "("; i++) ;
                 v = $i; sub(/^\(/, "", v); gsub(/:/, "%3a", v)
                 a = ""; for (j = i; j <= NF; j++) if ($j ~ /^\[[a-z0-9]+\]\)$/) { a = $j; break }
                 gsub(/[\[\])]/, "", a)
                 print $2 "_" v "_" a ".deb" }')
    TMP="$(mktemp -d "$OUT_ROOT/.$n.tmp.XXXXXX")"
    mkdir -p "$TMP/root/.ctl"
    count=0
    for f in "${files[@]}"; do
        [[ -f "$f" ]] || die "$n: $f missing after download"
        dpkg -x "$f" "$TMP/root"
        d="$TMP/root/.ctl/$(basename "$f" .deb)"
        mkdir -p "$d" && dpkg -e "$f" "$d"
        count=$((count + 1))
    done
    fixups "$n" "$TMP/root"
    merge_usr "$TMP/root"
    # Not needed to run programs, and large.
    rm -rf "$TMP/root/usr/share/doc" "$TMP/root/usr/share/man" "$TMP/root/usr/share/info" \
        "$TMP/root/usr/share/lintian" "$TMP/root/usr/share/locale"
    if [[ $n == fn-python ]]; then
        # Pulled in through build-time dependencies (pythran → python3-dev): headers and
        # static libraries nothing compiles against in a call.
        rm -rf "$TMP/root/usr/include"
        find "$TMP/root" -name '*.a' -type f -delete
    fi
    chmod -R u+rwX,go+rX,go-w "$TMP/root"
    mv "$TMP/root" "$OUT_ROOT/$n"
    rm -rf --one-file-system "$TMP"
    TMP=""
    log "$n: done, $count packages, $(du -sh "$OUT_ROOT/$n" | cut -f1), $(( $(date +%s) - started )) s"
done
