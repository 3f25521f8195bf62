// kiln_cutlass_probe --fold-dgrad: does the 1x1 data gradient with BatchNorm's dx pass folded
// into its operand load (src/backend/cuda/fold_dgrad.h) beat today's pair, the dx pass then the
// SM90 data gradient that reads the dz it wrote?
//
// For each of ResNet-50's 1x1 stride-1 data gradients (batch 256 by default; FP16 NHWC, KRSC
// filter), on the same random inputs in one process:
//   (a) kiln's dx pass (bn_kernels.cuh's bwd_dx_group over g and z: dz), then the backend's SM90
//       data gradient (dgrad_bn.h, the atomic unit the step takes) of dz, with the previous
//       BatchNorm's mask and sums in its epilogue;
//   (b) fold_dgrad: g and z in, dz (for the weight gradient), g' and the sums out, one launch
//       (plus clearing the sums), with 32- and with 64-deep chunks, and the faster without
//       writing dz.
// Checked: (b)'s dz bit for bit against (a)'s, g' against (a)'s to the rounding of two FP32
// sums of the same products, the sums against kiln's double sums of (b)'s own g'.
#include <cuda_fp16.h>

#include <cmath>
#include <random>

#include "backend/cuda/cutlass/dgrad_bn.h"
#include "backend/cuda/fold_dgrad.h"
#include "probe_common.h"
#include "probe_kernels.h"

