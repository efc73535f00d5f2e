#!/usr/bin/env bash
# The GPU check, in one command, on a GPU machine that has nothing but its own CUDA torch:
# builds against the LibTorch of that machine's Python torch and runs, ordered by value
# (what matters most first, so that a run cut short still has it):
#   large_model        the 1.3B GPT in bf16: this library, plain LibTorch and PyTorch FSDP2
#                      (fused attention, fused AdamW), three alternating rounds
#                      (tests/bench/large_model.py over bench_gpu --model large and
#                      tests/interop/fsdp2_bench.py --large): tokens/s, MFU, peak memory
#   two_ranks_one_gpu  world 2 on the one GPU over Gloo (CUDA tensors staged through pinned
#                      host memory) against world 1, FULL_SHARD, SHARD_GRAD_OP, ZeRO-2 and
#                      cpu offload (tests/bench/two_ranks_one_gpu.py)
#   test-cuda          tests/test_cuda.cpp and every test named *_CUDA
#   modes              every memory mode of train_gpt (tests/bench/memory_modes.py)
#   bench-gpu, fsdp2   the 152M GPT of the earlier runs: bench_gpu --model small against plain
#                      LibTorch, and FSDP2 on it
#   test-cpu           the CPU suites that must still pass there (Parity, FusedAdamW, Offload)
#   max_model          the largest GPT (d_model 2048) that plain LibTorch and offload_param=cpu
#                      train on this GPU and its host, one run each at fsdp-estimate's
#                      prediction (tests/bench/max_model.py --device cuda); last, in the time
#                      the budget has left, or alone in a second call on the same machine:
#                      FSDP_GPU_CHECK_PHASES=max_model FSDP_GPU_CHECK_BUDGET=300
#                      FSDP_GPU_MAX_MODEL_S=280 scripts/gpu/gpu-check.sh OUT2 (the build is done;
#                      on the device tool, make that call without carrying the bundle again:
#                      a carried path is replaced there, with whatever was built inside it)
# Such machines are borrowed, offline and short-lived, so the run is bounded
# (FSDP_GPU_CHECK_BUDGET, default 540 s, so that it ends within 9 minutes whatever hangs)
# and leaves its results in a folder:
#
#   scripts/gpu/gpu-check.sh [--bundle DIR] [OUT_DIR] [-- CMAKE_ARGS...]
#   scripts/gpu/gpu-check.sh --rehearse BUILD_DIR [OUT_DIR]
#                                    (OUT_DIR default: gpu-check-out/ in the current folder)
#
# OUT_DIR/results.json  phases (ok, failed, timeout, skipped; seconds), each test's result
#                       (GoogleTest's JUnit files), "metrics" (gpu_mfu: the large model's,
#                       bf16; ours_over_fsdp2.tokens_per_s_bf16: the median over the rounds),
#                       large_model (every round, medians and spreads), two_ranks_one_gpu
#                       (each mode's losses at world 1 and 2), bench_gpu's metrics of the
#                       152M GPT, FSDP2's with ours over theirs, memory_modes, torch, CUDA,
#                       GPU (nvidia-smi), the bundle's manifest
# OUT_DIR/gpu-check-DATE.json  the same file, named for docs/gpu/ (copy it there)
# OUT_DIR/gpu-check.log this output; OUT_DIR/logs/PHASE.log each phase's full output
#
# --rehearse BUILD_DIR: the same phases on this machine's CPU, at small sizes, with the
# binaries of an existing build (no dependencies built, no configure, no build; the
# ctest GpuCheck.RehearsedOnTheCpuWithEveryPhase runs it): every phase, its parsing and
# results.json are exercised where no GPU is. FSDP_GPU_PEAK_TFLOPS defaults to a nominal
# 0.1 there, so the MFU fields are computed (their values mean nothing on a CPU).
#
# What the machine lacks comes from the bundle of scripts/gpu/gpu-bundle.sh (the folder this
# source tree is src/ of, or --bundle DIR): GoogleTest and HDF5 are built from source
# into a prefix in the build folder, cxxopts, nlohmann-json and Gloo's headers are used
# where they lie. Without a bundle the machine's own packages are used. A phase that fails
# or runs out of time is recorded and the later phases go on where they can: without
# HDF5 the project builds with checkpoints disabled (test_cuda's checkpoint case then
# fails, saying so).
#
# The machine's torch: FSDP_GPU_CHECK_PYTHON, else /opt/torch/.venv/bin/python3, else
# python3 on PATH (its torch.utils.cmake_prefix_path; TORCH_PREFIX overrides the prefix).
# nvcc: CUDACXX, else /usr/local/cuda/bin/nvcc, else nvcc on PATH.
# The build compiles every file alone, without precompiled headers or unity batches
# (FSDP_GPU_CHECK_PCH=1 keeps the project's defaults): against a CUDA LibTorch a
# precompiled header takes longer to make than a source file takes to compile without it
# (measured on one core: 50 s for a 700 MB header against 35 to 45 s per source file), and
# the library's header, its batches, the tests' header and the tests form a chain that
# many cores cannot shorten; file by file, 16 cores build it in about the time of the
# slowest file.
# Other settings: FSDP_JOBS (default: all cores), FSDP_GPU_CHECK_WORK (the build folder,
# default: .gpu-build/ beside the bundle, outside it so that a second call finds the build
# even where the bundle was copied again; build-gpu-check/ in this source tree without one), FSDP_GPU_BENCH_ARGS (bench_gpu's extra
# arguments for the 152M GPT, default "--reps 10"; e.g. "--search-seconds 20" adds the
# largest-model search), FSDP_GPU_LARGE_ARGS (large_model.py's, default "--rounds 3 --reps 8"),
# FSDP_GPU_CHECK_PHASES (a comma-separated list: run only these of the phases after the
# build, e.g. a second call "max_model" on the same machine, whose build is then done;
# default: all), FSDP_GPU_MAX_MODEL_S (max_model's limit, default 120 s).
# Exit status 0 when the build and the tests passed (skips allowed).
set -euo pipefail
SRC="$(cd "$(dirname "$0")/../.." && pwd -P)"

