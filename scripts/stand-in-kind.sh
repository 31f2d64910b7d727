#!/bin/sh
# A stand-in for the `kind` CLI, for the Kind provider's tests and demo (there is no
# container engine here): copied next to a `clusters/` directory, it lists that directory's
# files as `kind get clusters` does and prints one as `kind get kubeconfig --name N` does.
dir="$(dirname "$0")/clusters"
case "$1 $2" in
  "get clusters")
    names=$(ls "$dir")
    if [ -z "$names" ]; then echo "No kind clusters found."; else echo "$names"; fi ;;
  "get kubeconfig")
    [ "$3" = "--name" ] && [ -f "$dir/$4" ] && exec cat "$dir/$4"
    echo "ERROR: unknown cluster $4" >&2; exit 1 ;;
  *) exit 2 ;;
esac
