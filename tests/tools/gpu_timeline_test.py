#!/usr/bin/env python3
"""bench/gpu_timeline.py on a small nsys cuda_gpu_trace CSV written here: busy and idle time
as the union of activity over streams, overlap, copies apart from kernels, kernel time by kind,
the idle gaps with their neighbours, and a clear error for a file that is not such a trace; and
on a CSV as tools/cupti_trace.cpp writes it. Run by ctest."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_timeline.py")

# nsys stats prints a title line before the CSV. Two steps: kernels A and B overlap on two
# streams (0-1.5 ms busy), 0.5 ms idle, a copy (2-3 ms), then kernel D (3-4 ms).
TRACE = '''Processing [trace.sqlite] with [cuda_gpu_trace.py]...
"Start (ns)","Duration (ns)","CorrId","GrdX","Strm","Name"
"1,000,000","1,000,000","1","1","7","kernel_A"
"1,500,000","1,000,000","2","1","14","kernel_B"
"3,000,000","1,000,000","3","","7","[CUDA memcpy Host-to-Device]"
"4,000,000","1,000,000","4","1","7","void kiln::bn::bwd_dx_vec<__half>(int)"
'''


def run(path, *extra):
    return subprocess.run([sys.executable, SCRIPT, path, *extra], capture_output=True, text=True)


def expect(cond, what, out):
    if not cond:
        print(f"gpu_timeline_test: {what}\n--- output ---\n{out}")
        sys.exit(1)


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.csv")
        with open(path, "w") as f:
            f.write(TRACE)
        r = run(path, "--steps", "2")
        out = r.stdout + r.stderr
        expect(r.returncode == 0, "exit status", out)
        # Per step: span 4 ms / 2, busy (1.5 + 2) / 2, idle 0.5 / 2.
        expect("span 2.00 ms, GPU busy 1.75 ms, idle 0.25 ms (12.5%)" in out, "span / busy / idle", out)
        expect("kernels 1.50 ms, copies 0.50, memsets 0.00" in out, "activity by kind", out)
        expect("= 1.14x the busy time" in out, "overlap", out)
        expect("7 1.50, 14 0.50" in out, "per stream", out)
        expect("500.0  kernel_B  ->  [CUDA memcpy Host-to-Device]" in out, "the gap and its neighbours", out)
        expect("0.500    0.5x  kernel_A" in out, "heaviest kernels", out)
        expect("by kind (ms / step, summed over streams): other 1.00, BatchNorm 0.50" in out, "kernel kinds", out)
        expect("of kind 'other' (name them in kernel_breakdown.py's KINDS): 0.50 ms kernel_" in out, "unnamed kinds", out)

        # tools/cupti_trace.cpp's CSV: no title line, plain numbers, names quoted where needed.
        cupti = os.path.join(d, "cupti.csv")
        with open(cupti, "w") as f:
            f.write('Start (ns),Duration (ns),Strm,Name\n1000,500,7,"void k<int, 2>(int)"\n2000,500,7,kernel_B\n')
        r = run(cupti, "--steps", "1")
        out = r.stdout + r.stderr
        expect(r.returncode == 0 and "span 0.00 ms" in out and "void k<int, 2>(int)" in out, "the CUPTI trace", out)

        # Phases: step 1 (conv 0-1 ms, loss 1-1.1, dgrad 1.2-2.2, sgd 2.3-2.5), step 2 alike from
        # 3 ms; the mean is over steps after the first: forward 1.1, backward 1.0 (1.2-2.2 of
        # 1.1-2.3), optimizer 0.2 (2.3-2.5; the window runs to the trace's end).
        steps = os.path.join(d, "steps.csv")
        with open(steps, "w") as f:
            f.write("Start (ns),Duration (ns),Strm,Name\n")
            for t0 in (0, 3000000):
                f.write(f"{t0},1000000,7,sm90_xmma_fprop_implicit_gemm\n")
                f.write(f"{t0 + 1000000},100000,7,softmax_ce_rows\n")
                f.write(f"{t0 + 1200000},1000000,7,sm90_xmma_dgrad_implicit_gemm\n")
                f.write(f"{t0 + 2300000},200000,7,sgd_kernel\n")
        r = run(steps, "--steps", "2")
        out = r.stdout + r.stderr
        expect("per phase (ms, busy, mean of 1 step(s)): forward 1.10, backward 1.00, optimizer and AMP casts 0.20" in out,
               "phases", out)

        bad = os.path.join(d, "bad.csv")
        with open(bad, "w") as f:
            f.write('"ID","Kernel Name","gpu__time_duration.sum"\n"0","k","1"\n')
        r = run(bad, "--steps", "1")
        expect(r.returncode == 1 and "cuda_gpu_trace" in r.stderr and not r.stdout, "error for a non-trace", r.stderr)
        r = run(path, "--steps", "0")
        expect(r.returncode == 2 and "--steps" in r.stderr, "error for --steps 0", r.stderr)
    print("gpu_timeline: ok")


if __name__ == "__main__":
    main()
