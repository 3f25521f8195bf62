// kiln_cutlass_probe --first-layer: does the first layer's direct convolution with BatchNorm's
// sums (src/backend/cuda/first_layer_conv.h) beat cuDNN's forward followed by kiln's statistics
// pass? VGG16-BN's first layer (224x224, 3x3 stride 1) and ResNet-50's stem (224x224, 7x7
// stride 2), 3 channels padded to 4 into 64, FP16 NHWC, on the same random inputs in one process:
//   (a) cuDNN's forward (the fastest of its first --max-engines engines), then kiln's statistics
//       pass over z (bn_stats.cuh's, as a training step runs it);
//   (b) the direct kernel, z and both sums in one launch (the sums in a fixed order).
// (b)'s z is compared with (a)'s (each rounds an FP32 sum of the same products once: an FP16 ulp
// apart at most) and its sums with kiln's double sums of its own z. Then the weight gradient of
// the same layer from z as dz: kiln's direct one (first_layer_wgrad.h), the same with BatchNorm's
// dx pass folded in (forming dz from g and z as it loads them), and cuDNN's (the fastest of its
// engines, where it has one for this graph), both FP32 dw, compared relative to dw's largest
// magnitude. Times are medians of --reps.
#include <cuda_fp16.h>

#include <cmath>

#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/first_layer_wgrad.h"
#include "probe_common.h"
#include "probe_kernels.h"

