// Transforms against values worked out by hand (for resize_bilinear, against what
// torch.nn.functional.interpolate(mode='bilinear', align_corners=False) is known to give; for
// the transforms' antialiased resize, against PIL's bilinear weights).
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "kiln/data/transforms.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;

// ramp(4, 4, 1) (value 4y + x) halved by PIL's antialiased bilinear: support 2, so output 0 of
// an axis weighs source 0, 1, 2 by 0.75, 0.75, 0.25 (normalised: 3/7, 3/7, 1/7) and output 1
// weighs 1, 2, 3 by 1/7, 3/7, 3/7; the axis values are 5/7 and 16/7.
void expect_halved_ramp(const FloatImage& d) {
  ASSERT_EQ(d.data.size(), 4u);
  const float want[4] = {25.0f / 7, 36.0f / 7, 69.0f / 7, 80.0f / 7};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(d.data[static_cast<size_t>(i)], want[i], 1e-5f) << i;
}

FloatImage image_of(int64_t h, int64_t w, int64_t c, std::vector<float> values) {
  FloatImage img(h, w, c);
  img.data = std::move(values);
  return img;
}

// 0, 1, 2, ... in HWC order.
FloatImage ramp(int64_t h, int64_t w, int64_t c) {
  FloatImage img(h, w, c);
  for (size_t i = 0; i < img.data.size(); ++i) img.data[i] = static_cast<float>(i);
  return img;
}

