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

// kiln's BatchNorm-backward sums pass (bn_kernels.cuh's bwd_partial_vec, as a training step
// runs it for BN+add+ReLU or a CBR) over x = z, dy = dx [+ dy2] where mask passes it: double
// partials [blocks][c] of sum g and sum g (z - mean), the same size and layout as
// kiln_stats's (kiln_stats_total adds them up).
cudaError_t kiln_bwd_sums(const __half* z, const __half* dx, const __half* dy2, const uint8_t* mask,
                          const float* mean, int64_t rows, int64_t c, int sm_count, void* partial,
                          cudaStream_t s);
// g = mask ? round16(dx [+ dy2]) : 0, as kiln's BatchNorm backward forms it (the reference the
// fused kernel's g is compared with).
cudaError_t masked_grad(const __half* dx, const __half* dy2, const uint8_t* mask, int64_t count,
                        __half* g, cudaStream_t s);
// Random mask bytes (a counter-based hash of (seed, i)).
cudaError_t fill_bytes(uint8_t* p, int64_t count, uint64_t seed, cudaStream_t s);

// kiln's CBR forward apply pass (bn_kernels.cuh's apply_group with the ReLU, as a training step
// runs it): y = relu(round16((z - mean) * scale + beta)) and its bit mask, coef [c] = (mean,
// scale, beta, -). Needs c % 8 == 0 and 256 % (c / 8) == 0.
cudaError_t kiln_apply_relu(const __half* z, const float4* coef, int64_t rows, int64_t c,
                            int sm_count, __half* y, uint8_t* mask, cudaStream_t s);

// kiln's BatchNorm-backward dx pass (bn_kernels.cuh's bwd_dx_group, as a training step runs it
// on an already-masked g): dz = round16(coef.y (g - coef.z - (z - coef.x) coef.w)), coef [c] as
// bwd_dx_group takes it. Needs c % 8 == 0 and 256 % (c / 8) == 0.
cudaError_t kiln_bn_dx(const __half* z, const __half* g, const float4* coef, int64_t rows,
                       int64_t c, int sm_count, __half* dz, cudaStream_t s);

// Over count elements: the largest |a - b|, and how many exceed abs_tol + rel_tol * |b|
// (result[0] as a float's bits, result[1] the count; both zeroed here first).
cudaError_t compare_half(const __half* a, const __half* b, int64_t count, float rel_tol,
                         float abs_tol, unsigned long long* result, cudaStream_t s);

}  // namespace kiln::probe
