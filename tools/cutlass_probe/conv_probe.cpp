// kiln_cutlass_probe --conv: does CUTLASS's SM90 implicit-GEMM convolution whose epilogue also
// takes BatchNorm's statistics (src/backend/cuda/cutlass/conv_stats.h) beat cuDNN's fprop
// followed by kiln's statistics pass, on the 3x3 layers of VGG16-BN and ResNet-50?
//
// For each shape (batch 256 by default; FP16 NHWC, KRSC filter, FP32 accumulation), on the same
// random inputs in one process:
//   (a) cuDNN's fprop (the fastest of its first --max-engines engines), then kiln's statistics
//       pass over z (bn_stats.cuh's stats_partial_vec, as a training step runs it);
//   (b) each variant of conv_stats.h (the backend's own units) whose tile fits the layer: z and
//       the sums in one kernel (plus clearing the sums); `none` is the convolution alone.
// Every (b) is checked against (a): z elementwise, the sums against kiln's double sums.
#include <cuda_fp16.h>

#include <cmath>

#include "backend/cuda/cutlass/conv_stats.h"
#include "probe_common.h"
#include "probe_kernels.h"

namespace kiln::probe {
namespace {

using sm90::ConvStats;
using sm90::ConvStatsKernel;

struct Conv3 {
  const char* name;
  int count;  // such layers in one step of the model
  int64_t h, c, k, r, pad, stride;
};

// torchvision's VGG16-BN (224x224 input; the first layer as kiln runs it, its 3 channels padded
// to 8) and ResNet-50 v1.5 (each bottleneck's conv2; the first of stages 2-4 has stride 2).
const Conv3 kConvs[] = {
    {"vgg 224x224 8>64", 1, 224, 8, 64, 3, 1, 1},
    {"vgg 224x224 64>64", 1, 224, 64, 64, 3, 1, 1},
    {"vgg 112x112 64>128", 1, 112, 64, 128, 3, 1, 1},
    {"vgg 112x112 128>128", 1, 112, 128, 128, 3, 1, 1},
    {"vgg 56x56 128>256", 1, 56, 128, 256, 3, 1, 1},
    {"vgg 56x56 256>256", 2, 56, 256, 256, 3, 1, 1},
    {"vgg 28x28 256>512", 1, 28, 256, 512, 3, 1, 1},
    {"vgg 28x28 512>512", 2, 28, 512, 512, 3, 1, 1},
    {"vgg 14x14 512>512", 3, 14, 512, 512, 3, 1, 1},
    {"r50 56x56 64>64", 3, 56, 64, 64, 3, 1, 1},
    {"r50 56x56 128>128 s2", 1, 56, 128, 128, 3, 1, 2},
    {"r50 28x28 128>128", 3, 28, 128, 128, 3, 1, 1},
    {"r50 28x28 256>256 s2", 1, 28, 256, 256, 3, 1, 2},
    {"r50 14x14 256>256", 5, 14, 256, 256, 3, 1, 1},
    {"r50 14x14 512>512 s2", 1, 14, 512, 512, 3, 1, 2},
    {"r50 7x7 512>512", 2, 7, 512, 512, 3, 1, 1},
};

int64_t out_size(const Conv3& c) {
  return (c.h + 2 * c.pad - c.r) / c.stride + 1;
}

}  // namespace

int conv_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop, int64_t batch,
               int reps, int max_engines, int64_t only, const std::string& shape) {
  const int sms = prop.multiProcessorCount;
  const std::vector<ConvStatsKernel> kernels = sm90::conv_stats_backend_kernels();
  auto problem = [&](const Conv3& c) {
    ConvStats p;
    p.n = static_cast<int>(batch), p.h = p.w_ = static_cast<int>(c.h);
    p.c = static_cast<int>(c.c), p.k = static_cast<int>(c.k);
    p.r = p.s = static_cast<int>(c.r);
    p.pad_h = p.pad_w = static_cast<int>(c.pad);
    p.stride_h = p.stride_w = static_cast<int>(c.stride);
    p.sm_count = sms;
    return p;
  };

  size_t in_max = 0, out_max = 0, w_max = 0, k_max = 0, stats_ws = 0, ws_max = 0;
  for (const Conv3& c : kConvs) {
    const int64_t p = out_size(c), rows = batch * p * p;
    in_max = std::max<size_t>(in_max, batch * c.h * c.h * c.c);
    out_max = std::max<size_t>(out_max, rows * c.k);
    w_max = std::max<size_t>(w_max, c.k * c.r * c.r * c.c);
    k_max = std::max<size_t>(k_max, c.k);
    stats_ws = std::max(stats_ws, kiln_stats_bytes(rows, c.k, sms));
    for (const auto& kern : kernels) ws_max = std::max(ws_max, kern.workspace(problem(c)));
  }
  auto* x = as_half(device_alloc(in_max * 2));
  auto* w = as_half(device_alloc(w_max * 2));
  auto* za = as_half(device_alloc(out_max * 2));
  auto* zb = as_half(device_alloc(out_max * 2));
  void* partial = device_alloc(stats_ws);
  void* ws = device_alloc(ws_max);
  auto* ref = static_cast<double2*>(device_alloc(k_max * sizeof(double2)));
  auto* sums = static_cast<float*>(device_alloc(2 * k_max * sizeof(float)));
  auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));

  std::printf(
      "# %s (%d SMs), cuDNN %zu, batch %lld, FP16 NHWC 3x3 convolutions with BatchNorm's "
      "statistics, median of %d runs (ms)\n",
      prop.name, sms, cudnnGetVersion(), static_cast<long long>(batch), reps);
  std::printf(
      "| layer | per step | (a) fprop | (a) stats | (a) total | (b) best | (b) ms | speedup |"
      " (b) conv alone | max z err | sum err | sumsq err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool failed = false;
  double vgg_a = 0, vgg_b = 0, r50_a = 0, r50_b = 0;
  std::vector<std::string> notes;
  int64_t done = 0;
  for (const Conv3& c : kConvs) {
    if (only > 0 && done++ >= only) break;
    if (!shape.empty() && std::strstr(c.name, shape.c_str()) == nullptr) continue;
    const int64_t p = out_size(c), rows = batch * p * p, count = rows * c.k;
    const int64_t taps = c.r * c.r * c.c;  // the GEMM's K
    // Post-ReLU inputs are non-negative; weights of variance 1/taps keep z near unit scale.
    const float wr = std::sqrt(3.0f / static_cast<float>(taps));
    PROBE_CUDA(fill_uniform(x, batch * c.h * c.h * c.c, 0.0f, 1.0f, 1 + done, s));
    PROBE_CUDA(fill_uniform(w, c.k * taps, -wr, wr, 1000 + done, s));

    CudnnConv conv;
    if (!conv.build(handle, s, batch, c.h, c.c, c.k, x, w, za, max_engines, reps, false, c.r, c.pad,
                    c.stride)) {
      std::printf("| %s | %d | no engine: %s |\n", c.name, c.count, conv.why.c_str());
      failed = true;
      continue;
    }
    if (!conv.run(handle)) {
      std::printf("| %s | cuDNN's run failed |\n", c.name);
      failed = true;
      continue;
    }
    PROBE_CUDA(kiln_stats(za, rows, c.k, sms, partial, s));
    PROBE_CUDA(kiln_stats_total(partial, rows, c.k, sms, ref, s));
    std::vector<double2> href(static_cast<size_t>(c.k));
    PROBE_CUDA(cudaMemcpyAsync(href.data(), ref, href.size() * sizeof(double2),
                               cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaStreamSynchronize(s));
    const float stats_ms = median_ms(
        s, reps, [&] { return kiln_stats(za, rows, c.k, sms, partial, s) == cudaSuccess; });
    const float total_ms = median_ms(s, reps, [&] {
      return conv.run(handle) && kiln_stats(za, rows, c.k, sms, partial, s) == cudaSuccess;
    });

    ConvStats a = problem(c);
    a.x = x, a.w = w, a.z = zb, a.sum = sums, a.sumsq = sums + c.k;
    float best_ms = -1, alone_ms = -1;
    const char* best_name = "-";
    double worst_z = 0, worst_sum = 0, worst_sq = 0;
    for (const auto& kern : kernels) {
      // conv_stats_kernel_for's choice: a 64-wide tile only where the layer has 64 channels.
      if (kern.tile_n == 64 && c.k > 64) continue;
      if (const std::string why = kern.check(a); !why.empty()) {
        notes.push_back(std::string(c.name) + ", " + kern.name + ": " + why);
        failed = true;
        continue;
      }
      PROBE_CUDA(cudaMemsetAsync(zb, 0xFF, static_cast<size_t>(count) * 2, s));  // NaNs
      if (const std::string err = run_and_wait(kern, a, ws, s); !err.empty()) {
        notes.push_back(std::string(c.name) + ", " + kern.name + ": " + err);
        failed = true;
        continue;
      }
      // z: each side rounds an FP32 sum of the same products to FP16 once, in its own order:
      // two FP16 ulps (2^-9 relative) cover both roundings; the absolute 2^-11 the FP32 sums'
      // differing cancellation near zero (taps * 2^-24 * sum |w x| stays below it for up to
      // 4608 taps of unit-scale terms). The sums as check_stats bounds them.
      const StatsCheck chk =
          check_stats(zb, za, rows, c.k, 0x1p-9f, 0x1p-11f,
                      kern.mode != sm90::StatsMode::none ? sums : nullptr, href, cmp, s);
      const bool ok = chk.ok;
      const float t = median_ms(s, reps, [&] { return kern.run(a, ws, s).empty(); });
      char line[256];
      std::snprintf(line, sizeof line,
                    "%s, %s: %.3f ms, max z err %.2e (%llu over), sum %.1e, sumsq %.1e%s", c.name,
                    kern.name, t, chk.z_err, chk.z_over, chk.sum_err, chk.sumsq_err,
                    ok ? "" : "  MISMATCH");
      notes.push_back(line);
      if (!ok || t < 0) {
        failed = true;
        continue;
      }
      if (kern.mode == sm90::StatsMode::none) {  // the fastest z-only form
        if (alone_ms < 0 || t < alone_ms) alone_ms = t;
        continue;
      }
      worst_z = std::max<double>(worst_z, chk.z_err);
      worst_sum = std::max(worst_sum, chk.sum_err);
      worst_sq = std::max(worst_sq, chk.sumsq_err);
      if (best_ms < 0 || t < best_ms) {
        best_ms = t;
        best_name = kern.name;
      }
    }
    notes.push_back(std::string(c.name) + ", cuDNN: " + conv.engine);
    std::printf(
        "| %s | %d | %.3f | %.3f | %.3f | %s | %.3f | %.2fx | %.3f | %.1e | %.1e | %.1e |\n",
        c.name, c.count, conv.ms, stats_ms, total_ms, best_name, best_ms,
        best_ms > 0 ? total_ms / best_ms : 0.0, alone_ms, worst_z, worst_sum, worst_sq);
    std::fflush(stdout);
    const bool vgg = std::strncmp(c.name, "vgg", 3) == 0;
    (vgg ? vgg_a : r50_a) += total_ms * c.count;
    (vgg ? vgg_b : r50_b) += best_ms * c.count;
  }
  std::printf("| **VGG16-BN per step** | | | | %.2f | | %.2f | %.2fx | | | | |\n", vgg_a, vgg_b,
              vgg_b > 0 ? vgg_a / vgg_b : 0.0);
  std::printf("| **ResNet-50 per step** | | | | %.2f | | %.2f | %.2fx | | | | |\n", r50_a, r50_b,
              r50_b > 0 ? r50_a / r50_b : 0.0);
  std::printf("\nvariants:\n");
  for (const std::string& n : notes) std::printf("  %s\n", n.c_str());
  std::printf("summary: VGG16-BN (a) %.2f ms, (b) %.2f ms; ResNet-50 (a) %.2f ms, (b) %.2f ms%s\n",
              vgg_a, vgg_b, r50_a, r50_b, failed ? ", FAILED (see above)" : "");
  for (void* ptr : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(za),
                    static_cast<void*>(zb), partial, ws, static_cast<void*>(ref),
                    static_cast<void*>(sums), static_cast<void*>(cmp)})
    PROBE_CUDA(cudaFree(ptr));
  return failed ? 1 : 0;
}

}  // namespace kiln::probe
