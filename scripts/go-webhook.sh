#!/usr/bin/env bash
# Builds benches/go-webhook (controller-runtime's webhook.Server serving one validating hook)
# with the machine's Go toolchain and caches the binary, for benches/webhooks.rs, which runs
# it side by side with this crate's webhook server. Prints the binary's path on stdout; all
# other output goes to stderr.
#
#   scripts/go-webhook.sh          build if missing, then print the binary's path
#   scripts/go-webhook.sh --print  only print the binary's path (no build)
#
# Environment:
#   MCR_GO_WEBHOOK_CACHE  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/go-webhook)
#
# The cache key is a hash of go.mod, go.sum and main.go, so editing any of them builds anew.
# The binary is built in a temporary directory and renamed into place, so a reader (or a
# concurrent run) never sees a half-written one.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/../benches/go-webhook" && pwd)"
CACHE_ROOT="${MCR_GO_WEBHOOK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/multicluster-runtime/go-webhook}"
HASH=$(cd "$SRC" && cat go.mod go.sum main.go | sha256sum | cut -c1-16)
DEST_DIR="$CACHE_ROOT/$HASH"
BIN="$DEST_DIR/go-webhook"

log() { printf '[go-webhook %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ "${1:-}" = "--print" ]; then
  echo "$BIN"
  exit 0
fi

if [ -x "$BIN" ]; then
  log "cached: $BIN"
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null 2>&1 || { log "error: the Go toolchain (go) is not on PATH"; exit 1; }

# GOTOOLCHAIN=auto fetches a newer Go through the module proxy if the local one is older than
# go.mod asks for; GOFLAGS=-buildvcs=false keeps the repository's git state out of the binary.
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" GOFLAGS=-buildvcs=false CGO_ENABLED=0
mkdir -p "$DEST_DIR"
WORK=$(mktemp -d "$DEST_DIR/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
log "building $SRC ($(go version))"
(cd "$SRC" && go build -trimpath -o "$WORK/go-webhook" .) >&2
mv -f "$WORK/go-webhook" "$BIN"
log "done in $(( $(date +%s) - start )) s: $BIN"
echo "$BIN"
