// kiln_cutlass_probe --dgrad: does the data gradient whose epilogue also takes BatchNorm-
// backward's sums (src/backend/cuda/cutlass/dgrad_bn.h) beat cuDNN's dgrad followed by kiln's
// sums pass?
//
// For each of ResNet-50's 1x1 stride-1 data gradients that feed a BatchNorm backward, and the
// 3x3 stride-1 ones of ResNet-50 and VGG16-BN (the convolution units, conv_dgrad_bn_sm90.cu)
// (batch 256 by default; FP16 NHWC, KRSC filter, FP32 accumulation), on the same random inputs
// in one process:
//   (a) cuDNN's dgrad dX = dY W (the fastest of its first --max-engines engines), then kiln's
//       sums pass (bn_kernels.cuh's bwd_partial_vec over z, dX, dy2 and the mask, as a training
//       step runs it);
//   (b) each variant of dgrad_bn.h (the backend's own units): g and both sums in one kernel (plus
//       clearing the sums, and for reg_partials its finalize kernel).
// BatchNorm's finalize and dx pass follow either (the dx pass reading g alone after (b)) and are
// left out of both. (b) is checked: g elementwise against kiln's masked sum of cuDNN's dX, the
// sums against kiln's double sums of (b)'s own g. Times are medians of --reps runs.
#include <cuda_fp16.h>

#include <cmath>

#include "backend/cuda/cutlass/dgrad_bn.h"
#include "probe_common.h"
#include "probe_kernels.h"

