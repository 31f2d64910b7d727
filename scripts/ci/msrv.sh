#!/usr/bin/env bash
# CI step, run in the background while the tests run: the minimum Rust version, the earliest
# Kubernetes version, the operator image's build, then the fuzz targets' build.
#
# The library crates build with the rust-version they state (rustup installs that
# toolchain), and neither picks a k8s-openapi version feature (two picks cannot build
# together): each builds with the earliest Kubernetes version a user may pick, and only that
# one. mcr is a binary: it picks its version itself. Then the Containerfile's cargo command,
# read from the file, on the Rust version its build stage names (which must be the minimum).
# The checks of the stated versions run first, in the foreground: `--check-only`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
for manifest in testenv/Cargo.toml cli/Cargo.toml fake/Cargo.toml; do
  grep -qx "rust-version = \"$msrv\"" "$manifest" || { echo "$manifest states another rust-version than $msrv"; exit 1; }
done
image_rust=$(sed -n 's|^FROM docker.io/library/rust:\([0-9.]*\)-[a-z-]* AS build$|\1|p' Containerfile)
[ "$image_rust" = "$msrv" ] || { echo "the Containerfile builds with Rust '$image_rust', not the stated minimum $msrv"; exit 1; }
image_build=$(sed -n 's/^RUN \(cargo build .*\)$/\1/p' Containerfile)
[ -n "$image_build" ] || { echo "the Containerfile has no RUN cargo build line"; exit 1; }
if [ "${1:-}" = "--check-only" ]; then
  rustup toolchain install "$msrv" --profile minimal --no-self-update
  exit 0
fi

# In a target directory of its own, so that no test waits for its build lock.
export RUSTUP_TOOLCHAIN="$msrv" CARGO_TARGET_DIR="$PWD/target/msrv"
set -x
for package in multicluster-runtime multicluster-runtime-testenv multicluster-runtime-fake; do
  cargo check --quiet -p "$package" --lib --all-features --features k8s-openapi/v1_33
done
cargo check --quiet -p multicluster-runtime-cli
bash -c "$image_build"
test -x target/msrv/release/examples/operator
# Then the fuzz targets, as the fuzzing step runs them (its build finds them built), on the
# default toolchain: the MSRV directory is not needed any more.
rm -rf target/msrv
unset RUSTUP_TOOLCHAIN CARGO_TARGET_DIR
MCR_FUZZ_SANITIZER=none MCR_FUZZ_BUILD_ONLY=1 bash scripts/fuzz.sh
