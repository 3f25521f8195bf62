// The probe's plain CUDA helpers (probe_kernels.cu): random inputs, kiln's BatchNorm statistics
// pass (the kernel a training step runs, from bn_stats.cuh) and the comparisons.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kiln::probe {

// p[i] uniform in [lo, hi), rounded to FP16, from a counter-based hash of (seed, i).
cudaError_t fill_uniform(__half* p, int64_t count, float lo, float hi, uint64_t seed,
                         cudaStream_t s);

// kiln's statistics pass over z [rows][c] (FP16): double partials [blocks][c] of sum z and
// sum z^2 into `partial` (kiln_stats_bytes of it). Needs c % 8 == 0 and 256 % (c / 8) == 0,
// as BatchNorm's vector path does.
size_t kiln_stats_bytes(int64_t rows, int64_t c, int sm_count);
cudaError_t kiln_stats(const __half* z, int64_t rows, int64_t c, int sm_count, void* partial,
                       cudaStream_t s);
// The partials' column sums (double2 per channel: sum, sum of squares), for the comparison.
cudaError_t kiln_stats_total(const void* partial, int64_t rows, int64_t c, int sm_count,
                             double2* total, cudaStream_t s);

// Over count elements: the largest |a - b|, and how many exceed abs_tol + rel_tol * |b|
// (result[0] as a float's bits, result[1] the count; both zeroed here first).
cudaError_t compare_half(const __half* a, const __half* b, int64_t count, float rel_tol,
                         float abs_tol, unsigned long long* result, cudaStream_t s);

}  // namespace kiln::probe
