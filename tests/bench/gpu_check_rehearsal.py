#!/usr/bin/env python3
"""scripts/gpu/gpu-check.sh --rehearse on this machine's CPU (the ctest
GpuCheck.RehearsedOnTheCpuWithEveryPhase): every phase the GPU check runs, at small sizes,
with the binaries of this build, so that the one call a borrowed GPU gets has run before.

  gpu_check_rehearsal.py --build BUILD_DIR [--out DIR]

Fails (exit 1) unless results.json says: the rehearsal mode; the phases large_model,
two_ranks_one_gpu, test-cuda, modes, bench-gpu, fsdp2, test-cpu and max_model in that order,
each ok;
a second call with FSDP_GPU_CHECK_PHASES=max_model running that phase alone;
metrics.gpu_mfu and metrics.ours_over_fsdp2.tokens_per_s_bf16 positive numbers; the test phases'
cases read (test-cuda's skipped on the CPU, test-cpu's passed, none failed); two ranks
equal to one in every mode run; every large-model round with ours, plain LibTorch and
FSDP2; and gpu-check-DATE.json beside it with the same content.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "gpu", "gpu-check.sh")
PHASES = ["large_model", "two_ranks_one_gpu", "test-cuda", "modes", "bench-gpu", "fsdp2", "test-cpu",
          "max_model"]


def second_call(build, out):
    """FSDP_GPU_CHECK_PHASES=max_model: the second call a GPU machine gets, that phase alone."""
    env = dict(os.environ, FSDP_GPU_CHECK_PHASES="max_model", FSDP_GPU_MAX_MODEL_S="200")
    p = subprocess.run(["bash", SCRIPT, "--rehearse", build, out], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=env)
    problems = []
    try:
        with open(os.path.join(out, "results.json")) as f:
            r = json.load(f)
    except (OSError, ValueError) as e:
        return [f"second call: no readable results.json in {out}: {e}\n{p.stdout[-3000:]}"]
    status = {ph["name"]: (ph["status"], ph.get("note", "")) for ph in r["phases"] if ph["name"] in PHASES}
    if status.get("max_model", ("",))[0] != "ok":
        problems.append(f"second call: max_model {status.get('max_model')}; see {out}")
    for name in PHASES[:-1]:
        if status.get(name, ("",))[0] != "skipped" or "FSDP_GPU_CHECK_PHASES" not in status[name][1]:
            problems.append(f"second call: {name} {status.get(name)}, expected skipped as not asked for")
    if p.returncode != 0:
        problems.append(f"second call exited {p.returncode}")
    if not problems:
        subprocess.run(["rm", "-rf", out])
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="fsdp_gpu_rehearsal_")
    p = subprocess.run(["bash", SCRIPT, "--rehearse", args.build, out], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    print(p.stdout[-12000:])
    problems = []
    if p.returncode != 0:
        problems.append(f"gpu-check.sh --rehearse exited {p.returncode}")
    try:
        with open(os.path.join(out, "results.json")) as f:
            r = json.load(f)
    except (OSError, ValueError) as e:
        print(f"FAIL: no readable results.json in {out}: {e}")
        return 1
    if not str(r.get("mode", "")).startswith("rehearsal"):
        problems.append(f"mode is {r.get('mode')!r}, not the rehearsal")
    ran = [ph["name"] for ph in r["phases"] if ph["status"] != "skipped" or ph["name"] in PHASES]
    if [n for n in ran if n in PHASES] != PHASES:
        problems.append(f"phases {ran}, expected {PHASES} in this order")
    for ph in r["phases"]:
        if ph["name"] in PHASES and ph["status"] != "ok":
            problems.append(f"phase {ph['name']}: {ph['status']} ({ph.get('note', '')}); see {out}/{ph.get('log', '')}")
    m = r.get("metrics") or {}
    for name, value in (("gpu_mfu", m.get("gpu_mfu")),
                        ("ours_over_fsdp2.tokens_per_s_bf16", (m.get("ours_over_fsdp2") or {}).get("tokens_per_s_bf16"))):
        if not isinstance(value, (int, float)) or not value > 0:
            problems.append(f"metrics.{name} is {value!r}, not a positive number")
    if m.get("two_ranks_one_gpu_equal_world1") is not True:
        problems.append(f"two_ranks_one_gpu_equal_world1 is {m.get('two_ranks_one_gpu_equal_world1')!r}")
    rounds = (r.get("large_model") or {}).get("rounds") or []
    if len(rounds) != 2 or any(not all(x.get(k, 0) > 0 for k in ("ours", "plain", "fsdp2")) for x in rounds):
        problems.append(f"large_model rounds {rounds!r}: expected 2, each with ours, plain and fsdp2 tokens/s")
    maxm = [x for x in ((r.get("max_model") or {}).get("modes") or []) if x.get("params", 0) > 0]
    if len(maxm) != 2:
        problems.append(f"max_model modes {(r.get('max_model') or {}).get('modes')!r}: expected plain and "
                        "offload_param=cpu, each with the parameters it trained")
    # The test phases' cases, from the binaries' JUnit files: every case of test-cuda skips on
    # the CPU, saying why; test-cpu's pass.
    tests = r.get("tests") or {}
    for key, want in (("cuda", "skipped"), ("cpu", "passed")):
        t = tests.get(key) or {}
        if not t.get("cases") or t.get(want, 0) == 0 or t.get("failed", 0) != 0:
            problems.append(f"tests.{key}: {dict((k, t.get(k)) for k in ('passed', 'failed', 'skipped'))}: "
                            f"expected cases, some {want} and none failed")
    dated = os.path.join(out, f"gpu-check-{r.get('started', '')[:10]}.json")
    try:
        with open(dated) as f:
            if json.load(f) != r:
                problems.append(f"{dated} differs from results.json")
    except (OSError, ValueError) as e:
        problems.append(f"{dated}: {e}")
    problems += second_call(args.build, out + "-max-model")
    for x in problems:
        print("FAIL: " + x)
    if problems:
        return 1
    print(f"ok: every phase of the GPU check ran on the CPU ({len(PHASES)} phases; results in {out}); "
          f"gpu_mfu {m['gpu_mfu']:.4g} (nominal peak), ours_over_fsdp2.tokens_per_s_bf16 "
          f"{m['ours_over_fsdp2']['tokens_per_s_bf16']:.3f}")
    if not args.out:
        subprocess.run(["rm", "-rf", out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
