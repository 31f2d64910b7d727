#!/usr/bin/env bash
# Runs docs/getting-started.md as a newcomer would: a new project beside the crates made
# with the page's commands, the page's dependencies in its Cargo.toml (the paths as written
# there) and the page's program as its src/main.rs, then both runs:
#
#   1. `cargo run`: two local control planes, a greeting reconciled in each, a clean stop;
#   2. `cargo run -- --context ... --context ...`: the clusters of kubeconfig contexts, here
#      control planes held by examples/testenv_fleet.rs (their kubeconfigs merged through
#      KUBECONFIG), until SIGINT.
#
# The project lives in a temporary directory; it builds into this checkout's target directory
# with this checkout's Cargo.lock, so the dependencies built for the tests are reused.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
page="$repo/docs/getting-started.md"

# The control plane in the default cache (or $MCR_TESTENV_CACHE), where the page's program
# finds it with Assets::locate_or_build: the variables that would point it elsewhere are
# unset for the page's runs, so the crate's own lookup is what runs.
bash "$repo/scripts/testenv-assets.sh" >/dev/null
assets_dir=$(bash "$repo/scripts/testenv-assets.sh" --print)

# The n-th fenced block with the given info string under the given heading.
block() {
  python3 - "$page" "$1" "$2" <<'PY'
import sys
path, heading, info = sys.argv[1:4]
lines = open(path).read().splitlines()
start = lines.index(heading)
out, inside = [], False
for line in lines[start + 1:]:
    if not inside and line.startswith("## "):
        break
    if not inside and line.strip() == "```" + info:
        inside = True
        continue
    if inside and line.strip() == "```":
        print("\n".join(out))
        sys.exit(0)
    if inside:
        out.append(line)
sys.exit(f"no ```{info} block under {heading!r} in {path}")
PY
}

work=$(mktemp -d)
holder=""
demo=""
# Ends a background process: SIGINT (a graceful stop), then SIGKILL after 30 s.
stop() {
  local pid=$1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill -INT "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  stop "$demo"
  stop "$holder"
  rm -rf "$work"
}
trap cleanup EXIT
# The page's layout: the crates in multicluster-runtime/ (testenv in its testenv/), the new
# project beside it. They are the packages `cargo publish` would upload (scripts/package.sh
# checks their contents), so this also proves the packages build on their own.
bash "$repo/scripts/package.sh" --allow-dirty
mkdir -p "$work/multicluster-runtime/testenv"
tar -xzf "$repo/target/package/multicluster-runtime-0.1.0.crate" -C "$work/multicluster-runtime" --strip-components=1
tar -xzf "$repo/target/package/multicluster-runtime-testenv-0.1.0.crate" -C "$work/multicluster-runtime/testenv" --strip-components=1
cd "$work"

echo "-- the page's commands: cargo new fleet-demo; cd fleet-demo"
cargo new --quiet fleet-demo
cd fleet-demo

echo "-- the page's dependencies, in place of the empty [dependencies] section"
sed -i '/^\[dependencies\]/,$d' Cargo.toml
block "## Installation" toml >> Cargo.toml
echo "-- the page's program as src/main.rs"
block "## A first controller" rust,no_run > src/main.rs
cp "$repo/Cargo.lock" Cargo.lock
export CARGO_TARGET_DIR="$repo/target"

echo "-- step 1: cargo run"
out="$work/step1.log"
env -u MCR_TESTENV_ASSETS -u KUBEBUILDER_ASSETS cargo run 2>&1 | tee "$out"
for cluster in cluster-0 cluster-1; do
  grep -q "^reconciled cluster://$cluster/default/greeting (1 keys)$" "$out" || {
    echo "step 1: no reconcile of $cluster's greeting" >&2
    exit 1
  }
done
grep -q "^every cluster's greeting was reconciled" "$out"

echo "-- step 2: cargo run -- --context cluster-0 --context cluster-2 (control planes held by testenv_fleet)"
held="$work/held.log"
(cd "$repo" && cargo build --quiet --all-features --example testenv_fleet)
(cd "$repo" && MCR_TESTENV_ASSETS="$assets_dir" exec cargo run --quiet --all-features --example testenv_fleet -- --hold) > "$held" 2>&1 &
holder=$!
for _ in $(seq 1 600); do
  grep -q '^holding the clusters' "$held" && break
  kill -0 "$holder" 2>/dev/null || { cat "$held" >&2; echo "testenv_fleet ended early" >&2; exit 1; }
  sleep 0.2
done
grep -q '^holding the clusters' "$held" || { cat "$held" >&2; exit 1; }
KUBECONFIG=$(sed -n 's/^kubectl --kubeconfig \(.*\) get configmaps$/\1/p' "$held" | paste -sd:)
[ -n "$KUBECONFIG" ] || { cat "$held" >&2; echo "testenv_fleet printed no kubeconfig" >&2; exit 1; }
export KUBECONFIG
echo "KUBECONFIG=$KUBECONFIG"
out="$work/step2.log"
cargo run -- --context cluster-0 --context cluster-2 > "$out" 2>&1 &
demo=$!
for _ in $(seq 1 600); do
  if grep -q '^reconciled cluster://cluster-0/default/hello ' "$out" \
    && grep -q '^reconciled cluster://cluster-2/default/hello ' "$out"; then
    break
  fi
  kill -0 "$demo" 2>/dev/null || break
  sleep 0.2
done
kill -INT "$demo" 2>/dev/null || true
for _ in $(seq 1 150); do
  kill -0 "$demo" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$demo" 2>/dev/null; then
  cat "$out"
  echo "step 2: still running 30 s after SIGINT" >&2
  exit 1
fi
status=0
wait "$demo" || status=$?
demo=""
cat "$out"
for cluster in cluster-0 cluster-2; do
  grep -q "^reconciled cluster://$cluster/default/hello " "$out" || {
    echo "step 2: no reconcile of $cluster's hello" >&2
    exit 1
  }
done
[ "$status" -eq 0 ] || { echo "step 2: exit status $status after SIGINT" >&2; exit 1; }
echo "getting started: both steps ran as the page says"
