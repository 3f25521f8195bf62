#!/usr/bin/env python3
"""Where a training step's wall time goes on the GPU timeline: busy, idle, and the gaps between.

kernel_breakdown.py sums kernel durations from Nsight Compute, which replays each kernel alone;
a measured step is longer (VGG16-BN AMP on the H200: 53.4 ms of kernels, 60 ms a step). This
reads a trace of the real run - tools/cupti_trace.cpp's CSV (the H200 has no Nsight Systems), or
`nsys stats --report cuda_gpu_trace --format csv` of `nsys profile
--capture-range=cudaProfilerApi kiln bench ... --cuda-profiler-range`, in the same columns - and
prints, per step: the span, the time at least one kernel, copy or memset was running (busy),
the time nothing was (idle), how much of the busy time overlapped, the copies and memsets, the
largest idle gaps with what ran either side of them, and the heaviest kernels as they ran (to
compare with the ncu replay's durations). `scripts/gpu-check.sh timeline` runs it.

  python3 bench/gpu_timeline.py trace.csv --steps 5 [--top 10]
"""
import argparse
import collections
import csv
import os
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