BUNDLE="${FSDP_GPU_BUNDLE:-}"
OUT=""
EXTRA=()
REHEARSE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) [ $# -ge 2 ] || { echo "gpu-check: --bundle needs a folder" >&2; exit 2; }; BUNDLE="$2"; shift 2 ;;
    --rehearse)
      [ $# -ge 2 ] || { echo "gpu-check: --rehearse needs the build folder whose binaries it runs" >&2; exit 2; }
      [ -x "$2/bin/train_gpt" ] || { echo "gpu-check: --rehearse $2: no bin/train_gpt there; build first (./scripts/test.sh)" >&2; exit 2; }
      REHEARSE="$(cd "$2" && pwd -P)"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown option '$1' (expected --bundle DIR or an output folder)" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "gpu-check: one output folder only" >&2; exit 2; }; OUT="$1"; shift ;;
  esac
done
fail() { echo "gpu-check: FAILED: $*" >&2; exit 1; }
say() { echo "[gpu-check] $*"; }

# The bundle: given, or the folder this source tree was unpacked into (not when rehearsing).
if [ -z "$BUNDLE" ] && [ -z "$REHEARSE" ] && [ -f "$SRC/../manifest.json" ] && [ -d "$SRC/../deps" ]; then BUNDLE="$SRC/.."; fi
if [ -n "$BUNDLE" ]; then
  [ -d "$BUNDLE/deps" ] || fail "$BUNDLE is not a bundle of scripts/gpu/gpu-bundle.sh (no deps/ in it)"
  BUNDLE="$(cd "$BUNDLE" && pwd -P)"
fi

OUT="$(realpath -m "${OUT:-gpu-check-out}")"
mkdir -p "$OUT/logs" || fail "cannot make the output folder $OUT"
rm -f "$OUT"/logs/*.log "$OUT"/results.json "$OUT"/gpu-check-*.json "$OUT"/junit-*.xml "$OUT"/*.txt "$OUT"/phases.tsv "$OUT"/env.json
LOG="$OUT/gpu-check.log"
exec > >(tee "$LOG") 2>&1
TEE_PID=$!
# On exit, let tee write the last lines before the script's own end.
trap 'exec >&- 2>&-; wait "$TEE_PID" 2>/dev/null || true' EXIT

JOBS="${FSDP_JOBS:-$(nproc)}"
DEFAULT_BUDGET=540
BUDGET="${FSDP_GPU_CHECK_BUDGET:-$DEFAULT_BUDGET}"
case "$BUDGET" in ''|*[!0-9]*) fail "FSDP_GPU_CHECK_BUDGET='$BUDGET': expected a number of seconds" ;; esac
if [ -n "$BUNDLE" ]; then DEFAULT_WORK="$(dirname "$BUNDLE")/.gpu-build"; else DEFAULT_WORK="$SRC/build-gpu-check"; fi
WORK="$(realpath -m "${FSDP_GPU_CHECK_WORK:-$DEFAULT_WORK}")"
BUILD="$WORK/fsdp"
DEPS="$WORK/deps"        # build folders of the bundled dependencies
PREFIX="$WORK/prefix"    # where they are installed
BENCH_ARGS="${FSDP_GPU_BENCH_ARGS:---reps 10}"
LARGE_ARGS="${FSDP_GPU_LARGE_ARGS:---rounds 3 --reps 8}"
ONLY="${FSDP_GPU_CHECK_PHASES:-}"
MAX_MODEL_S="${FSDP_GPU_MAX_MODEL_S:-120}"
case "$MAX_MODEL_S" in ''|*[!0-9]*) echo "gpu-check: FSDP_GPU_MAX_MODEL_S='$MAX_MODEL_S': expected a number of seconds" >&2; exit 2 ;; esac
START=$SECONDS
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
DEADLINE=$((START + BUDGET))
RESERVE=10  # for the results at the end (their writer gets at most 30 s)
PHASES="$OUT/phases.tsv"
: >"$PHASES"
say "source: $SRC; bundle: ${BUNDLE:-none, the packages of this machine}; output: $OUT"
say "budget $BUDGET s, $JOBS jobs, build folder $WORK"

# limit_for CAP: a phase's time limit: CAP seconds (scaled with the budget: CAP is for the
# default budget) or what is left of the budget, whichever is less. A phase that reaches
# its limit is stopped (and killed 10 s later), so every phase ends by the deadline.
limit_for() {
  local cap=$(($1 * BUDGET / DEFAULT_BUDGET)) left=$((DEADLINE - SECONDS - RESERVE))
  echo $((cap < left ? cap : left))
}
# run_phase NAME CAP CMD...: runs CMD with its output in logs/NAME.log under the limit of
# limit_for CAP (CAP given as =N: N seconds, capped by the budget alone) and records the
# outcome in phases.tsv.
run_phase() {
  local name="$1" cap="$2" t0=$SECONDS left limit rc=0 status
  shift 2
  case "$name" in googletest|hdf5|configure|build) ;; *)
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
      printf '%s\tskipped\t\t0\t0\tnot in FSDP_GPU_CHECK_PHASES=%s\n' "$name" "$ONLY" >>"$PHASES"
      return 0
    fi ;;
  esac
  case "$cap" in
    =*) left=$((DEADLINE - SECONDS - RESERVE)); limit=${cap#=}; [ "$limit" -lt "$left" ] || limit=$left ;;
    *) limit="$(limit_for "$cap")" ;;
  esac
  if [ "$limit" -lt 10 ]; then
    printf '%s\tskipped\t\t0\t0\tno time left in the budget of %s s\n' "$name" "$BUDGET" >>"$PHASES"
    say "$name: SKIPPED (no time left of the $BUDGET s budget)"
    return 1
  fi
  say "$name (at $((SECONDS - START)) s, limit $limit s)"
  timeout -k 10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1 </dev/null || rc=$?
  case "$rc" in
    0) status=ok ;;
    124|137) status=timeout ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" >>"$PHASES"
  if [ "$status" = ok ]; then
    say "$name: ok ($((SECONDS - t0)) s)"
    return 0
  fi
  if [ "$status" = timeout ]; then
    say "$name: TIMEOUT after $((SECONDS - t0)) s (limit $limit s); the end of logs/$name.log:"
  else
    say "$name: FAILED (exit $rc, $((SECONDS - t0)) s); the end of logs/$name.log:"
  fi
  tail -25 "$OUT/logs/$name.log" | sed 's/^/    /'
  return 1
}
note_phase() { printf '%s\t%s\t\t0\t0\t%s\n' "$1" "$2" "$3" >>"$PHASES"; }

# write_results: results.json from phases.tsv, the JUnit files, bench_gpu.txt, env.json,
# nvidia-smi.csv and the bundle's manifest (also on a failure before the phases).
write_results() {
  local writer="${PY:-}" manifest=""
  [ -n "$writer" ] || writer="$(command -v python3 || true)"
  [ -z "${BUNDLE:-}" ] || manifest="$BUNDLE/manifest.json"
  if [ -n "$writer" ] && timeout 30 "$writer" - "$OUT" "$STARTED" "$((SECONDS - START))" "$BUDGET" "$JOBS" "$BUILT" \
       "$TESTS_OK" "${NVCC:-}" "$NVCC_VERSION" "$manifest" "$BENCH_ARGS" "$(cmake --version 2>/dev/null | head -1)" \
       "$(c++ --version 2>/dev/null | head -1)" "${REHEARSE:-}" <<'EOF'; then
import datetime, glob, json, os, platform, re, sys
import xml.etree.ElementTree as ET
(out, started, wall, budget, jobs, built, tests_ok, nvcc, nvcc_version, manifest, bench_args,
 cmake_v, cxx_v, rehearse) = sys.argv[1:]
def read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return None
phases = []
for line in (read(os.path.join(out, "phases.tsv")) or "").splitlines():
    name, status, rc, secs, limit, note = (line.split("\t") + [""] * 6)[:6]
    ph = {"name": name, "status": status, "seconds": int(secs or 0), "log": "logs/%s.log" % name}
    if rc:
        ph["exit"] = int(rc)
    if limit and limit != "0":
        ph["limit_s"] = int(limit)
    if note:
        ph["note"] = note
    if not os.path.exists(os.path.join(out, ph["log"])):
        del ph["log"]
    phases.append(ph)
def junit(name):
    # One JUnit file per test binary (gtest_phase): junit-NAME-BINARY.xml.
    paths = sorted(glob.glob(os.path.join(out, "junit-%s-test_*.xml" % name)))
    if not paths:
        return None
    testcases = []
    for p in paths:
        try:
            testcases += list(ET.parse(p).getroot().iter("testcase"))
        except ET.ParseError as e:
            return {"error": "unreadable %s: %s" % (p, e)}
    cases, count = [], {"passed": 0, "failed": 0, "timeout": 0, "skipped": 0}
    for tc in testcases:
        c = {"name": "%s.%s" % (tc.get("classname"), tc.get("name")), "seconds": float(tc.get("time") or 0)}
        f, s = tc.find("failure"), tc.find("skipped")
        text = (tc.findtext("system-out") or "").splitlines()
        if f is not None:
            c["status"] = "failed"
            # GoogleTest's failures (file:line: Failure and what follows), without backtraces.
            lines = [l for l in text if not l.startswith("frame #") and not l.startswith("Exception raised from")]
            first = next((i for i, l in enumerate(lines) if "Failure" in l or "rank " in l), 0)
            c["message"] = (f.get("message") or "").strip()
            c["output"] = lines[first:first + 40]
        elif s is not None or tc.get("status") in ("notrun", "disabled") or tc.get("result") == "skipped":
            c["status"] = "skipped"
            # GTEST_SKIP prints "file:line: Skipped" and its message on the next line.
            why = [text[i + 1] for i, l in enumerate(text[:-1]) if l.endswith(": Skipped")]
            msg = (s.get("message") if s is not None else "") or ""
            c["message"] = why[0] if why else msg
        else:
            c["status"] = "passed"
        count[c["status"]] += 1
        cases.append(c)
    return {"junit": [os.path.basename(p) for p in paths], **count, "cases": cases}
env = None
if read(os.path.join(out, "env.json")):
    env = json.loads(read(os.path.join(out, "env.json")))
smi = read(os.path.join(out, "nvidia-smi.csv"))
gpus = []
for line in (smi or "").strip().splitlines():
    f = [x.strip() for x in line.split(",")]
    if len(f) == 4:
        gpus.append({"name": f[0], "driver": f[1], "memory": f[2], "compute_cap": f[3]})
    elif line.strip():
        gpus.append({"error": line.strip()})
def json_lines(name):
    text = read(os.path.join(out, name))
    if text is None:
        return None
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows
bench = None
rows = json_lines("bench_gpu.txt")
if rows is not None:
    bench = {"args": bench_args.split(), "metrics": rows, "output": "bench_gpu.txt"}
    for line in read(os.path.join(out, "bench_gpu.txt")).splitlines():
        if not line.startswith("{") and "no GPU" in line:
            bench["note"] = line.strip()
# PyTorch FSDP2 on the same GPT, batch, optimizer and GPU (tests/interop/fsdp2_bench.py),
# and this library's figures over FSDP2's: tokens/s (fp32, bf16), peak memory, MFU.
fsdp2 = None
rows = json_lines("fsdp2.txt")
if rows is not None:
    fsdp2 = {"output": "fsdp2.txt", "metrics": rows}
    ours = {m["metric"]: m["value"] for m in (bench or {}).get("metrics", [])}
    theirs = {m["metric"]: m["value"] for m in fsdp2["metrics"]}
    fsdp2["ours_over_fsdp2"] = {
        name: ours[a] / theirs[b]
        for name, a, b in (("tokens_per_s_fp32", "gpu_tokens_per_s", "fsdp2_tokens_per_s"),
                           ("tokens_per_s_bf16", "gpu_bf16_tokens_per_s", "fsdp2_bf16_tokens_per_s"),
                           ("peak_memory_fp32", "gpu_peak_memory_bytes", "fsdp2_peak_memory_bytes"),
                           ("mfu_bf16", "gpu_mfu_152m", "fsdp2_bf16_mfu"))
        if a in ours and b in theirs and theirs[b]}
# Every memory mode of train_gpt on the GPU (tests/bench/memory_modes.py): one JSON line each.
modes = None
rows = json_lines("memory_modes.txt")
if rows is not None:
    modes = {"output": "memory_modes.txt", "modes": rows}
# The 1.3B GPT: every round (ours, plain LibTorch, FSDP2) and the summary (tests/bench/large_model.py).
large = None
rows = json_lines("large_model.txt")
if rows is not None:
    large = {"output": "large_model.txt",
             "rounds": [x for x in rows if x.get("metric") == "large_model_round"],
             "summary": next((x for x in rows if x.get("metric") == "large_model"), None),
             "processes": [x for x in rows if x.get("metric", "").startswith(("gpu_large", "gpu_mfu", "fsdp2_large"))]}
# Two ranks on one GPU against one rank (tests/bench/two_ranks_one_gpu.py): each mode's losses.
two = None
rows = json_lines("two_ranks_one_gpu.txt")
if rows is not None:
    two = {"output": "two_ranks_one_gpu.txt", "modes": [x for x in rows if x.get("metric") == "two_ranks_one_gpu"]}
# The largest model per mode (tests/bench/max_model.py): plain LibTorch and offload.
maxm = None
rows = json_lines("max_model.txt")
if rows is not None:
    maxm = {"output": "max_model.txt", "modes": [x for x in rows if x.get("metric") == "max_model"]}
# The headline figures under the names the issue tracker reads.
summary = (large or {}).get("summary") or {}
metrics = {"gpu_mfu": summary.get("gpu_mfu"),
           "ours_over_fsdp2": {"tokens_per_s_bf16": (summary.get("ours_over_fsdp2") or {}).get("tokens_per_s_bf16")},
           "ours_over_plain_libtorch": (summary.get("ours_over_plain") or {}).get("median"),
           "every_pair_ours_at_least_fsdp2": summary.get("every_pair_ours_at_least_fsdp2"),
           "two_ranks_one_gpu_equal_world1": None if two is None else bool(two["modes"]) and all(m["ok"] for m in two["modes"])}
configure = read(os.path.join(out, "logs", "configure.log")) or ""
summary = [l[3:] for l in configure.splitlines() if l.startswith("-- fsdp: LibTorch")]
osr = dict(l.split("=", 1) for l in (read("/etc/os-release") or "").splitlines() if "=" in l)
r = {
    "script": "scripts/gpu/gpu-check.sh",
    "mode": ("rehearsal on the CPU with the build in %s" % rehearse) if rehearse else "gpu",
    "started": started,
    "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "wall_s": int(wall), "budget_s": int(budget),
    "ok": built == "1" and tests_ok == "1",
    "machine": {"host": platform.node(), "os": osr.get("PRETTY_NAME", "").strip('"'), "cores": os.cpu_count(),
                "jobs": int(jobs), "cmake": cmake_v, "cxx": cxx_v, "nvcc": nvcc or None,
                "nvcc_cuda": nvcc_version or None, "nvidia_smi": gpus if smi is not None else None},
    "torch": env,
    "build": {"configure": summary[0] if summary else None,
              "hdf5": None if not summary else "HDF5 not found" not in configure},
    "phases": phases,
    "metrics": metrics,
    "tests": {"cuda": junit("test-cuda"), "cpu": junit("test-cpu")},
    "large_model": large,
    "two_ranks_one_gpu": two,
    "bench_gpu": bench,
    "fsdp2": fsdp2,
    "memory_modes": modes,
    "max_model": maxm,
    "bundle": json.loads(read(manifest)) if manifest and read(manifest) else None,
}
for name in ("results.json", "gpu-check-%s.json" % started[:10]):
    with open(os.path.join(out, name), "w") as f:
        json.dump(r, f, indent=2)
        f.write("\n")
def line(k):
    t = r["tests"][k]
    return "none run" if not t else ("%d passed, %d failed, %d timed out, %d skipped" % (
        t.get("passed", 0), t.get("failed", 0), t.get("timeout", 0), t.get("skipped", 0)))
print("[gpu-check] tests: cuda %s; cpu %s" % (line("cuda"), line("cpu")))
print("[gpu-check] metrics: gpu_mfu %s; ours_over_fsdp2.tokens_per_s_bf16 %s; ours over plain LibTorch %s; two ranks on one GPU equal world 1: %s" % (
    metrics["gpu_mfu"], metrics["ours_over_fsdp2"]["tokens_per_s_bf16"], metrics["ours_over_plain_libtorch"],
    metrics["two_ranks_one_gpu_equal_world1"]))
print("[gpu-check] phases: " + "; ".join("%s %s %d s" % (p["name"], p["status"], p["seconds"]) for p in phases))
EOF
    say "results: $OUT/results.json (log: $LOG)"
  else
    say "warning: no Python wrote results.json; the phases are in $PHASES, the tests in $OUT/junit-*.xml"
  fi
}
# From here on a failure is recorded too: a "setup" phase in results.json.
fail() {
  echo "gpu-check: FAILED: $*" >&2
  note_phase setup failed "$*"
  write_results || true
  exit 1
}

BUILT=0
TESTS_OK=0
PY=""
NVCC=""
NVCC_VERSION=""

# 1. The machine: Python with torch, nvcc, the GPU.
PY="${FSDP_GPU_CHECK_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY="$(command -v python3 || true)"; fi
fi
TORCH_CUDA=""
if [ -n "$PY" ] && timeout 120 "$PY" -W ignore - "$OUT/env.json" <<'EOF'; then
import json, sys
import torch
e = {"python": sys.executable, "python_version": sys.version.split()[0], "torch": torch.__version__,
     "torch_cuda": torch.version.cuda, "cmake_prefix_path": torch.utils.cmake_prefix_path,
     "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "cuda_available": torch.cuda.is_available(),
     "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0, "devices": []}
try:
    e["cudnn"] = torch.backends.cudnn.version()
except Exception:
    e["cudnn"] = None
try:
    e["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
except Exception:
    e["nccl"] = None
for i in range(e["device_count"]):
    p = torch.cuda.get_device_properties(i)
    e["devices"].append({"name": p.name, "capability": "%d.%d" % (p.major, p.minor),
                         "memory_bytes": p.total_memory})
json.dump(e, open(sys.argv[1], "w"), indent=2)
EOF
  TORCH_PREFIX="${TORCH_PREFIX:-$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["cmake_prefix_path"])' "$OUT/env.json")}"
  TORCH_CUDA="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["torch_cuda"] or "")' "$OUT/env.json")"
  ABI="$("$PY" -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["cxx11_abi"]))' "$OUT/env.json")"
  say "python: $PY; $("$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])); print("torch %s (CUDA %s), GPUs: %s" % (e["torch"], e["torch_cuda"], ", ".join(d["name"] for d in e["devices"]) or "none visible"))' "$OUT/env.json")"
else
  [ -n "${TORCH_PREFIX:-}" ] ||
    fail "no Python with torch (tried ${PY:-python3}): set FSDP_GPU_CHECK_PYTHON to the python of the CUDA torch, or TORCH_PREFIX to a LibTorch"
  say "no Python with torch (${PY:-none}); LibTorch from TORCH_PREFIX=$TORCH_PREFIX"
  ABI=""
fi
NVCC="${CUDACXX:-}"
if [ -z "$NVCC" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; else NVCC="$(command -v nvcc || true)"; fi
fi
CUDA_ARGS=()
NVCC_VERSION=""
if [ -n "$NVCC" ] && [ -x "$NVCC" ]; then
  NVCC_VERSION="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  CUDA_ROOT="$(dirname "$(dirname "$(realpath "$NVCC")")")"
  CUDA_ARGS=(-DCMAKE_CUDA_COMPILER="$NVCC" -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT")
  say "nvcc: $NVCC (CUDA $NVCC_VERSION, toolkit $CUDA_ROOT)"
  if [ -n "$TORCH_CUDA" ] && [ "${NVCC_VERSION%%.*}" != "${TORCH_CUDA%%.*}" ]; then
    say "warning: nvcc is CUDA $NVCC_VERSION but torch is built with CUDA $TORCH_CUDA; the headers may not match its libraries"
  fi
elif [ -n "$TORCH_CUDA" ] && [ -z "$REHEARSE" ]; then  # the rehearsal builds nothing
  fail "torch is built with CUDA $TORCH_CUDA but there is no nvcc (tried CUDACXX, /usr/local/cuda/bin/nvcc, PATH): install the CUDA toolkit $TORCH_CUDA or set CUDACXX to its nvcc"
fi
if command -v nvidia-smi >/dev/null; then
  timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader >"$OUT/nvidia-smi.csv" 2>&1 ||
    say "warning: nvidia-smi failed: $(head -1 "$OUT/nvidia-smi.csv")"
  say "nvidia-smi: $(head -1 "$OUT/nvidia-smi.csv")"
else
  say "no nvidia-smi on PATH (no NVIDIA driver?)"
fi
GEN=(-G "Unix Makefiles")
command -v ninja >/dev/null && GEN=(-G Ninja)
command -v cmake >/dev/null || fail "no cmake on PATH (it builds everything here)"
# CMake 4 refuses projects that ask for policies older than 3.5; the bundled sources ask for 3.5 to 3.12.
OLD_CMAKE=(-DCMAKE_POLICY_VERSION_MINIMUM=3.5)
DEP_FLAGS=()
[ -z "$ABI" ] || DEP_FLAGS=(-DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI")
export JOBS

# The targets the build makes: the test binaries the test phases run and every program a phase
# runs from BIN (bench_gpu is added where this LibTorch has CUDA).
read -ra TARGETS <<<"${FSDP_GPU_CHECK_TARGETS:-test_tools test_programs test_engine test_training train_gpt fsdp-run fsdp-estimate}"
if [ -n "$REHEARSE" ]; then
  # The rehearsal: this machine's build, on its CPU, at small sizes. Its phases see only
  # the programs the build would make (BIN: links to them), so a phase that runs one the
  # target list lacks fails here, not on the GPU machine.
  BUILD="$REHEARSE"
  BIN="$OUT/rehearsal-bin"
  rm -rf "$BIN" && mkdir -p "$BIN"
  for t in "${TARGETS[@]}" bench_gpu; do
    case "$t" in test_*) continue ;; esac
    [ ! -x "$BUILD/bin/$t" ] || ln -s "$BUILD/bin/$t" "$BIN/$t"
  done
  DEVICE=cpu
  export FSDP_GPU_PEAK_TFLOPS="${FSDP_GPU_PEAK_TFLOPS:-0.1}"
  for p in googletest hdf5 configure build; do note_phase "$p" skipped "rehearsal: the build in $BUILD"; done
  say "rehearsal on the CPU with the build in $BUILD (FSDP_GPU_PEAK_TFLOPS=$FSDP_GPU_PEAK_TFLOPS, nominal)"
  BUILT=1
else
  BIN="$BUILD/bin"
  DEVICE=cuda
  # 2. The bundled dependencies, built into PREFIX (a second run reuses them).
  PROJECT_ARGS=()
  HAVE_HDF5_BUILD=0
  if [ -n "$BUNDLE" ]; then
    mkdir -p "$DEPS" "$PREFIX"
    if [ -d "$BUNDLE/deps/googletest" ]; then
      if [ -f "$PREFIX/.gtest-done" ]; then
        note_phase googletest ok "built by an earlier run ($PREFIX)"
        say "googletest: built by an earlier run"
      else
        # shellcheck disable=SC2016  # the inner script expands its own arguments
        run_phase googletest 60 bash -euo pipefail -c '
          cmake -S "$0" -B "$1" "${@:3}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$2" -DBUILD_GMOCK=OFF \
            -DINSTALL_GTEST=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON
          cmake --build "$1" -j"$JOBS"
          cmake --install "$1"
          touch "$2/.gtest-done"' \
          "$BUNDLE/deps/googletest" "$DEPS/googletest" "$PREFIX" "${GEN[@]}" "${OLD_CMAKE[@]}" "${DEP_FLAGS[@]}" || true
      fi
    fi
    H5TAR="$(compgen -G "$BUNDLE/deps/hdf5/hdf5_*.orig.tar.*" | head -1 || true)"
    if [ -n "$H5TAR" ]; then
      # shellcheck disable=SC2016  # the inner scripts expand their own arguments
      if [ -f "$PREFIX/.hdf5-done" ]; then
        note_phase hdf5 ok "built by an earlier run ($PREFIX)"
        say "hdf5: built by an earlier run"
        HAVE_HDF5_BUILD=1
      elif run_phase hdf5 200 bash -euo pipefail -c '
          rm -rf "$1/src" "$1/build" && mkdir -p "$1/src" "$1/build"
          tar -xf "$0" -C "$1/src" --strip-components=1
          # The C library only, shared (FindHDF5 takes the hdf5-shared target of its CMake
          # package): no tools, tests, examples, high-level or C++/Fortran/Java parts, no
          # compression filters (the checkpoints use none). Configured from inside its build
          # folder: HDF5 1.10 reads what its configure-time test programs write into the
          # current folder.
          cd "$1/build"
          cmake -S "$1/src" -B "$1/build" "${@:3}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$2" \
            -DBUILD_SHARED_LIBS=ON -DONLY_SHARED_LIBS=ON -DBUILD_STATIC_LIBS=OFF -DBUILD_TESTING=OFF \
            -DHDF5_BUILD_TOOLS=OFF -DHDF5_BUILD_UTILS=OFF -DHDF5_BUILD_EXAMPLES=OFF -DHDF5_BUILD_HL_LIB=OFF \
            -DHDF5_BUILD_CPP_LIB=OFF -DHDF5_BUILD_FORTRAN=OFF -DHDF5_BUILD_JAVA=OFF -DHDF5_BUILD_DOC=OFF \
            -DHDF5_ENABLE_Z_LIB_SUPPORT=OFF -DHDF5_ENABLE_SZIP_SUPPORT=OFF -DHDF5_NO_PACKAGES=ON
          cmake --build "$1/build" -j"$JOBS"
          cmake --install "$1/build"
          touch "$2/.hdf5-done"' \
          "$H5TAR" "$DEPS/hdf5" "$PREFIX" "${GEN[@]}" "${OLD_CMAKE[@]}"; then
        HAVE_HDF5_BUILD=1
      else
        say "continuing without HDF5: checkpoints are disabled in this build"
      fi
    else
      note_phase hdf5 skipped "the bundle has no HDF5 source (scripts/gpu/gpu-bundle.sh left it out; see its manifest.json)"
      say "hdf5: not in the bundle; the machine's own HDF5 is used if CMake finds one"
    fi
    PROJECT_ARGS+=(-DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$PREFIX")
    [ "$HAVE_HDF5_BUILD" = 0 ] || PROJECT_ARGS+=(-DHDF5_DIR="$PREFIX/share/cmake" -DHDF5_ROOT="$PREFIX")
    [ ! -d "$BUNDLE/deps/include" ] || PROJECT_ARGS+=(-DCMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES="$BUNDLE/deps/include")
    [ ! -f "$BUNDLE/deps/gloo/include/gloo/algorithm.h" ] || PROJECT_ARGS+=(-DGLOO_INCLUDE_DIR="$BUNDLE/deps/gloo/include")
  else
    PROJECT_ARGS+=(-DCMAKE_PREFIX_PATH="$TORCH_PREFIX")
  fi
  [ -z "$PY" ] || PROJECT_ARGS+=(-DFSDP_PYTHON="$PY")
  [ "${FSDP_GPU_CHECK_PCH:-0}" = 1 ] || PROJECT_ARGS+=(-DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON -DFSDP_UNITY_BUILD=OFF)

  # 3. The project: configure, then only the targets the checks run.
  if run_phase configure 90 cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
       "${PROJECT_ARGS[@]}" "${CUDA_ARGS[@]}" "${EXTRA[@]}"; then
    grep -m1 -E '^-- fsdp: LibTorch [0-9]' "$OUT/logs/configure.log" | sed 's/^-- /[gpu-check] /' || true
    grep -iE 'warning.*(hdf5|gloo)|HDF5 not found' -A2 "$OUT/logs/configure.log" | sed 's/^/    /' || true
    if cmake --build "$BUILD" --target help 2>/dev/null | grep -qw bench_gpu; then
      TARGETS+=(bench_gpu)
    else
      say "no bench_gpu target (this LibTorch has no CUDA)"
    fi
    run_phase build 300 cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}" && BUILT=1
  fi
fi

# 4. The phases, ordered by value (see the top): each records its outcome and keeps its
# output; a failure does not stop the later ones. A test binary stopped at the phase's end
# writes no JUnit file (the phase is then "timeout"). The rehearsal runs each at a small size.
gtest_phase() {  # gtest_phase NAME CAP FILTER: FILTER's cases (GoogleTest's --gtest_filter) in each test binary
  # The binaries run the cases themselves (ctest has one entry per test file, not per case:
  # tests/CMakeLists.txt), each writing its JUnit file (junit-NAME-BINARY.xml); no case run
  # at all is a failure, as ctest's --no-tests=error was.
  local name="$1" cap="$2" filter="$3" bins=() t
  for t in "${TARGETS[@]}"; do
    case "$t" in test_*) [ ! -x "$BUILD/bin/$t" ] || bins+=("$BUILD/bin/$t") ;; esac
  done
  run_phase "$name" "$cap" bash -c '
    out="$1" name="$2" filter="$3" rc=0 ran=0 n=0
    shift 3
    for bin in "$@"; do
      echo "== $(basename "$bin") --gtest_filter=$filter"
      "$bin" --gtest_filter="$filter" --gtest_output="xml:$out/junit-$name-$(basename "$bin").xml" >"$out/logs/$name.$$" 2>&1 || rc=1
      cat "$out/logs/$name.$$"
      n="$(sed -nE "s/^\[==========\] ([0-9]+) tests? from .* ran\..*/\1/p" "$out/logs/$name.$$" | tail -1)"
      ran=$((ran + ${n:-0}))
    done
    rm -f "$out/logs/$name.$$"
    echo "== $ran cases ran"
    [ "$ran" -gt 0 ] || { echo "no case matched --gtest_filter=$filter" >&2; exit 1; }
    exit $rc' _ "$OUT" "$name" "$filter" "${bins[@]}"
}
# keep NAME: the phase's log as OUT/NAME.txt, its JSON lines echoed with a prefix.
keep() {
  cp "$OUT/logs/$1.log" "$OUT/$1.txt" 2>/dev/null || true
  grep '^{' "$OUT/$1.txt" 2>/dev/null | cut -c1-400 | sed "s/^/[gpu-check] $1: /" || true
}
if [ -n "$REHEARSE" ]; then
  LARGE_SIZE=(--rounds 2 --reps 2 --n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 4)
  TWO_SIZE=(--steps 3 --n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 8 --tolerance 1e-5 --only "FULL_SHARD,cpu offload")
  MODES_SIZE=(--steps 4 --n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 8 --only "fp32 zero3,bf16 zero2")
  SMALL_SIZE=(--reps 2 --small-layers 2 --small-d-model 64 --small-heads 4 --small-block-size 32 --small-batch 4)
  FSDP2_SIZE=(--reps 2 --n-layer 2 --d-model 64 --n-head 4 --block-size 32 --batch-size 4)
  CPU_TESTS="${FSDP_GPU_CHECK_CPU_TESTS:-FusedAdamW.*}"
  # As on the GPU but without a cgroup on the CPU: device and host are one memory here.
  MAX_SIZE=(--no-cgroup --budget-mib 3072 --world 2 --d-model 64 --n-head 4 --block-size 32 --max-layers 4)
