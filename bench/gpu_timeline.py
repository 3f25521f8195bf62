#!/usr/bin/env python3
"""Where a training step's wall time goes on the GPU timeline: busy, idle, and the gaps between.

kernel_breakdown.py sums kernel durations from Nsight Compute, which replays each kernel alone;
a measured step is longer (VGG16-BN AMP on the H200: 53.4 ms of kernels, 60 ms a step). This
reads a trace of the real run - tools/cupti_trace.cpp's CSV (the H200 has no Nsight Systems), or
`nsys stats --report cuda_gpu_trace --format csv` of `nsys profile
--capture-range=cudaProfilerApi kiln bench ... --cuda-profiler-range`, in the same columns - and
prints, per step: the span, the time at least one kernel, copy or memset was running (busy),
the time nothing was (idle), how much of the busy time overlapped, the copies and memsets,
the busy time per phase (forward to the loss, backward to the optimizer, optimizer and AMP
casts to the next step's first convolution), the
largest idle gaps with what ran either side of them, and the heaviest kernels as they ran (to
compare with the ncu replay's durations). `scripts/gpu-check.sh timeline` runs it.

  python3 bench/gpu_timeline.py trace.csv --steps 5 [--top 10]
"""
import argparse
import collections
import csv
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_breakdown import kind_of  # noqa: E402  (one list of kernel kinds for both reports)


def column(header, *prefixes):
    for i, h in enumerate(header):
        for p in prefixes:
            if h.strip().lower().startswith(p):
                return i
    return -1


