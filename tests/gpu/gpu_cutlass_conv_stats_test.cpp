// kiln's SM90 implicit-GEMM convolution with BatchNorm's statistics in its epilogue
// (src/backend/cuda/cutlass/conv_stats.h), called directly, against
//  - a float64 reference: z = conv(x, w) in float64 (each z within its FP16 rounding and the FP32
//    accumulation's error), and the per-channel sums of the kernel's own z and z^2;
//  - what it replaces: kiln's conv_fwd (cuDNN) on the same inputs, z within an FP16 ulp;
// on VGG16's and ResNet-50's 3x3 shapes at small batches (stride 1 and 2), the padded stem's 7x7
// stride-2 filter, and odd sizes (rows and channels that end inside a tile). Every variant the
// backend links, so the tile and the sums' mode do not change z. Needs a compute capability 9.0
// GPU and a kiln built with its CUTLASS kernels; skips elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "support/fused_checks.h"

#ifdef KILN_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#ifdef KILN_HAVE_CUTLASS
#include "backend/cuda/cutlass/conv_stats.h"
#endif

namespace kiln::test {
namespace {

struct ConvCase {
  const char* name;
  int64_t n, h, w, c, k, r, stride, pad;  // x [n h w][c], w [k][r][r][c]
  int64_t p() const { return (h + 2 * pad - r) / stride + 1; }
  int64_t q() const { return (w + 2 * pad - r) / stride + 1; }
  int64_t rows() const { return n * p() * q(); }
};

struct Inputs {
  std::vector<float> x, w;  // FP16 values held as floats
};

Inputs make_inputs(const ConvCase& t) {
  const float wr = static_cast<float>(std::sqrt(3.0 / static_cast<double>(t.r * t.r * t.c)));
  // Post-ReLU inputs are non-negative, so z has a mean away from 0 as BatchNorm's inputs do.
  return {round_f16(rand_floats(t.n * t.h * t.w * t.c, 71, 0.0f, 1.0f)),
          round_f16(rand_floats(t.k * t.r * t.r * t.c, 72, -wr, wr))};
}

// z in float64 and, per element, the sum of the products' magnitudes (the accumulation's scale).
void conv_float64(const ConvCase& t, const Inputs& in, std::vector<double>& z,
                  std::vector<double>& mag) {
  z.assign(static_cast<size_t>(t.rows() * t.k), 0.0);
  mag.assign(z.size(), 0.0);
  for (int64_t b = 0; b < t.n; ++b)
    for (int64_t p = 0; p < t.p(); ++p)
      for (int64_t q = 0; q < t.q(); ++q)
        for (int64_t k = 0; k < t.k; ++k) {
          double s = 0.0, a = 0.0;
          for (int64_t r = 0; r < t.r; ++r)
            for (int64_t u = 0; u < t.r; ++u) {
              const int64_t y = p * t.stride + r - t.pad, x = q * t.stride + u - t.pad;
              if (y < 0 || y >= t.h || x < 0 || x >= t.w) continue;  // zero padding
              const float* xv = &in.x[static_cast<size_t>(((b * t.h + y) * t.w + x) * t.c)];
              const float* wv = &in.w[static_cast<size_t>(((k * t.r + r) * t.r + u) * t.c)];
              for (int64_t c = 0; c < t.c; ++c) {
                s += static_cast<double>(xv[c]) * wv[c];
                a += std::fabs(static_cast<double>(xv[c]) * wv[c]);
              }
            }
          const size_t e = static_cast<size_t>(((b * t.p() + p) * t.q() + q) * t.k + k);
          z[e] = s;
          mag[e] = a;
        }
}

// z against float64: the FP32 sum rounded to FP16 once (half an FP16 ulp, 2^-11 of |z|), plus
// the FP32 accumulation's error (chunked sums of at most 9 * 512 products: a few 1e-7 of the
// products' magnitudes; 4e-6 leaves room) and FP16's subnormal spacing. Returns the elements
// outside that bound.
int64_t z_outside_float64(const std::vector<double>& want, const std::vector<double>& mag,
                          const std::vector<float>& z) {
  int64_t bad = 0;
  for (size_t e = 0; e < want.size(); ++e) {
    const double tol = 0x1p-11 * std::fabs(want[e]) + 4e-6 * mag[e] + 0x1p-24;
    bad += !(std::fabs(z[e] - want[e]) <= tol);  // NaN counts
  }
  return bad;
}

// kiln's conv_fwd on its CUDA backend (cuDNN; the CUTLASS switches off).
std::vector<float> run_kiln_conv(const ConvCase& t, const Inputs& in) {
  OpHarness h(true);
  const fused::Maker mk{h, true};
  const TensorId x = mk.feature("x", {t.n, t.h, t.w, t.c});
  const TensorId w = mk.weight("w", {t.k, t.r, t.r, t.c});
  const TensorId z = mk.feature("z", {t.n, t.p(), t.q(), t.k});
  h.node(OpKind::conv_fwd, {x, w}, {z}, fused::conv_bn_attrs(t.r, t.stride, t.pad));
  Switches sw = Switches::from_environment();
  sw.cutlass = Auto::off;
  sw.cutlass_dgrad = Auto::off;
  h.compile(make_backend("cuda", sw));
  h.write(x, in.x);
  h.write(w, in.w);
  h.run();
  return h.read(z);
}

#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
struct Result {
  std::vector<float> z, sum, sumsq;
};

// clear_by_kernel: how the unit clears the sums it adds into (KILN_SUMS_CLEAR_KERNEL).
Result run_kernel(const ConvCase& t, const Inputs& in, const sm90::ConvStatsKernel& kern,
                  bool clear_by_kernel) {
  DeviceBuffer x = upload_half(in.x), w = upload_half(in.w);
  DeviceBuffer z(static_cast<size_t>(t.rows() * t.k) * 2),
      sums(sizeof(float) * static_cast<size_t>(2 * t.k));
  // NaNs where the kernel writes nothing, and in the sums a mode without them leaves (or a
  // clear that missed some).
  EXPECT_EQ(cudaMemset(z.p, 0xFF, static_cast<size_t>(t.rows() * t.k) * 2), cudaSuccess);
  EXPECT_EQ(cudaMemset(sums.p, 0xFF, sizeof(float) * static_cast<size_t>(2 * t.k)), cudaSuccess);
  sm90::ConvStats c;
  c.x = x.p, c.w = w.p, c.z = z.p;
  c.sum = static_cast<float*>(sums.p), c.sumsq = c.sum + t.k;
  c.n = static_cast<int>(t.n), c.h = static_cast<int>(t.h), c.w_ = static_cast<int>(t.w);
  c.c = static_cast<int>(t.c), c.k = static_cast<int>(t.k);
  c.r = c.s = static_cast<int>(t.r);
  c.pad_h = c.pad_w = static_cast<int>(t.pad);
  c.stride_h = c.stride_w = static_cast<int>(t.stride);
  EXPECT_EQ(cudaDeviceGetAttribute(&c.sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(cudaGetDevice(&c.device_id), cudaSuccess);
  c.clear_by_kernel = clear_by_kernel;
  const std::string why = kern.check(c);
  EXPECT_EQ(why, "") << kern.name;
  if (!why.empty()) return {};
  DeviceBuffer ws(kern.workspace(c));
  EXPECT_EQ(kern.run(c, ws.p, nullptr), "") << kern.name;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> zh(static_cast<size_t>(t.rows() * t.k));
  std::vector<float> sh(static_cast<size_t>(2 * t.k));
  EXPECT_EQ(cudaMemcpy(zh.data(), z.p, zh.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), sums.p, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  Result r;
  for (uint16_t v : zh) r.z.push_back(half_to_float(v));
  r.sum.assign(sh.begin(), sh.begin() + t.k);
  r.sumsq.assign(sh.begin() + t.k, sh.end());
  return r;
}

// The sums against float64 sums of the kernel's own z: FP32 running sums (per thread, then
// across the CTA and the grid by atomics) round with the terms' magnitudes, so the error is
// taken relative to sum |z| and sum z^2 per channel.
void expect_sums_near_float64(const ConvCase& t, const Result& got) {
  double worst_s = 0.0, worst_q = 0.0;
  int64_t not_finite = 0;
  for (int64_t k = 0; k < t.k; ++k) {
    not_finite += !std::isfinite(got.sum[static_cast<size_t>(k)]) +
                  !std::isfinite(got.sumsq[static_cast<size_t>(k)]);
    double s = 0.0, sa = 0.0, q = 0.0;
    for (int64_t r = 0; r < t.rows(); ++r) {
      const double v = got.z[static_cast<size_t>(r * t.k + k)];
      s += v;
      sa += std::fabs(v);
      q += v * v;
    }
    worst_s = std::max(worst_s, std::fabs(got.sum[static_cast<size_t>(k)] - s) / (sa + 1e-30));
    worst_q = std::max(worst_q, std::fabs(got.sumsq[static_cast<size_t>(k)] - q) / (q + 1e-30));
  }
  EXPECT_EQ(not_finite, 0) << "sums left NaN: not cleared, or not written";
  EXPECT_LE(worst_s, 1e-4) << "sum z against float64, relative to sum |z|";
  EXPECT_LE(worst_q, 1e-4) << "sum z^2 against float64, relative";
}
#endif

class GpuCutlassConvStats : public ::testing::TestWithParam<ConvCase> {};

TEST_P(GpuCutlassConvStats, AgreesWithFloat64AndCudnn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const ConvCase& t = GetParam();
#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
  const Inputs in = make_inputs(t);
  std::vector<double> want, mag;
  conv_float64(t, in, want, mag);
  const std::vector<float> cudnn = run_kiln_conv(t, in);
  EXPECT_EQ(z_outside_float64(want, mag, cudnn), 0) << "cuDNN's z against float64 (the bound)";
  std::vector<float> first_z;
  for (const sm90::ConvStatsKernel& kern : sm90::conv_stats_backend_kernels()) {
    SCOPED_TRACE(kern.name);
    if (kern.tile_n == 64 && t.k > 64) continue;  // conv_stats_kernel_for's choice
    const Result cut = run_kernel(t, in, kern, true);
    ASSERT_EQ(cut.z.size(), want.size());
    EXPECT_EQ(z_outside_float64(want, mag, cut.z), 0) << "z against float64";
    // cuDNN and CUTLASS sum the same products in different orders: neighbouring FP16
    // roundings, a few percent of the elements at most.
    int64_t differ = 0;
    for (size_t e = 0; e < cut.z.size(); ++e) differ += cut.z[e] != cudnn[e];
    EXPECT_LE(differ, static_cast<int64_t>(cut.z.size()) / 20 + 1) << "z elements unlike cuDNN's";
    if (kern.mode != sm90::StatsMode::none) expect_sums_near_float64(t, cut);
    if (first_z.empty()) first_z = cut.z;
    EXPECT_EQ(cut.z, first_z) << "z differs between variants";
    if (kern.mode == sm90::StatsMode::reg_partials) {
      // The deterministic form, its partials cleared by cudaMemsetAsync instead: the same bits.
      const Result again = run_kernel(t, in, kern, false);
      EXPECT_EQ(again.z, cut.z) << "deterministic z";
      EXPECT_EQ(again.sum, cut.sum) << "sums cleared by a memset or a kernel";
      EXPECT_EQ(again.sumsq, cut.sumsq) << "sums cleared by a memset or a kernel";
    }
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassConvStats,
    ::testing::Values(
        // VGG16's and ResNet-50's 3x3 layers at small batches and sizes.
        ConvCase{"vgg_28_c64_k64", 2, 28, 28, 64, 64, 3, 1, 1},
        ConvCase{"vgg_14_c128_k256", 2, 14, 14, 128, 256, 3, 1, 1},
        ConvCase{"vgg_7_c512_k512", 2, 7, 7, 512, 512, 3, 1, 1},
        ConvCase{"r50_conv2_s2_c128", 2, 16, 16, 128, 128, 3, 2, 1},
        ConvCase{"r50_conv2_7_c512", 4, 7, 7, 512, 512, 3, 1, 1},
        // The stem as kiln runs it with its channels padded to 8: 7x7, stride 2, padding 3.
        ConvCase{"stem_7x7_s2_c8_k64", 2, 32, 32, 8, 64, 7, 2, 3},
        // Odd sizes: fewer rows than a tile, rows and channels ending inside a tile, a 1x1
        // unpadded filter, and several CTAs adding into the same columns' sums.
        ConvCase{"n1_3x5_c8_k8", 1, 3, 5, 8, 8, 3, 1, 1},
        ConvCase{"n3_9x11_c24_k136", 3, 9, 11, 24, 136, 3, 1, 1},
        ConvCase{"n2_13x13_c16_k72_1x1", 2, 13, 13, 16, 72, 1, 1, 0},
        ConvCase{"n5_40x60_c32_k200", 5, 40, 60, 32, 200, 3, 1, 1}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::test
