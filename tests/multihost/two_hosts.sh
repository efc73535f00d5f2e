#!/usr/bin/env bash
# Two hosts made as network namespaces joined by a veth link, 2 ranks each, started with
# a scheduler's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = host 1's link
# address) and no GLOO_SOCKET_IFNAME, training train_gpt with --sharding hybrid
# --hybrid-group-size 2: each rank must bind Gloo to its link (Note [Gloo's interface]),
# and the losses must equal one rank's (deadlines.sh has the same hosts with every rank
# bound to loopback). Needs root and iproute2; exits 77 (ctest: skipped) without them.
#   tests/multihost/two_hosts.sh BIN_DIR PYTHON
set -euo pipefail
BIN="$1"
PY="$2"
[ "$(id -u)" = 0 ] || { echo "two_hosts: needs root for network namespaces; skipped"; exit 77; }
command -v ip >/dev/null || { echo "two_hosts: needs ip (iproute2); skipped"; exit 77; }
TAG="fsdp$$"
H1="${TAG}a" H2="${TAG}b"
OUT="$(mktemp -d /tmp/fsdp-two-hosts.XXXXXX)"
cleanup() {
  ip netns del "$H1" 2>/dev/null || true
  ip netns del "$H2" 2>/dev/null || true
  rm -rf "$OUT"
}
trap cleanup EXIT
if ! ip netns add "$H1" 2>"$OUT/ns.err"; then
  echo "two_hosts: cannot make network namespaces here ($(cat "$OUT/ns.err")); skipped"
  exit 77
fi
ip netns add "$H2"
if ! ip link add "${TAG}x" type veth peer name "${TAG}y" 2>"$OUT/veth.err"; then
  echo "two_hosts: cannot make a veth link here ($(cat "$OUT/veth.err")); skipped"
  exit 77
fi
ip link set "${TAG}x" netns "$H1"
ip link set "${TAG}y" netns "$H2"
ip -n "$H1" addr add 10.9.0.1/24 dev "${TAG}x"
ip -n "$H2" addr add 10.9.0.2/24 dev "${TAG}y"
for h in "$H1" "$H2"; do ip -n "$h" link set lo up; done
ip -n "$H1" link set "${TAG}x" up
ip -n "$H2" link set "${TAG}y" up

ARGS=(--n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 8 --steps 10 --log-every 5)
IFACE=(-u GLOO_SOCKET_IFNAME)
TIMEOUT_S=30
pids=()
for r in 0 1 2 3; do
  h="$H1"
  [ "$r" -ge 2 ] && h="$H2"
  ip netns exec "$h" env "${IFACE[@]}" RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) \
    LOCAL_WORLD_SIZE=2 MASTER_ADDR=10.9.0.1 MASTER_PORT=29500 FSDP_TIMEOUT_S=$TIMEOUT_S \
    OMP_NUM_THREADS=1 timeout 120 "$BIN/train_gpt" "${ARGS[@]}" --sharding hybrid \
    --hybrid-group-size 2 --log-jsonl "$OUT/w4_r$r.jsonl" >"$OUT/rank$r.log" 2>&1 &
  pids+=($!)
done
failed=0
for r in 0 1 2 3; do
  if ! wait "${pids[$r]}"; then
    echo "two_hosts: rank $r failed; its output:"
    tail -5 "$OUT/rank$r.log" || true
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
OMP_NUM_THREADS=1 "$BIN/train_gpt" "${ARGS[@]}" --log-jsonl "$OUT/w1.jsonl" >"$OUT/w1.log" 2>&1
"$PY" - "$OUT/w1.jsonl" "$OUT/w4_r0.jsonl" <<'PY'
import json, sys
def losses(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    return [r["loss"] for r in rows if "step" in r and "loss" in r]
one, four = losses(sys.argv[1]), losses(sys.argv[2])
assert len(one) == 10 and len(four) == 10, (len(one), len(four))
worst = max(abs(a - b) / abs(a) for a, b in zip(one, four))
print(f"two_hosts: 4 ranks on 2 namespace hosts (hybrid, groups of 2) vs 1 rank: "
      f"10 losses, max rel diff {worst:.2e}")
sys.exit(0 if worst <= 1e-5 else 1)
PY
