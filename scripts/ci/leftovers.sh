#!/usr/bin/env bash
# CI step: no test control plane outlived the tests. Every etcd/kube-apiserver started by
# testenv has its temporary directory (mcr-testenv-*) in its arguments; each environment's
# directory (etcd data) goes with it, also when a test binary dies without unwinding (the
# guardian removes it). The guardians get their grace period first.
set -euo pipefail
sleep 6
if leftovers=$(pgrep -a -f 'mcr-testenv-'); then
  echo "processes outlived the tests:"
  echo "$leftovers"
  exit 1
fi
if leftovers=$(ls -d "${TMPDIR:-/tmp}"/mcr-testenv-* 2>/dev/null); then
  echo "directories outlived the tests:"
  echo "$leftovers"
  exit 1
fi
echo "none"