namespace kiln::probe {
namespace {

struct FirstLayer {
  const char* name;
  int h, r, stride, pad;
};

const FirstLayer kLayers[] = {{"vgg conv1_1 224x224 3x3", 224, 3, 1, 1},
                              {"r50 stem 224x224 7x7/2", 224, 7, 2, 3}};

}  // namespace

int first_layer_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop,
                      int64_t batch, int reps, int max_engines) {
  const int sms = prop.multiProcessorCount;
  constexpr int64_t kC = cuda::kFirstLayerChannels, kK = cuda::kFirstLayerOutputs;
  std::printf(
      "# %s (%d SMs), cuDNN %zu, batch %lld, FP16 NHWC, 4 (3 padded) > 64 channels, "
      "median of %d runs (ms)\n",
      prop.name, sms, cudnnGetVersion(), static_cast<long long>(batch), reps);
  std::printf(
      "| layer | (a) cuDNN fprop | (a) stats pass | (a) total | (b) direct + sums | "
      "speedup | max z diff | sum err | sum z^2 err |\n|---|---|---|---|---|---|---|---|---|\n");
  bool failed = false;
  for (const FirstLayer& l : kLayers) {
    const int64_t p = (l.h + 2 * l.pad - l.r) / l.stride + 1, m = batch * p * p;
    auto* x = static_cast<__half*>(device_alloc(batch * l.h * l.h * kC * 2));
    auto* w = static_cast<__half*>(device_alloc(kK * l.r * l.r * kC * 2));
    auto* za = static_cast<__half*>(device_alloc(m * kK * 2));
    auto* zb = static_cast<__half*>(device_alloc(m * kK * 2));
    auto* sums = static_cast<float*>(device_alloc(2 * kK * sizeof(float)));
    void* partial = device_alloc(kiln_stats_bytes(m, kK, sms));
    auto* ref = static_cast<double2*>(device_alloc(kK * sizeof(double2)));
    auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));
    PROBE_CUDA(fill_uniform(x, batch * l.h * l.h * kC, 0.0f, 1.0f, 11, s));
    const float wr = std::sqrt(3.0f / static_cast<float>(l.r * l.r * kC));
    PROBE_CUDA(fill_uniform(w, kK * l.r * l.r * kC, -wr, wr, 12, s));
    CudnnConv conv;
    if (!conv.build(handle, s, batch, l.h, kC, kK, x, w, za, max_engines, reps, false, l.r, l.pad,
                    l.stride)) {
      std::printf("| %s | no cuDNN engine: %s |\n", l.name, conv.why.c_str());
      failed = true;
      continue;
    }
    const auto stats = [&] { return kiln_stats(za, m, kK, sms, partial, s) == cudaSuccess; };
    const float stats_ms = median_ms(s, reps, stats);
    const float total_ms = median_ms(s, reps, [&] { return conv.run(handle) && stats(); });
    cuda::FirstLayerConv c;
    c.x = x, c.w = w, c.z = zb, c.sums = sums;
    c.n = static_cast<int>(batch), c.h = c.w_ = l.h, c.r = c.s = l.r;
    c.stride_h = c.stride_w = l.stride, c.pad_h = c.pad_w = l.pad;
    if (const std::string why = cuda::first_layer_conv_refusal(c); !why.empty()) {
      std::printf("| %s | the direct kernel refuses it: %s |\n", l.name, why.c_str());
      failed = true;
      continue;
    }
    unsigned grid = 0;
    PROBE_CUDA(cuda::prepare_first_layer_conv(c, sms, &grid));
    const size_t ws_bytes = cuda::first_layer_conv_workspace(grid);
    c.partials = static_cast<float*>(device_alloc(ws_bytes));
    PROBE_CUDA(cudaMemsetAsync(c.partials, 0, ws_bytes, s));
    const float direct_ms = median_ms(
        s, reps, [&] { return cuda::launch_first_layer_conv(c, grid, s) == cudaSuccess; });
    PROBE_CUDA(conv.run(handle) ? cudaSuccess : cudaErrorUnknown);
    PROBE_CUDA(compare_half(zb, za, m * kK, 0x1p-10f, 0x1p-14f, cmp, s));
    PROBE_CUDA(kiln_stats(zb, m, kK, sms, partial, s));
    PROBE_CUDA(kiln_stats_total(partial, m, kK, sms, ref, s));
    unsigned long long hc[2];
    std::vector<float> hs(2 * kK);
    std::vector<double2> href(kK);
    PROBE_CUDA(cudaMemcpyAsync(hc, cmp, sizeof hc, cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaMemcpyAsync(hs.data(), sums, hs.size() * 4, cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaMemcpyAsync(href.data(), ref, href.size() * sizeof(double2),
                               cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaStreamSynchronize(s));
    const float zdiff = worst_of(hc);
    double es = 0, eq = 0;
    for (int64_t k = 0; k < kK; ++k) {
      es = std::max(es, std::fabs(hs[k] - href[k].x) / (std::fabs(href[k].x) + 1e-30));
      eq = std::max(eq, std::fabs(hs[kK + k] - href[k].y) / (href[k].y + 1e-30));
    }
    // z an FP16 ulp apart at most (2^-10 relative), sums within FP32 running sums' rounding.
    const bool ok = hc[1] == 0 && es <= 1e-4 && eq <= 1e-4;
    failed = failed || !ok;
    std::printf(
        "| %s | %.3f (%s) | %.3f | %.3f | %.3f | %.2fx | %.2e (%llu over) | %.1e | %.1e%s |\n",
        l.name, conv.ms, conv.engine.c_str(), stats_ms, total_ms, direct_ms,
        direct_ms > 0 ? total_ms / direct_ms : 0.0, zdiff, hc[1], es, eq, ok ? "" : " MISMATCH");
    std::fflush(stdout);
    // The weight gradient, with za (cuDNN's z) as dz.
    const int64_t dwn = kK * l.r * l.r * kC;
    auto* dwa = static_cast<float*>(device_alloc(dwn * 4));
    auto* dwb = static_cast<float*>(device_alloc(dwn * 4));
    CudnnConv wconv;
    cuda::FirstLayerWgrad wg;
    static_cast<cuda::FirstLayerShape&>(wg) = c;
    wg.x = x, wg.dz = za, wg.dw = dwb, wg.dw_f32 = true, wg.dw_channels = static_cast<int>(kC);
    // The fold's inputs: g = za, BatchNorm's z = zb, every mask bit set, zero coefficients (the
    // time does not depend on the values).
    auto* mask = static_cast<uint8_t*>(device_alloc(m * kK / 8));
    auto* coef = static_cast<float4*>(device_alloc(kK * sizeof(float4)));
    PROBE_CUDA(cudaMemsetAsync(mask, 0xFF, m * kK / 8, s));
    PROBE_CUDA(cudaMemsetAsync(coef, 0, kK * sizeof(float4), s));
    cuda::FirstLayerWgrad fold = wg;
    fold.bn.z = zb, fold.bn.mask = mask, fold.bn.coef = coef;
    if (const std::string why = cuda::first_layer_wgrad_refusal(wg); !why.empty()) {
      std::printf("| %s wgrad | the direct kernel refuses it: %s |\n", l.name, why.c_str());
      failed = true;
    } else {
      const auto timed = [&](cuda::FirstLayerWgrad& q) {
        unsigned grid = 0;
        PROBE_CUDA(cuda::prepare_first_layer_wgrad(q, sms, &grid));
        void* ws = device_alloc(cuda::first_layer_wgrad_workspace(q, grid));
        q.partials = static_cast<float*>(ws);
        const float ms = median_ms(
            s, reps, [&] { return cuda::launch_first_layer_wgrad(q, grid, s) == cudaSuccess; });
        PROBE_CUDA(cudaFree(ws));
        return ms;
      };
      const float fold_ms = timed(fold);  // first: wg's dw is the one compared below
      const float direct_ms = timed(wg);
      // cuDNN's own (FP32 dw from FP16 x and dz at 4 channels; some versions have no engine).
      const bool has_cudnn = wconv.build(handle, s, batch, l.h, kC, kK, x, dwa, za, max_engines,
                                         reps, false, l.r, l.pad, l.stride, true);
      std::string check = "no cuDNN engine: " + wconv.why.substr(0, 80), cudnn = "-";
      if (has_cudnn) {
        PROBE_CUDA(wconv.run(handle) ? cudaSuccess : cudaErrorUnknown);
        std::vector<float> ha(dwn), hb(dwn);
        PROBE_CUDA(cudaMemcpyAsync(ha.data(), dwa, dwn * 4, cudaMemcpyDeviceToHost, s));
        PROBE_CUDA(cudaMemcpyAsync(hb.data(), dwb, dwn * 4, cudaMemcpyDeviceToHost, s));
        PROBE_CUDA(cudaStreamSynchronize(s));
        double scale = 0, diff = 0;
        for (int64_t i = 0; i < dwn; ++i) {
          scale = std::max(scale, std::fabs(static_cast<double>(ha[i])));
          diff = std::max(diff, std::fabs(static_cast<double>(ha[i]) - hb[i]));
        }
        const double rel = diff / (scale + 1e-30);
        // Two FP32 sums of the same exact products over ~3-13M pixels in different orders.
        const bool wok = rel <= 1e-4;
        failed = failed || !wok;
        char buf[96];
        std::snprintf(buf, sizeof buf, "max diff %.1e of max |dw|%s", rel, wok ? "" : " MISMATCH");
        check = buf;
        std::snprintf(buf, sizeof buf, "%.3f (", wconv.ms);
        cudnn = buf + wconv.engine + ")";
      }
      // The fold reads g and z where the plain kernel reads dz: twice the bytes, and BatchNorm's
      // dx pass (reading g and z, writing dz) goes.
      std::printf(
          "| %s wgrad | cuDNN %s | direct %.3f | folded %.3f (+%.3f for %.2f GB more) | %s |\n",
          l.name, cudnn.c_str(), direct_ms, fold_ms, fold_ms - direct_ms,
          static_cast<double>(m * kK * 2) / 1e9, check.c_str());
      std::fflush(stdout);
    }
    PROBE_CUDA(cudaFree(mask));
    PROBE_CUDA(cudaFree(coef));
    PROBE_CUDA(cudaFree(dwa));
    PROBE_CUDA(cudaFree(dwb));
    for (void* q : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(za),
                    static_cast<void*>(zb), static_cast<void*>(sums), partial,
                    static_cast<void*>(ref), static_cast<void*>(cmp)})
      PROBE_CUDA(cudaFree(q));
  }
  return failed ? 1 : 0;
}

}  // namespace kiln::probe
