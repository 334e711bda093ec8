#!/usr/bin/env bash
# Puts json-server 0.17 (a REST server that knows nothing of idempotency)
# behind effectgate, posts the same request twice with one Idempotency-Key,
# and checks that json-server's db file holds exactly one record.
#
# Usage: examples/third-party/json-server.sh [path/to/effectgate]
# (default: target/debug/effectgate, built with `cargo build -p effectgate`)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
bin=${1:-$target/debug/effectgate}
[ -x "$bin" ] || { echo "effectgate binary not found at $bin (cargo build -p effectgate)"; exit 2; }

work=$(mktemp -d /tmp/effectgate-json-server.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# json-server 0.17, installed once into a cache folder.
cache=${JSON_SERVER_CACHE:-$HOME/.cache/effectgate-json-server}
if [ ! -x "$cache/node_modules/.bin/json-server" ]; then
  mkdir -p "$cache"
  npm install --prefix "$cache" --no-audit --no-fund --silent json-server@0.17 >/dev/null
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 100); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; echo "timed out waiting for $1"; return 1; }

js_port=$(free_port); proxy_port=$(free_port); admin_port=$(free_port)
echo '{"posts": []}' > "$work/db.json"
"$cache/node_modules/.bin/json-server" --quiet --port "$js_port" --host 127.0.0.1 "$work/db.json" >"$work/json-server.log" 2>&1 &
pids+=($!)

client_key="third-party-client-key"
hash=$(printf %s "$client_key" | sha256sum | cut -d' ' -f1)
cat > "$work/effectgate.toml" <<TOML
[listen]
proxy = "127.0.0.1:$proxy_port"
admin = "127.0.0.1:$admin_port"
[storage]
path = "$work/ledger.db"
[[tenants]]
id = "demo"
keys = [{ role = "client", sha256 = "$hash" }]
[[routes]]
name = "json-server"
prefix = "/js/"
upstream = "http://127.0.0.1:$js_port"
effectful_methods = ["POST"]
TOML
"$bin" serve --config "$work/effectgate.toml" >"$work/effectgate.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$js_port/posts"
wait_http "http://127.0.0.1:$admin_port/readyz"

post() {
  curl -sS -o "$work/resp.$1" -w '%{http_code}' -X POST "http://127.0.0.1:$proxy_port/js/posts" \
    -H "Authorization: Bearer $client_key" -H 'Idempotency-Key: post-1' \
    -H 'Content-Type: application/json' -d "$2"
}
s1=$(post 1 '{"title":"hello","author":"effectgate"}')
s2=$(post 2 '{ "author": "effectgate", "title": "hello" }')
count=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["posts"]))' "$work/db.json")
echo "first: $s1, duplicate: $s2, records in json-server db: $count"
if [ "$s1" = 201 ] && [ "$s2" = 201 ] && [ "$count" = 1 ] && cmp -s "$work/resp.1" "$work/resp.2"; then
  echo "json-server: PASS (one record, duplicate replayed)"
else
  echo "json-server: FAIL"; cat "$work/effectgate.log"; exit 1
fi
