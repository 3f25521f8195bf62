#!/usr/bin/env python3
"""bench/kernel_breakdown.py on a small ncu raw CSV written here: kernels land in their kinds,
times are per step, units rows and malformed input are handled. Run by ctest."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernel_breakdown.py")

CSV = '''"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"
"","","nsecond","byte","byte"
"0","void kiln::<unnamed>::apply_group<__half, true>(const __half *)","2,000,000","4000000000","2000000000"
"1","sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize","3,000,000","100","100"
"2","void kiln::<unnamed>::add_vec<__half>(const __half *)","1,000,000","0","0"
"3","nvjet_sm90_hsh_128x128_64x6_2x1_v_bz_splitK_NTT","1,000,000","0","0"
"4","kiln::<unnamed>::sgd_kernel(float *)","500,000","0","0"
"5","some_unknown_kernel","500,000","0","0"
"6","void kiln::<unnamed>::apply_group<__half, true>(const __half *)","2,000,000","4000000000","2000000000"
"7","sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize","3,000,000","100","100"
'''


def run(path, *extra):
    return subprocess.run([sys.executable, SCRIPT, path, *extra], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ncu.csv")
        with open(path, "w") as f:
            f.write(CSV)
        r = run(path, "--steps", "2")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        # 13 ms of kernels over 2 steps.
        assert "GPU time per step: 6.50 ms" in out, out
        assert "| convolutions and GEMMs | 3.50 |" in out, out  # (3 + 1 + 3) / 2
        assert "| BatchNorm | 2.00 |" in out, out
        assert "| residual add / gradient sum | 0.50 |" in out, out
        assert "| optimizer / AMP | 0.25 |" in out, out
        assert "| other | 0.25 |" in out, out
        # apply_group: 6e9 bytes in 2e6 ns per launch -> 3000 GB/s.
        assert "3000  void kiln::<unnamed>::apply_group<__half, true>" in out, out
        bad = os.path.join(d, "bad.csv")
        with open(bad, "w") as f:
            f.write("a,b\n1,2\n")
        r = run(bad, "--steps", "1")
        assert r.returncode != 0 and "Kernel Name" in r.stderr, r
        r = run(path, "--steps", "0")
        assert r.returncode != 0, r
        # ncu's scaled units: microseconds and megabytes read the same.
        scaled = os.path.join(d, "scaled.csv")
        with open(scaled, "w") as f:
            f.write('''"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"
"","","usecond","Mbyte","Mbyte"
"0","kiln::<unnamed>::sgd_kernel(float *)","1,500","3,000","1,500"
''')
        r = run(scaled, "--steps", "1")
        assert r.returncode == 0, r.stderr
        assert "GPU time per step: 1.50 ms" in r.stdout and "3000  kiln::<unnamed>::sgd_kernel" in r.stdout, r.stdout
    print("kernel_breakdown: ok")


if __name__ == "__main__":
    main()
