#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver and etcd) from their Go modules and caches it.
# The script itself ships inside the testenv crate (testenv/build-assets.sh), so that
# `multicluster_runtime_testenv::Assets::locate_or_build` runs the same build for users who
# have only the crate; this is the repository's way to call it. Same arguments:
#
#   scripts/testenv-assets.sh          build if missing, then print the asset directory
#   scripts/testenv-assets.sh --print  only print the asset directory (no build)
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/../testenv/build-assets.sh" "$@"
