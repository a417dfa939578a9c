#!/usr/bin/env bash
# Installs what dsec needs on a Debian machine, idempotently. Run as root.
set -euo pipefail

PKGS=(erofs-utils busybox-static debootstrap runc bubblewrap nftables iproute2 sqlite3
      libseccomp-dev python3 python3-pip python3-venv ca-certificates procps psmisc hyperfine
      sshfs openssh-server docker-registry skopeo qemu-system-x86 kmod cpio file binutils)

# Sandbox disk limits (mkfs.ext4, loop mounts) and networking (ip, nft) in issue 8.
PKGS+=(e2fsprogs mount util-linux)

# The function-call tests build a C++ toolkit layer from the host's g++ packages.
PKGS+=(g++ g++-12 libstdc++-12-dev)

# Tests of the apiserver on PostgreSQL start a private server from these binaries.
PKGS+=(postgresql)

# Full VMs (issue 9): qemu-img overlays, SeaBIOS (qemu's default firmware), and the test disk
# image's partition table and boot loader (scripts/vm/build-disk.sh).
PKGS+=(qemu-utils seabios fdisk extlinux syslinux-common)

# Distributed storage tests (issue 23): a single-node Ceph, scripts/storage/ceph-dev.sh.
PKGS+=(ceph-mon ceph-mgr ceph-osd ceph-mds radosgw ceph-fuse ceph-common)

missing_pkgs() {
    missing=()
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
}
missing_pkgs
if ((${#missing[@]})); then
    echo "[dsec] installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
    # An install can remove a package that was present: a backported qemu-utils conflicts with
    # the distribution's qemu-system-x86 and is removed for it. Install what is missing again
    # (now from the same release as what replaced it).
    missing_pkgs
    if ((${#missing[@]})); then
        echo "[dsec] installing Debian packages removed by the first pass: ${missing[*]}"
        apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
else
    echo "[dsec] Debian packages present"
fi

if ! command -v cargo >/dev/null; then
    for d in "$HOME/.cargo/bin" /root/.cargo/bin /usr/local/cargo/bin; do
        [[ -x "$d/cargo" ]] && export PATH="$d:$PATH" && break
    done
fi
command -v cargo >/dev/null || { echo "[dsec] cargo not found: install a Rust toolchain (rustup) first" >&2; exit 1; }

# The Python used for the SDK and the end-to-end tests.
PY=${PYTHON:-python3}
if ! "$PY" -c 'import httpx, pytest' 2>/dev/null; then
    echo "[dsec] installing Python packages (httpx, pytest)"
    "$PY" -m pip install -q httpx pytest pytest-asyncio 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages httpx pytest pytest-asyncio
fi
# The linter of the function pools' guest code (crates/functions/guest), pinned.
PYFLAKES_VERSION=3.2.0
if [[ "$("$PY" -m pyflakes --version 2>/dev/null | awk '{print $1}')" != "$PYFLAKES_VERSION" ]]; then
    echo "[dsec] installing pyflakes $PYFLAKES_VERSION"
    "$PY" -m pip install -q "pyflakes==$PYFLAKES_VERSION" 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages "pyflakes==$PYFLAKES_VERSION"
fi

# SandboxFusion's client package, unmodified, drives tests/test_sandboxfusion.py: pinned.
SANDBOX_FUSION_VERSION=0.3.7
if [[ "$("$PY" -c 'from importlib.metadata import version; print(version("sandbox-fusion"))' 2>/dev/null)" != "$SANDBOX_FUSION_VERSION" ]]; then
    echo "[dsec] installing sandbox-fusion $SANDBOX_FUSION_VERSION"
    "$PY" -m pip install -q "sandbox-fusion==$SANDBOX_FUSION_VERSION" 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages "sandbox-fusion==$SANDBOX_FUSION_VERSION"
fi

# The e2b SDK, unmodified, drives tests/test_e2b_api.py (dsec's E2B-compatible API): pinned.
E2B_VERSION=2.63.0
if [[ "$("$PY" -c 'from importlib.metadata import version; print(version("e2b"))' 2>/dev/null)" != "$E2B_VERSION" ]]; then
    echo "[dsec] installing e2b $E2B_VERSION"
    "$PY" -m pip install -q "e2b==$E2B_VERSION" 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages "e2b==$E2B_VERSION"
fi
# ... and its JavaScript SDK (tests/e2b_js, run with the machine's Node.js), from its lock file.
E2B_JS="$(cd "$(dirname "$0")/.." && pwd)/tests/e2b_js"
if command -v npm >/dev/null 2>&1 && [[ -f "$E2B_JS/package-lock.json" ]] \
        && [[ ! -d "$E2B_JS/node_modules/e2b" ]]; then
    echo "[dsec] installing the e2b JavaScript SDK (npm ci in tests/e2b_js)"
    (cd "$E2B_JS" && npm ci --no-audit --no-fund --silent) \
        || echo "[dsec] npm ci in tests/e2b_js failed: the JavaScript E2B test will skip"
fi

# Checks of the deployment files (tests/test_deploy.py): pinned, like the Kubernetes version
# the manifests are validated against.
DEPLOY_TOOLS=(yamllint==1.38.0 kubernetes-validate==1.37.0)
if ! "$PY" - "${DEPLOY_TOOLS[@]}" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (t.split("==") for t in sys.argv[1:])))
PYEOF
    echo "[dsec] installing Python packages (${DEPLOY_TOOLS[*]})"
    "$PY" -m pip install -q "${DEPLOY_TOOLS[@]}" 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages "${DEPLOY_TOOLS[@]}"
fi

# API fuzzing of the served OpenAPI document (tests/test_schemathesis.py): pinned.
SCHEMATHESIS_VERSION=4.32.5
if [[ "$("$PY" -c 'from importlib.metadata import version; print(version("schemathesis"))' 2>/dev/null)" != "$SCHEMATHESIS_VERSION" ]]; then
    echo "[dsec] installing schemathesis $SCHEMATHESIS_VERSION"
    "$PY" -m pip install -q "schemathesis==$SCHEMATHESIS_VERSION" 2>/dev/null \
        || "$PY" -m pip install -q --break-system-packages "schemathesis==$SCHEMATHESIS_VERSION"
fi
