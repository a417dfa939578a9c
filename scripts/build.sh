#!/usr/bin/env bash
# Builds the dsec binary and the static aether agent (release).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -d "$HOME/.cargo/bin" ]] && export PATH="$HOME/.cargo/bin:$PATH"
echo "[dsec] building dsec (release)"
cargo build --release -p dsec
echo "[dsec] building the static aether agent"
RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p dsec-aether --target x86_64-unknown-linux-gnu
# Put the agent next to the binary, where the edge looks first.
install -m 0755 target/x86_64-unknown-linux-gnu/release/dsec-aether target/release/dsec-aether
echo "[dsec] built target/release/dsec and target/release/dsec-aether"
