#!/usr/bin/env bash
# Builds the book (docs/, an mdBook) into target/book. Installs mdBook (cached under
# ~/.cache/multicluster-runtime/tools) if needed. The book's code samples are doctests of
# the crates and its links are checked by tests/book.rs, both run by scripts/test.sh.
#
#   scripts/book.sh      # then open target/book/index.html
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools=${MCR_TOOLS:-$HOME/.cache/multicluster-runtime/tools}
version=0.5.4
if ! "$tools/bin/mdbook" --version 2>/dev/null | grep -q "v$version"; then
  echo "[book] installing mdBook $version into $tools"
  # Only the search index on top of the HTML output: no file watcher, no web server.
  cargo install --quiet --locked --root "$tools" mdbook --version "$version" \
    --no-default-features --features search
fi
"$tools/bin/mdbook" build docs
echo "[book] target/book/index.html"
