// The first layer's direct convolution (src/backend/cuda/first_layer_conv.h), called directly,
// against a float64 reference: z = conv(x, w) over 4 channels into 64 (each z within its FP16
// rounding and the FP32 accumulation's error), and the per-channel sums of the kernel's own z and
// z^2 (BatchNorm's statistics). Shapes: VGG's 3x3 stride-1 first layer and ResNet-50's 7x7
// stride-2 stem at small sizes, a rectangular filter with unequal padding, a 1x1, and enough
// rows that each CTA of the persistent grid walks several tiles, the last one partial. Then the
// CBR forward on it (KILN_FIRST_LAYER_CONV=1) against the CBR forward without it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "gpu/step_forms.h"
#include "support/fused_checks.h"

#ifdef KILN_HAVE_CUDA
#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/first_layer_wgrad.h"
#endif

namespace kiln::test {
namespace {

constexpr int64_t kC = 4, kK = 64;

struct Case {
  const char* name;
  int n, h, w, r, s, stride_h, stride_w, pad_h, pad_w;
  int p() const { return (h + 2 * pad_h - r) / stride_h + 1; }
  int q() const { return (w + 2 * pad_w - s) / stride_w + 1; }
  int64_t rows() const { return static_cast<int64_t>(n) * p() * q(); }
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

struct Inputs {
  std::vector<float> x, w;  // FP16 values held as floats
};

Inputs make_inputs(const Case& t) {
  const float wr = static_cast<float>(std::sqrt(3.0 / static_cast<double>(t.r * t.s * kC)));
  // Pixels in [0, 1] as a normalised image's are near; weights of variance 1 / fan-in.
  return {round_f16(rand_floats(int64_t{t.n} * t.h * t.w * kC, 81, -1.0f, 1.0f)),
          round_f16(rand_floats(kK * t.r * t.s * kC, 82, -wr, wr))};
}

// z in float64 and, per element, the sum of its products' magnitudes.
void conv_float64(const Case& t, const Inputs& in, std::vector<double>& z,
                  std::vector<double>& mag) {
  z.assign(static_cast<size_t>(t.rows() * kK), 0.0);
  mag.assign(z.size(), 0.0);
  for (int64_t b = 0; b < t.n; ++b)
    for (int64_t p = 0; p < t.p(); ++p)
      for (int64_t q = 0; q < t.q(); ++q)
        for (int64_t k = 0; k < kK; ++k) {
          double s = 0.0, a = 0.0;
          for (int64_t dy = 0; dy < t.r; ++dy)
            for (int64_t dx = 0; dx < t.s; ++dx) {
              const int64_t y = p * t.stride_h + dy - t.pad_h, x = q * t.stride_w + dx - t.pad_w;
              if (y < 0 || y >= t.h || x < 0 || x >= t.w) continue;  // zero padding
              const float* xv = &in.x[static_cast<size_t>(((b * t.h + y) * t.w + x) * kC)];
              const float* wv = &in.w[static_cast<size_t>(((k * t.r + dy) * t.s + dx) * kC)];
              for (int64_t c = 0; c < kC; ++c) {
                s += static_cast<double>(xv[c]) * wv[c];
                a += std::fabs(static_cast<double>(xv[c]) * wv[c]);
              }
            }
          const size_t e = static_cast<size_t>(((b * t.p() + p) * t.q() + q) * kK + k);
          z[e] = s;
          mag[e] = a;
        }
}

// Shapes both kernels take: VGG's 3x3 stride-1 first layer and ResNet-50's 7x7 stride-2 stem at
// small sizes, a rectangular filter with unequal padding and strides, a 1x1, enough pixels that
// each CTA of the persistent grid walks several tiles (the last one partial), and images smaller
// than a warp's 32 pixels; then each kernel's own (its largest filter).
std::vector<Case> with_cases(std::vector<Case> own) {
  std::vector<Case> c = {Case{"vgg_3x3_n2_20x20", 2, 20, 20, 3, 3, 1, 1, 1, 1},
                         Case{"stem_7x7_s2_n2_30x30", 2, 30, 30, 7, 7, 2, 2, 3, 3},
                         Case{"rect_3x5_pad1x2_s2x1_n2_9x17", 2, 9, 17, 3, 5, 2, 1, 1, 2},
                         Case{"one_by_one_n1_9x7", 1, 9, 7, 1, 1, 1, 1, 0, 0},
                         Case{"many_tiles_3x3_n8_96x97", 8, 96, 97, 3, 3, 1, 1, 1, 1},
                         Case{"small_images_3x3_n40_5x3", 40, 5, 3, 3, 3, 1, 1, 1, 1}};
  c.insert(c.end(), own.begin(), own.end());
  return c;
}

class GpuFirstLayerConv : public ::testing::TestWithParam<Case> {};

TEST_P(GpuFirstLayerConv, AgreesWithFloat64) {
  KILN_REQUIRE_GPU();
#ifdef KILN_HAVE_CUDA
  const Case& t = GetParam();
  const Inputs in = make_inputs(t);
  std::vector<double> want, mag;
  conv_float64(t, in, want, mag);
  DeviceBuffer x = upload_half(in.x), w = upload_half(in.w);
  const size_t zn = static_cast<size_t>(t.rows() * kK);
  DeviceBuffer z(zn * 2), sums(2 * kK * sizeof(float));
  // NaNs where the kernel writes nothing, and in the sums it writes, not adds to.
  ASSERT_EQ(cudaMemset(z.p, 0xFF, zn * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(sums.p, 0xFF, 2 * kK * sizeof(float)), cudaSuccess);
  cuda::FirstLayerConv c;
  c.x = static_cast<const __half*>(x.p), c.w = static_cast<const __half*>(w.p);
  c.z = static_cast<__half*>(z.p), c.sums = static_cast<float*>(sums.p);
  c.n = t.n, c.h = t.h, c.w_ = t.w, c.r = t.r, c.s = t.s;
  c.stride_h = t.stride_h, c.stride_w = t.stride_w, c.pad_h = t.pad_h, c.pad_w = t.pad_w;
  ASSERT_EQ(cuda::first_layer_conv_refusal(c), "");
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  // A grid of four SMs' CTAs as well as the full one: every CTA then walks many tiles.
  for (const int grid_sms : {sms, 4}) {
    SCOPED_TRACE("persistent grid over " + std::to_string(grid_sms) + " SMs");
    unsigned grid = 0;
    ASSERT_EQ(cuda::prepare_first_layer_conv(c, grid_sms, &grid), cudaSuccess);
    DeviceBuffer partials(cuda::first_layer_conv_workspace(grid));
    ASSERT_EQ(cudaMemset(partials.p, 0, cuda::first_layer_conv_workspace(grid)), cudaSuccess);
    c.partials = static_cast<float*>(partials.p);
    // Twice: the CTAs' shares are added in a fixed order (the last CTA's), so the same bits,
    // and the first launch left its counter ready for the second.
    std::vector<float> sh(2 * kK), first(2 * kK);
    for (int run = 0; run < 2; ++run) {
      ASSERT_EQ(cuda::launch_first_layer_conv(c, grid, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(sh.data(), sums.p, sh.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      if (run == 0) {
        first = sh;
        ASSERT_EQ(cudaMemset(sums.p, 0xFF, 2 * kK * sizeof(float)), cudaSuccess);  // NaNs again
      }
    }
    EXPECT_EQ(std::memcmp(first.data(), sh.data(), sh.size() * 4), 0)
        << "the same sums' bits twice";
    std::vector<uint16_t> zh(zn);
    ASSERT_EQ(cudaMemcpy(zh.data(), z.p, zn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> got(zn);
    for (size_t e = 0; e < zn; ++e) got[e] = half_to_float(zh[e]);
    // z: the FP32 sum rounded to FP16 once (2^-11 of |z|), the FP32 accumulation's error over at
    // most 256 products (4e-6 of their magnitudes leaves room) and FP16's subnormal spacing.
    int64_t bad = 0;
    for (size_t e = 0; e < zn; ++e) {
      const double tol = 0x1p-11 * std::fabs(want[e]) + 4e-6 * mag[e] + 0x1p-24;
      bad += !(std::fabs(got[e] - want[e]) <= tol);  // NaN counts
    }
    EXPECT_EQ(bad, 0) << "z elements outside their FP16 bound of float64, of " << zn;
    // The sums against float64 sums of the kernel's own z: FP32 running sums over a lane's rows
    // (~9,300 of them on the small grid), then across warps and CTAs, round with the
    // terms' magnitudes: ~sqrt(rows) 2^-24 of them, 1e-4 as the SM90 units' test allows.
    double worst_s = 0.0, worst_q = 0.0;
    for (int64_t k = 0; k < kK; ++k) {
      double s = 0.0, sa = 0.0, q = 0.0;
      for (int64_t r = 0; r < t.rows(); ++r) {
        const double v = got[static_cast<size_t>(r * kK + k)];
        s += v, sa += std::fabs(v), q += v * v;
      }
      const double es = std::fabs(sh[static_cast<size_t>(k)] - s) / (sa + 1e-30);
      const double eq = std::fabs(sh[static_cast<size_t>(kK + k)] - q) / (q + 1e-30);
      worst_s = std::max(worst_s, std::isfinite(es) ? es : INFINITY);
      worst_q = std::max(worst_q, std::isfinite(eq) ? eq : INFINITY);
    }
    EXPECT_LE(worst_s, 1e-4) << "sum z against float64, relative to sum |z|";
    EXPECT_LE(worst_q, 1e-4) << "sum z^2 against float64, relative";
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuFirstLayerConv,
                         ::testing::ValuesIn(with_cases({Case{"odd_5x5_n3_13x11", 3, 13, 11, 5, 5,
                                                              1, 1, 2, 2},
                                                         Case{"largest_filter_11x11_n2_20x18", 2,
                                                              20, 18, 11, 11, 1, 1, 5, 4}})),
                         [](const auto& info) { return std::string(info.param.name); });

// The first layer's weight gradient (first_layer_wgrad.h) against float64: dw[k][tap][c] =
// sum over output pixels of dz[pixel][k] x[tap's pixel][c], in FP32 with x's 4 channels and in
// FP16 with the first 3 (a padded first layer's dw), on the full grid and on four SMs' CTAs (each
// then sums many tiles); the same bits twice (the CTAs' shares are added in a fixed order).
class GpuFirstLayerWgrad : public ::testing::TestWithParam<Case> {};

TEST_P(GpuFirstLayerWgrad, AgreesWithFloat64) {
  KILN_REQUIRE_GPU();
#ifdef KILN_HAVE_CUDA
  const Case& t = GetParam();
  const Inputs in = make_inputs(t);
  const std::vector<float> dz = round_f16(rand_floats(t.rows() * kK, 83, -1.0f, 1.0f));
  const int64_t taps = int64_t{t.r} * t.s;
  std::vector<double> want(static_cast<size_t>(kK * taps * kC), 0.0), mag(want.size(), 0.0);
  for (int64_t b = 0; b < t.n; ++b)
    for (int64_t p = 0; p < t.p(); ++p)
      for (int64_t q = 0; q < t.q(); ++q) {
        const float* d = &dz[static_cast<size_t>(((b * t.p() + p) * t.q() + q) * kK)];
        for (int64_t dy = 0; dy < t.r; ++dy)
          for (int64_t dx = 0; dx < t.s; ++dx) {
            const int64_t ih = p * t.stride_h - t.pad_h + dy, iw = q * t.stride_w - t.pad_w + dx;
            if (ih < 0 || ih >= t.h || iw < 0 || iw >= t.w) continue;
            const float* xv = &in.x[static_cast<size_t>(((b * t.h + ih) * t.w + iw) * kC)];
            for (int64_t k = 0; k < kK; ++k)
              for (int64_t c = 0; c < kC; ++c) {
                const double v = static_cast<double>(d[k]) * xv[c];
                const auto e = static_cast<size_t>((k * taps + dy * t.s + dx) * kC + c);
                want[e] += v, mag[e] += std::fabs(v);
              }
          }
      }
  DeviceBuffer x = upload_half(in.x), dzb = upload_half(dz);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const bool f32 : {true, false}) {
    const int channels = f32 ? 4 : 3;
    const size_t dwn = static_cast<size_t>(kK * taps * channels), bytes = dwn * (f32 ? 4 : 2);
    for (const int grid_sms : {sms, 4}) {
      SCOPED_TRACE(std::string(f32 ? "FP32 dw, 4 channels" : "FP16 dw, 3 channels") +
                   ", persistent grid over " + std::to_string(grid_sms) + " SMs");
      DeviceBuffer dw(bytes);
      ASSERT_EQ(cudaMemset(dw.p, 0xFF, bytes), cudaSuccess);  // NaNs where nothing is written
      cuda::FirstLayerWgrad c;
      static_cast<cuda::FirstLayerShape&>(c) = {t.n,        t.h,        t.w,     t.r,    t.s,
                                                t.stride_h, t.stride_w, t.pad_h, t.pad_w};
      c.x = static_cast<const __half*>(x.p), c.dz = static_cast<const __half*>(dzb.p);
      c.dw = dw.p, c.dw_f32 = f32, c.dw_channels = channels;
      ASSERT_EQ(cuda::first_layer_wgrad_refusal(c), "");
      unsigned grid = 0;
      ASSERT_EQ(cuda::prepare_first_layer_wgrad(c, grid_sms, &grid), cudaSuccess);
      DeviceBuffer ws(cuda::first_layer_wgrad_workspace(c, grid));
      c.partials = static_cast<float*>(ws.p);
      std::vector<std::vector<uint8_t>> runs;
      for (int run = 0; run < 2; ++run) {
        ASSERT_EQ(cuda::launch_first_layer_wgrad(c, grid, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        runs.emplace_back(bytes);
        ASSERT_EQ(cudaMemcpy(runs.back().data(), dw.p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      EXPECT_EQ(runs[0], runs[1]) << "two runs, different bits";
      // FP32 sums of exact FP16 products, in 16-deep MMA steps, then over a CTA's tiles and over
      // the CTAs (up to ~1,200 additions in a row on four SMs): 1e-5 of the products'
      // magnitudes leaves room; FP16's dw rounds once more (2^-11) and has subnormals.
      int64_t bad = 0;
      for (size_t i = 0; i < dwn; ++i) {
        const size_t k = i / (taps * channels), tap = i / channels % taps, ch = i % channels;
        const size_t e = (k * taps + tap) * kC + ch;
        float got = 0.0f;
        if (f32) {
          std::memcpy(&got, runs[0].data() + 4 * i, 4);
        } else {
          uint16_t h = 0;
          std::memcpy(&h, runs[0].data() + 2 * i, 2);
          got = half_to_float(h);
        }
        const double tol =
            1e-5 * mag[e] + (f32 ? 0.0 : 0x1p-11 * std::fabs(want[e]) + 0x1p-24) + 1e-30;
        bad += !(std::fabs(got - want[e]) <= tol);  // NaN counts
      }
      EXPECT_EQ(bad, 0) << "dw elements outside their bound of float64, of " << dwn;
    }
  }
#endif
}

// With the shared cases, every warp split the kernel has: 1 to 4 column pairs a warp in one run
// (1x1, 2x3, 3x3, 3x5), two runs (5x5: 7 pairs) and four (7x7: 13, 8x8: 16).
INSTANTIATE_TEST_SUITE_P(Shapes, GpuFirstLayerWgrad,
                         ::testing::ValuesIn(with_cases(
                             {Case{"largest_filter_8x8_n2_20x18", 2, 20, 18, 8, 8, 1, 1, 3, 4},
                              Case{"two_runs_5x5_n3_13x11", 3, 13, 11, 5, 5, 1, 1, 2, 2},
                              Case{"two_pairs_2x3_n2_11x9", 2, 11, 9, 2, 3, 1, 1, 0, 1}})),
                         [](const auto& info) { return std::string(info.param.name); });

// The weight gradient forming dz itself from BatchNorm's backward (FirstLayerWgrad::bn) against
// the same kernel reading that dz, formed here on the host as bn_kernels.cuh's dx pass forms it:
// dz = k.y (g - k.z - (z - k.x) k.w), g zero where the mask's bit is clear. The values are
// dyadic with few bits (g, z and k.x, k.z in 1/64ths, k.y, k.w in 1/16ths) so that every step
// before dz's rounding to FP16 is exact in FP32, fused or not: the host's dz is the kernel's to
// the bit, and so dw must be the same bits. With the mask and without it (every element passes).
TEST_P(GpuFirstLayerWgrad, FoldFormsDzAsBatchNormsDxPass) {
  KILN_REQUIRE_GPU();
#ifdef KILN_HAVE_CUDA
  const Case& t = GetParam();
  const Inputs in = make_inputs(t);
  const size_t count = static_cast<size_t>(t.rows() * kK);
  auto dyadic = [](size_t n, uint32_t seed, float lo, float hi, float step) {
    std::vector<float> v = rand_floats(static_cast<int64_t>(n), seed, lo, hi);
    for (float& e : v) e = std::round(e / step) * step;
    return v;
  };
  const std::vector<float> g = dyadic(count, 91, -2.0f, 2.0f, 1.0f / 64),
                           z = dyadic(count, 92, -2.0f, 2.0f, 1.0f / 64);
  const std::vector<float> kx = dyadic(kK, 93, -1.0f, 1.0f, 1.0f / 64),
                           kz = dyadic(kK, 94, -1.0f, 1.0f, 1.0f / 64),
                           ky = dyadic(kK, 95, 0.5f, 2.0f, 1.0f / 16),
                           kw = dyadic(kK, 96, 0.5f, 2.0f, 1.0f / 16);
  std::vector<float> coef(4 * kK);
  for (int64_t k = 0; k < kK; ++k) {
    coef[4 * k] = kx[k], coef[4 * k + 1] = ky[k], coef[4 * k + 2] = kz[k], coef[4 * k + 3] = kw[k];
  }
  std::vector<uint8_t> mask(count / 8);
  uint32_t state = 7;
  for (uint8_t& m : mask) {
    state = state * 1664525u + 1013904223u;
    m = static_cast<uint8_t>(state >> 24);
  }
  DeviceBuffer x = upload_half(in.x), gb = upload_half(g), zb = upload_half(z);
  DeviceBuffer coefb(coef.size() * 4), maskb(mask.size());
  ASSERT_EQ(cudaMemcpy(coefb.p, coef.data(), coef.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(maskb.p, mask.data(), mask.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const int64_t taps = int64_t{t.r} * t.s;
  const size_t bytes = static_cast<size_t>(kK * taps * kC) * 4;
  auto problem = [&](const void* dz, const cuda::FirstLayerBnFold& bn, void* dw) {
    cuda::FirstLayerWgrad c;
    static_cast<cuda::FirstLayerShape&>(c) = {t.n,        t.h,        t.w,     t.r,    t.s,
                                              t.stride_h, t.stride_w, t.pad_h, t.pad_w};
    c.x = static_cast<const __half*>(x.p), c.dz = static_cast<const __half*>(dz);
    c.dw = dw, c.dw_f32 = true, c.dw_channels = 4, c.bn = bn;
    return c;
  };
  // Both forms on the same grid (four SMs' worth of the smaller), so that each CTA sums the
  // same tiles in the same order.
  auto run = [&](const void* dz, const cuda::FirstLayerBnFold& bn, unsigned grid) {
    DeviceBuffer dw(bytes);
    cuda::FirstLayerWgrad c = problem(dz, bn, dw.p);
    std::vector<uint8_t> out(bytes);
    EXPECT_EQ(cuda::first_layer_wgrad_refusal(c), "");
    DeviceBuffer ws(cuda::first_layer_wgrad_workspace(c, grid));
    c.partials = static_cast<float*>(ws.p);
    EXPECT_EQ(cuda::launch_first_layer_wgrad(c, grid, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), dw.p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  };
  for (const bool masked : {true, false}) {
    SCOPED_TRACE(masked ? "masked" : "no mask");
    std::vector<float> dz(count);
    for (size_t i = 0; i < count; ++i) {
      const size_t k = i % kK;
      const float gi = !masked || (mask[i / 8] >> (i % 8)) & 1u ? g[i] : 0.0f;
      dz[i] = ky[k] * (gi - kz[k] - (z[i] - kx[k]) * kw[k]);  // exact (the values are dyadic)
    }
    DeviceBuffer dzb = upload_half(round_f16(dz));
    cuda::FirstLayerBnFold bn;
    bn.z = static_cast<const __half*>(zb.p);
    bn.mask = masked ? static_cast<const uint8_t*>(maskb.p) : nullptr;
    bn.coef = static_cast<const float4*>(coefb.p);
    unsigned folded = 0, plain = 0;
    ASSERT_EQ(cuda::prepare_first_layer_wgrad(problem(gb.p, bn, gb.p), 4, &folded), cudaSuccess);
    ASSERT_EQ(cuda::prepare_first_layer_wgrad(problem(dzb.p, {}, gb.p), 4, &plain), cudaSuccess);
    const unsigned grid = std::min(folded, plain);
    EXPECT_EQ(run(gb.p, bn, grid), run(dzb.p, {}, grid))
        << "dw folded and from the host's dz differ";
  }
#endif
}

// What the kernel refuses, in words.
TEST(GpuFirstLayerConvRefusal, NamesWhatItCannotTake) {
#ifdef KILN_HAVE_CUDA
  cuda::FirstLayerConv c;
  EXPECT_NE(cuda::first_layer_conv_refusal(c).find("needs x, w and z"), std::string::npos);
  alignas(16) static __half buf[64];
  c.x = c.w = buf, c.z = buf;
  c.n = 1, c.h = c.w_ = 8, c.r = c.s = 3, c.pad_h = c.pad_w = 1;
  EXPECT_EQ(cuda::first_layer_conv_refusal(c), "");
  c.h = c.w_ = 32, c.r = c.s = 12;  // 144 taps x 4 > 512 (the window fits the image)
  EXPECT_NE(cuda::first_layer_conv_refusal(c).find("at most 128 taps"), std::string::npos);
  c.h = c.w_ = 8, c.r = c.s = 3;
  EXPECT_EQ(cuda::first_layer_conv_refusal(c), "");
  c.h = 1, c.pad_h = 0;  // 1 - 3 + 1 rows
  EXPECT_NE(cuda::first_layer_conv_refusal(c).find("has no output"), std::string::npos);
  c.h = 2, c.stride_h = 2;  // (2 - 3) / 2 + 1 rounds to a row that does not exist
  EXPECT_NE(cuda::first_layer_conv_refusal(c).find("has no output"), std::string::npos);
  c.h = 8, c.stride_h = 1, c.pad_h = 1 << 27;  // padding past where the kernel parks its zeros
  EXPECT_NE(cuda::first_layer_conv_refusal(c).find("2^27"), std::string::npos);
  cuda::FirstLayerWgrad g;
  EXPECT_NE(cuda::first_layer_wgrad_refusal(g).find("needs x, dz and dw"), std::string::npos);
  g.x = g.dz = buf, g.dw = buf;
  g.n = 1, g.h = g.w_ = 32, g.r = g.s = 8, g.pad_h = g.pad_w = 1;
  EXPECT_EQ(cuda::first_layer_wgrad_refusal(g), "");
  g.r = g.s = 9;  // 81 taps x 4 > 256
  EXPECT_NE(cuda::first_layer_wgrad_refusal(g).find("at most 64 taps"), std::string::npos);
  g.r = g.s = 3, g.dw_channels = 5;
  EXPECT_NE(cuda::first_layer_wgrad_refusal(g).find("1 to 4 channels"), std::string::npos);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The kernel's multiply-and-shift division (it places each output pixel with two) against the
// division it replaces: every divisor up to 4096 on numerators at the edges of the range and
// between, then large divisors. Runs on the host (no GPU needed).
TEST(FirstLayerFastDivide, AgreesWithDivision) {
#ifdef KILN_HAVE_CUDA
  constexpr int kIntMax = std::numeric_limits<int>::max();
  std::vector<int> ns = {
      0, 1, 2, 3, 7, 8, 255, 256, 65535, 65536, (1 << 30) - 1, 1 << 30, kIntMax - 1, kIntMax};
  uint32_t state = 12345;
  for (int i = 0; i < 64; ++i) {
    state = state * 1664525u + 1013904223u;
    ns.push_back(static_cast<int>(state >> 1));
  }
  std::vector<int> ds;
  for (int d = 1; d <= 4096; ++d) ds.push_back(d);
  for (int d : {50176, 12544, 65537, 1 << 20, (1 << 20) + 1, 1 << 30, (1 << 30) + 7, kIntMax})
    ds.push_back(d);
  for (int d : ds) {
    const cuda::FastDivide by(d);
    for (int n : ns) {
      ASSERT_EQ(by.quotient(n), n / d) << n << " / " << d;
      // n's neighbours at multiples of d, where a rounding error would show first.
      const int64_t below = static_cast<int64_t>(n / d) * d;
      for (int64_t m : {below - 1, below, below + d - 1, below + d})
        if (m >= 0 && m < (int64_t{1} << 31))
          ASSERT_EQ(by.quotient(static_cast<int>(m)), static_cast<int>(m / d)) << m << " / " << d;
    }
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// A first layer's CBR forward (cbr_fwd, cbr_pool_fwd) with KILN_FIRST_LAYER_CONV=1 against the
// same layer without it (cuDNN's convolution and kiln's statistics pass), everything else off.
class GpuFirstLayerCbr : public ::testing::TestWithParam<std::pair<fused::CbrCase, int>> {};

TEST_P(GpuFirstLayerCbr, AgreesWithTheUsualFormToRounding) {
  KILN_REQUIRE_GPU();
  const auto& [t, pool] = GetParam();
  auto run = [&](Auto direct, CompileReport* report) {
    Switches sw = Switches::from_environment();
    sw.first_layer_conv = direct;
    sw.cutlass = Auto::off;
    sw.cbr_form = "kiln";
    OpHarness h(true);
    fused::CbrForwardOut out = fused::run_cbr_forward(fused::Maker{h, true}, t, pool, "cuda", sw);
    *report = h.backend().compile_report();
    return out;
  };
  CompileReport on_report, off_report;
  const fused::CbrForwardOut on = run(Auto::on, &on_report), off = run(Auto::off, &off_report);
  EXPECT_EQ(on_report.first_layer_convs, 1) << "the layer did not take the direct convolution "
                                               "(KILN_LOG=debug says why)";
  EXPECT_EQ(off_report.first_layer_convs, 0);
  // The two convolutions round FP32 sums of the same FP16 products to neighbouring FP16 values
  // (one ulp, 2^-10 of the largest |z|); the statistics (FP32 sums against kiln's double pass)
  // and the running statistics move with them; y carries z's ulp through BatchNorm and rounds
  // again (two ulps of its scale); the mask may flip where BatchNorm's output sits within rounding
  // of 0 (or of its window's maximum).
  EXPECT_LE(rel_error(on.z, off.z, kSumFloor), 2e-3) << "z";
  EXPECT_LE(rel_error(on.saved, off.saved, kSumFloor), 1e-3) << "saved mean and inverse std";
  EXPECT_LE(rel_error(on.rm, off.rm, kSumFloor), 1e-4) << "running mean";
  EXPECT_LE(rel_error(on.rv, off.rv, kSumFloor), 1e-4) << "running variance";
  EXPECT_LE(rel_error(on.y, off.y, kSumFloor), 4e-3) << "y";
  size_t differ = 0;
  const size_t bits = on.z.size();
  for (size_t i = 0; i < bits; ++i)
    differ += (((on.mask[i / 8] ^ off.mask[i / 8]) >> (i % 8)) & 1u) != 0;
  EXPECT_LE(differ, 5 * bits / 1000 + 2) << "mask bits that differ";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuFirstLayerCbr,
    ::testing::Values(
        // VGG16's first layer and ResNet-50's stem scaled down (3 channels, padded to 4 by the
        // kernel's factory), a 2x2 max-pool folded in, and 4 channels taken as they are.
        std::pair{fused::CbrCase{"vgg_n2_28x28_c3_k64", 2, 28, 28, 3, 64, 3, 1, 1, true}, 0},
        std::pair{fused::CbrCase{"stem_n2_30x30_c3_k64_7x7s2", 2, 30, 30, 3, 64, 7, 2, 3, true}, 0},
        std::pair{fused::CbrCase{"vgg_n2_28x28_c3_k64_pool2", 2, 28, 28, 3, 64, 3, 1, 1, true}, 2},
        std::pair{fused::CbrCase{"n3_13x11_c4_k64", 3, 13, 11, 4, 64, 3, 1, 1, true}, 0}),
    [](const auto& info) { return std::string(info.param.first.name); });

// VGG16-BN and ResNet-50 trained three steps with their first layer's forward on the direct
// convolution (KILN_FIRST_LAYER_CONV=1, channels padded so that the weight gradient reads the
// direct form's 4-channel copy of x: KILN_PAD_INPUT_ONCE), then with its weight gradient on the
// direct kernel too (KILN_FIRST_LAYER_WGRAD=1, reading the same copy), then with BatchNorm's dx
// pass folded into it (KILN_FIRST_LAYER_BN_FOLD=1: VGG16-BN's plain CBR, ResNet-50's stem with
// its overlapping max-pool), each against today's form within the noise of genstats
// (step_forms.h).
TEST(GpuFirstLayerStep, StepsAgreeDirectOffAndOn) {
  KILN_REQUIRE_GPU();
  if (!sm90_gpu()) GTEST_SKIP() << "the direct kernels are built for SM90";
  for (const char* model : {"vgg16_bn", "resnet50"}) {
    SCOPED_TRACE(model);
    enum Form { kToday, kGenstats, kDirect, kDirectWgrad, kFolded };
    std::vector<StepForm> forms = {{"today", "kiln", Auto::off, Auto::off},
                                   {"genstats", "genstats", Auto::off, Auto::off},
                                   {"KILN_FIRST_LAYER_CONV", "kiln", Auto::off, Auto::off},
                                   {"+ KILN_FIRST_LAYER_WGRAD", "kiln", Auto::off, Auto::off},
                                   {"+ KILN_FIRST_LAYER_BN_FOLD", "kiln", Auto::off, Auto::off}};
    for (const Form f : {kDirect, kDirectWgrad, kFolded}) {
      forms[f].first_layer_conv = Auto::on;
      forms[f].pad_channels = Auto::on;
    }
    forms[kDirectWgrad].first_layer_wgrad = forms[kFolded].first_layer_wgrad = Auto::on;
    forms[kFolded].first_layer_bn_fold = Auto::on;
    const std::vector<FormSteps> runs = three_steps(model, forms);
    EXPECT_EQ(runs[kToday].report.first_layer_convs + runs[kToday].report.first_layer_wgrads, 0);
    EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "genstats took no layer: no noise floor";
    for (const Form f : {kDirect, kDirectWgrad, kFolded}) {
      EXPECT_EQ(runs[f].report.first_layer_convs, 1) << forms[f].name << ": the first layer";
      EXPECT_EQ(runs[f].report.pad_copies_shared, 1)
          << forms[f].name << ": the first layer's weight gradient reads the direct form's x";
    }
    EXPECT_EQ(runs[kDirect].report.first_layer_wgrads, 0);
    EXPECT_EQ(runs[kDirectWgrad].report.first_layer_wgrads, 1) << "the first layer's";
    EXPECT_EQ(runs[kDirectWgrad].report.first_layer_bn_folds, 0);
    EXPECT_EQ(runs[kFolded].report.first_layer_wgrads, 1) << "the first layer's";
    EXPECT_EQ(runs[kFolded].report.first_layer_bn_folds, 1) << "the first layer's";
    expect_within_noise(runs, forms, {kToday, kDirect, kGenstats});
    expect_within_noise(runs, forms, {kToday, kDirectWgrad, kGenstats});
    expect_within_noise(runs, forms, {kToday, kFolded, kGenstats});
  }
}

}  // namespace
}  // namespace kiln::test
