// The GPU input kernel with --interpolation bicubic: the same taps as the host's (input_stage.h
// shares axis_taps with the decoder's window planning), checked against resample_float, which
// tests/unit/data_bicubic_test.cpp checks against a float64 PIL reference, clamped to bytes'
// range as the kernel clamps bicubic's overshoot.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/input_stage.h"
#include "gpu/gpu_test_util.h"
#include "kiln/core/rng.h"
#include "kiln/data/transforms.h"

namespace kiln::test {
namespace {

ResampleAxis bicubic_axis(int64_t start, int64_t len, int64_t out) {
  ResampleAxis a;
  a.out = out;
  a.origin = static_cast<double>(start);
  a.scale = static_cast<double>(len) / static_cast<double>(out);
  a.lo = start, a.hi = start + len;
  a.valid_lo = 0, a.valid_hi = out;
  a.filter = ResampleFilter::bicubic;
  return a;
}

TEST(GpuInputKernel, BicubicMatchesHostTaps) {
  KILN_REQUIRE_GPU();
  const int64_t H = 24, W = 20;
  for (int64_t C : {int64_t{3}, int64_t{1}}) {
    struct Src {
      int64_t h, w, top, left, bh, bw;
      bool flip;
    };
    const Src srcs[] = {{97, 131, 10, 20, 70, 90, false},  // down
                        {30, 25, 3, 2, 12, 9, true},       // up x2, flipped
                        {24, 20, 0, 0, 24, 20, false}};    // identity
    const int64_t n = 3;
    std::vector<cuda::SampleDesc> descs(static_cast<size_t>(n));
    std::vector<uint8_t*> dev(static_cast<size_t>(n), nullptr);
    std::vector<std::vector<float>> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const Src& s = srcs[i];
      Rng rng(static_cast<uint64_t>(i + 1));
      FloatImage f(s.h, s.w, C);
      std::vector<uint8_t> px(static_cast<size_t>(s.h * s.w * C));
      for (size_t k = 0; k < px.size(); ++k) {
        // Edges (a checkerboard) so that the overshoot and its clamp show.
        const int64_t p = static_cast<int64_t>(k) / C, y = p / s.w, x = p % s.w;
        px[k] = static_cast<uint8_t>(((x / 3 + y / 2) % 2 ? 230 : 20) + rng.below(20));
        f.data[k] = px[k];
      }
      SampleGeometry g = SampleGeometry::identity(s.h, s.w);
      g.y = bicubic_axis(s.top, s.bh, H);
      g.x = bicubic_axis(s.left, s.bw, W);
      g.flip = s.flip;
      const FloatImage ref = resample_float(f, g);
      want[static_cast<size_t>(i)].resize(ref.data.size());
      for (size_t k = 0; k < ref.data.size(); ++k) {
        want[static_cast<size_t>(i)][k] = std::clamp(ref.data[k], 0.0f, 255.0f);
      }
      cuda::SampleDesc d;
      d.y = cuda::axis_desc(g.y, s.h);
      d.x = cuda::axis_desc(g.x, s.w);
      d.flip = s.flip;
      ASSERT_EQ(d.y.bicubic, 1);
      ASSERT_EQ(cudaMalloc(&dev[static_cast<size_t>(i)], px.size()), cudaSuccess);
      ASSERT_EQ(
          cudaMemcpy(dev[static_cast<size_t>(i)], px.data(), px.size(), cudaMemcpyHostToDevice),
          cudaSuccess);
      d.src = dev[static_cast<size_t>(i)];
      d.pitch = s.w * C;
      descs[static_cast<size_t>(i)] = d;
    }
    // mean 0, std 1/255: the slot holds the resampled values themselves.
    const InputNormalization norm{std::vector<float>(static_cast<size_t>(C), 0.0f),
                                  std::vector<float>(static_cast<size_t>(C), 1.0f / 255.0f)};
    const cuda::NormParams np = cuda::make_norm_params(norm, C, "test");
    cuda::SampleDesc* d_descs = nullptr;
    ASSERT_EQ(cudaMalloc(&d_descs, descs.size() * sizeof(cuda::SampleDesc)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_descs, descs.data(), descs.size() * sizeof(cuda::SampleDesc),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    const int64_t per = H * W * C;
    float* out = nullptr;
    ASSERT_EQ(cudaMalloc(&out, static_cast<size_t>(n * per) * sizeof(float)), cudaSuccess);
    cuda::launch_stage_samples(d_descs, n, H, W, np, out, DType::F32, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got(static_cast<size_t>(n * per));
    ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    cudaFree(out);
    cudaFree(d_descs);
    for (uint8_t* p : dev) cudaFree(p);
    // Float weights and sums in another order than the host's: ~1e-5 of a level per tap;
    // 1e-3 levels (x 255 std 1/255 = the value) leaves room for 30 taps.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < per; ++j) {
        ASSERT_NEAR(got[static_cast<size_t>(i * per + j)],
                    want[static_cast<size_t>(i)][static_cast<size_t>(j)], 1e-3)
            << "sample " << i << " value " << j << " channels " << C;
      }
    }
  }
}

}  // namespace
}  // namespace kiln::test
