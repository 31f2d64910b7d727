#!/usr/bin/env bash
# CI step: rustfmt, then clippy with all features, with none, and with each feature alone (a
# downstream crate builds with whatever features it picks: each set must be warning-free).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features -- -D warnings
for features in "" kind file fuzzing profiling; do
  echo "-- features: ${features:-none}"
  cargo clippy --all-targets --no-default-features ${features:+--features "$features"} -- -D warnings
done
