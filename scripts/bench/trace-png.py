#!/usr/bin/env python3
"""Renders merged per-unit traces (fsdp-trace merge) to a PNG timeline: one panel per
trace, one row per track lane of each rank (and per nesting depth inside it), spans coloured by kind, labelled where they
are wide enough.

  trace-png.py OUT.png TRACE.json[:TITLE] [TRACE.json[:TITLE] ...]
               [--step N] [--ranks 0,1] [--title TEXT]

--step N shows the span "train step N" of each trace (train_gpt --trace writes one per
step), its start at 0; without it the whole trace is shown. Needs matplotlib (the
project's .venv has it: scripts/requirements.txt).
"""
import argparse
import json
import sys

COLOURS = {
    "all_gather": "#4c72b0",
    "reduce_scatter": "#dd8452",
    "all_reduce": "#937860",
    "forward": "#55a868",
    "recompute": "#8fd19e",
    "backward": "#c44e52",
    "wait": "#222222",
    "bubble": "#f2c744",
    "optimizer": "#8172b3",
    "clip_grad_norm": "#b3a2e0",
    "checkpoint": "#da8bc3",
    "end": "#999999",
    "train": "#e8e8e8",
}


def colour(name, cat):
    if cat in ("wait", "bubble"):
        return COLOURS[cat]
    for key, c in COLOURS.items():
        if name.startswith(key):
            return c
    return "#cccccc"


def load(path, step, ranks):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    lanes = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and (ranks is None or e["pid"] in ranks)]
    t0, t1 = 0.0, max((e["ts"] + e["dur"] for e in spans), default=1.0)
    if step is not None:
        want = f"train step {step}"
        frame = [e for e in spans if e["name"] == want and e["pid"] == min(x["pid"] for x in spans)]
        if not frame:
            sys.exit(f"trace-png.py: no span '{want}' in {path}; run train_gpt --trace with at least {step} steps")
        t0, t1 = frame[0]["ts"], frame[0]["ts"] + frame[0]["dur"]
        spans = [e for e in spans if e["ts"] + e["dur"] > t0 and e["ts"] < t1]
    return spans, lanes, t0, t1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("traces", nargs="+", help="TRACE.json or TRACE.json:TITLE")
    p.add_argument("--step", type=int)
    p.add_argument("--ranks", help="comma-separated ranks to show (default all)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        sys.exit(f"trace-png.py: matplotlib is needed ({e}); use the project's .venv (scripts/setup.sh)")
    ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
    panels = []
    for item in args.traces:
        path, _, title = item.partition(":")
        panels.append((load(path, args.step, ranks), title or path))
    width = max(t1 - t0 for (_, _, t0, t1), _ in panels)
    rows_per = []
    for (spans, lanes, _, _), _ in panels:
        # Nested spans of a lane go on rows below it, one per depth.
        stacks = {}
        for e in sorted(spans, key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"])):
            stack = stacks.setdefault((e["pid"], e["tid"]), [])
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            e["_depth"] = len(stack)
            stack.append(e["ts"] + e["dur"])
        rows = sorted({(e["pid"], e["tid"], e["_depth"]) for e in spans})
        rows_per.append(rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.2 + 0.3 * sum(len(r) for r in rows_per)),
                             squeeze=False, gridspec_kw={"height_ratios": [max(1, len(r)) for r in rows_per]})
    for ax, ((spans, lanes, t0, t1), title), rows in zip(axes[:, 0], panels, rows_per):
        index = {r: i for i, r in enumerate(rows)}
        for e in spans:
            y = index[(e["pid"], e["tid"], e["_depth"])]
            x0 = (max(e["ts"], t0) - t0) / 1e3
            w = (min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) / 1e3
            ax.barh(y, w, left=x0, height=0.8, color=colour(e["name"], e.get("cat", "")),
                    edgecolor="white", linewidth=0.3)
            if w > width / 1e3 * 0.04 and e.get("cat") not in ("wait", "bubble"):
                ax.text(x0 + w / 2, y, e["name"].replace("all_gather ", "AG ").replace("reduce_scatter ", "RS "),
                        ha="center", va="center", fontsize=6, clip_on=True)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"rank {pid} {lanes.get((pid, tid), tid)}" if d == 0 else "" for pid, tid, d in rows],
                           fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, width / 1e3)
        ax.set_title(f"{title}: {(t1 - t0) / 1e3:.1f} ms", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    legend = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    top = 0.95 if args.title else 0.97
    if args.title:
        fig.suptitle(args.title, y=0.995, fontsize=10)
    fig.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, top + 0.01), ncol=len(legend),
               fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top - 0.02))
    fig.savefig(args.out, dpi=130)
    print(f"trace-png.py: wrote {args.out}")


if __name__ == "__main__":
    main()