namespace kiln::probe {
namespace {

struct Layer {
  const char* name;
  int count;        // such layers in one ResNet-50 step
  int64_t h, k, n;  // height = width; dz's channels (the folded BatchNorm's), dX's
  bool dy2;         // dX feeds a BN+add+ReLU (the residual path adds dy2), else a CBR
};

// dgrad_probe.cpp's 1x1 layers: each conv3 (bn3's dz folded; dX feeds bn2's CBR) and each conv1
// whose input is the previous block's output (bn1's dz; dX feeds the block's BN+add+ReLU).
const Layer kLayers[] = {
    {"conv3 56x56 256>64", 3, 56, 256, 64, false},
    {"conv3 28x28 512>128", 4, 28, 512, 128, false},
    {"conv3 14x14 1024>256", 6, 14, 1024, 256, false},
    {"conv3 7x7 2048>512", 3, 7, 2048, 512, false},
    {"conv1 56x56 64>256", 2, 56, 64, 256, true},
    {"conv1 28x28 128>512", 3, 28, 128, 512, true},
    {"conv1 14x14 256>1024", 5, 14, 256, 1024, true},
    {"conv1 7x7 512>2048", 2, 7, 512, 2048, true},
};

}  // namespace

int fold_dgrad_probe(cudaStream_t s, const cudaDeviceProp& prop, int64_t batch, int reps,
                     const std::string& shape) {
  const int sms = prop.multiProcessorCount;
  size_t zk_max = 0, zn_max = 0, w_max = 0, k_max = 0, n_max = 0, ws_max = 0, sums_ws = 0;
  for (const Layer& l : kLayers) {
    const int64_t m = batch * l.h * l.h;
    zk_max = std::max<size_t>(zk_max, m * l.k);
    zn_max = std::max<size_t>(zn_max, m * l.n);
    w_max = std::max<size_t>(w_max, l.k * l.n);
    k_max = std::max<size_t>(k_max, l.k);
    n_max = std::max<size_t>(n_max, l.n);
    sums_ws = std::max(sums_ws, kiln_stats_bytes(m, l.n, sms));
    sm90::DgradBn a;
    a.m = m, a.n = l.n, a.k = l.k, a.sm_count = sms;
    ws_max = std::max(ws_max, sm90::dgrad_bn_kernel_for(l.n, false, l.dy2).workspace(a));
  }
  auto* g = as_half(device_alloc(zk_max * 2));
  auto* z = as_half(device_alloc(zk_max * 2));
  auto* dza = as_half(device_alloc(zk_max * 2));
  auto* dzb = as_half(device_alloc(zk_max * 2));
  auto* w = as_half(device_alloc(w_max * 2));
  auto* zp = as_half(device_alloc(zn_max * 2));
  auto* dy2 = as_half(device_alloc(zn_max * 2));
  auto* ga = as_half(device_alloc(zn_max * 2));
  auto* gb = as_half(device_alloc(zn_max * 2));
  auto* mask = static_cast<uint8_t*>(device_alloc(zn_max / 8 + 8));
  auto* coef = static_cast<float4*>(device_alloc(k_max * sizeof(float4)));
  auto* mean = static_cast<float*>(device_alloc(n_max * sizeof(float)));
  auto* sa = static_cast<float*>(device_alloc(2 * n_max * sizeof(float)));
  auto* sb = static_cast<float*>(device_alloc(2 * n_max * sizeof(float)));
  void* ws = device_alloc(ws_max);
  void* partial = device_alloc(sums_ws);
  auto* ref = static_cast<double2*>(device_alloc(n_max * sizeof(double2)));
  auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));

  std::printf(
      "# %s (%d SMs), batch %lld, ResNet-50's 1x1 data gradients with BatchNorm's dx pass "
      "(a) before them, (b) folded in; median of %d runs (ms)\n",
      prop.name, sms, static_cast<long long>(batch), reps);
  std::printf(
      "| layer | per step | (a) dx pass | (a) SM90 dgrad | (a) total | (b) 32-deep | (b) 64-deep "
      "| (b) faster, without dz | (a) / faster (b) | dz bits off | max g' err | sum err "
      "| sum g'(z'-mean) err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool failed = false;
  double step_a = 0, step_b = 0;
  std::mt19937 rng(7);
  int64_t seed = 0;
  for (const Layer& l : kLayers) {
    ++seed;
    if (!shape.empty() && std::strstr(l.name, shape.c_str()) == nullptr) continue;
    const int64_t m = batch * l.h * l.h, zk = m * l.k, zn = m * l.n;
    const float wr = std::sqrt(3.0f / static_cast<float>(l.k));
    PROBE_CUDA(fill_uniform(g, zk, -1.0f, 1.0f, 10 * seed + 1, s));
    PROBE_CUDA(fill_uniform(z, zk, -1.0f, 3.0f, 10 * seed + 2, s));
    PROBE_CUDA(fill_uniform(w, l.k * l.n, -wr, wr, 10 * seed + 3, s));
    PROBE_CUDA(fill_uniform(zp, zn, -1.0f, 3.0f, 10 * seed + 4, s));
    PROBE_CUDA(fill_uniform(dy2, zn, -1.0f, 1.0f, 10 * seed + 5, s));
    PROBE_CUDA(fill_bytes(mask, (zn + 7) / 8, 10 * seed + 6, s));
    // The dx pass's coefficients as a step's finalize leaves them: (mean, k1 = gamma invstd,
    // mean of g, k3 = mean of g (z - mean) invstd^2), at unit-ish scales.
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float4> hc(static_cast<size_t>(l.k));
    for (float4& c : hc)
      c = make_float4(1.0f + 0.2f * u(rng), 1.0f + 0.5f * u(rng), 0.1f * u(rng), 0.3f * u(rng));
    PROBE_CUDA(
        cudaMemcpyAsync(coef, hc.data(), hc.size() * sizeof(float4), cudaMemcpyHostToDevice, s));
    std::vector<float> hm(static_cast<size_t>(l.n), 1.0f);
    PROBE_CUDA(
        cudaMemcpyAsync(mean, hm.data(), hm.size() * sizeof(float), cudaMemcpyHostToDevice, s));
    const __half* d2 = l.dy2 ? dy2 : nullptr;

    // (a)
    sm90::DgradBn a;
    a.m = m, a.n = l.n, a.k = l.k, a.sm_count = sms;
    a.dy = dza, a.w = w, a.z = zp, a.mask = mask, a.dy2 = d2, a.mean = mean, a.g = ga, a.sums = sa;
    const sm90::DgradBnKernel unit = sm90::dgrad_bn_kernel_for(l.n, false, l.dy2);
    if (const std::string why = unit.check(a); !why.empty()) {
      std::printf("| %s | the SM90 unit refuses it: %s |\n", l.name, why.c_str());
      failed = true;
      continue;
    }
    const auto dx_pass = [&] { return kiln_bn_dx(z, g, coef, m, l.k, sms, dza, s) == cudaSuccess; };
    const auto dgrad = [&] { return unit.run(a, ws, s).empty(); };
    if (!dx_pass()) {
      std::printf("| %s | the dx pass failed |\n", l.name);
      failed = true;
      continue;
    }
    if (const std::string err = run_and_wait(unit, a, ws, s); !err.empty()) {
      std::printf("| %s | the SM90 unit failed: %s |\n", l.name, err.c_str());
      failed = true;
      continue;
    }
    const float dx_ms = median_ms(s, reps, dx_pass);
    const float dgrad_ms = median_ms(s, reps, dgrad);
    const float a_ms = median_ms(s, reps, [&] { return dx_pass() && dgrad(); });

    // (b)
    cuda::FoldDgrad f;
    f.g = g, f.z = z, f.coef = coef, f.dz = dzb, f.w = w;
    f.z_prev = zp, f.mask_prev = mask, f.dy2 = d2, f.mean_prev = mean, f.g_prev = gb, f.sums = sb;
    f.m = m, f.k = l.k, f.n = l.n;
    if (const std::string why = cuda::fold_dgrad_refusal(f); !why.empty()) {
      std::printf("| %s | the folded kernel refuses it: %s |\n", l.name, why.c_str());
      failed = true;
      continue;
    }
    const auto folded = [&](const cuda::FoldDgrad& q, unsigned grid) {
      return cudaMemsetAsync(sb, 0, 2 * l.n * sizeof(float), s) == cudaSuccess &&
             cuda::launch_fold_dgrad(q, grid, s) == cudaSuccess;
    };
    // Each variant (32- and 64-deep chunks where k allows both), checked on its first run's
    // outputs, then timed; then the faster without writing dz.
    float best_ms = -1, v_ms[2] = {-1, -1};
    cuda::FoldDgrad best = f;
    unsigned best_grid = 0;
    unsigned long long dzc[2] = {0, 0}, gc[2] = {0, 0};
    float gerr = 0;
    BwdSumsError se;
    bool ok = true;
    for (int v = 0; v < 2; ++v) {
      cuda::FoldDgrad q = f;
      q.chunk = v == 0 ? 32 : 64;
      if (!cuda::fold_dgrad_refusal(q).empty()) continue;
      unsigned grid = 0;
      PROBE_CUDA(cuda::prepare_fold_dgrad(q, sms, &grid));
      PROBE_CUDA(cudaMemsetAsync(dzb, 0xFF, zk * 2, s));  // NaNs where nothing is written
      PROBE_CUDA(cudaMemsetAsync(gb, 0xFF, zn * 2, s));
      PROBE_CUDA(folded(q, grid) ? cudaSuccess : cudaErrorUnknown);
      PROBE_CUDA(cudaStreamSynchronize(s));
      unsigned long long dzv[2], gv[2];
      PROBE_CUDA(compare_half(dzb, dza, zk, 0.0f, 0.0f, cmp, s));
      PROBE_CUDA(cudaMemcpyAsync(dzv, cmp, sizeof dzv, cudaMemcpyDeviceToHost, s));
      // g': both round an FP32 sum of the same products once to FP16 (an ulp apart where their
      // orders differ), then add dy2 and round again: dgrad_probe.cpp's bounds.
      PROBE_CUDA(compare_half(gb, ga, zn, 0x1p-9f, 0x1p-8f, cmp, s));
      PROBE_CUDA(cudaMemcpyAsync(gv, cmp, sizeof gv, cudaMemcpyDeviceToHost, s));
      PROBE_CUDA(cudaStreamSynchronize(s));
      const BwdSumsError sv = bwd_sums_error(sb, zp, gb, mean, m, l.n, sms, partial, ref, s);
      ok = ok && dzv[1] == 0 && gv[1] == 0 && sv.ok();
      dzc[1] += dzv[1], gc[1] += gv[1];
      gerr = std::max(gerr, worst_of(gv));
      se.sum = std::max(se.sum, sv.sum), se.sum_gz = std::max(se.sum_gz, sv.sum_gz);
      v_ms[v] = median_ms(s, reps, [&] { return folded(q, grid); });
      if (v_ms[v] >= 0 && (best_ms < 0 || v_ms[v] < best_ms))
        best_ms = v_ms[v], best = q, best_grid = grid;
    }
    cuda::FoldDgrad no_dz = best;
    no_dz.dz = nullptr;
    const float b_nodz_ms = median_ms(s, reps, [&] { return folded(no_dz, best_grid); });
    std::printf(
        "| %s | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2fx | %llu | %.1e (%llu over) | "
        "%.1e | %.1e |%s\n",
        l.name, l.count, dx_ms, dgrad_ms, a_ms, v_ms[0], v_ms[1], b_nodz_ms,
        best_ms > 0 ? a_ms / best_ms : 0.0, dzc[1], gerr, gc[1], se.sum, se.sum_gz,
        ok ? "" : "  MISMATCH");
    std::fflush(stdout);
    failed = failed || !ok || best_ms < 0 || a_ms < 0;
    step_a += a_ms * l.count;
    step_b += best_ms * l.count;
  }
  std::printf("| **per step** | | | | %.2f | the faster (b): %.2f | | | %.2fx | | | | |\n", step_a,
              step_b, step_b > 0 ? step_a / step_b : 0.0);
  std::printf("summary: fold-dgrad per step (a) %.2f ms, (b) %.2f ms, speedup %.2fx%s\n", step_a,
              step_b, step_b > 0 ? step_a / step_b : 0.0, failed ? ", FAILED (see above)" : "");
  return failed ? 1 : 0;
}

}  // namespace kiln::probe
