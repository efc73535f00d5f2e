#!/usr/bin/env bash
# The link between two namespace hosts (lib.sh) goes down mid-training: 4 ranks, train_gpt
# --sharding full (every collective crosses the link), checkpoints every few steps,
# FSDP_TIMEOUT_S=5. Once a checkpoint exists the link is cut (ip link set ... down). Every
# rank must end within the timeout (+3 s) naming the collective it waited for and the
# peers on the other host (Note [Peer probe]). Then the link comes back and the same job
# --resume's from the last checkpoint and must finish. Prints every rank's message and time
# to exit. Needs root (exit 77: skipped).
#   tests/multihost/link_cut.sh BIN_DIR PYTHON
set -euo pipefail
BIN="$1"
. "$(dirname "$0")/lib.sh"
mh_setup link-cut 10.9.8
TIMEOUT_S=5
MARGIN_S=3
STEPS=120
ARGS=(--n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 8 --steps "$STEPS"
  --log-every 20 --sharding full --save-dir "$OUT/ckpt" --save-every 10 --keep 2)
start_ranks() {  # PORT TAG [EXTRA...]
  local port="$1" tag="$2" r h
  shift 2
  for r in 0 1 2 3; do
    h="$H1"
    [ "$r" -ge 2 ] && h="$H2"
    # shellcheck disable=SC2046
    mh_run "$h" "$OUT/$tag$r.log" env -u GLOO_SOCKET_IFNAME $(mh_rank_env "$r" 4) \
      MASTER_ADDR="$A1" MASTER_PORT="$port" FSDP_TIMEOUT_S=$TIMEOUT_S OMP_NUM_THREADS=1 \
      timeout 120 "$BIN/train_gpt" "${ARGS[@]}" "$@"
  done
}
T0=$(mh_now_ms)
start_ranks 29681 cut
# Cut once the first checkpoint is complete (its 'latest' marker), while training goes on.
for _ in $(seq 600); do
  [ -e "$OUT/ckpt/latest" ] && break
  sleep 0.05
done
[ -e "$OUT/ckpt/latest" ] || { echo "link_cut.sh: no checkpoint after 30 s"; tail -5 "$OUT/cut0.log"; exit 1; }
sleep 0.5
ip -n "$H1" link set "$L1" down
CUT_MS=$(mh_now_ms)
echo "link_cut.sh: cut the link $((CUT_MS - T0)) ms after the start, the last checkpoint being $(cat "$OUT/ckpt/latest") (FSDP_TIMEOUT_S=$TIMEOUT_S)"
mh_wait_all
failed=0
for r in 0 1 2 3; do
  read -r rc _ end <"$OUT/cut$r.log.exit"
  after=$((end - CUT_MS))
  other="$A2"
  [ "$r" -ge 2 ] && other="$A1"
  msg="$(grep -m1 "error:" "$OUT/cut$r.log" | cut -c1-600 || true)"
  peers="$(grep -m1 "It waited for peers\|Every other rank" "$OUT/cut$r.log" || true)"
  echo "rank $r: exit $rc, $after ms after the cut: $msg"
  echo "        $peers"
  if [ "$rc" = 0 ] || [ "$rc" = 124 ] || ! grep -q "collective #[0-9]* on .* did not complete" "$OUT/cut$r.log" ||
    ! grep -q "It waited for peers that do not answer: .*rank [0-3] on $other: \(no answer\|cannot be reached\)" "$OUT/cut$r.log"; then
    echo "link_cut.sh: rank $r did not fail naming the collective and a peer on $other; its output:"
    tail -8 "$OUT/cut$r.log" || true
    failed=1
  elif [ "$after" -gt $(((TIMEOUT_S + MARGIN_S) * 1000)) ]; then
    echo "link_cut.sh: rank $r ended $after ms after the cut, over FSDP_TIMEOUT_S=$TIMEOUT_S s + $MARGIN_S s"
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
ip -n "$H1" link set "$L1" up
ip -n "$H2" link set "$L2" up
start_ranks 29682 resume --resume --log-jsonl "$OUT/resume.jsonl"
mh_wait_all
for r in 0 1 2 3; do
  read -r rc ms _ <"$OUT/resume$r.log.exit"
  if [ "$rc" != 0 ]; then
    echo "link_cut.sh: resumed rank $r exited $rc; its output:"
    tail -8 "$OUT/resume$r.log" || true
    exit 1
  fi
done
from="$(grep -m1 "resumed from" "$OUT/resume0.log" || true)"
[ -n "$from" ] || { echo "link_cut.sh: rank 0 did not resume from a checkpoint"; tail -5 "$OUT/resume0.log"; exit 1; }
last="$(tail -1 "$OUT/resume.jsonl")"
echo "link_cut.sh: link back up; $from; finished in $ms ms; last log line: $last"
grep -q "\"step\": *$STEPS\b\|\"step\":$STEPS," "$OUT/resume.jsonl" || { echo "link_cut.sh: the resumed run did not reach step $STEPS"; exit 1; }
