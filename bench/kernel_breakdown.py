#!/usr/bin/env python3
"""Where a training step's GPU time goes, by kernel kind (issue 5, SPEC Q3's breakdown).

Reads Nsight Compute's raw CSV (`ncu --csv --page raw --metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum`) of `kiln bench ...
--cuda-profiler-range` under `ncu --profile-from-start off`, which profiles the timed steps
only, and prints milliseconds per step for each kind of kernel - convolutions and GEMMs,
BatchNorm, residual adds, ReLU, pooling, optimizer and AMP, ... - then the heaviest kernels
with their achieved DRAM bandwidth. `scripts/gpu-check.sh kernels` runs it.

  python3 bench/kernel_breakdown.py ncu.csv --steps 2 [--top 25]
"""
import argparse
import collections
import csv
import re
import sys

# First match wins; the patterns are kernel-name fragments: kiln's own kernels by their names
# in src/backend/cuda, PyTorch's (ATen, as traced by gpu_timeline.py for SPEC Q3's side of the
# comparison) by their functors, cuDNN's and cuBLAS's by their families. apply_relu_pool is
# BatchNorm's apply pass with a max-pool folded in (cbr_pool_fwd): counted as BatchNorm.
KINDS = [
    ("BatchNorm", r"stats_partial|stats_finalize|sums_to_partial|apply_group|apply_kernel|apply_relu_mask|"
                  r"bwd_partial|bwd_finalize|bwd_dx|fwd_coef|bwd_coef|infer_kernel|local_stats|bwd_local|"
                  r"combine_kernel|batchnorm|batch_norm|apply_relu_pool"),
    ("residual add / gradient sum", r"\badd_vec|\badd_kernel|CUDAFunctor_add"),
    # PyTorch: ReLU forward is clamp_min (launch_clamp_scalar), its backward threshold_backward.
    ("ReLU", r"relu_fwd|relu_bwd|clamp_scalar|threshold"),
    ("pooling", r"maxpool|avgpool|gap_fwd|gap_bwd|max_pool|avg_pool|adaptive_avg"),
    ("channel padding", r"pad_channels_kernel|unpad_channels_kernel"),
    # PyTorch: a conv / linear bias's gradient is a sum over the batch (reduce_kernel); in these
    # models nothing else reduces a tensor in a step.
    ("conv bias", r"bias_add_kernel|channel_partial_kernel|channel_finalize_kernel|reduce_kernel"),
    ("loss", r"softmax_ce|log_softmax|nll_loss|cross_entropy"),
    # PyTorch: the fused SGD, GradScaler's checks and autocast's FP32 -> FP16 weight copies.
    ("optimizer / AMP", r"sgd_kernel|adamw_kernel|lars_|ema_kernel|cast_|check_clip|check_finish|"
                        r"loss_scale_update|fill_kernel|multi_tensor_apply|fused_sgd|FusedSgd|_amp_|"
                        r"non_finite|unscale|copy_kernel"),
    ("dropout", r"dropout_"),
    ("convolutions and GEMMs", r"xmma|nvjet|cutlass|gemm|implicit|splitKreduce|cudnn|conv|wgrad|dgrad|fprop|"
                               r"nhwcAddPadding|nchwToNhwc|nhwcToNchw"),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def number(text):
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_rows(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header is None:
        sys.exit(f"{path}: no 'Kernel Name' column; is this ncu --csv --page raw output?")
    h = rows[header]
    need = ["Kernel Name", "gpu__time_duration.sum"]
    for column in need:
        if column not in h:
            sys.exit(f"{path}: no '{column}' column; run ncu with --metrics gpu__time_duration.sum")
    name_i, time_i = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    read_i = h.index("dram__bytes_read.sum") if "dram__bytes_read.sum" in h else None
    write_i = h.index("dram__bytes_write.sum") if "dram__bytes_write.sum" in h else None
    # The row after the header holds the units (ncu scales them unless --print-units base):
    # times become nanoseconds, sizes bytes.
    units = rows[header + 1] if len(rows) > header + 1 else []
    scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "byte": 1.0, "Kbyte": 1e3,
             "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6, "GB": 1e9}

    def factor(i, default):
        return scale.get(units[i].strip(), default) if i is not None and i < len(units) else default

    t_scale, r_scale, w_scale = factor(time_i, 1.0), factor(read_i, 1.0), factor(write_i, 1.0)
    out = []
    for r in rows[header + 1:]:
        if len(r) <= max(name_i, time_i) or not r[time_i] or not re.match(r"[\d.,]+$", r[time_i].strip()):
            continue
        nbytes = (number(r[read_i]) * r_scale if read_i is not None else 0.0) + \
                 (number(r[write_i]) * w_scale if write_i is not None else 0.0)
        out.append((r[name_i], number(r[time_i]) * t_scale, nbytes))
    return out


def breakdown(rows, steps):
    kinds = collections.defaultdict(lambda: [0, 0.0])
    kernels = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, ns, nbytes in rows:
        short = re.sub(r"\(.*", "", name).strip()[:80]
        k = kinds[kind_of(name)]
        k[0] += 1
        k[1] += ns
        e = kernels[short]
        e[0] += 1
        e[1] += ns
        e[2] += nbytes
    total = sum(k[1] for k in kinds.values())
    return total / steps / 1e6, {n: (c / steps, ns / steps / 1e6) for n, (c, ns) in kinds.items()}, kernels


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--steps", type=int, required=True, help="training steps the profile covers")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    if args.steps < 1:
        sys.exit("--steps must be >= 1")
    rows = read_rows(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no kernel rows")
    total_ms, kinds, kernels = breakdown(rows, args.steps)
    print(f"GPU time per step: {total_ms:.2f} ms over {len(rows) / args.steps:.0f} kernels ({args.steps} steps profiled)")
    print("| kind | ms / step | share | kernels / step |")
    print("|---|---|---|---|")
    for name, (count, ms) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {ms:.2f} | {100 * ms / total_ms:.1f}% | {count:.0f} |")
    print()
    print(f"heaviest kernels (ms / step, launches / step, achieved DRAM GB/s):")
    for name, (count, ns, nbytes) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{ns / args.steps / 1e6:9.3f} {count / args.steps:6.0f}x {nbytes / max(ns, 1):7.0f}  {name}")


if __name__ == "__main__":
    main()
