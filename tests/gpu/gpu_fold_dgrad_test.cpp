// The 1x1 data gradient with BatchNorm's dx pass folded in (src/backend/cuda/fold_dgrad.h):
// dz bit for bit against the dx pass's arithmetic on the host (dyadic inputs make it exact
// before its one FP16 rounding), g' against float64 products of that dz and W with the
// epilogue's roundings, and the sums against float64 sums of the kernel's own g'. Odd row counts
// (a partial last tile), one and several column tiles, with and without dy2 and the dz output,
// both chunk depths, and a small grid (CTAs walking many tiles) beside the full one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"

#ifdef KILN_HAVE_CUDA
#include <cuda_fp16.h>

#include "backend/cuda/fold_dgrad.h"
#endif

namespace kiln::test {
namespace {

struct FoldCase {
  const char* name;
  int64_t m, k, n;
  bool dy2, dz;
  int chunk = 0;  // FoldDgrad::chunk: 0 lets the kernel choose (64 where k allows)
};

void PrintTo(const FoldCase& c, std::ostream* os) {
  *os << c.name;
}

class GpuFoldDgrad : public ::testing::TestWithParam<FoldCase> {};

// Multiples of 2^-q in [lo, hi): few significant bits, so sums and products stay exact in float.
std::vector<float> dyadic(size_t count, uint32_t seed, float lo, float hi, int q) {
  std::vector<float> v(count);
  const float step = std::ldexp(1.0f, -q);
  const auto levels = static_cast<uint32_t>((hi - lo) / step);
  uint32_t s = seed;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = lo + step * static_cast<float>((s >> 8) % levels);
  }
  return v;
}

TEST_P(GpuFoldDgrad, AgreesWithTheDxPassAndFloat64) {
  KILN_REQUIRE_GPU();
#ifdef KILN_HAVE_CUDA
  if (!sm90_gpu()) GTEST_SKIP() << "kiln's hand-written kernels are built for sm_90";
  const FoldCase& t = GetParam();
  const int64_t m = t.m, k = t.k, n = t.n;
  const size_t zk = static_cast<size_t>(m * k), zn = static_cast<size_t>(m * n);
  // g, z in eighths; the coefficients in sixteenths: dz's expression is exact in float.
  const std::vector<float> g = dyadic(zk, 1, -2.0f, 2.0f, 3), z = dyadic(zk, 2, -1.0f, 3.0f, 3);
  const std::vector<float> kx = dyadic(k, 3, 0.5f, 1.5f, 4), ky = dyadic(k, 4, 0.5f, 1.5f, 4);
  const std::vector<float> kz = dyadic(k, 5, -0.25f, 0.25f, 4), kw = dyadic(k, 6, -0.5f, 0.5f, 4);
  const float wr = std::sqrt(3.0f / static_cast<float>(k));
  const std::vector<float> w = round_f16(rand_floats(k * n, 7, -wr, wr));
  const std::vector<float> zp = round_f16(rand_floats(static_cast<int64_t>(zn), 8, -1.0f, 3.0f));
  const std::vector<float> dy2 = round_f16(rand_floats(static_cast<int64_t>(zn), 9, -1.0f, 1.0f));
  const std::vector<float> mean = dyadic(n, 10, 0.5f, 1.5f, 4);
  std::vector<uint8_t> mask(zn / 8);
  uint32_t state = 11;
  for (uint8_t& b : mask) {
    state = state * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(state >> 24);
  }
  std::vector<float> coef(static_cast<size_t>(4 * k));
  for (int64_t c = 0; c < k; ++c)
    coef[4 * c] = kx[c], coef[4 * c + 1] = ky[c], coef[4 * c + 2] = kz[c], coef[4 * c + 3] = kw[c];

  // The host's dz, as BatchNorm's dx pass rounds it.
  std::vector<float> dz(zk);
  for (size_t i = 0; i < zk; ++i) {
    const size_t c = i % static_cast<size_t>(k);
    dz[i] = ky[c] * (g[i] - kz[c] - (z[i] - kx[c]) * kw[c]);  // exact
  }
  const std::vector<float> dz16 = round_f16(dz);

  DeviceBuffer gb = upload_half(g), zb = upload_half(z), wb = upload_half(w), zpb = upload_half(zp),
               dy2b = upload_half(dy2);
  DeviceBuffer coefb(coef.size() * 4), meanb(mean.size() * 4), maskb(mask.size());
  DeviceBuffer dzb(zk * 2), gpb(zn * 2), sumsb(2 * static_cast<size_t>(n) * 4);
  ASSERT_EQ(cudaMemcpy(coefb.p, coef.data(), coef.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(meanb.p, mean.data(), mean.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(maskb.p, mask.data(), mask.size(), cudaMemcpyHostToDevice), cudaSuccess);
  cuda::FoldDgrad c;
  c.g = static_cast<const __half*>(gb.p), c.z = static_cast<const __half*>(zb.p);
  c.coef = static_cast<const float4*>(coefb.p);
  c.dz = t.dz ? static_cast<__half*>(dzb.p) : nullptr;
  c.w = static_cast<const __half*>(wb.p);
  c.z_prev = static_cast<const __half*>(zpb.p);
  c.mask_prev = static_cast<const uint8_t*>(maskb.p);
  c.dy2 = t.dy2 ? static_cast<const __half*>(dy2b.p) : nullptr;
  c.mean_prev = static_cast<const float*>(meanb.p);
  c.g_prev = static_cast<__half*>(gpb.p), c.sums = static_cast<float*>(sumsb.p);
  c.m = m, c.k = k, c.n = n, c.chunk = t.chunk;
  ASSERT_EQ(cuda::fold_dgrad_refusal(c), "");

  // The reference g' from the host's dz (the kernel's, as checked below): float64 products, the
  // FP32-accumulated sum's rounding to FP16 being the one difference (an ulp at most).
  std::vector<double> dx(zn), mag(zn);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, a = 0;
      for (int64_t e = 0; e < k; ++e) {
        const double p = static_cast<double>(dz16[r * k + e]) * w[e * n + j];
        s += p, a += std::fabs(p);
      }
      dx[r * n + j] = s, mag[r * n + j] = a;
    }

  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  for (const int grid_sms : {sms, 2}) {
    SCOPED_TRACE("persistent grid over " + std::to_string(grid_sms) + " SMs");
    unsigned grid = 0;
    ASSERT_EQ(cuda::prepare_fold_dgrad(c, grid_sms, &grid), cudaSuccess);
    // NaNs where the kernel should write; zeros in the sums it adds into.
    ASSERT_EQ(cudaMemset(dzb.p, 0xFF, zk * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(gpb.p, 0xFF, zn * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(sumsb.p, 0, 2 * static_cast<size_t>(n) * 4), cudaSuccess);
    ASSERT_EQ(cuda::launch_fold_dgrad(c, grid, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> dzh(zk), gph(zn);
    std::vector<float> sums(2 * static_cast<size_t>(n));
    ASSERT_EQ(cudaMemcpy(dzh.data(), dzb.p, zk * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gph.data(), gpb.p, zn * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(sums.data(), sumsb.p, sums.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    if (t.dz) {
      int64_t off = 0;
      for (size_t i = 0; i < zk; ++i) off += dzh[i] != float_to_half(dz16[i]);
      EXPECT_EQ(off, 0) << "dz elements whose bits differ from the dx pass's, of " << zk;
    }
    int64_t bad = 0;
    double worst_s = 0, worst_x = 0;
    std::vector<double> s(n, 0.0), sx(n, 0.0), sa(n, 0.0), sxa(n, 0.0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = static_cast<size_t>(r * n + j);
        const bool on = (mask[i / 8] >> (i % 8)) & 1u;
        // round16(dX) can land an ulp from float64's rounding: 2^-10 of |dX| plus the FP32
        // accumulation's error over k products (k 2^-24 of their magnitudes), carried through
        // the add of dy2 and its rounding (another 2^-11 of the result).
        const double d16 = half_to_float(float_to_half(static_cast<float>(dx[i])));
        const double want = on ? (t.dy2 ? d16 + dy2[i] : d16) : 0.0;
        const double tol = on ? 0x1p-10 * std::fabs(dx[i]) + 1e-7 * k * mag[i] +
                                    0x1p-11 * std::fabs(want) + 0x1p-24
                              : 0.0;
        const double got = half_to_float(gph[i]);
        bad += !(std::fabs(got - want) <= tol);  // NaN counts
        s[j] += got, sa[j] += std::fabs(got);
        sx[j] += got * (zp[i] - mean[j]), sxa[j] += std::fabs(got * (zp[i] - mean[j]));
      }
    EXPECT_EQ(bad, 0) << "g' elements outside their bound, of " << zn;
    // The sums against float64 sums of the kernel's own g': FP32 over a lane's rows, then
    // shuffles, shared-memory and global atomics: ~sqrt(rows) 2^-24 of the terms' magnitudes,
    // 1e-4 of them as the SM90 units' tests allow.
    for (int64_t j = 0; j < n; ++j) {
      const double es = std::fabs(sums[j] - s[j]) / (sa[j] + 1e-30);
      const double ex = std::fabs(sums[n + j] - sx[j]) / (sxa[j] + 1e-30);
      worst_s = std::max(worst_s, std::isfinite(es) ? es : INFINITY);
      worst_x = std::max(worst_x, std::isfinite(ex) ? ex : INFINITY);
    }
    EXPECT_LE(worst_s, 1e-4) << "sum g' against float64, relative to sum |g'|";
    EXPECT_LE(worst_x, 1e-4) << "sum g' (z' - mean) against float64, relative";
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuFoldDgrad,
    // 64-deep chunks (two stages) where k allows, 32-deep (three) for k = 96 and where asked;
    // k = 64 in 64-deep chunks is one chunk a tile.
    ::testing::Values(FoldCase{"m300_k64_n64", 300, 64, 64, false, true},
                      FoldCase{"m300_k64_n64_chunk32", 300, 64, 64, false, true, 32},
                      FoldCase{"m1000_k96_n128_dy2", 1000, 96, 128, true, true},
                      FoldCase{"m129_k256_n64_dy2_no_dz", 129, 256, 64, true, false},
                      FoldCase{"m2049_k128_n192", 2049, 128, 192, false, true},
                      FoldCase{"m2049_k128_n192_chunk32", 2049, 128, 192, false, true, 32},
                      FoldCase{"m784_k512_n256_dy2", 784, 512, 256, true, true},
                      FoldCase{"m784_k512_n256_dy2_chunk32", 784, 512, 256, true, true, 32}),
    [](const ::testing::TestParamInfo<FoldCase>& i) { return std::string(i.param.name); });

// What the kernel refuses, in words.
TEST(GpuFoldDgradRefusal, NamesWhatItCannotTake) {
#ifdef KILN_HAVE_CUDA
  cuda::FoldDgrad c;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("needs g, z"), std::string::npos);
  alignas(16) static __half h[64];
  alignas(16) static float4 f4[4];
  alignas(16) static float f[4];
  alignas(16) static uint8_t bits[16];
  c.g = c.z = c.w = c.z_prev = h, c.g_prev = h, c.coef = f4, c.mean_prev = f, c.sums = f;
  c.mask_prev = bits;
  c.m = 100, c.k = 64, c.n = 64;
  EXPECT_EQ(cuda::fold_dgrad_refusal(c), "");
  c.k = 48;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("k a multiple of 32"), std::string::npos);
  c.k = 96, c.chunk = 64;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("k a multiple of 64"), std::string::npos);
  c.chunk = 48;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("chunks of 32 or 64"), std::string::npos);
  c.chunk = 0;
  c.k = 64, c.n = 96;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("n a multiple of 64"), std::string::npos);
  c.n = 64, c.m = int64_t{1} << 30;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("below 2^31"), std::string::npos);
  c.m = 100, c.g = h + 1;
  EXPECT_NE(cuda::fold_dgrad_refusal(c).find("16-byte aligned"), std::string::npos);
#endif
}

}  // namespace
}  // namespace kiln::test