else
  read -ra LARGE_SIZE <<<"$LARGE_ARGS"
  TWO_SIZE=()
  MODES_SIZE=()
  read -ra SMALL_SIZE <<<"$BENCH_ARGS"
  FSDP2_SIZE=(--reps 10)
  CPU_TESTS="${FSDP_GPU_CHECK_CPU_TESTS:-*Parity*:*FusedAdamW*:*Offload*}"
  MAX_SIZE=(--world 1 --d-model 2048 --n-head 16 --block-size 256)
fi
if [ "$BUILT" = 1 ]; then
  TESTS_OK=1
  # The 1.3B GPT: ours, plain LibTorch and FSDP2, alternating (line-buffered, so a run
  # stopped at its limit keeps the lines it printed).
  if [ -x "$BIN/bench_gpu" ] && [ -n "$PY" ]; then
    run_phase large_model 200 stdbuf -oL "$PY" "$SRC/tests/bench/large_model.py" \
      --bench-gpu "$BIN/bench_gpu" --python "$PY" --device "$DEVICE" "${LARGE_SIZE[@]}" || true
    keep large_model
  else
    note_phase large_model skipped "no bench_gpu (this LibTorch has no CUDA) or no Python with torch"
  fi
  # Two ranks on the one GPU over Gloo against one rank.
  if [ -n "$PY" ]; then
    run_phase two_ranks_one_gpu 90 stdbuf -oL "$PY" "$SRC/tests/bench/two_ranks_one_gpu.py" \
      --bin-dir "$BIN" --device "$DEVICE" "${TWO_SIZE[@]}" || TESTS_OK=0
    keep two_ranks_one_gpu
  else
    note_phase two_ranks_one_gpu skipped "no Python to run tests/bench/two_ranks_one_gpu.py"
  fi
  # The GPU tests: suite Cuda (test_cuda.cpp) and every test named *_CUDA (test_examples'
  # train_gpt --device cuda runs among them); on the CPU they skip, saying why.
  gtest_phase test-cuda 60 'Cuda.*:*_CUDA' || TESTS_OK=0
  # Every memory mode of train_gpt (ZeRO stages, offloads, pure bf16, activation offload).
  if [ -n "$PY" ] && [ -x "$BIN/train_gpt" ]; then
    run_phase modes 80 stdbuf -oL "$PY" "$SRC/tests/bench/memory_modes.py" \
      --train-gpt "$BIN/train_gpt" --device "$DEVICE" --expect-learning "${MODES_SIZE[@]}" || true
    cp "$OUT/logs/modes.log" "$OUT/memory_modes.txt" 2>/dev/null || true
    grep '^|' "$OUT/memory_modes.txt" | sed 's/^/[gpu-check] modes: /' || true
  fi
  # The 152M GPT of the earlier runs, and FSDP2 on it.
  if [ -x "$BIN/bench_gpu" ]; then
    # shellcheck disable=SC2086
    run_phase bench-gpu 50 stdbuf -oL "$BIN/bench_gpu" --device "$DEVICE" --model small \
      "${SMALL_SIZE[@]}" || true
    cp "$OUT/logs/bench-gpu.log" "$OUT/bench_gpu.txt" 2>/dev/null || true
    grep '^{' "$OUT/bench_gpu.txt" | sed 's/^/[gpu-check] bench_gpu: /' || true
  fi
  if [ -n "$PY" ]; then
    run_phase fsdp2 40 stdbuf -oL "$PY" "$SRC/tests/interop/fsdp2_bench.py" --device "$DEVICE" \
      "${FSDP2_SIZE[@]}" || true
    cp "$OUT/logs/fsdp2.log" "$OUT/fsdp2.txt" 2>/dev/null || true
    grep '^{' "$OUT/fsdp2.txt" | sed 's/^/[gpu-check] fsdp2: /' || true
  fi
  gtest_phase test-cpu 60 "$CPU_TESTS-Cuda.*:*_CUDA" || TESTS_OK=0
  # The largest model, by memory: plain LibTorch against everything offloaded to the host
  # (issue: bigger than memory, >= 4x on a GPU), one run each at the estimate's size.
  if [ -n "$PY" ] && [ -x "$BIN/train_gpt" ] && [ -x "$BIN/fsdp-estimate" ]; then
    run_phase max_model "=$MAX_MODEL_S" stdbuf -oL "$PY" "$SRC/tests/bench/max_model.py" --bin-dir "$BIN" \
      --device "$DEVICE" --runs 1 --timeout $((MAX_MODEL_S * 2 / 5)) --only "plain (no sharding, fp32)|+ offload_param=cpu" \
      "${MAX_SIZE[@]}" || true
    keep max_model
  else
    note_phase max_model skipped "no Python, train_gpt or fsdp-estimate"
  fi
else
  for p in large_model two_ranks_one_gpu test-cuda modes bench-gpu fsdp2 test-cpu max_model; do note_phase "$p" skipped "the build did not complete"; done
fi

# 5. The results, as JSON.
write_results
if [ "$BUILT" = 1 ] && [ "$TESTS_OK" = 1 ]; then
  say "PASSED in $((SECONDS - START)) s"
  exit 0
fi
say "FAILED after $((SECONDS - START)) s (see the phases above and $OUT/logs/)"
exit 1
