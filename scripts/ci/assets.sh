#!/usr/bin/env bash
# CI step: the test control plane and the provider assets, built once and cached. The Go
# caches of the build live in a directory of this step's that goes when it ends (disk is the
# scarce resource on a CI machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
go_tmp=$(mktemp -d)
(
  export GOCACHE="$go_tmp/cache" GOMODCACHE="$go_tmp/mod"
  bash scripts/testenv-assets.sh >/dev/null
  bash scripts/provider-assets.sh >/dev/null
)
chmod -R u+w "$go_tmp" && rm -rf "$go_tmp"
