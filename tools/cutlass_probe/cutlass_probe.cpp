// kiln_cutlass_probe: issue 20's first question - does a Hopper GEMM whose epilogue also takes
// BatchNorm's per-channel sums beat cuDNN's convolution followed by kiln's statistics pass?
//
// For each of ResNet-50's 1x1 stride-1 convolutions (batch 256 by default; FP16 NHWC input,
// KRSC filter, FP32 accumulation), on the same random inputs in one process:
//   (a) cuDNN's fprop (the fastest of the first --max-engines engines of its heuristics), then
//       kiln's statistics pass over z (bn_stats.cuh's stats_partial_vec, as a training step
//       runs it);
//   (b) each SM90 CUTLASS variant of probe_variants.h that fits the shape: z and the sums in one
//       kernel (plus clearing what the sums add into, and for the partials variants their
//       finalize kernel).
// BatchNorm's finalize (sums to mean and invstd) follows either and is left out of both.
// Every (b) is checked against (a): z elementwise, the sums against kiln's double sums. Times
// are medians of --reps runs after warm-up, from CUDA events around each run.
// --dgrad runs dgrad_probe.cpp's comparison instead (the data gradient with BatchNorm-backward's
// sums), --conv conv_probe.cpp's (VGG16-BN's and ResNet-50's 3x3 convolutions with the
// statistics), --prologue prologue_probe.cpp's (BatchNorm + ReLU applied on the 1x1 GEMM's
// operand load against kiln's apply pass before the GEMM), --first-layer first_layer_probe.cpp's
// (the first layer's direct convolution with the sums against cuDNN's forward and kiln's
// statistics pass), --fold-dgrad fold_dgrad_probe.cpp's (BatchNorm's dx pass folded into the 1x1
// data gradient against the dx pass then the SM90 data gradient). Needs an SM90 GPU (exit 77
// without one); exits 1 on a mismatch or a failed run.
//
// --only N keeps the first N shapes, --shape TEXT those whose name holds TEXT (one shape for
// ncu, as `scripts/gpu-check.sh cutlass-dgrad` with DGRAD_NCU does).
//
//   kiln_cutlass_probe [--dgrad | --conv | --prologue | --first-layer | --fold-dgrad] [--batch 256]
//   [--reps 20]
//   [--max-engines 4]
//   [--only N]
//                      [--shape TEXT]
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "probe_common.h"
#include "probe_kernels.h"
#include "probe_variants.h"

using namespace kiln::probe;
using namespace kiln::sm90;