namespace kiln::probe {
namespace {

using sm90::DgradBn;
using sm90::DgradBnKernel;

struct Dgrad {
  const char* name;
  int count;        // such layers in one step of its model
  int64_t h, k, n;  // height = width; dY's channels (the convolution's output), dX's (its input)
  bool dy2;         // dX feeds a BN+add+ReLU (the residual path adds dy2), else a CBR
  int64_t r = 1;    // the filter's size (stride 1, padded to keep h)
  const char* group = "ResNet-50 1x1";  // the per-step total it counts in
};

// torchvision's ResNet-50 (v1.5): each bottleneck's conv3 (its input is bn2's CBR output) and
// each conv1 whose input is the previous block's BN+add+ReLU output (all but the first block's,
// whose input is the stem's max-pool).
const Dgrad kDgrads[] = {
    {"conv3 56x56 256>64", 3, 56, 256, 64, false},
    {"conv3 28x28 512>128", 4, 28, 512, 128, false},
    {"conv3 14x14 1024>256", 6, 14, 1024, 256, false},
    {"conv3 7x7 2048>512", 3, 7, 2048, 512, false},
    {"conv1 56x56 64>256", 2, 56, 64, 256, true},
    {"conv1 56x56 128>256", 1, 56, 128, 256, true},
    {"conv1 28x28 128>512", 3, 28, 128, 512, true},
    {"conv1 28x28 256>512", 1, 28, 256, 512, true},
    {"conv1 14x14 256>1024", 5, 14, 256, 1024, true},
    {"conv1 14x14 512>1024", 1, 14, 512, 1024, true},
    {"conv1 7x7 512>2048", 2, 7, 512, 2048, true},
    // Each stride-1 conv2 (3x3) feeds bn1's CBR: all but the first block's of stages 2-4.
    {"conv2 56x56 64>64 3x3", 3, 56, 64, 64, false, 3, "ResNet-50 3x3"},
    {"conv2 28x28 128>128 3x3", 3, 28, 128, 128, false, 3, "ResNet-50 3x3"},
    {"conv2 14x14 256>256 3x3", 5, 14, 256, 256, false, 3, "ResNet-50 3x3"},
    {"conv2 7x7 512>512 3x3", 2, 7, 512, 512, false, 3, "ResNet-50 3x3"},
    // VGG16-BN's convolutions whose input is a CBR's output (not a max-pool's).
    {"vgg 224x224 64>64 3x3", 1, 224, 64, 64, false, 3, "VGG16-BN 3x3"},
    {"vgg 112x112 128>128 3x3", 1, 112, 128, 128, false, 3, "VGG16-BN 3x3"},
    {"vgg 56x56 256>256 3x3", 2, 56, 256, 256, false, 3, "VGG16-BN 3x3"},
    {"vgg 28x28 512>512 3x3", 2, 28, 512, 512, false, 3, "VGG16-BN 3x3"},
    {"vgg 14x14 512>512 3x3", 2, 14, 512, 512, false, 3, "VGG16-BN 3x3"},
};

// The units for a layer: the GEMM's for 1x1, the convolution's otherwise.
std::vector<DgradBnKernel> kernels_for(const Dgrad& d) {
  return d.r == 1 ? sm90::dgrad_bn_backend_kernels(d.dy2)
                  : sm90::conv_dgrad_bn_backend_kernels(d.dy2);
}

// The problem of a layer at `batch`, pointers left for the caller.
DgradBn problem(const Dgrad& d, int64_t batch, int sms) {
  DgradBn a;
  a.m = batch * d.h * d.h, a.n = d.n, a.k = d.k, a.sm_count = sms;
  a.h = a.w_ = static_cast<int>(d.h);
  a.r = a.s = static_cast<int>(d.r);
  a.pad_h = a.pad_w = static_cast<int>((d.r - 1) / 2);
  return a;
}

}  // namespace

int dgrad_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop, int64_t batch,
                int reps, int max_engines, int64_t only, const std::string& shape) {
  const int sms = prop.multiProcessorCount;

  size_t dy_max = 0, dx_max = 0, w_max = 0, n_max = 0, sums_ws = 0, ws_max = 0;
  for (const Dgrad& d : kDgrads) {
    const int64_t m = batch * d.h * d.h;
    dy_max = std::max<size_t>(dy_max, m * d.k);
    dx_max = std::max<size_t>(dx_max, m * d.n);
    w_max = std::max<size_t>(w_max, d.k * d.r * d.r * d.n);
    n_max = std::max<size_t>(n_max, d.n);
    sums_ws = std::max(sums_ws, kiln_stats_bytes(m, d.n, sms));
    const DgradBn g = problem(d, batch, sms);
    for (const auto& kern : kernels_for(d)) ws_max = std::max(ws_max, kern.workspace(g));
  }
  auto* dy = as_half(device_alloc(dy_max * 2));
  auto* w = as_half(device_alloc(w_max * 2));
  auto* z = as_half(device_alloc(dx_max * 2));
  auto* dy2 = as_half(device_alloc(dx_max * 2));
  auto* dx = as_half(device_alloc(dx_max * 2));
  auto* gref = as_half(device_alloc(dx_max * 2));
  auto* g = as_half(device_alloc(dx_max * 2));
  auto* mask = static_cast<uint8_t*>(device_alloc(dx_max / 8 + 1));
  auto* mean = static_cast<float*>(device_alloc(n_max * sizeof(float)));
  void* partial = device_alloc(sums_ws);
  void* ws = device_alloc(ws_max);
  auto* ref = static_cast<double2*>(device_alloc(n_max * sizeof(double2)));
  auto* sums = static_cast<float*>(device_alloc(2 * n_max * sizeof(float)));
  auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));

  std::printf(
      "# %s (%d SMs), cuDNN %zu, batch %lld, FP16 NHWC stride-1 data gradients "
      "feeding BatchNorm, median of %d runs (ms)\n",
      prop.name, sms, cudnnGetVersion(), static_cast<long long>(batch), reps);
  std::printf(
      "| layer | per step | (a) dgrad | (a) sums | (a) total | (b) best | (b) ms | speedup |"
      " max g err | sum err | sum g(z-mean) err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool failed = false;
  double step_a = 0, step_b = 0, step_dgrad = 0;  // ResNet-50's 1x1 layers
  // Per group: (a) and (b) per step.
  std::vector<std::pair<std::string, std::pair<double, double>>> groups;
  std::vector<std::string> notes;
  int64_t done = 0;
  for (const Dgrad& d : kDgrads) {
    if (only > 0 && done++ >= only) break;
    if (!shape.empty() && std::strstr(d.name, shape.c_str()) == nullptr) continue;
    const int64_t m = batch * d.h * d.h, count = m * d.n;
    // dY of unit scale, weights of variance 1/(k r^2) keep dX near unit scale; z around a mean
    // of 1.
    const float wr = std::sqrt(3.0f / static_cast<float>(d.k * d.r * d.r));
    PROBE_CUDA(fill_uniform(dy, m * d.k, -1.0f, 1.0f, 1 + done, s));
    PROBE_CUDA(fill_uniform(w, d.k * d.r * d.r * d.n, -wr, wr, 1000 + done, s));
    PROBE_CUDA(fill_uniform(z, count, -1.0f, 3.0f, 2000 + done, s));
    PROBE_CUDA(fill_uniform(dy2, count, -1.0f, 1.0f, 3000 + done, s));
    PROBE_CUDA(fill_bytes(mask, (count + 7) / 8, 4000 + done, s));
    std::vector<float> hmean(static_cast<size_t>(d.n), 1.0f);
    PROBE_CUDA(cudaMemcpyAsync(mean, hmean.data(), hmean.size() * sizeof(float),
                               cudaMemcpyHostToDevice, s));
    const __half* d2 = d.dy2 ? dy2 : nullptr;

    CudnnConv conv;
    // cuDNN's view: x = dX [m][n] (the convolution's input), w [k][n], y = dY [m][k].
    if (!conv.build(handle, s, batch, d.h, d.n, d.k, dx, w, dy, max_engines, reps, true, d.r,
                    (d.r - 1) / 2)) {
      std::printf("| %s | %d | no engine: %s |\n", d.name, d.count, conv.why.c_str());
      failed = true;
      continue;
    }
    if (!conv.run(handle)) {
      std::printf("| %s | cuDNN's run failed |\n", d.name);
      failed = true;
      continue;
    }
    auto sums_pass = [&] {
      return kiln_bwd_sums(z, dx, d2, mask, mean, m, d.n, sms, partial, s) == cudaSuccess;
    };
    PROBE_CUDA(masked_grad(dx, d2, mask, count, gref, s));
    const float sums_ms = median_ms(s, reps, sums_pass);
    const float total_ms = median_ms(s, reps, [&] { return conv.run(handle) && sums_pass(); });

    DgradBn a = problem(d, batch, sms);
    a.dy = dy, a.w = w, a.z = z, a.mask = mask, a.dy2 = d2, a.mean = mean, a.g = g, a.sums = sums;
    const std::vector<DgradBnKernel> kernels = kernels_for(d);
    float best_ms = -1;
    const char* best_name = "-";
    double worst_g = 0, worst_s = 0, worst_x = 0;
    for (const auto& kern : kernels) {
      if (kern.tile_n == 64 && d.n > 64) continue;  // dgrad_bn_kernel_for's choice
      if (const std::string why = kern.check(a); !why.empty()) {
        notes.push_back(std::string(d.name) + ", " + kern.name + ": " + why);
        failed = true;
        continue;
      }
      PROBE_CUDA(cudaMemsetAsync(g, 0xFF, static_cast<size_t>(count) * 2, s));  // NaNs
      if (const std::string err = run_and_wait(kern, a, ws, s); !err.empty()) {
        notes.push_back(std::string(d.name) + ", " + kern.name + ": " + err);
        failed = true;
        continue;
      }
      // g: each side rounds an FP32 sum of the same products to FP16 once, in its own order
      // (they may land an ulp apart), then adds dy2 and rounds again. Relative 2^-9 covers that
      // where dX and dy2 do not cancel; where they do, dX's ulp survives the cancellation: the
      // absolute 2^-8 is one ulp of |dX| < 4 (dX here has a standard deviation of 0.58) plus the
      // sum's rounding.
      PROBE_CUDA(compare_half(g, gref, count, 0x1p-9f, 0x1p-8f, cmp, s));
      unsigned long long hc[2];
      PROBE_CUDA(cudaMemcpyAsync(hc, cmp, sizeof hc, cudaMemcpyDeviceToHost, s));
      PROBE_CUDA(cudaStreamSynchronize(s));
      const float gerr = worst_of(hc);
      // The sums against kiln's double sums of the kernel's own g (no mask, no dy2: g is
      // already formed).
      const BwdSumsError se = bwd_sums_error(sums, z, g, mean, m, d.n, sms, partial, ref, s);
      const double es = se.sum, ex = se.sum_gz;
      const bool ok = hc[1] == 0 && se.ok();
      const float t = median_ms(s, reps, [&] { return kern.run(a, ws, s).empty(); });
      char line[256];
      std::snprintf(line, sizeof line,
                    "%s, %s: %.3f ms, max g err %.2e (%llu over), sum %.1e, "
                    "sum g(z-mean) %.1e%s",
                    d.name, kern.name, t, gerr, hc[1], es, ex, ok ? "" : "  MISMATCH");
      notes.push_back(line);
      if (!ok || t < 0) {
        failed = true;
        continue;
      }
      worst_g = std::max<double>(worst_g, gerr);
      worst_s = std::max(worst_s, es);
      worst_x = std::max(worst_x, ex);
      if (kern.mode == sm90::StatsMode::reg_atomic && (best_ms < 0 || t < best_ms)) {
        best_ms = t;
        best_name = kern.name;
      }
    }
    notes.push_back(std::string(d.name) + ", cuDNN dgrad: " + conv.engine);
    std::printf("| %s | %d | %.3f | %.3f | %.3f | %s | %.3f | %.2fx | %.1e | %.1e | %.1e |\n",
                d.name, d.count, conv.ms, sums_ms, total_ms, best_name, best_ms,
                best_ms > 0 ? total_ms / best_ms : 0.0, worst_g, worst_s, worst_x);
    std::fflush(stdout);
    if (d.r == 1) {
      step_a += total_ms * d.count;
      step_dgrad += conv.ms * d.count;
      step_b += best_ms * d.count;
    }
    auto at =
        std::find_if(groups.begin(), groups.end(), [&](auto& e) { return e.first == d.group; });
    if (at == groups.end()) at = groups.insert(groups.end(), {d.group, {0.0, 0.0}});
    at->second.first += total_ms * d.count;
    at->second.second += best_ms * d.count;
  }
  for (const auto& [name, t] : groups)
    std::printf("| **%s per step** | | | | %.2f | | %.2f | %.2fx | | | |\n", name.c_str(), t.first,
                t.second, t.second > 0 ? t.first / t.second : 0.0);
  // The 1x1 layers' totals only where --only or --shape left some (zeros are no measurement).
  const bool gemm_layers = step_b > 0;
  if (gemm_layers) {
    std::printf("| **per step** | | %.2f | | %.2f | | %.2f | %.2fx | | | |\n", step_dgrad, step_a,
                step_b, step_a / step_b);
  }
  std::printf("\nvariants ((b) best: the atomic form; reg_partials is the deterministic one):\n");
  for (const std::string& n : notes) std::printf("  %s\n", n.c_str());
  if (gemm_layers) {
    std::printf("summary: dgrad per step (a) %.2f ms, (b) %.2f ms, speedup %.2fx%s\n", step_a,
                step_b, step_a / step_b, failed ? ", FAILED (see above)" : "");
  } else {
    std::printf("summary: no 1x1 layer run (--only, --shape); the groups' rows above%s\n",
                failed ? ", FAILED (see above)" : "");
  }
  for (void* p :
       {static_cast<void*>(dy), static_cast<void*>(w), static_cast<void*>(z),
        static_cast<void*>(dy2), static_cast<void*>(dx), static_cast<void*>(gref),
        static_cast<void*>(g), static_cast<void*>(mask), static_cast<void*>(mean), partial, ws,
        static_cast<void*>(ref), static_cast<void*>(sums), static_cast<void*>(cmp)})
    PROBE_CUDA(cudaFree(p));
  return failed ? 1 : 0;
}

}  // namespace kiln::probe
