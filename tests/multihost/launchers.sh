#!/usr/bin/env bash
# The launchers of DESIGN.md section 6 across two namespace hosts (lib.sh), 2 ranks each,
# no GLOO_SOCKET_IFNAME, train_gpt --sharding hybrid --hybrid-group-size 2; the losses must
# equal one rank's.
#   --torchrun  on each host: torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d
#               --rdzv-endpoint HOST1:PORT --rdzv-conf is_host=1 (host 1; 0 on host 2)
#               --no-python train_gpt ...; host 1's agent serves the store on PORT and tells
#               the workers so (TORCHELASTIC_USE_AGENT_STORE=True). is_host: torchrun
#               recognizes its host by name or by the addresses the name resolves to, not
#               by the endpoint's address on a second interface (it would wait 60 s, fail).
#               --local-addr: the address the workers get as MASTER_ADDR is rank 0's node's
#               (its host name otherwise, which resolves to loopback in these namespaces)
#   --slurm     each rank started as srun would: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
#               MASTER_ADDR, MASTER_PORT (no RANK/WORLD_SIZE)
#   --env       each rank started with a scheduler's torchrun variables set by hand: RANK,
#               WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = host 1's link
#               address; each rank must bind Gloo to its link (Note [Gloo's interface])
# Prints the launcher command lines and the losses. Needs root (exit 77: skipped) and, for
# --torchrun, PYTHON's torchrun (exit 77 without it).
#   tests/multihost/launchers.sh BIN_DIR PYTHON --torchrun|--slurm|--env
set -euo pipefail
BIN="$(cd "$1" && pwd)"
PY="$2"
MODE="$3"
. "$(dirname "$0")/lib.sh"
ARGS=(--n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 8 --steps 10 --log-every 5)
case "$MODE" in
  --torchrun)
    TORCHRUN="$(dirname "$PY")/torchrun"
    [ -x "$TORCHRUN" ] || { echo "launchers.sh: no torchrun next to $PY; skipped"; exit 77; }
    mh_setup launchers-torchrun 10.9.6
    PORT=29661
    for n in 1 2; do
      h="$H1" a="$A1"
      [ "$n" = 2 ] && h="$H2" a="$A2"
      CMD=(env -u GLOO_SOCKET_IFNAME -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT
        FSDP_TIMEOUT_S=60 OMP_NUM_THREADS=1 timeout 120 "$TORCHRUN" --nnodes 2
        --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "$A1:$PORT" --rdzv-id fsdpmn
        --rdzv-conf "is_host=$((n == 1)),join_timeout=60" --local-addr "$a" --no-python "$BIN/train_gpt" "${ARGS[@]}" --sharding hybrid --hybrid-group-size 2
        --log-jsonl "$OUT/wn.jsonl")
      echo "host $n: ip netns exec $h ${CMD[*]}"
      mh_run "$h" "$OUT/node$n.log" "${CMD[@]}"
    done
    LOGS="node1 node2"
    ;;
  --slurm)
    mh_setup launchers-slurm 10.9.7
    PORT=29671
    for r in 0 1 2 3; do
      h="$H1"
      [ "$r" -ge 2 ] && h="$H2"
      CMD=(env -u GLOO_SOCKET_IFNAME -u RANK -u WORLD_SIZE -u LOCAL_RANK "SLURM_PROCID=$r"
        SLURM_NTASKS=4 SLURM_LOCALID=$((r % 2)) MASTER_ADDR="$A1" "MASTER_PORT=$PORT"
        FSDP_TIMEOUT_S=60 OMP_NUM_THREADS=1 timeout 120 "$BIN/train_gpt" "${ARGS[@]}"
        --sharding hybrid --hybrid-group-size 2 --log-jsonl "$OUT/wn.jsonl")
      echo "rank $r: ip netns exec $h ${CMD[*]}"
      mh_run "$h" "$OUT/rank$r.log" "${CMD[@]}"
    done
    LOGS="rank0 rank1 rank2 rank3"
    ;;
  --env)
    mh_setup launchers-env 10.9.0
    PORT=29500
    for r in 0 1 2 3; do
      h="$H1"
      [ "$r" -ge 2 ] && h="$H2"
      read -ra RANK_ENV <<<"$(mh_rank_env "$r" 4)"
      CMD=(env -u GLOO_SOCKET_IFNAME "${RANK_ENV[@]}" MASTER_ADDR="$A1" "MASTER_PORT=$PORT"
        FSDP_TIMEOUT_S=30 OMP_NUM_THREADS=1 timeout 120 "$BIN/train_gpt" "${ARGS[@]}"
        --sharding hybrid --hybrid-group-size 2 --log-jsonl "$OUT/wn.jsonl")
      echo "rank $r: ip netns exec $h ${CMD[*]}"
      mh_run "$h" "$OUT/rank$r.log" "${CMD[@]}"
    done
    LOGS="rank0 rank1 rank2 rank3"
    ;;
  *) echo "launchers.sh: unknown mode '$MODE'; use --torchrun, --slurm or --env"; exit 2 ;;
esac
mh_wait_all
failed=0
for l in $LOGS; do
  read -r rc ms _ <"$OUT/$l.log.exit"
  if [ "$rc" != 0 ]; then
    echo "launchers.sh: $l exited $rc after $ms ms; its output:"
    tail -15 "$OUT/$l.log" || true
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
OMP_NUM_THREADS=1 "$BIN/train_gpt" "${ARGS[@]}" --log-jsonl "$OUT/w1.jsonl" >"$OUT/w1.log" 2>&1
mh_losses_match "$OUT/w1.jsonl" "$OUT/wn.jsonl" 10 "launchers.sh $MODE: 4 ranks on 2 hosts" "$PY"