TEST(DataTransforms, ToFloatDividesBy255) {
  Image bytes;
  bytes.height = 1;
  bytes.width = 2;
  bytes.channels = 1;
  bytes.pixels = {0, 255};
  Pipeline p;
  p.add<ToFloat>();
  Rng rng(1);
  const FloatImage out = p(bytes, rng);
  EXPECT_EQ(out.data, (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(p.describe(), "ToFloat(/255)");
}

TEST(DataTransforms, HorizontalFlip) {
  // 2x3, 2 channels: flipping reverses pixel order in each row, keeping channel order.
  FloatImage img = ramp(2, 3, 2);
  Rng rng(0);
  RandomHorizontalFlip(1.0f).apply(img, rng);
  EXPECT_EQ(img.data, (std::vector<float>{4, 5, 2, 3, 0, 1, 10, 11, 8, 9, 6, 7}));
  FloatImage same = ramp(2, 3, 2);
  RandomHorizontalFlip(0.0f).apply(same, rng);
  EXPECT_EQ(same.data, ramp(2, 3, 2).data);
  // p = 0.5 flips about half the time.
  int flips = 0;
  for (int i = 0; i < 1000; ++i) {
    FloatImage t = ramp(1, 2, 1);
    RandomHorizontalFlip(0.5f).apply(t, rng);
    flips += t.data[0] == 1.0f;
  }
  EXPECT_GT(flips, 400);  // binomial(1000, 0.5): 400..600 is over 6 standard deviations
  EXPECT_LT(flips, 600);
}

TEST(DataTransforms, CropWithZeroPadding) {
  const FloatImage img = image_of(2, 2, 1, {1, 2, 3, 4});
  // Window starting one pixel above and left of the image: a zero border.
  EXPECT_EQ(crop_image(img, -1, -1, 3, 3).data, (std::vector<float>{0, 0, 0, 0, 1, 2, 0, 3, 4}));
  EXPECT_EQ(crop_image(img, 1, 0, 2, 3).data, (std::vector<float>{3, 4, 0, 0, 0, 0}));
  // RandomCrop(4, padding 1) of a 2x2 image has one possible position: the padded image.
  FloatImage t = img;
  Rng rng(3);
  RandomCrop(4, 1).apply(t, rng);
  EXPECT_EQ(t.data, (std::vector<float>{0, 0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 0, 0, 0, 0, 0}));
  // RandomCrop(2, padding 1): 3x3 corner positions, all reached, each a window of the padded image.
  std::set<std::vector<float>> seen;
  for (int i = 0; i < 400; ++i) {
    FloatImage u = img;
    RandomCrop(2, 1).apply(u, rng);
    seen.insert(u.data);
  }
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_TRUE(seen.count({0, 0, 0, 1}));  // top-left corner
  EXPECT_TRUE(seen.count({4, 0, 0, 0}));  // bottom-right corner
  FloatImage small = img;
  expect_error([&] { RandomCrop(5, 1).apply(small, rng); }, ErrorKind::InvalidArgument,
               {"larger than the padded image"});
}

TEST(DataTransforms, Normalize) {
  FloatImage img = image_of(1, 2, 2, {0.5f, 0.2f, 1.0f, 0.0f});
  Rng rng(0);
  Normalize({0.5f, 0.1f}, {0.25f, 0.5f}).apply(img, rng);
  // (x - mean) / std per channel: (0.5-0.5)/0.25, (0.2-0.1)/0.5, (1-0.5)/0.25, (0-0.1)/0.5
  const std::vector<float> want = {0.0f, 0.2f, 2.0f, -0.2f};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(img.data[i], want[i], 1e-6f);
  FloatImage three(1, 1, 3);
  expect_error(
      [&] {
        Normalize({0.5f, 0.1f}, {0.25f, 0.5f}).apply(three, rng);
      },
      ErrorKind::InvalidArgument, {"2 channel statistics", "3 channels"});
  expect_error([] { Normalize({0.5f}, {0.0f}); }, ErrorKind::InvalidArgument, {"std"});
}

TEST(DataTransforms, BilinearResize) {
  // [[0,1],[2,3]] to 4x4: F.interpolate(bilinear, align_corners=False) gives these values
  // (source coordinate (o + 0.5) / 2 - 0.5, clamped at the edges).
  const FloatImage up = resize_bilinear(image_of(2, 2, 1, {0, 1, 2, 3}), 4, 4);
  // Rows 1 and 2 blend rows 0 and 1 with weights 3/4,1/4 and 1/4,3/4; columns alike.
  const std::vector<float> exact = {0.0f, 0.25f, 0.75f, 1.0f, 0.5f, 0.75f, 1.25f, 1.5f,
                                    1.5f, 1.75f, 2.25f, 2.5f, 2.0f, 2.25f, 2.75f, 3.0f};
  for (size_t i = 0; i < exact.size(); ++i) EXPECT_FLOAT_EQ(up.data[i], exact[i]) << i;
  // Halving averages 2x2 blocks (source coordinates 0.5 and 2.5).
  const FloatImage down = resize_bilinear(ramp(4, 4, 1), 2, 2);
  EXPECT_EQ(down.data, (std::vector<float>{2.5f, 4.5f, 10.5f, 12.5f}));
  // Channels are resized independently.
  const FloatImage two = resize_bilinear(image_of(1, 2, 2, {0, 10, 4, 20}), 1, 4);
  EXPECT_EQ(two.data, (std::vector<float>{0, 10, 1, 12.5f, 3, 17.5f, 4, 20}));
}

TEST(DataTransforms, ResizeShorterSide) {
  Rng rng(0);
  FloatImage a(4, 6, 1);
  Resize(2).apply(a, rng);
  EXPECT_EQ(a.height, 2);
  EXPECT_EQ(a.width, 3);
  FloatImage b(6, 4, 3);
  Resize(2).apply(b, rng);
  EXPECT_EQ(b.height, 3);
  EXPECT_EQ(b.width, 2);
  FloatImage c(3, 5, 1);  // long side int(2 * 5 / 3) = 3, truncated as torchvision
  Resize(2).apply(c, rng);
  EXPECT_EQ(c.height, 2);
  EXPECT_EQ(c.width, 3);
  FloatImage d = ramp(4, 4, 1);
  Resize(2).apply(d, rng);
  expect_halved_ramp(d);
}

TEST(DataTransforms, AntialiasedUpsamplingIsHalfPixelBilinear) {
  // When enlarging, PIL's triangle keeps support 1: output o blends the two source pixels
  // around (o + 0.5) * in / out - 0.5, and at the edges the renormalised weights reproduce
  // F.interpolate's clamping. So resample_float equals resize_bilinear up to float rounding.
  const FloatImage src = ramp(5, 7, 3);
  for (auto [h, w] : {std::pair<int64_t, int64_t>{5, 7}, {10, 14}, {13, 9}, {17, 29}}) {
    const FloatImage a = resize_bilinear(src, h, w);
    SampleGeometry g = SampleGeometry::identity(5, 7);
    g.y.out = g.y.valid_hi = h;
    g.y.scale = 5.0 / static_cast<double>(h);
    g.x.out = g.x.valid_hi = w;
    g.x.scale = 7.0 / static_cast<double>(w);
    const FloatImage b = resample_float(src, g);
    ASSERT_EQ(a.data.size(), b.data.size());
    // Values up to 104, float weights and sums: measured 1.5e-5 at most (edges included).
    for (size_t i = 0; i < a.data.size(); ++i) ASSERT_NEAR(a.data[i], b.data[i], 1e-4f) << i;
  }
}

TEST(DataTransforms, CenterCrop) {
  Rng rng(0);
  FloatImage a = ramp(5, 5, 1);
  CenterCrop(3).apply(a, rng);  // offset (5-3)/2 = 1
  EXPECT_EQ(a.data, (std::vector<float>{6, 7, 8, 11, 12, 13, 16, 17, 18}));
  FloatImage b = ramp(4, 4, 1);
  CenterCrop(1).apply(b, rng);  // round(1.5) = 2 (half to even, as Python)
  EXPECT_EQ(b.data, (std::vector<float>{10}));
  FloatImage c = ramp(6, 6, 1);
  CenterCrop(1).apply(c, rng);  // round(2.5) = 2
  EXPECT_EQ(c.data, (std::vector<float>{14}));
  FloatImage d = image_of(2, 2, 1, {1, 2, 3, 4});
  CenterCrop(3, 4).apply(d, rng);  // larger: zero padding (3-2)//2 = 0 above, (4-2)//2 = 1 left
  EXPECT_EQ(d.data, (std::vector<float>{0, 1, 2, 0, 0, 3, 4, 0, 0, 0, 0, 0}));
}

TEST(DataTransforms, RandomResizedCropBoxes) {
  // scale (1,1) and ratio (1,1) on 4x8: the square of area 32 has side round(5.66) = 6 > 4, so
  // all ten tries fail and the fallback takes the centred 4x4 box (ratio 2 > max ratio 1).
  RandomResizedCrop square(2, {1.0f, 1.0f}, {1.0f, 1.0f});
  Rng rng(5);
  const CropBox fb = square.sample_box(4, 8, rng);
  EXPECT_EQ(fb.top, 0);
  EXPECT_EQ(fb.left, 2);
  EXPECT_EQ(fb.height, 4);
  EXPECT_EQ(fb.width, 4);
  // On a square image the whole image is the box, and the output its resize.
  FloatImage img = ramp(4, 4, 1);
  square.apply(img, rng);
  expect_halved_ramp(img);
  // Default parameters: boxes inside the image, with area and ratio in range (up to rounding).
  RandomResizedCrop rrc(8);
  for (int i = 0; i < 500; ++i) {
    const CropBox b = rrc.sample_box(100, 150, rng);
    ASSERT_GE(b.top, 0);
    ASSERT_GE(b.left, 0);
    ASSERT_LE(b.top + b.height, 100);
    ASSERT_LE(b.left + b.width, 150);
    const double area = static_cast<double>(b.height * b.width) / (100.0 * 150.0);
    EXPECT_GE(area, 0.07);
    EXPECT_LE(area, 1.0);
    const double ratio = static_cast<double>(b.width) / static_cast<double>(b.height);
    EXPECT_GE(ratio, 0.7);
    EXPECT_LE(ratio, 1.42);
  }
  FloatImage big = ramp(20, 30, 3);
  rrc.apply(big, rng);
  EXPECT_EQ(big.height, 8);
  EXPECT_EQ(big.width, 8);
  EXPECT_EQ(big.channels, 3);
  expect_error([] { RandomResizedCrop(8, {0.5f, 0.1f}); }, ErrorKind::InvalidArgument, {"scale"});
}

TEST(DataTransforms, ColorJitterBlends) {
  Rng rng(11);
  const FloatImage base = image_of(1, 2, 3, {0.2f, 0.4f, 0.6f, 0.8f, 0.1f, 0.3f});
  // Brightness only: every value scaled by one factor in [0.5, 1.5], clamped to [0,1].
  for (int i = 0; i < 20; ++i) {
    FloatImage img = base;
    ColorJitter(0.5f, 0, 0).apply(img, rng);
    const float f = img.data[0] / base.data[0];
    EXPECT_GE(f, 0.5f);
    EXPECT_LE(f, 1.5f);
    for (size_t k = 0; k < 6; ++k) {
      EXPECT_NEAR(img.data[k], std::min(1.0f, base.data[k] * f), 1e-5f);
    }
  }
  // Contrast only: a blend with the image's mean grey (0.2989 R + 0.587 G + 0.114 B averaged
  // over pixels), the same factor for all values; values chosen so nothing clamps.
  const FloatImage mid = image_of(1, 2, 3, {0.3f, 0.4f, 0.5f, 0.6f, 0.35f, 0.45f});
  const float mean = (0.2989f * 0.3f + 0.587f * 0.4f + 0.114f * 0.5f + 0.2989f * 0.6f +
                      0.587f * 0.35f + 0.114f * 0.45f) /
                     2.0f;
  FloatImage c = mid;
  ColorJitter(0, 0.5f, 0).apply(c, rng);
  const float f = (c.data[3] - mean) / (mid.data[3] - mean);  // 0.6 is far from the mean
  EXPECT_GE(f, 0.5f - 1e-4f);
  EXPECT_LE(f, 1.5f + 1e-4f);
  for (size_t k = 0; k < 6; ++k) EXPECT_NEAR(c.data[k], f * mid.data[k] + (1 - f) * mean, 1e-5f);
  // Saturation and hue leave grey pixels grey; hue keeps each pixel's max and min.
  FloatImage grey = image_of(1, 1, 3, {0.3f, 0.3f, 0.3f});
  ColorJitter(0, 0, 0.9f, 0.5f).apply(grey, rng);
  // (Within 1e-4: torchvision's grey weights sum to 0.9999, so grey moves by < 3e-5.)
  for (float v : grey.data) EXPECT_NEAR(v, 0.3f, 1e-4f);
  FloatImage h = base;
  ColorJitter(0, 0, 0, 0.4f).apply(h, rng);
  for (int p = 0; p < 2; ++p) {
    const float* a = &base.data[static_cast<size_t>(3 * p)];
    const float* b = &h.data[static_cast<size_t>(3 * p)];
    EXPECT_NEAR(std::max({b[0], b[1], b[2]}), std::max({a[0], a[1], a[2]}), 1e-5f);
    EXPECT_NEAR(std::min({b[0], b[1], b[2]}), std::min({a[0], a[1], a[2]}), 1e-5f);
  }
  // Needs values in [0,1]: a pipeline without ToFloat before it is refused.
  Pipeline p;
  expect_error([&] { p.add<ColorJitter>(0.4f, 0.4f, 0.4f); }, ErrorKind::InvalidArgument,
               {"ToFloat"});
  p.add<ToFloat>().add<ColorJitter>(0.4f, 0.4f, 0.4f, 0.1f);
  EXPECT_EQ(p.size(), 2u);
}

TEST(DataTransforms, SameRngStateSameResult) {
  Pipeline p;
  p.add<ToFloat>()
      .add<RandomResizedCrop>(6)
      .add<RandomHorizontalFlip>()
      .add<ColorJitter>(0.4f, 0.4f, 0.4f, 0.1f)
      .add<Normalize>(std::vector<float>{0.5f, 0.5f, 0.5f}, std::vector<float>{0.2f, 0.2f, 0.2f});
  Image img;
  img.height = 10;
  img.width = 12;
  img.channels = 3;
  for (int i = 0; i < 360; ++i) img.pixels.push_back(static_cast<uint8_t>(i * 37));
  Rng a = Rng::derive(7, 1, 2), b = Rng::derive(7, 1, 2), c = Rng::derive(7, 1, 3);
  const FloatImage x = p(img, a), y = p(img, b), z = p(img, c);
  EXPECT_EQ(x.data, y.data);
  EXPECT_NE(x.data, z.data);
  EXPECT_EQ(x.height, 6);
}

}  // namespace
}  // namespace kiln
