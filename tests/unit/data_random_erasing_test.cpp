// RandomErasing (--random-erase) against torchvision's RandomErasing.forward / get_params,
// transcribed here on the same uniform draws: torch.rand(1) < p, then up to 10 tries of an
// area fraction in scale and a log-uniform aspect in ratio, h = round(sqrt(area * aspect)),
// w = round(sqrt(area / aspect)) (half to even), kept when h < H and w < W, then the corner.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/transforms.h"

namespace kiln {
namespace {

CropBox ref_box(int64_t H, int64_t W, double p, Rng& rng) {
  if (!(rng.uniform() < p)) return {};
  const double area = static_cast<double>(H * W);
  for (int i = 0; i < 10; ++i) {
    const double erase = area * (0.02f + rng.uniform() * (0.33f - 0.02f));
    const double aspect =
        std::exp(std::log(0.3f) + rng.uniform() * (std::log(3.3f) - std::log(0.3f)));
    const int64_t h = static_cast<int64_t>(std::nearbyint(std::sqrt(erase * aspect)));
    const int64_t w = static_cast<int64_t>(std::nearbyint(std::sqrt(erase / aspect)));
    if (!(h < H && w < W)) continue;
    const int64_t top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(H - h + 1)));
    const int64_t left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(W - w + 1)));
    return {top, left, h, w};
  }
  return {};
}

TEST(DataRandomErasing, BoxesMatchTorchvisionGetParams) {
  // Sizes where the tries almost always succeed (224), often fail (3 x 40) and always fail (1).
  const std::pair<int64_t, int64_t> sizes[] = {{224, 224}, {32, 32}, {3, 40}, {17, 5}, {1, 1}};
  for (const auto& [h, w] : sizes) {
    for (const float p : {0.25f, 1.0f}) {
      const RandomErasing t(p);
      for (uint64_t s = 0; s < 300; ++s) {
        Rng a = Rng::derive(7, 2, s), b = Rng::derive(7, 2, s);
        const CropBox got = t.sample_box(h, w, a), want = ref_box(h, w, p, b);
        ASSERT_EQ(got.top, want.top) << h << "x" << w << " seed " << s;
        ASSERT_EQ(got.left, want.left);
        ASSERT_EQ(got.height, want.height);
        ASSERT_EQ(got.width, want.width);
        ASSERT_EQ(a.next_u64(), b.next_u64()) << "a different number of draws";
      }
    }
  }
}

TEST(DataRandomErasing, BoxDistribution) {
  // 4000 images at p 0.5: the erased share within 0.04 (5 binomial sd); every box inside, its
  // area a share of the image in scale (widened by the rounding of each side: at 64 x 64 a
  // side of 12..38 moves by at most 0.5, about 8% of the area) and its aspect in ratio likewise.
  const RandomErasing t(0.5f);
  int64_t erased = 0;
  double log_aspect_sum = 0;
  const int64_t H = 64, W = 64, n = 4000;
  for (int64_t s = 0; s < n; ++s) {
    Rng rng = Rng::derive(11, 0, static_cast<uint64_t>(s));
    const CropBox b = t.sample_box(H, W, rng);
    if (b.height == 0) continue;
    ++erased;
    ASSERT_GE(b.top, 0);
    ASSERT_GE(b.left, 0);
    ASSERT_LE(b.top + b.height, H);
    ASSERT_LE(b.left + b.width, W);
    ASSERT_LT(b.height, H);
    ASSERT_LT(b.width, W);
    const double share = static_cast<double>(b.height * b.width) / static_cast<double>(H * W);
    ASSERT_GE(share, 0.02 * 0.7);
    ASSERT_LE(share, 0.33 * 1.15);
    const double aspect = static_cast<double>(b.height) / static_cast<double>(b.width);
    ASSERT_GE(aspect, 0.3 * 0.7);
    ASSERT_LE(aspect, 3.3 / 0.7);
    log_aspect_sum += std::log(aspect);
  }
  EXPECT_NEAR(static_cast<double>(erased) / n, 0.5, 0.04);
  // log-uniform over [log 0.3, log 3.3]: mean -0.005; the failed tries drop tall and wide boxes
  // alike at 64 x 64, so it stays near 0 (sd of the mean about 0.02).
  EXPECT_NEAR(log_aspect_sum / static_cast<double>(erased), 0.0, 0.1);
}

TEST(DataRandomErasing, ErasesTheBoxInEveryChannel) {
  FloatImage im(40, 30, 3);
  for (size_t i = 0; i < im.data.size(); ++i) im.data[i] = 0.1f + 0.001f * static_cast<float>(i);
  const FloatImage before = im;
  const RandomErasing t(1.0f, {0.02f, 0.33f}, {0.3f, 3.3f}, -2.5f);
  Rng a(5), b(5);
  const CropBox box = t.sample_box(40, 30, b);
  ASSERT_GT(box.height, 0);
  t.apply(im, a);
  for (int64_t y = 0; y < 40; ++y) {
    for (int64_t x = 0; x < 30; ++x) {
      const bool in =
          y >= box.top && y < box.top + box.height && x >= box.left && x < box.left + box.width;
      for (int64_t c = 0; c < 3; ++c) {
        ASSERT_EQ(im.at(y, x, c), in ? -2.5f : before.at(y, x, c)) << y << "," << x;
      }
    }
  }
}

TEST(DataRandomErasing, KeepsThePipelineOnTheFloatPathAndChecksItsArguments) {
  Pipeline p;
  p.add<ToFloat>().add<RandomHorizontalFlip>().add<Normalize>(std::vector<float>{0.5f},
                                                              std::vector<float>{0.25f});
  EXPECT_TRUE(p.geometric());
  p.add<RandomErasing>(0.25f);
  std::string why;
  EXPECT_FALSE(p.geometric(&why));
  EXPECT_NE(why.find("RandomErasing"), std::string::npos) << why;
  EXPECT_EQ(why.find("move Normalize"), std::string::npos) << why;
  EXPECT_THROW(RandomErasing(1.5f), Error);
  EXPECT_THROW(RandomErasing(0.5f, {0.5f, 0.2f}), Error);
  EXPECT_THROW(RandomErasing(0.5f, {0.02f, 0.33f}, {0.0f, 3.3f}), Error);
}

}  // namespace
}  // namespace kiln
