#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS seconds each (default 60) and fails on a crash.
# Installs cargo-fuzz (cached under ~/.cache/multicluster-runtime/tools) if needed.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# MCR_FUZZ_JOBS: how many targets run at once (default: one per core; each uses one core).
# MCR_FUZZ_SANITIZER: cargo-fuzz's --sanitizer (default `address`). The library forbids
# unsafe code, so AddressSanitizer watches only its dependencies' unsafe code; `none` builds
# and runs about twice as fast and finds the same panics (CI's choice).
# MCR_FUZZ_BUILD_ONLY=1: build the targets and stop (CI builds them while the tests run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(request_text cluster_names queue kubeconfig namespace_scope object_decoding access_providers webhook_review fake_sequences owner_records)
fi
jobs=${MCR_FUZZ_JOBS:-$(nproc)}
sanitizer=${MCR_FUZZ_SANITIZER:-address}

tools=${MCR_TOOLS:-$HOME/.cache/multicluster-runtime/tools}
if ! "$tools/bin/cargo-fuzz" --version >/dev/null 2>&1; then
  echo "[fuzz] installing cargo-fuzz into $tools"
  cargo install --quiet --locked --root "$tools" cargo-fuzz --version 0.13.2
fi
# cargo-fuzz passes nightly -Z flags; this lets the stable toolchain accept them.
export RUSTC_BOOTSTRAP=1
flags=(--release --debug-assertions --sanitizer "$sanitizer")

"$tools/bin/cargo-fuzz" build "${flags[@]}"
if [ "${MCR_FUZZ_BUILD_ONLY:-}" = 1 ]; then
  exit 0
fi

# One target: its summary lines, or its log's tail and a failure.
fuzz_one() {
  local target=$1 log status=0
  log=$(mktemp)
  mkdir -p "fuzz/corpus/$target"
  "$tools/bin/cargo-fuzz" run "${flags[@]}" "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
  echo "[fuzz] $target for ${seconds}s"
  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|SUMMARY)|panicked|Test unit written|cov: ' "$log" | tail -n 8 || true
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log"
    echo "[fuzz] $target failed (exit $status); inputs in fuzz/artifacts/$target"
  fi
  rm -f "$log"
  return "$status"
}

# `jobs` targets at a time; each one's lines are printed together when it ends.
failed=0
pending=("${targets[@]}")
while [ ${#pending[@]} -gt 0 ]; do
  batch=("${pending[@]:0:$jobs}")
  pending=("${pending[@]:$jobs}")
  pids=()
  for target in "${batch[@]}"; do
    fuzz_one "$target" > "${TMPDIR:-/tmp}/mcr-fuzz-$$-$target.out" 2>&1 &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    status=0
    wait "${pids[$i]}" || status=$?
    cat "${TMPDIR:-/tmp}/mcr-fuzz-$$-${batch[$i]}.out"
    rm -f "${TMPDIR:-/tmp}/mcr-fuzz-$$-${batch[$i]}.out"
    if [ "$status" -ne 0 ]; then
      failed=1
    fi
  done
done
if [ "$failed" -ne 0 ]; then
  echo "[fuzz] a target failed" >&2
  exit 1
fi
