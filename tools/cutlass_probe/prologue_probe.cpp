// kiln_cutlass_probe --prologue: does BatchNorm's apply + ReLU cost anything when it runs on the
// next 1x1 convolution's operand load (issue 20, stage 2's forward) instead of as its own pass?
//
// For each of ResNet-50's bottleneck conv3 layers (input: bn2 + ReLU of conv2's z [rows][c],
// output 4c channels; batch 256 by default), on the same random inputs in one process:
//   (a) today's form: kiln's CBR apply pass (y = relu(bn(z)) and its bit mask, apply_group),
//       then the backend's SM90 GEMM with BatchNorm's statistics (256x128 reg_atomic) on y;
//   (b) the faster prologue unit with the statistics (gemm_stats_sm90.cu with KILN_BN_PROLOGUE=1,
//       256x128 or 128x128): the same GEMM reading z, applying bn2 + ReLU to each A fragment in
//       registers, y and the mask never written.
//   (c) as (b) with the coefficients folded to (scale, shift) (KILN_BN_PROLOGUE=2): one FMA a
//       value; its y may differ from kiln's apply pass's by an FP16 ulp.
// Also each GEMM alone (`none`), so that the prologue's own cost inside the GEMM shows.
// (b)'s output is checked against (a)'s elementwise and its sums against kiln's double sums of
// (a)'s output. In a training step (b) also needs the mask recomputed in the backward and the
// weight gradient to read relu(bn(z)) on its load; neither is measured here.
#include <cuda_fp16.h>

#include <cmath>
#include <utility>
#include <vector>

#include "probe_common.h"
#include "probe_kernels.h"
#include "probe_variants.h"

