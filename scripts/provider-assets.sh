#!/usr/bin/env bash
# Fetches what the hub-cluster providers' tests run against, from the projects' own Go
# modules through the Go module proxy, and caches it:
#   crds/cluster-api.yaml          Cluster API's Cluster CRD (sigs.k8s.io/cluster-api)
#   crds/cluster-inventory-api.yaml  ClusterProfile CRD (sigs.k8s.io/cluster-inventory-api)
#   crds/placement-decisions.yaml    PlacementDecision CRD (the same module)
#   crds/kubefed.yaml              KubeFed's CRDs, KubeFedCluster among them (sigs.k8s.io/kubefed)
#   bin/secretreader-plugin        the KEP-5339 reference exec plugins of cluster-inventory-api,
#   bin/kubeconfig-secretreader-plugin   built with the machine's Go toolchain
#
#   scripts/provider-assets.sh          fetch and build if missing, then print the directory
#   scripts/provider-assets.sh --print  only print the directory
#
# Environment:
#   MCR_PROVIDER_ASSETS_CACHE  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/providers)
#
# Versions are pinned below; the directory name carries them, so a change fetches anew.
# Safe to run twice at once (flock), idempotent (a complete directory is reused).
set -euo pipefail

CAPI_VERSION=v1.14.2
INVENTORY_VERSION=v0.1.3
KUBEFED_VERSION=v0.10.0
CACHE_ROOT="${MCR_PROVIDER_ASSETS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/providers}"
DEST="$CACHE_ROOT/capi-$CAPI_VERSION-inventory-$INVENTORY_VERSION-kubefed-$KUBEFED_VERSION"

log() { printf '[provider-assets %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

complete() {
  local dir=$1
  [ -s "$dir/crds/cluster-api.yaml" ] && [ -s "$dir/crds/cluster-inventory-api.yaml" ] &&
    [ -s "$dir/crds/placement-decisions.yaml" ] &&
    [ -s "$dir/crds/kubefed.yaml" ] && [ -x "$dir/bin/secretreader-plugin" ] &&
    [ -x "$dir/bin/kubeconfig-secretreader-plugin" ]
}

if [ "${1:-}" = "--print" ]; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
if complete "$DEST"; then
  log "cached: $DEST"
  echo "$DEST"
  exit 0
fi

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain (go) is not on PATH"; exit 1; }
command -v flock >/dev/null 2>&1 || { log "error: flock (util-linux) is not on PATH"; exit 1; }
exec 9>"$CACHE_ROOT/.lock"
flock 9
if complete "$DEST"; then
  log "cached (fetched by a concurrent run): $DEST"
  echo "$DEST"
  exit 0
fi

export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" GOFLAGS=-buildvcs=false CGO_ENABLED=0
WORK=$(mktemp -d "$CACHE_ROOT/.fetch-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# The directory of module $1 at version $2 in the module cache (downloaded if needed).
module_dir() {
  local dir
  dir=$(cd "$WORK" && go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [ -d "$dir" ] || { log "error: could not download $1@$2"; exit 1; }
  echo "$dir"
}

# `go mod download` outside a module needs a module to run in.
(cd "$WORK" && go mod init mcr-provider-assets >/dev/null 2>&1)
mkdir -p "$WORK/out/crds" "$WORK/out/bin"

log "Cluster API $CAPI_VERSION"
capi=$(module_dir sigs.k8s.io/cluster-api "$CAPI_VERSION")
cp "$capi/core/config/crd/bases/cluster.x-k8s.io_clusters.yaml" "$WORK/out/crds/cluster-api.yaml"

log "Cluster Inventory API $INVENTORY_VERSION"
inventory=$(module_dir sigs.k8s.io/cluster-inventory-api "$INVENTORY_VERSION")
cp "$inventory/config/crd/bases/multicluster.x-k8s.io_clusterprofiles.yaml" \
  "$WORK/out/crds/cluster-inventory-api.yaml"
cp "$inventory/config/crd/bases/multicluster.x-k8s.io_placementdecisions.yaml" \
  "$WORK/out/crds/placement-decisions.yaml"

log "KubeFed $KUBEFED_VERSION"
kubefed=$(module_dir sigs.k8s.io/kubefed "$KUBEFED_VERSION")
cp "$kubefed/charts/kubefed/charts/controllermanager/crds/crds.yaml" "$WORK/out/crds/kubefed.yaml"

# Built from a copy of the module (its own go.mod and go.sum pin the dependencies): `go
# install pkg@version` would ask the proxy for the module's version list, which a proxy that
# serves pinned versions only may refuse.
cp -r "$inventory" "$WORK/inventory"
chmod -R u+w "$WORK/inventory"
for plugin in secretreader kubeconfig-secretreader; do
  log "building the $plugin exec plugin"
  (cd "$WORK/inventory" && go build -ldflags="-s -w" -o "$WORK/out/bin/$plugin-plugin" "./plugins/$plugin/cmd/plugin")
done

chmod -R u+w "$WORK/out"
rm -rf "$DEST"
mv "$WORK/out" "$DEST"
complete "$DEST" || { log "error: $DEST is incomplete"; exit 1; }
log "ready: $DEST"
echo "$DEST"
