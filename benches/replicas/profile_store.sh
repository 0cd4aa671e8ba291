#!/usr/bin/env bash
# Where a replica's CPU goes with the Redis store vs the local store: three gateways on the local
# store and three on one redis-server, all pinned to CPU 1 with Redis, one `wrk` per gateway (16
# connections) and the fast upstream on CPU 0; ROUNDS rounds (default 4) of 6 s per set, the sets
# alternated; py-spy samples replica 0 of each set at 100 Hz. Prints CPU µs per request per
# round and, from the samples, the functions whose share differs most between the two sets.
# Needs wrk, redis-server and taskset; installs py-spy into .venv when it is missing.
# Usage: bash benches/replicas/profile_store.sh   (from the repository root, after make build)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
[ -x .venv/bin/py-spy ] || .venv/bin/pip install -q py-spy
ROUNDS=${ROUNDS:-4}
D=$(mktemp -d)
PIDS=""
cleanup() {
  kill $PIDS 2>/dev/null || true
  redis-cli -p "$RPORT" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$D"
}
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RPORT=$(free_port)
trap cleanup EXIT
redis-server --port "$RPORT" --save '' --appendonly no --daemonize yes >/dev/null
RPID=$(redis-cli -p "$RPORT" info server | awk -F: '/process_id/{print $2}' | tr -d '\r')
taskset -p -c 1 "$RPID" >/dev/null
UPORT=$(free_port)
taskset -c 0 $PY benches/load/fast_upstream.py "$UPORT" >"$D/up.log" 2>&1 &
PIDS="$PIDS $!"
KEY=sk-profile
KEYSHA=$(printf %s "$KEY" | sha256sum | cut -d' ' -f1)
declare -A PORT
for mode in local redis; do
  for i in 0 1 2; do
    PORT[$mode$i]=$(free_port)
    f="$D/$mode$i.yaml"
    cat >"$f" <<Y
listen: {host: 127.0.0.1, port: ${PORT[$mode$i]}}
backends:
- name: fast
  url: http://127.0.0.1:$UPORT
  models: [{name: fast, context_window: 8192}]
  max_concurrency: 100000
  adaptive: {enabled: false}
tenants:
- name: bench
  api_key_sha256: [$KEYSHA]
  max_concurrency: 100000
  tokens_per_minute: 1000000000000
access_log: {enabled: false}
Y
    [ $mode = redis ] && printf 'store: {url: "redis://127.0.0.1:%s", key_prefix: profile}\n' "$RPORT" >>"$f"
    taskset -c 1 $PY -m kvgate serve --config "$f" --log-level WARNING >"$D/$mode$i.log" 2>&1 &
    echo $! >"$D/$mode$i.pid"
    PIDS="$PIDS $!"
  done
done
for p in "${PORT[@]}"; do
  for _ in $(seq 300); do curl -sf "127.0.0.1:$p/healthz" >/dev/null && break; sleep 0.2; done
done
echo '{"model":"fast","messages":[{"role":"user","content":"Hello there, how are you today?"}],"max_tokens":16}' >"$D/body.json"
export KVB_BODY="$D/body.json"
cpu() { local s=0; for m in "$@"; do s=$((s + $(awk '{print $14+$15}' "/proc/$m/stat"))); done; echo $s; }
load() { # mode seconds
  for i in 0 1 2; do
    taskset -c 0 wrk -t1 -c16 -d"$2"s -s benches/load/post.lua -H "Authorization: Bearer $KEY" \
      "http://127.0.0.1:${PORT[$1$i]}/v1/chat/completions" >"$D/w$i.out" &
  done
  wait $(jobs -p | tail -3)
}
for round in $(seq "$ROUNDS"); do
  order="local redis"; [ $((round % 2)) = 0 ] && order="redis local"
  for mode in $order; do
    pids="$(cat "$D/${mode}0.pid") $(cat "$D/${mode}1.pid") $(cat "$D/${mode}2.pid")"
    [ $mode = redis ] && pids="$pids $RPID"
    load $mode 1 >/dev/null
    c0=$(cpu $pids)
    .venv/bin/py-spy record -r 100 -d 6 -f raw -o "$D/spy.$mode.$round.txt" \
      -p "$(cat "$D/${mode}0.pid")" --nonblocking >/dev/null 2>&1 &
    SPY=$!
    load $mode 6
    wait $SPY || true
    c1=$(cpu $pids)
    req=0
    for i in 0 1 2; do
      r=$(grep KVB "$D/w$i.out" | sed 's/.*"requests":\([0-9]*\).*/\1/'); req=$((req + r))
    done
    ticks=$(getconf CLK_TCK)
    echo "round $round $mode ×3: $req requests, $(( (c1 - c0) * 1000000 / ticks / req )) CPU µs/request (gateways$([ $mode = redis ] && echo ' + Redis'))"
  done
done
$PY - "$D" <<'P'
import collections, glob, re, sys
d = sys.argv[1]
res = {}
for mode in ("local", "redis"):
    tot, inc = 0, collections.Counter()
    for fn in glob.glob(f"{d}/spy.{mode}.*.txt"):
        for line in open(fn):
            stack, _, n = line.rstrip().rpartition(" ")
            tot += int(n)
            seen = set()
            for f in stack.split(";"):
                k = re.sub(r" \((.*?)(?::\d+)?\)$", r" (\1)", f)
                if k not in seen:
                    inc[k] += int(n)
                    seen.add(k)
    res[mode] = (tot, inc)
(lt, lc), (rt, rc) = res["local"], res["redis"]
print(f"py-spy samples of replica 0: local {lt}, redis {rt}")
print("functions whose share of the samples differs most (inclusive; redis − local):")
for k in sorted(set(lc) | set(rc), key=lambda k: -(rc[k] / max(rt, 1) - lc[k] / max(lt, 1)))[:12]:
    print(f"  {100 * (rc[k] / rt - lc[k] / lt):+5.1f} pts  local {100 * lc[k] / lt:5.1f} %  redis {100 * rc[k] / rt:5.1f} %  {k[:110]}")
for name in ("RedisStore.try_admit", "StoreAdmission.release", "RedisStore.release",
             "._send_packed_command"):
    got = sum(v for k, v in rc.items() if k.split(" (")[0].endswith(name))
    print(f"  {name}: {100 * got / rt:.1f} % of the redis replica's samples")
P
