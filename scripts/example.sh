#!/usr/bin/env bash
# Runs one of the examples against local control planes: builds or reuses the test control
# plane first, then `cargo run --example NAME -- ARGS...`.
#
#   scripts/example.sh testenv_fleet
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 1 ] || { echo "usage: scripts/example.sh EXAMPLE [ARGS...]" >&2; exit 2; }
name=$1
shift
if [ -z "${MCR_TESTENV_ASSETS:-}" ] && [ -z "${KUBEBUILDER_ASSETS:-}" ]; then
  MCR_TESTENV_ASSETS=$(bash scripts/testenv-assets.sh)
  export MCR_TESTENV_ASSETS
fi
# The CRDs the hub-cluster providers' demos install.
if [ -z "${MCR_PROVIDER_ASSETS:-}" ]; then
  MCR_PROVIDER_ASSETS=$(bash scripts/provider-assets.sh)
  export MCR_PROVIDER_ASSETS
fi
exec cargo run --quiet --all-features --example "$name" -- "$@"
