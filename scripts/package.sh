#!/usr/bin/env bash
# Packages the workspace's crates as `cargo publish` would (`cargo package --workspace`, without the
# verification build: scripts/getting-started.sh builds a project against the library and
# testenv packages; mcr's package is checked for its contents only)
# and checks what each holds: the library, its README, LICENSE (and the CHANGELOG for the main
# crate); no tests, benchmarks, examples, scripts, manifests, CI, fuzz targets or build
# output. Leaves the packages in target/package/.
#
#   scripts/package.sh [--allow-dirty]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The library picks no Kubernetes version (the final binary does); packaging resolves the
# dependencies only, but k8s-openapi's build script wants a version to be named.
export K8S_OPENAPI_ENABLED_VERSION="${K8S_OPENAPI_ENABLED_VERSION:-1.36}"
# Extra arguments go to cargo (`--allow-dirty` to package uncommitted changes).
rm -f target/package/*.crate
log=$(mktemp)
if ! cargo package --workspace --no-verify --quiet "$@" >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  exit 1
fi
# Cargo names every test, benchmark and example it leaves out; the check below is the list.
grep -v '^warning: ignoring \(test\|benchmark\|example\) ' "$log" >&2 || true
rm -f "$log"

status=0
check() {
  local crate=$1
  shift
  local file="target/package/$crate-0.1.0.crate"
  [ -f "$file" ] || { echo "$file was not made" >&2; exit 1; }
  local list
  list=$(tar -tzf "$file" | sed "s|^$crate-0.1.0/||")
  for required in "$@"; do
    grep -qx "$required" <<<"$list" || { echo "$crate: $required is missing from the package" >&2; status=1; }
  done
  local unwanted
  unwanted=$(grep -E '^(tests|benches|examples|scripts|deploy|fuzz|target|testenv|cli|fake|\.ci|\.github)/|^BENCHMARKS\.md$|^docs/benchmarks/|^Containerfile$|\.crate$' <<<"$list" || true)
  if [ -n "$unwanted" ]; then
    echo "$crate: the package holds files that are not for users:" >&2
    echo "$unwanted" >&2
    status=1
  fi
  local size
  size=$(stat -c %s "$file")
  # crates.io refuses packages over 10 MB; these are far below, and should stay so.
  [ "$size" -lt 2000000 ] || { echo "$crate: the package is $size bytes" >&2; status=1; }
  echo "$crate: $(wc -l <<<"$list") files, $size bytes compressed"
}
check multicluster-runtime Cargo.toml README.md LICENSE CHANGELOG.md src/lib.rs docs/getting-started.md
check multicluster-runtime-testenv Cargo.toml README.md LICENSE src/lib.rs build-assets.sh
check multicluster-runtime-cli Cargo.toml README.md LICENSE src/main.rs
check multicluster-runtime-fake Cargo.toml README.md LICENSE src/lib.rs
exit $status
