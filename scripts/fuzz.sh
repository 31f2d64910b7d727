#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS seconds each (default 60) and fails on a crash.
# Installs cargo-fuzz (cached under ~/.cache/multicluster-runtime/tools) if needed.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(request_text cluster_names queue kubeconfig namespace_scope object_decoding access_providers webhook_review)
fi

tools=${MCR_TOOLS:-$HOME/.cache/multicluster-runtime/tools}
if ! "$tools/bin/cargo-fuzz" --version >/dev/null 2>&1; then
  echo "[fuzz] installing cargo-fuzz into $tools"
  cargo install --quiet --locked --root "$tools" cargo-fuzz --version 0.13.2
fi
# cargo-fuzz passes nightly -Z flags; this lets the stable toolchain accept them.
export RUSTC_BOOTSTRAP=1

"$tools/bin/cargo-fuzz" build --release --debug-assertions
for target in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$target"
  echo "[fuzz] $target for ${seconds}s"
  log=$(mktemp)
  status=0
  "$tools/bin/cargo-fuzz" run --release --debug-assertions "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|SUMMARY)|panicked|Test unit written|cov: ' "$log" | tail -n 8 || true
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "[fuzz] $target failed (exit $status); inputs in fuzz/artifacts/$target" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
done
