#!/usr/bin/env bash
# One command: the whole test suite (unit, privileged integration, end to end). Run as root.
#   sudo ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -d "$HOME/.cargo/bin" ]] && export PATH="$HOME/.cargo/bin:$PATH"

bash scripts/install-deps.sh
bash scripts/build.sh
bash scripts/images/build-debian.sh
bash scripts/images/build-e2b-base.sh   # E2B's `base` template (tests/test_e2b_api.py; cached)
# toolkits of the languages tests/test_sandboxfusion.py runs (cached; ~40 min for all on a
# loaded 2-core machine, seconds once built; a test whose toolkit is absent skips)
bash scripts/images/build-function-toolkits.sh fn-python fn-gxx fn-java fn-go fn-node fn-rust \
    || echo "[test] function toolkits not built: their language tests will skip"
bash scripts/vm/build-guest.sh   # microVM guest kernel + initramfs (tests/test_microvm.py)
DSEC_BIN=$PWD/target/release/dsec bash scripts/vm/build-disk.sh   # full-VM disk image (tests/test_fullvm.py)
python3 -m pip install -q ./sdk/python 2>/dev/null || python3 -m pip install -q --break-system-packages ./sdk/python

export DSEC_BIN=$PWD/target/release/dsec
export DSEC_AETHER=$PWD/target/release/dsec-aether

# Every stage runs even when an earlier one failed, so one run shows every problem; any
# failure makes the whole run fail.
status=0
echo "[dsec] cargo fmt --check"
cargo fmt --all -- --check || { echo "[dsec] FAILED: cargo fmt"; status=1; }
echo "[dsec] cargo clippy"
cargo clippy --release --workspace --all-targets -- -D warnings || { echo "[dsec] FAILED: clippy"; status=1; }

echo "[dsec] pyflakes (guest code: crates/functions/guest)"
python3 -m pyflakes crates/functions/guest || { echo "[dsec] FAILED: pyflakes"; status=1; }

echo "[dsec] cargo test (unit + privileged integration)"
cargo test --release --workspace -- --test-threads=2 || { echo "[dsec] FAILED: cargo test"; status=1; }

echo "[dsec] pytest (SDK unit tests + end-to-end suite)"
python3 -m pytest -q -rs sdk/python/tests crates/functions/guest tests || { echo "[dsec] FAILED: pytest"; status=1; }

exit $status
