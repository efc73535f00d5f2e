"""DeepSpeed's WarmupLR and WarmupDecayLR rates, for test_deepspeed_config to compare with
fsdp::WarmupSchedule. Prints one line per case: RATES <name> <rate of optimizer step 0> ...
(the rate DeepSpeed's engine uses at each step: the scheduler is built, then stepped after
each optimizer step). Exits 77 where deepspeed does not import."""
import sys

try:
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR, WarmupDecayLR
except Exception as e:  # noqa: BLE001
    print(f"deepspeed_lr: SKIP: deepspeed does not import ({e})")
    sys.exit(77)


def rates(cls, n, **kw):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    s = cls(opt, **kw)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(n - 1):
        s.step()
        out.append(opt.param_groups[0]["lr"])
    return out


# name, class, steps, min, max, warmup, type, total (0: WarmupLR); the C++ side builds the
# same schedules from these fields.
CASES = [
    ("warmup_log", WarmupLR, 8, 1e-4, 3e-3, 5, "log", 0),
    ("warmup_linear", WarmupLR, 8, 1e-4, 3e-3, 5, "linear", 0),
    ("warmup_one_step", WarmupLR, 4, 0.0, 1e-3, 1, "log", 0),
    ("decay_log", WarmupDecayLR, 12, 0.0, 3e-3, 4, "log", 10),
    ("decay_linear", WarmupDecayLR, 12, 1e-5, 2e-3, 3, "linear", 10),
    ("decay_long", WarmupDecayLR, 40, 1e-6, 5e-4, 7, "log", 33),
]
for name, cls, n, lo, hi, warm, kind, total in CASES:
    kw = dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=warm, warmup_type=kind)
    if total:
        kw["total_num_steps"] = total
    r = rates(cls, n, **kw)
    print("RATES", name, lo, hi, warm, kind, total, " ".join(repr(x) for x in r))