namespace kiln::probe {
namespace {

using sm90::GemmStats;
using sm90::GemmStatsKernel;

struct Layer {
  const char* name;
  int count;     // such layers in one ResNet-50 step
  int64_t h, c;  // conv3's input height = width, input channels (output: 4c)
};

const Layer kLayers[] = {
    {"s1 56x56 64>256", 3, 56, 64},
    {"s2 28x28 128>512", 4, 28, 128},
    {"s3 14x14 256>1024", 6, 14, 256},
    {"s4 7x7 512>2048", 3, 7, 512},
};

// The unit of `units` named `name`, or null.
const GemmStatsKernel* unit(const std::vector<GemmStatsKernel>& units, const char* name) {
  for (const auto& u : units)
    if (std::strcmp(u.name, name) == 0) return &u;
  return nullptr;
}

}  // namespace

int prologue_probe(cudaStream_t s, const cudaDeviceProp& prop, int64_t batch, int reps,
                   int64_t only, const std::string& shape) {
  const int sms = prop.multiProcessorCount;
  const std::vector<GemmStatsKernel> plain = sm90::probe_gemm_stats_kernels();
  const std::vector<GemmStatsKernel> prologue = sm90::probe_gemm_bn_prologue_kernels();
  const std::vector<GemmStatsKernel> folded = sm90::probe_gemm_bn_folded_kernels();
  const GemmStatsKernel* gemm_stats = unit(plain, "256x128 reg_atomic cluster 1x1");
  const GemmStatsKernel* gemm_alone = unit(plain, "256x128 none cluster 1x1");
  const GemmStatsKernel* pro_alone = unit(prologue, "256x128 none cluster 1x1");
  const GemmStatsKernel* fold_alone = unit(folded, "256x128 none cluster 1x1");
  std::vector<const GemmStatsKernel*> pro_stats, fold_stats;
  for (const auto& u : prologue)
    if (u.mode != sm90::StatsMode::none) pro_stats.push_back(&u);
  for (const auto& u : folded)
    if (u.mode != sm90::StatsMode::none) fold_stats.push_back(&u);
  if (!gemm_stats || !gemm_alone || !pro_alone || !fold_alone || pro_stats.empty() ||
      fold_stats.empty()) {
    std::fprintf(stderr, "kiln_cutlass_probe: a 256x128 unit is missing from probe_variants.h\n");
    return 1;
  }

  size_t in_max = 0, out_max = 0, c_max = 0, stats_ws = 0, ws_max = 0;
  for (const Layer& l : kLayers) {
    const int64_t rows = batch * l.h * l.h;
    in_max = std::max<size_t>(in_max, rows * l.c);
    out_max = std::max<size_t>(out_max, rows * 4 * l.c);
    c_max = std::max<size_t>(c_max, 4 * l.c);
    stats_ws = std::max(stats_ws, kiln_stats_bytes(rows, 4 * l.c, sms));
    GemmStats g;
    g.m = rows, g.n = 4 * l.c, g.k = l.c, g.sm_count = sms;
    for (const GemmStatsKernel* u : {gemm_stats, gemm_alone, pro_alone, fold_alone})
      ws_max = std::max(ws_max, u->workspace(g));
    for (const GemmStatsKernel* u : pro_stats) ws_max = std::max(ws_max, u->workspace(g));
    for (const GemmStatsKernel* u : fold_stats) ws_max = std::max(ws_max, u->workspace(g));
  }
  auto* z = static_cast<__half*>(device_alloc(in_max * 2));
  auto* y = static_cast<__half*>(device_alloc(in_max * 2));
  auto* mask = static_cast<uint8_t*>(device_alloc(in_max / 8 + 1));
  auto* w = static_cast<__half*>(device_alloc(c_max * c_max / 4 * 2));
  auto* za = static_cast<__half*>(device_alloc(out_max * 2));
  auto* zb = static_cast<__half*>(device_alloc(out_max * 2));
  auto* coef = static_cast<float4*>(device_alloc(c_max * sizeof(float4)));
  auto* coef_f = static_cast<float4*>(device_alloc(c_max * sizeof(float4)));  // (c)'s
  void* partial = device_alloc(stats_ws);
  void* ws = device_alloc(ws_max);
  auto* ref = static_cast<double2*>(device_alloc(c_max * sizeof(double2)));
  auto* sums = static_cast<float*>(device_alloc(2 * c_max * sizeof(float)));
  auto* cmp = static_cast<unsigned long long*>(device_alloc(2 * sizeof(unsigned long long)));

  std::printf(
      "# %s (%d SMs), batch %lld, ResNet-50's conv3 (1x1) after bn2 + ReLU, median of %d runs "
      "(ms)\n",
      prop.name, sms, static_cast<long long>(batch), reps);
  std::printf(
      "| layer | per step | (a) apply | (a) GEMM+stats | (a) total | (b) prologue GEMM+stats | "
      "(b) unit | speedup | (c) folded | (c) unit | speedup | GEMM alone | prologue GEMM alone | "
      "folded GEMM alone | max z err | sum err | sumsq err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  bool failed = false;
  double step_a = 0, step_b = 0, step_c = 0, step_plain = 0, step_pro = 0, step_fold = 0;
  int64_t done = 0;
  for (const Layer& l : kLayers) {
    if (only > 0 && done++ >= only) break;
    if (!shape.empty() && std::strstr(l.name, shape.c_str()) == nullptr) continue;
    const int64_t rows = batch * l.h * l.h, k = 4 * l.c;
    // conv2's z near unit scale; bn2's coefficients as a trained layer's might be, about half
    // the values passing the ReLU; weights of variance 1/c.
    PROBE_CUDA(fill_uniform(z, rows * l.c, -2.0f, 2.0f, 11 + done, s));
    const float wr = std::sqrt(3.0f / static_cast<float>(l.c));
    PROBE_CUDA(fill_uniform(w, k * l.c, -wr, wr, 2000 + done, s));
    std::vector<float4> hc(static_cast<size_t>(l.c));
    for (size_t j = 0; j < hc.size(); ++j) {
      const auto u = [&](int salt) {  // a fixed pseudo-random value in [0, 1)
        return static_cast<float>((j * 2654435761u + salt * 40503u + done * 977u) % 1000) / 1000;
      };
      hc[j] = make_float4(0.4f * u(1) - 0.2f, 0.5f + u(2), u(3) - 0.5f, 0.0f);
    }
    std::vector<float4> hf(hc.size());  // (scale, beta - mean * scale)
    for (size_t j = 0; j < hc.size(); ++j)
      hf[j] = make_float4(hc[j].y, hc[j].z - hc[j].x * hc[j].y, 0.0f, 0.0f);
    PROBE_CUDA(
        cudaMemcpyAsync(coef, hc.data(), hc.size() * sizeof(float4), cudaMemcpyHostToDevice, s));
    PROBE_CUDA(
        cudaMemcpyAsync(coef_f, hf.data(), hf.size() * sizeof(float4), cudaMemcpyHostToDevice, s));

    GemmStats a;  // today's GEMM, on y
    a.x = y, a.w = w, a.z = za, a.sum = sums, a.sumsq = sums + k;
    a.m = rows, a.n = k, a.k = l.c, a.sm_count = sms;
    GemmStats b = a;  // the prologue's, on z
    b.x = z, b.z = zb, b.bn_coef = coef;
    GemmStats f = b;  // the folded prologue's
    f.bn_coef = coef_f;
    bool runs = true;
    std::vector<std::pair<const GemmStatsKernel*, const GemmStats*>> all = {
        {gemm_stats, &a}, {gemm_alone, &a}, {pro_alone, &b}, {fold_alone, &f}};
    for (const GemmStatsKernel* u : pro_stats) all.emplace_back(u, &b);
    for (const GemmStatsKernel* u : fold_stats) all.emplace_back(u, &f);
    for (const auto& [u, p] : all) {
      if (const std::string why = u->check(*p); !why.empty()) {
        std::printf("| %s | %s: %s |\n", l.name, u->name, why.c_str());
        runs = false;
      }
    }
    if (!runs) {
      failed = true;
      continue;
    }

    // (a), and the reference sums: kiln's double sums of (a)'s output.
    PROBE_CUDA(kiln_apply_relu(z, coef, rows, l.c, sms, y, mask, s));
    if (const std::string err = run_and_wait(*gemm_stats, a, ws, s); !err.empty()) {
      std::printf("| %s | (a) failed: %s |\n", l.name, err.c_str());
      failed = true;
      continue;
    }
    PROBE_CUDA(kiln_stats(za, rows, k, sms, partial, s));
    PROBE_CUDA(kiln_stats_total(partial, rows, k, sms, ref, s));
    std::vector<double2> href(static_cast<size_t>(k));
    PROBE_CUDA(cudaMemcpyAsync(href.data(), ref, href.size() * sizeof(double2),
                               cudaMemcpyDeviceToHost, s));
    PROBE_CUDA(cudaStreamSynchronize(s));

    // (b) and (c), each unit checked then timed: the same y bits enter the same GEMM, so z should
    // agree but for the order WGMMA adds in (register- against shared-memory-sourced A, other
    // tiles): two FP16 ulps and 2^-12 absolute, cutlass_probe.cpp's bound; (c)'s y may also move
    // by an ulp, well inside it over k >= 64 terms. Returns the fastest unit's time and name.
    StatsCheck chk;
    chk.ok = true;
    auto best = [&](const std::vector<const GemmStatsKernel*>& units, const GemmStats& p,
                    const char* form) -> std::pair<float, const char*> {
      float ms = -1;
      const char* name = "-";
      for (const GemmStatsKernel* u : units) {
        PROBE_CUDA(cudaMemsetAsync(zb, 0xFF, static_cast<size_t>(rows * k) * 2, s));  // NaNs
        if (const std::string err = run_and_wait(*u, p, ws, s); !err.empty()) {
          std::printf("| %s | %s %s failed: %s |\n", l.name, form, u->name, err.c_str());
          failed = true;
          continue;
        }
        const StatsCheck c = check_stats(zb, za, rows, k, 0x1p-9f, 0x1p-12f, sums, href, cmp, s);
        const float t = median_ms(s, reps, [&] { return u->run(p, ws, s).empty(); });
        std::printf("  %s, %s %s: %.3f ms, max z err %.2e (%llu over), sum %.1e, sumsq %.1e%s\n",
                    l.name, form, u->name, t, c.z_err, c.z_over, c.sum_err, c.sumsq_err,
                    c.ok ? "" : "  MISMATCH");
        chk.z_err = std::max(chk.z_err, c.z_err);
        chk.sum_err = std::max(chk.sum_err, c.sum_err);
        chk.sumsq_err = std::max(chk.sumsq_err, c.sumsq_err);
        chk.ok = chk.ok && c.ok;
        if (c.ok && t > 0 && (ms < 0 || t < ms)) {
          ms = t;
          name = u->name;
        }
      }
      return {ms, name};
    };
    const auto [pro_ms, pro_name] = best(pro_stats, b, "(b)");
    const auto [fold_ms, fold_name] = best(fold_stats, f, "(c)");
    failed = failed || !chk.ok || pro_ms < 0 || fold_ms < 0;

    const float apply_ms = median_ms(s, reps, [&] {
      return kiln_apply_relu(z, coef, rows, l.c, sms, y, mask, s) == cudaSuccess;
    });
    const float gemm_ms = median_ms(s, reps, [&] { return gemm_stats->run(a, ws, s).empty(); });
    const float total_ms = median_ms(s, reps, [&] {
      return kiln_apply_relu(z, coef, rows, l.c, sms, y, mask, s) == cudaSuccess &&
             gemm_stats->run(a, ws, s).empty();
    });
    const float plain_alone = median_ms(s, reps, [&] { return gemm_alone->run(a, ws, s).empty(); });
    const float pro_alone_ms = median_ms(s, reps, [&] { return pro_alone->run(b, ws, s).empty(); });
    const float fold_alone_ms =
        median_ms(s, reps, [&] { return fold_alone->run(f, ws, s).empty(); });
    std::printf(
        "| %s | %d | %.3f | %.3f | %.3f | %.3f | %s | %.2fx | %.3f | %s | %.2fx | %.3f | %.3f | "
        "%.3f | %.1e%s | %.1e | %.1e |\n",
        l.name, l.count, apply_ms, gemm_ms, total_ms, pro_ms, pro_name,
        pro_ms > 0 ? total_ms / pro_ms : 0.0, fold_ms, fold_name,
        fold_ms > 0 ? total_ms / fold_ms : 0.0, plain_alone, pro_alone_ms, fold_alone_ms, chk.z_err,
        chk.ok ? "" : " MISMATCH", chk.sum_err, chk.sumsq_err);
    std::fflush(stdout);
    step_a += total_ms * l.count;
    step_b += pro_ms * l.count;
    step_c += fold_ms * l.count;
    step_plain += plain_alone * l.count;
    step_pro += pro_alone_ms * l.count;
    step_fold += fold_alone_ms * l.count;
  }
  std::printf(
      "| **per step** | | | | %.2f | %.2f | | %.2fx | %.2f | | %.2fx | %.2f | %.2f | %.2f | | | "
      "|\n",
      step_a, step_b, step_b > 0 ? step_a / step_b : 0.0, step_c,
      step_c > 0 ? step_a / step_c : 0.0, step_plain, step_pro, step_fold);
  std::printf(
      "summary: per step (a) %.2f ms, (b) %.2f ms, speedup %.2fx, (c) folded %.2f ms, speedup "
      "%.2fx; GEMM alone %.2f ms, with the prologue %.2f ms, folded %.2f ms%s\n",
      step_a, step_b, step_b > 0 ? step_a / step_b : 0.0, step_c,
      step_c > 0 ? step_a / step_c : 0.0, step_plain, step_pro, step_fold,
      failed ? ", FAILED (see above)" : "");
  for (void* p : {static_cast<void*>(z), static_cast<void*>(y), static_cast<void*>(mask),
                  static_cast<void*>(w), static_cast<void*>(za), static_cast<void*>(zb),
                  static_cast<void*>(coef), static_cast<void*>(coef_f), partial, ws,
                  static_cast<void*>(ref), static_cast<void*>(sums), static_cast<void*>(cmp)})
    PROBE_CUDA(cudaFree(p));
  return failed ? 1 : 0;
}

}  // namespace kiln::probe
