#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver and etcd) from their Go modules with the
# machine's Go toolchain and caches them where `multicluster_runtime_testenv::Assets::locate`
# looks for them. Part of the testenv crate: `Assets::locate_or_build` runs this text, and
# the repository's scripts/testenv-assets.sh calls this file.
#
#   build-assets.sh          build if missing, then print the asset directory
#   build-assets.sh --print  only print the asset directory (no build)
#
# Environment:
#   MCR_TESTENV_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/testenv)
#   MCR_K8S_VERSION     Kubernetes version to build (default below; keep it in step with
#                       the k8s-openapi feature in Cargo.toml and testenv's KUBERNETES_VERSION)
#   MCR_ETCD_VERSION    etcd version to build (default: the one envtest pairs with it)
#
# Safe to run twice at once (flock on the cache directory), idempotent (a verified build is
# reused), and it checks what it built with `--version` before publishing it.
set -euo pipefail

K8S_VERSION="${MCR_K8S_VERSION:-1.36.3}"
ETCD_VERSION="${MCR_ETCD_VERSION:-3.6.8}"
CACHE_ROOT="${MCR_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/testenv}"
DEST="$CACHE_ROOT/$K8S_VERSION"

log() { printf '[testenv-assets %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

verify() {
  local dir=$1
  [ -x "$dir/kube-apiserver" ] && [ -x "$dir/etcd" ] || return 1
  "$dir/kube-apiserver" --version 2>/dev/null | grep -q "v$K8S_VERSION" || return 1
  "$dir/etcd" --version 2>/dev/null | grep -q "etcd Version: $ETCD_VERSION" || return 1
}

if [ "${1:-}" = "--print" ]; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
if verify "$DEST"; then
  log "cached: $DEST"
  echo "$DEST"
  exit 0
fi

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain (go) is not on PATH"; exit 1; }
command -v flock >/dev/null 2>&1 || { log "error: flock (util-linux) is not on PATH"; exit 1; }

exec 9>"$CACHE_ROOT/.lock-$K8S_VERSION"
log "waiting for the build lock $CACHE_ROOT/.lock-$K8S_VERSION"
flock 9
# Another run may have finished the build while this one waited.
if verify "$DEST"; then
  log "cached (built by a concurrent run): $DEST"
  echo "$DEST"
  exit 0
fi

# GOTOOLCHAIN=auto fetches a newer Go through the module proxy if the local one is too old for
# the go.mod of the Kubernetes release; GOFLAGS=-buildvcs=false because the wrapper modules are
# not in a repository.
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" GOFLAGS=-buildvcs=false CGO_ENABLED=0
WORK=$(mktemp -d "$CACHE_ROOT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

# --- kube-apiserver -------------------------------------------------------------------------
# k8s.io/kubernetes requires its ~30 staging modules at v0.0.0 and replaces them with paths
# inside its own tree; a dependent module ignores those replaces, so the wrapper module below
# points each one at its published v0.<minor>.<patch> instead. The list comes from that
# version's own go.mod so it follows whatever staging modules the release has.
log "kube-apiserver v$K8S_VERSION: resolving modules"
staging_version="v0.${K8S_VERSION#1.}"
mkdir -p "$WORK/apiserver"
(
  cd "$WORK/apiserver"
  go mod init mcr-testenv/kube-apiserver >/dev/null 2>&1
  kmod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [ -f "$kmod" ] || { log "error: could not download k8s.io/kubernetes@v$K8S_VERSION"; exit 1; }
  args=()
  while read -r mod; do
    args+=("-replace=$mod=$mod@$staging_version")
  done < <(awk '$2 == "v0.0.0" { print $1 }' "$kmod" | sort -u)
  log "kube-apiserver: replacing ${#args[@]} staging modules with $staging_version"
  go mod edit "${args[@]}"
  go mod edit -require="k8s.io/kubernetes@v$K8S_VERSION"
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S_VERSION" >&2
  log "kube-apiserver: compiling (the long part: about 5 minutes on 2 cores)"
  minor=${K8S_VERSION#1.}
  minor=${minor%%.*}
  ldflags="-s -w"
  ldflags+=" -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION"
  ldflags+=" -X k8s.io/component-base/version.gitMajor=1"
  ldflags+=" -X k8s.io/component-base/version.gitMinor=$minor"
  ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
  go build -trimpath -ldflags "$ldflags" -o "$WORK/out/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
)
log "kube-apiserver built ($(( $(date +%s) - start )) s so far)"

# --- etcd -----------------------------------------------------------------------------------
# go.etcd.io/etcd/server/v3 is itself the etcd main package.
log "etcd v$ETCD_VERSION: resolving modules"
mkdir -p "$WORK/etcd"
(
  cd "$WORK/etcd"
  go mod init mcr-testenv/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >&2
  log "etcd: compiling"
  go build -trimpath -ldflags "-s -w" -o "$WORK/out/etcd" go.etcd.io/etcd/server/v3
)

log "verifying"
"$WORK/out/kube-apiserver" --version >&2
"$WORK/out/etcd" --version >&2
verify "$WORK/out" || { log "error: the built binaries do not report v$K8S_VERSION / $ETCD_VERSION"; exit 1; }

rm -rf "$DEST"
mv "$WORK/out" "$DEST"
log "done in $(( $(date +%s) - start )) s: $DEST"
echo "$DEST"
