#!/usr/bin/env bash
# The project's test command (README): builds or reuses the test control plane, then runs
# every test of the crate with all features. Extra arguments go to `cargo test`.
#
# Binaries already at hand are used as they are: set MCR_TESTENV_ASSETS (or KUBEBUILDER_ASSETS)
# to a directory holding `etcd` and `kube-apiserver` to skip the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${MCR_TESTENV_ASSETS:-}" ] && [ -z "${KUBEBUILDER_ASSETS:-}" ]; then
  MCR_TESTENV_ASSETS=$(bash scripts/testenv-assets.sh)
  export MCR_TESTENV_ASSETS
fi
echo "test control plane: ${MCR_TESTENV_ASSETS:-$KUBEBUILDER_ASSETS}" >&2
# The CRDs and credential plugins of the hub-cluster providers' tests.
if [ -z "${MCR_PROVIDER_ASSETS:-}" ]; then
  MCR_PROVIDER_ASSETS=$(bash scripts/provider-assets.sh)
  export MCR_PROVIDER_ASSETS
fi
echo "provider assets: $MCR_PROVIDER_ASSETS" >&2
exec cargo test --workspace --all-features "$@"
