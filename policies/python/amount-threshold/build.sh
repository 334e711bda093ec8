#!/usr/bin/env bash
# Builds amount_threshold_py.wasm, a component of the effectgate:policy world
# (../../../wit), from amount_threshold.py with componentize-py; the bindings
# (the `wit_world` module) are generated from the WIT on every build.
#
#   ./build.sh [OUT.wasm]      # OUT defaults to ./amount_threshold_py.wasm
#   ./build.sh --bindings      # only write the bindings to ./bindings (for an editor)
#
# componentize-py comes from $COMPONENTIZE_PY, else from PATH
# (`pip install componentize-py==0.25.*`). WASI imports are replaced by
# trapping stubs (--stub-wasi): a policy has no filesystem or network, and
# the world's own `clock` interface gives the time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wit="$here/../../../wit"
cpy=${COMPONENTIZE_PY:-componentize-py}
if [ "${1:-}" = "--bindings" ]; then
  rm -rf "$here/bindings"
  exec "$cpy" -d "$wit" -w policy bindings "$here/bindings"
fi
out=$(realpath -m "${1:-$here/amount_threshold_py.wasm}")
cd "$here"
"$cpy" -q -d "$wit" -w policy componentize --stub-wasi -p "$here" amount_threshold -o "$out"
echo "$out: $(( $(stat -c %s "$out") / 1048576 )) MiB"
