// kiln's SM90 data-gradient kernel with BatchNorm-backward's sums in its epilogue
// (src/backend/cuda/cutlass/dgrad_bn.h), called directly, against
//  - a float64 reference: dX = dY W in float64, g = mask ? dX [+ dy2] : 0, and the two
//    per-channel sums of the kernel's own g;
//  - the unfused chain it replaces: kiln's conv_bwd_data (cuDNN) then bn_add_relu_bwd (kiln's
//    BatchNorm backward: its sums pass gives dbeta = sum g and dgamma = invstd sum g (z - mean),
//    its dresidual is g) on the same inputs;
// on ResNet-50's 1x1 dgrad shapes (conv3: k = 4w -> n = w; conv1: k = w -> n = 4w, with dy2) at
// small batches and odd sizes, in the atomic and the deterministic form (bit-for-bit repeatable);
// and the stride-1 convolution units (VGG's 3x3 layers, a 5x5) likewise, GpuCutlassConvDgradBn.
// Needs a compute capability 9.0 GPU and a kiln built with its CUTLASS kernels; skips elsewhere.
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
#include "backend/cuda/cutlass/dgrad_bn.h"
#endif

namespace kiln::test {
namespace {

struct DgradCase {
  const char* name;
  int64_t n, h, w, k, c;  // dY [n h w][k], W [k][r][r][c], dX [n h w][c]
  bool dy2;               // BN+add+ReLU (the residual path's gradient), else a CBR
  int64_t r = 1;          // the filter's size: stride 1, padded by (r - 1) / 2 to keep h x w
  int64_t pad() const { return (r - 1) / 2; }
};

// The inputs, FP16 values held as floats.
struct Inputs {
  std::vector<float> dy, w, z, dy2, saved;  // saved = [mean; invstd] [2][c]
  std::vector<uint8_t> mask;
};

Inputs make_inputs(const DgradCase& t) {
  const int64_t m = t.n * t.h * t.w;
  Inputs in;
  in.dy = round_f16(rand_floats(m * t.k, 61));
  in.w = round_f16(rand_floats(t.k * t.r * t.r * t.c, 62, -0.5f, 0.5f));
  in.z = round_f16(rand_floats(m * t.c, 63, -1.0f, 3.0f));  // a mean away from 0
  if (t.dy2) in.dy2 = round_f16(rand_floats(m * t.c, 64));
  const std::vector<float> bits = rand_floats((m * t.c + 7) / 8, 65, 0.0f, 256.0f);
  for (float b : bits) in.mask.push_back(static_cast<uint8_t>(std::min(255.0f, b)));
  in.saved.assign(static_cast<size_t>(2 * t.c), 0.0f);
  const std::vector<float> invstd = rand_floats(t.c, 66, 0.5f, 2.0f);
  for (int64_t c = 0; c < t.c; ++c) {
    double s = 0.0;
    for (int64_t r = 0; r < m; ++r) s += in.z[static_cast<size_t>(r * t.c + c)];
    in.saved[static_cast<size_t>(c)] = static_cast<float>(s / static_cast<double>(m));
    in.saved[static_cast<size_t>(t.c + c)] = invstd[static_cast<size_t>(c)];
  }
  return in;
}

bool bit(const std::vector<uint8_t>& mask, int64_t e) {
  return ((mask[static_cast<size_t>(e / 8)] >> (e % 8)) & 1u) != 0;
}

// What both forms give: g [m][c], and sum g, sum g (z - mean) per channel.
struct Result {
  std::vector<float> g, sum, sum_xhat;
};

// The unfused chain on kiln's CUDA backend: sum_xhat from dgamma / invstd.
Result run_kiln_chain(const DgradCase& t, const Inputs& in) {
  const Shape ys{t.n, t.h, t.w, t.k}, xs{t.n, t.h, t.w, t.c}, ws{t.k, t.r, t.r, t.c};
  OpHarness h(true);
  const fused::Maker mk{h, true};
  const TensorId dy = mk.feature("dy", ys), w = mk.weight("w", ws), dx = mk.feature("dx", xs);
  const TensorId z = mk.feature("z", xs), dy2 = t.dy2 ? mk.feature("dy2", xs) : kNoTensor;
  const TensorId mask = h.tensor("mask", {(xs.numel() + 7) / 8}, Region::aux, DType::U8);
  const TensorId gamma = mk.channels("gamma", t.c, Region::params_f32);
  const TensorId saved = h.tensor("saved", {2, t.c}, Region::bn_saved);
  const TensorId dz = mk.feature("dz", xs), dres = mk.feature("dres", xs);
  const TensorId dgamma = mk.channels("dgamma", t.c, Region::grads_f32),
                 dbeta = mk.channels("dbeta", t.c, Region::grads_f32);
  const Attrs a = fused::conv_bn_attrs(t.r, 1, t.pad());
  h.node(OpKind::conv_bwd_data, {dy, w}, {dx}, a);
  std::vector<TensorId> bn_in{z, dx, mask, gamma, saved};
  if (t.dy2) bn_in.push_back(dy2);
  h.node(OpKind::bn_add_relu_bwd, bn_in, {dz, dres, dgamma, dbeta}, a);
  Switches sw = Switches::from_environment();
  sw.cutlass = Auto::off;  // kiln's own form throughout, as the other CUTLASS tests' references
  sw.cutlass_dgrad = Auto::off;
  sw.deterministic = true;
  h.compile(make_backend("cuda", sw));
  h.write(dy, in.dy);
  h.write(w, in.w);
  h.write(z, in.z);
  if (t.dy2) h.write(dy2, in.dy2);
  h.write_u8(mask, in.mask);
  h.write(gamma, std::vector<float>(static_cast<size_t>(t.c), 1.0f));
  h.write(saved, in.saved);
  h.run();
  Result r{h.read(dres), h.read(dbeta), h.read(dgamma)};
  for (int64_t c = 0; c < t.c; ++c)
    r.sum_xhat[static_cast<size_t>(c)] /= in.saved[static_cast<size_t>(t.c + c)];
  return r;
}

#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
// One variant on the same inputs.
// clear_by_kernel: how the unit clears the sums it adds into (KILN_SUMS_CLEAR_KERNEL); the sums
// start as NaNs, so a clear that misses some shows.
Result run_kernel(const DgradCase& t, const Inputs& in, const sm90::DgradBnKernel& kern,
                  bool clear_by_kernel) {
  const int64_t m = t.n * t.h * t.w;
  DeviceBuffer dy = upload_half(in.dy), w = upload_half(in.w), z = upload_half(in.z);
  DeviceBuffer dy2(t.dy2 ? in.dy2.size() * 2 : 0), mask(in.mask.size()),
      mean(sizeof(float) * static_cast<size_t>(t.c)), g(static_cast<size_t>(m * t.c) * 2),
      sums(sizeof(float) * static_cast<size_t>(2 * t.c));
  if (t.dy2) {
    std::vector<uint16_t> h(in.dy2.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = float_to_half(in.dy2[i]);
    EXPECT_EQ(cudaMemcpy(dy2.p, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  EXPECT_EQ(cudaMemcpy(mask.p, in.mask.data(), in.mask.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cudaMemset(sums.p, 0xFF, sizeof(float) * static_cast<size_t>(2 * t.c)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(mean.p, in.saved.data(), sizeof(float) * static_cast<size_t>(t.c),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  sm90::DgradBn d;
  d.dy = dy.p;
  d.w = w.p;
  d.z = z.p;
  d.mask = static_cast<const uint8_t*>(mask.p);
  d.dy2 = t.dy2 ? dy2.p : nullptr;
  d.mean = static_cast<const float*>(mean.p);
  d.g = g.p;
  d.sums = static_cast<float*>(sums.p);
  d.m = m;
  d.n = t.c;
  d.k = t.k;
  d.h = static_cast<int>(t.h);
  d.w_ = static_cast<int>(t.w);
  d.r = d.s = static_cast<int>(t.r);
  d.pad_h = d.pad_w = static_cast<int>(t.pad());
  d.clear_by_kernel = clear_by_kernel;
  EXPECT_EQ(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const std::string why = kern.check(d);
  EXPECT_EQ(why, "") << kern.name;
  if (!why.empty()) return {};
  DeviceBuffer ws(kern.workspace(d));
  EXPECT_EQ(kern.run(d, ws.p, nullptr), "") << kern.name;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> gh(static_cast<size_t>(m * t.c));
  std::vector<float> sh(static_cast<size_t>(2 * t.c));
  EXPECT_EQ(cudaMemcpy(gh.data(), g.p, gh.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sh.data(), sums.p, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  Result r;
  for (uint16_t v : gh) r.g.push_back(half_to_float(v));
  r.sum.assign(sh.begin(), sh.begin() + t.c);
  r.sum_xhat.assign(sh.begin() + t.c, sh.end());
  return r;
}
#endif

// g against float64: dX[p][c] = sum over taps (i, j) and k of dY[p + pad - (i, j)][k] W[k][i][j][c]
// (zero outside the image) summed in FP32 and rounded to FP16 (half an FP16 ulp, 2^-11 of |dX|),
// dy2 added and rounded again (2^-11 of the sum's magnitude): at most 2^-10 (|dX| + |dy2|), plus
// the FP32 sums' own error (the MMAs' chunked FP32 sums of the products: a few 1e-7 of their
// magnitudes; 4e-6 leaves room) and FP16's subnormal spacing. Returns the elements outside that
// bound.
int64_t g_outside_float64(const DgradCase& t, const Inputs& in, const std::vector<float>& g) {
  int64_t bad = 0;
  std::vector<double> acc(static_cast<size_t>(t.c)), mag(static_cast<size_t>(t.c));
  for (int64_t img = 0; img < t.n; ++img) {
    for (int64_t y = 0; y < t.h; ++y) {
      for (int64_t x = 0; x < t.w; ++x) {
        std::fill(acc.begin(), acc.end(), 0.0);
        std::fill(mag.begin(), mag.end(), 0.0);
        for (int64_t i = 0; i < t.r; ++i) {
          for (int64_t j = 0; j < t.r; ++j) {
            const int64_t yy = y + t.pad() - i, xx = x + t.pad() - j;
            if (yy < 0 || yy >= t.h || xx < 0 || xx >= t.w) continue;
            const float* dyr = &in.dy[static_cast<size_t>(((img * t.h + yy) * t.w + xx) * t.k)];
            for (int64_t k = 0; k < t.k; ++k) {
              const double a = dyr[k];
              const float* wr = &in.w[static_cast<size_t>(((k * t.r + i) * t.r + j) * t.c)];
              for (int64_t c = 0; c < t.c; ++c) {
                acc[static_cast<size_t>(c)] += a * wr[c];
                mag[static_cast<size_t>(c)] += std::fabs(a * wr[c]);
              }
            }
          }
        }
        const int64_t row = (img * t.h + y) * t.w + x;
        for (int64_t c = 0; c < t.c; ++c) {
          const int64_t e = row * t.c + c;
          const double d2 = t.dy2 ? in.dy2[static_cast<size_t>(e)] : 0.0;
          const double v = acc[static_cast<size_t>(c)];
          const double want = bit(in.mask, e) ? v + d2 : 0.0;
          const double tol = 0x1p-10 * (std::fabs(v) + std::fabs(d2)) +
                             4e-6 * mag[static_cast<size_t>(c)] + 0x1p-24;
          bad += !(std::fabs(g[static_cast<size_t>(e)] - want) <= tol);  // NaN counts
        }
      }
    }
  }
  return bad;
}

// The kernel's sums against float64 sums of its own g: FP32 running sums (per thread, then
// across the CTA and the grid) round with the terms' magnitudes, not their cancelling result,
// so the error is taken relative to sum |term| per channel.
void expect_sums_near_float64(const DgradCase& t, const Inputs& in, const Result& got) {
  const int64_t m = t.n * t.h * t.w;
  double worst_s = 0.0, worst_x = 0.0;
  int64_t not_finite = 0;
  for (int64_t c = 0; c < t.c; ++c) {
    not_finite += !std::isfinite(got.sum[static_cast<size_t>(c)]) +
                  !std::isfinite(got.sum_xhat[static_cast<size_t>(c)]);
    double s = 0.0, sa = 0.0, x = 0.0, xa = 0.0;
    const double mean = in.saved[static_cast<size_t>(c)];
    for (int64_t r = 0; r < m; ++r) {
      const double gv = got.g[static_cast<size_t>(r * t.c + c)];
      const double v = gv * (in.z[static_cast<size_t>(r * t.c + c)] - mean);
      s += gv;
      sa += std::fabs(gv);
      x += v;
      xa += std::fabs(v);
    }
    worst_s = std::max(worst_s, std::fabs(got.sum[static_cast<size_t>(c)] - s) / (sa + 1e-30));
    worst_x = std::max(worst_x, std::fabs(got.sum_xhat[static_cast<size_t>(c)] - x) / (xa + 1e-30));
  }
  EXPECT_EQ(not_finite, 0) << "sums left NaN: not cleared, or not written";
  EXPECT_LE(worst_s, 1e-4) << "sum g against float64, relative to sum |g|";
  EXPECT_LE(worst_x, 1e-4) << "sum g (z - mean) against float64, relative to sum |g (z - mean)|";
}

// Against kiln's chain: g may differ by the FP16 roundings of dX (cuDNN and CUTLASS sum in
// different orders), so each channel's sums may differ by what those g differences add up to,
// plus both forms' FP32/double summation error (1e-4 of the terms' magnitudes, as above).
void expect_agrees_with_chain(const DgradCase& t, const Inputs& in, const Result& cut,
                              const Result& kiln) {
  const int64_t m = t.n * t.h * t.w;
  int64_t differ = 0;
  for (int64_t c = 0; c < t.c; ++c) {
    double dg = 0.0, dgx = 0.0, sa = 0.0, xa = 0.0;
    const double mean = in.saved[static_cast<size_t>(c)];
    for (int64_t r = 0; r < m; ++r) {
      const size_t e = static_cast<size_t>(r * t.c + c);
      const double zc = in.z[e] - mean, d = std::fabs(static_cast<double>(cut.g[e]) - kiln.g[e]);
      differ += cut.g[e] != kiln.g[e];
      dg += d;
      dgx += d * std::fabs(zc);
      sa += std::fabs(kiln.g[e]);
      xa += std::fabs(kiln.g[e] * zc);
    }
    EXPECT_LE(std::fabs(cut.sum[static_cast<size_t>(c)] - kiln.sum[static_cast<size_t>(c)]),
              dg + 1e-4 * sa)
        << "sum g (dbeta), channel " << c;
    EXPECT_LE(
        std::fabs(cut.sum_xhat[static_cast<size_t>(c)] - kiln.sum_xhat[static_cast<size_t>(c)]),
        dgx + 1e-4 * xa)
        << "sum g (z - mean) (dgamma / invstd), channel " << c;
  }
  // Neighbouring FP16 roundings of the same dX: a few percent of the elements at most.
  EXPECT_LE(differ, m * t.c / 20 + 1) << "g elements that differ from kiln's dresidual";
}

#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
// Every variant of `kernels` on the case, against float64 and kiln's chain: the tile shape and
// the sums' form do not change what is computed.
void expect_variants_agree(const DgradCase& t, const std::vector<sm90::DgradBnKernel>& kernels) {
  const Inputs in = make_inputs(t);
  const Result kiln = run_kiln_chain(t, in);
  EXPECT_EQ(g_outside_float64(t, in, kiln.g), 0) << "kiln's chain against float64 (the bound)";
  std::vector<float> first_g;
  for (const sm90::DgradBnKernel& kern : kernels) {
    SCOPED_TRACE(kern.name);
    const Result cut = run_kernel(t, in, kern, true);
    ASSERT_EQ(cut.g.size(), kiln.g.size());
    EXPECT_EQ(g_outside_float64(t, in, cut.g), 0) << "g against float64";
    expect_sums_near_float64(t, in, cut);
    expect_agrees_with_chain(t, in, cut, kiln);
    // g does not depend on the tile or on how the sums are added: the same bits.
    if (first_g.empty()) first_g = cut.g;
    EXPECT_EQ(cut.g, first_g) << "g differs between variants";
    if (kern.mode == sm90::StatsMode::reg_partials) {
      // Its partials cleared by cudaMemsetAsync this time: the same bits.
      const Result again = run_kernel(t, in, kern, false);
      EXPECT_EQ(again.g, cut.g) << "deterministic g";
      EXPECT_EQ(again.sum, cut.sum) << "deterministic sum g";
      EXPECT_EQ(again.sum_xhat, cut.sum_xhat) << "deterministic sum g (z - mean)";
    }
  }
}
#endif

class GpuCutlassDgradBn : public ::testing::TestWithParam<DgradCase> {};

TEST_P(GpuCutlassDgradBn, AgreesWithFloat64AndKilnsChain) {
  KILN_REQUIRE_SM90_CUTLASS();
#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
  expect_variants_agree(GetParam(), sm90::dgrad_bn_backend_kernels(GetParam().dy2));
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassDgradBn,
    ::testing::Values(
        // ResNet-50's bottleneck 1x1 data gradients at small batches. conv3's (k = 4w -> w)
        // feeds bn2 of a CBR; conv1's (k = w -> 4w) feeds the previous block's bn3 (BN+add+ReLU,
        // dy2 from the residual path).
        DgradCase{"r50_conv3_56_w64", 2, 56, 56, 256, 64, false},
        DgradCase{"r50_conv1_56_w64", 2, 56, 56, 64, 256, true},
        DgradCase{"r50_conv3_28_w128", 2, 28, 28, 512, 128, false},
        DgradCase{"r50_conv1_28_w128", 2, 28, 28, 128, 512, true},
        DgradCase{"r50_conv3_14_w256", 2, 14, 14, 1024, 256, false},
        DgradCase{"r50_conv1_14_w256", 2, 14, 14, 256, 1024, true},
        DgradCase{"r50_conv3_7_w512", 4, 7, 7, 2048, 512, false},
        DgradCase{"r50_conv1_7_w512", 4, 7, 7, 512, 2048, true},
        // Odd sizes: rows fewer than a tile and not a multiple of it, k under the 64-wide K step,
        // channel counts that end inside a column block, and several tiles per CTA over
        // several column blocks (840 channels: 7 blocks, which no CTA count near the SMs'
        // divides, so CTAs move between blocks and flush their sums on the way).
        DgradCase{"n3_5x7_k16_c8", 3, 5, 7, 16, 8, false},
        DgradCase{"n1_3x3_k40_c24_dy2", 1, 3, 3, 40, 24, true},
        DgradCase{"n2_9x11_k72_c136", 2, 9, 11, 72, 136, false},
        DgradCase{"n5_13x13_k264_c16_dy2", 5, 13, 13, 264, 16, true},
        DgradCase{"n5_40x100_k32_c840_dy2", 5, 40, 100, 32, 840, true}),
    [](const auto& info) { return std::string(info.param.name); });

// The stride-1 convolution units (conv_dgrad_bn_sm90.cu, cooperative and ping-pong): VGG's 3x3
// data gradients that feed the previous CBR's BatchNorm, at small batches, and odd sizes (rows
// and channels ending inside a tile, a 5x5 filter, the residual path's gradient).
class GpuCutlassConvDgradBn : public ::testing::TestWithParam<DgradCase> {};

TEST_P(GpuCutlassConvDgradBn, AgreesWithFloat64AndKilnsChain) {
  KILN_REQUIRE_SM90_CUTLASS();
#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
  expect_variants_agree(GetParam(), sm90::conv_dgrad_bn_backend_kernels(GetParam().dy2));
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassConvDgradBn,
    ::testing::Values(DgradCase{"vgg_14_k128_c64", 2, 14, 14, 128, 64, false, 3},
                      DgradCase{"vgg_14_k256_c128", 2, 14, 14, 256, 128, false, 3},
                      DgradCase{"vgg_7_k512_c512", 2, 7, 7, 512, 512, false, 3},
                      DgradCase{"n3_9x11_k72_c136", 3, 9, 11, 72, 136, false, 3},
                      // Several tiles a warpgroup (the ping-pong units' sums flushed as their
                      // column block changes, and after the last tile), a partial last M tile.
                      DgradCase{"n14_28x28_k16_c840", 14, 28, 28, 16, 840, false, 3},
                      // Far more column blocks than row blocks (2 of 128 rows, 267 of 64
                      // columns, 134 of 128): the scheduler rasters along M, so a ping-pong
                      // warpgroup's tiles change column block every time and its order check
                      // reads the other raster; the last column block ends inside N (the
                      // checked loop beside whole tiles) and the mask rows are not aligned.
                      DgradCase{"n4_8x8_k16_c17032", 4, 8, 8, 16, 17032, false, 3},
                      DgradCase{"n2_10x6_k40_c24_5x5_dy2", 2, 10, 6, 40, 24, true, 5},
                      DgradCase{"n1_3x3_k16_c8_dy2", 1, 3, 3, 16, 8, true, 3}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::test