namespace {

struct Conv {
  const char* name;
  int count;        // such layers in one ResNet-50 step
  int64_t h, c, k;  // input height = width (stride 1: the output's too), channels in, out
};

// torchvision's ResNet-50 (v1.5, the zoo's resnet50): each bottleneck's conv1 and conv3, and
// stage 1's downsample (the others have stride 2).
const Conv kConvs[] = {
    {"s1 56x56 64>64", 1, 56, 64, 64},       {"s1 56x56 256>64", 2, 56, 256, 64},
    {"s1 56x56 64>256", 4, 56, 64, 256},     {"s2 56x56 256>128", 1, 56, 256, 128},
    {"s2 28x28 512>128", 3, 28, 512, 128},   {"s2 28x28 128>512", 4, 28, 128, 512},
    {"s3 28x28 512>256", 1, 28, 512, 256},   {"s3 14x14 1024>256", 5, 14, 1024, 256},
    {"s3 14x14 256>1024", 6, 14, 256, 1024}, {"s4 14x14 1024>512", 1, 14, 1024, 512},
    {"s4 7x7 2048>512", 2, 7, 2048, 512},    {"s4 7x7 512>2048", 3, 7, 512, 2048},
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: kiln_cutlass_probe [--dgrad | --conv | --prologue | --first-layer | "
          "--fold-dgrad] [--batch 256] "
          "[--reps 20] "
          "[--max-engines 4] [--only N] [--shape TEXT]\n");
      return 0;
    }
    if (a == "--dgrad" || a == "--conv" || a == "--prologue" || a == "--first-layer" ||
        a == "--fold-dgrad")
      continue;
    if (a != "--batch" && a != "--reps" && a != "--max-engines" && a != "--only" &&
        a != "--shape") {
      std::fprintf(
          stderr,
          "kiln_cutlass_probe: unknown flag %s; its flags are --dgrad, --conv, --prologue, "
          "--first-layer, --fold-dgrad, "
          "--batch, --reps, --max-engines, --only, --shape\n",
          a.c_str());
      return 2;
    }
    ++i;
  }
  const int64_t batch = flag(argc, argv, "--batch", 256);
  const int reps = static_cast<int>(flag(argc, argv, "--reps", 20));
  const int max_engines = static_cast<int>(flag(argc, argv, "--max-engines", 4));
  const int64_t only = flag(argc, argv, "--only", 0);
  std::string shape;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--shape") == 0) shape = argv[i + 1];
  }
  if (batch < 1 || reps < 1 || max_engines < 1) {
    std::fprintf(stderr, "kiln_cutlass_probe: --batch, --reps and --max-engines must be >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "kiln_cutlass_probe: no CUDA device; this probe times kernels on a GPU\n");
    return 77;
  }
  cudaDeviceProp prop{};
  PROBE_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr,
                 "kiln_cutlass_probe: %s is sm_%d%d; the kernels are built for sm_90a only\n",
                 prop.name, prop.major, prop.minor);
    return 77;
  }
  const int sms = prop.multiProcessorCount;
  cudaStream_t s;
  PROBE_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS ||
      cudnnSetStream(handle, s) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "kiln_cutlass_probe: cudnnCreate failed\n");
    return 1;
  }
  bool dgrad = false, conv3 = false, prologue = false, first = false, fold = false;
  for (int i = 1; i < argc; ++i) {
    fold = fold || std::strcmp(argv[i], "--fold-dgrad") == 0;
    first = first || std::strcmp(argv[i], "--first-layer") == 0;
    dgrad = dgrad || std::strcmp(argv[i], "--dgrad") == 0;
    conv3 = conv3 || std::strcmp(argv[i], "--conv") == 0;
    prologue = prologue || std::strcmp(argv[i], "--prologue") == 0;
  }
  if (fold) {
    const int rc = fold_dgrad_probe(s, prop, batch, reps, shape);
    cudnnDestroy(handle);
    PROBE_CUDA(cudaStreamDestroy(s));
    return rc;
  }
  if (first) {
    const int rc = first_layer_probe(handle, s, prop, batch, reps, max_engines);
    cudnnDestroy(handle);
    PROBE_CUDA(cudaStreamDestroy(s));
    return rc;
  }
  if (dgrad || conv3 || prologue) {
    const int rc = dgrad   ? dgrad_probe(handle, s, prop, batch, reps, max_engines, only, shape)
                   : conv3 ? conv_probe(handle, s, prop, batch, reps, max_engines, only, shape)
                           : prologue_probe(s, prop, batch, reps, only, shape);
    cudnnDestroy(handle);
    PROBE_CUDA(cudaStreamDestroy(s));
    return rc;
  }
  const std::vector<GemmStatsKernel> kernels = probe_gemm_stats_kernels();

  // Buffers for the largest shape, reused.
  size_t act_in = 0, act_out = 0, wmax = 0, cmax = 0, stats_ws = 0, gemm_ws = 0;
  for (const Conv& c : kConvs) {
    const int64_t m = batch * c.h * c.h;
    act_in = std::max<size_t>(act_in, m * c.c);
    act_out = std::max<size_t>(act_out, m * c.k);
    wmax = std::max<size_t>(wmax, c.k * c.c);
    cmax = std::max<size_t>(cmax, c.k);
    stats_ws = std::max(stats_ws, kiln_stats_bytes(m, c.k, sms));
    GemmStats g;
    g.m = m, g.n = c.k, g.k = c.c, g.sm_count = sms;
    for (const auto& kern : kernels) gemm_ws = std::max(gemm_ws, kern.workspace(g));
  }
  auto* x = static_cast<__half*>(device_alloc(act_in * 2));
  auto* w = static_cast<__half*>(device_alloc(wmax * 2));
  auto* za = static_cast<__half*>(device_alloc(act_out * 2));
  auto* zb = static_cast<__half*>(device_alloc(act_out * 2));
  void* partial = device_alloc(stats_ws);
  void* ws = device_alloc(gemm_ws);
  auto* ref = static_cast<double2*>(device_alloc(cmax * sizeof(double2)));
  auto* sums = static_cast<float*>(device_alloc(2 * cmax * sizeof(float)));
  auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));

  std::printf(
      "# %s (%d SMs), cuDNN %zu, batch %lld, FP16 NHWC 1x1 stride 1, median of %d runs (ms)\n",
      prop.name, sms, cudnnGetVersion(), static_cast<long long>(batch), reps);
  std::printf(
      "| layer | per step | (a) fprop | (a) stats | (a) total | (b) best | (b) ms | speedup |"
      " (b) GEMM alone | max z err | sum err | sumsq err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool failed = false;
  double step_a = 0, step_b = 0, step_fprop = 0, step_gemm = 0;
  std::vector<std::string> notes;
  int64_t done = 0;
  for (const Conv& c : kConvs) {
    if (only > 0 && done++ >= only) break;
    if (!shape.empty() && std::strstr(c.name, shape.c_str()) == nullptr) continue;
    const int64_t m = batch * c.h * c.h;
    // Post-ReLU inputs are non-negative; weights of variance 1/C keep z near unit scale.
    const float wr = std::sqrt(3.0f / static_cast<float>(c.c));
    PROBE_CUDA(fill_uniform(x, m * c.c, 0.0f, 1.0f, 1 + done, s));
    PROBE_CUDA(fill_uniform(w, c.k * c.c, -wr, wr, 1000 + done, s));

    CudnnConv conv;
    if (!conv.build(handle, s, batch, c.h, c.c, c.k, x, w, za, max_engines, reps)) {
      std::printf("| %s | %d | no engine: %s |\n", c.name, c.count, conv.why.c_str());
      failed = true;
      continue;
    }
    // kiln's sums of cuDNN's z: the reference.
    if (!conv.run(handle)) {
      std::printf("| %s | cuDNN's run failed |\n", c.name);
      failed = true;
      continue;
    }
    PROBE_CUDA(kiln_stats(za, m, c.k, sms, partial, s));
    PROBE_CUDA(kiln_stats_total(partial, m, c.k, sms, ref, s));
    std::vector<double2> href(static_cast<size_t>(c.k));
    PROBE_CUDA(cudaMemcpyAsync(href.data(), ref, href.size() * sizeof(double2),
                               cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaStreamSynchronize(s));
    const float stats_ms =
        median_ms(s, reps, [&] { return kiln_stats(za, m, c.k, sms, partial, s) == cudaSuccess; });
    const float total_ms = median_ms(s, reps, [&] {
      return conv.run(handle) && kiln_stats(za, m, c.k, sms, partial, s) == cudaSuccess;
    });

    GemmStats g;
    g.x = x, g.w = w, g.z = zb, g.sum = sums, g.sumsq = sums + c.k;
    g.m = m, g.n = c.k, g.k = c.c, g.sm_count = sms;
    float best_ms = -1, gemm_ms = -1;
    const char* best_name = "-";
    double worst_z = 0, worst_sum = 0, worst_sq = 0;
    for (const auto& kern : kernels) {
      // A tile wider than the layer would compute padding; a cluster needs whole tiles.
      if (c.k < kern.tile_n || c.k % (kern.tile_n * kern.cluster_n) != 0) continue;
      if (kern.tile_n == 64 && c.k > 64) continue;
      PROBE_CUDA(cudaMemsetAsync(zb, 0xFF, static_cast<size_t>(m * c.k) * 2, s));  // NaNs
      if (const std::string err = run_and_wait(kern, g, ws, s); !err.empty()) {
        notes.push_back(std::string(c.name) + ", " + kern.name + ": " + err);
        failed = true;
        continue;
      }
      // z: each side rounds an FP32 sum of the same products once, in its own order; two FP16
      // ulps (2^-9 relative) cover both roundings, and the absolute 2^-12 the FP32 sums'
      // differing cancellation near zero (K * 2^-24 * sum |w x| stays below it for K <= 2048).
      const StatsCheck chk =
          check_stats(zb, za, m, c.k, 0x1p-9f, 0x1p-12f,
                      kern.mode != StatsMode::none ? sums : nullptr, href, cmp, s);
      const bool ok = chk.ok;
      const float t = median_ms(s, reps, [&] { return kern.run(g, ws, s).empty(); });
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
      if (kern.mode == StatsMode::none) {
        gemm_ms = gemm_ms < 0 ? t : std::min(gemm_ms, t);
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
        best_ms > 0 ? total_ms / best_ms : 0.0, gemm_ms, worst_z, worst_sum, worst_sq);
    std::fflush(stdout);
    step_a += total_ms * c.count;
    step_fprop += conv.ms * c.count;
    step_b += best_ms * c.count;
    step_gemm += gemm_ms * c.count;
  }
  std::printf("| **per step** | | %.2f | | %.2f | | %.2f | %.2fx | %.2f | | | |\n", step_fprop,
              step_a, step_b, step_b > 0 ? step_a / step_b : 0.0, step_gemm);
  std::printf("\nvariants:\n");
  for (const std::string& n : notes) std::printf("  %s\n", n.c_str());
  std::printf("summary: per step (a) %.2f ms, (b) %.2f ms, speedup %.2fx%s\n", step_a, step_b,
              step_b > 0 ? step_a / step_b : 0.0, failed ? ", FAILED (see above)" : "");
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(za),
                  static_cast<void*>(zb), partial, ws, static_cast<void*>(ref),
                  static_cast<void*>(sums), static_cast<void*>(cmp)})
    PROBE_CUDA(cudaFree(p));
  cudnnDestroy(handle);
  PROBE_CUDA(cudaStreamDestroy(s));
  return failed ? 1 : 0;
}