def read_trace(path):
    """(start_ns, end_ns, stream, name) for every GPU activity, sorted by start."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # nsys stats may print lines before the CSV header: find the header row.
    for h, header in enumerate(rows):
        if column(header, "start") >= 0 and column(header, "duration") >= 0 and column(header, "name") >= 0:
            break
    else:
        raise ValueError(f"{path}: no 'Start', 'Duration' and 'Name' columns: is it "
                         "`nsys stats --report cuda_gpu_trace --format csv` output?")
    i_start, i_dur = column(header, "start"), column(header, "duration")
    i_name, i_strm = column(header, "name"), column(header, "strm", "stream")
    events = []
    for row in rows[h + 1:]:
        if len(row) <= max(i_start, i_dur, i_name):
            continue
        try:
            start = float(row[i_start].replace(",", ""))
            dur = float(row[i_dur].replace(",", ""))
        except ValueError:
            continue
        stream = row[i_strm] if i_strm >= 0 and i_strm < len(row) else "?"
        events.append((start, start + dur, stream, row[i_name]))
    if not events:
        raise ValueError(f"{path}: no GPU activity rows")
    events.sort()
    return events


def kind(name):
    n = name.lower()
    if "memcpy" in n:
        return "copy"
    if "memset" in n:
        return "memset"
    return "kernel"


# The optimizer's first kernels, kiln's and PyTorch's: they end the backward phase.
OPTIMIZER = re.compile(r"sgd|adamw|lars_|multi_tensor_apply|check_clip|non_finite|unscale")


def busy_in(events, lo, hi):
    """The time in [lo, hi) during which some activity ran."""
    spans = sorted((max(s, lo), min(e, hi)) for s, e, _, _ in events if s < hi and e > lo)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (cur_e - cur_s if cur_e is not None else 0.0)


def phases(events):
    """Per step, the busy time of forward (to the end of the loss's first kernel), backward (to
    the optimizer's first kernel) and optimizer + AMP casts (to the next step's first
    convolution), averaged over the steps after the first (whose forward holds the range's
    start) when there are several; None when the trace has no loss kernel."""
    losses = [e for e in events if kind_of(e[3]) == "loss"]
    if not losses:
        return None
    bounds = []  # (step start, forward end, backward end)
    start, i = events[0][0], 0
    while i < len(losses):
        fwd_end = losses[i][1]
        while i < len(losses) and losses[i][0] <= fwd_end + 1e6:  # the step's other loss kernels
            i += 1
        opt = next((e[0] for e in events if e[0] >= fwd_end and OPTIMIZER.search(e[3])), None)
        if opt is None:
            break
        bounds.append((start, fwd_end, opt))
        start = next((e[0] for e in events if e[0] > opt and kind_of(e[3]) == "convolutions and GEMMs"),
                     max(e[1] for e in events))
    if not bounds:
        return None
    ends = [b[0] for b in bounds[1:]] + [start]
    rows = [(busy_in(events, s, f), busy_in(events, f, o), busy_in(events, o, end))
            for (s, f, o), end in zip(bounds, ends)]
    use = rows[1:] if len(rows) > 1 else rows
    return [sum(r[j] for r in use) / len(use) for j in range(3)], len(use)


def analyse(events, steps, top):
    span_start = events[0][0]
    span_end = max(e[1] for e in events)
    span = span_end - span_start
    busy = 0.0
    gaps = []  # (length, end of what ran before, start of what runs next, name before, name after)
    cur_start, cur_end, last_name = events[0][0], events[0][1], events[0][3]
    for start, end, _, name in events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, last_name, name))
            cur_start, cur_end = start, end
        if end >= cur_end:
            cur_end, last_name = end, name
    busy += cur_end - cur_start
    by_kind = collections.Counter()
    by_stream = collections.Counter()
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_family = collections.Counter()
    for start, end, stream, name in events:
        k = kind(name)
        by_kind[k] += end - start
        by_stream[stream] += end - start
        if k == "kernel":
            by_kernel[name][0] += end - start
            by_kernel[name][1] += 1
            by_family[kind_of(name)] += end - start
    ms = 1e-6 / steps
    out = []
    out.append(f"per step over {steps} steps: span {span * ms:.2f} ms, GPU busy {busy * ms:.2f} ms, "
               f"idle {(span - busy) * ms:.2f} ms ({100 * (span - busy) / span:.1f}%)")
    total = sum(by_kind.values())
    out.append(f"activity per step: kernels {by_kind['kernel'] * ms:.2f} ms, copies {by_kind['copy'] * ms:.2f}, "
               f"memsets {by_kind['memset'] * ms:.2f}; summed over streams {total * ms:.2f} ms "
               f"= {total / busy:.2f}x the busy time (overlap)")
    out.append("per stream (ms / step): " + ", ".join(
        f"{s} {t * ms:.2f}" for s, t in sorted(by_stream.items(), key=lambda kv: -kv[1])))
    out.append("kernel time by kind (ms / step, summed over streams): " + ", ".join(
        f"{k} {t * ms:.2f}" for k, t in sorted(by_family.items(), key=lambda kv: -kv[1])))
    split = phases(events)
    if split:
        (f, b, o), n = split
        out.append(f"per phase (ms, busy, mean of {n} step(s)): forward {f * 1e-6:.2f}, backward {b * 1e-6:.2f}, "
                   f"optimizer and AMP casts {o * 1e-6:.2f}")
    others = sorted(((t, n) for n, (t, c) in by_kernel.items() if kind_of(n) == "other"), reverse=True)[:3]
    if others:
        out.append("heaviest kernels of kind 'other' (name them in kernel_breakdown.py's KINDS): " + "; ".join(
            f"{t * ms:.2f} ms {n[:150]}" for t, n in others))
    small = [g for g in gaps if g[0] < 20e3]
    out.append(f"idle gaps: {len(gaps) / steps:.0f} a step; those under 20 us add up to "
               f"{sum(g[0] for g in small) * ms:.2f} ms, the {len(gaps) - len(small)} longer ones to "
               f"{sum(g[0] for g in gaps if g[0] >= 20e3) * ms:.2f} ms")
    out.append("")
    out.append(f"longest idle gaps (us, what ended before it -> what started after):")
    for length, before, after in sorted(gaps, reverse=True)[:top]:
        out.append(f"  {length / 1e3:9.1f}  {before[:60]}  ->  {after[:60]}")
    out.append("")
    out.append("heaviest kernels as run (ms / step, launches / step):")
    for name, (t, c) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"  {t * ms:8.3f} {c / steps:6.1f}x  {name[:90]}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="tools/cupti_trace.cpp's CSV, or nsys stats --report cuda_gpu_trace --format csv output")
    ap.add_argument("--steps", type=int, required=True, help="training steps inside the profiled range")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    if a.steps < 1:
        print("gpu_timeline: --steps must be at least 1", file=sys.stderr)
        return 2
    try:
        events = read_trace(a.trace)
    except (OSError, ValueError) as e:
        print(f"gpu_timeline: {e}", file=sys.stderr)
        return 1
    print(analyse(events, a.steps, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
