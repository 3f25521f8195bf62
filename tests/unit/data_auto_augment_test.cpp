// RandAugment / TrivialAugmentWide ops against references written here in float64 from
// torchvision's definitions (_functional_tensor.py on uint8 tensors), on fixed small images.
// The geometric ops' references are the closed forms of torchvision's inverse affine matrix
// (ShearX about the top-left corner: source x = x + m (y + 0.5); rotate about the centre), with
// nearest sampling (half to even) and 0 outside. kiln mirrors torchvision's float32 steps, the
// references are exact: they may disagree only where the exact value lies within 1e-3 of a
// truncation boundary (an integer for blends) or of a sampling tie (.5 for the nearest pixel).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/auto_augment.h"

namespace kiln {
namespace {

Image test_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  Rng rng(seed);
  Image im;
  im.height = h, im.width = w, im.channels = c;
  im.pixels.resize(static_cast<size_t>(h * w * c));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t k = 0; k < c; ++k) {
        // A gradient over a middle range plus noise: autocontrast and equalize have work to do.
        const double v = 60 + 8 * x + 5 * y + 20 * k + 30 * rng.uniform();
        im.pixels[static_cast<size_t>((y * w + x) * c + k)] =
            static_cast<uint8_t>(std::min(230.0, v));
      }
    }
  }
  return im;
}

uint8_t px(const Image& im, int64_t y, int64_t x, int64_t k) {
  return im.pixels[static_cast<size_t>((y * im.width + x) * im.channels + k)];
}

// A blend's exact value per pixel (before clamp and truncation): kiln's must be its truncation,
// or one off where the exact value is within 1e-3 of an integer (float32 rounding).
void expect_blend(const Image& got, const std::vector<double>& exact, const char* what) {
  int64_t near = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double v = std::min(255.0, std::max(0.0, exact[i]));
    const double want = std::trunc(v);
    if (got.pixels[i] == want) continue;
    const bool boundary =
        std::fabs(v - std::nearbyint(v)) < 1e-3 && std::fabs(got.pixels[i] - want) <= 1;
    ASSERT_TRUE(boundary) << what << " value " << i << ": " << int(got.pixels[i]) << " vs exact "
                          << exact[i];
    // An exact integer (sharpness on the border, where the blur is the pixel itself) lands on
    // either side in float32, as in torch; only values merely near one must be rare.
    near += std::fabs(v - std::nearbyint(v)) > 1e-9;
  }
  EXPECT_LE(near, static_cast<int64_t>(exact.size() / 50 + 1)) << what;
}

double ref_grey(const Image& im, int64_t y, int64_t x) {
  return std::trunc(0.2989 * px(im, y, x, 0) + 0.587 * px(im, y, x, 1) + 0.114 * px(im, y, x, 2));
}

// The sampling of a geometric op: source (sx, sy) of output (x, y) in pixel coordinates.
using SourceOf = std::function<std::pair<double, double>(double x, double y)>;
void expect_sampling(const Image& src, const Image& got, const SourceOf& source, const char* what) {
  for (int64_t y = 0; y < src.height; ++y) {
    for (int64_t x = 0; x < src.width; ++x) {
      const auto [sx, sy] = source(static_cast<double>(x), static_cast<double>(y));
      const double ix = std::nearbyint(sx), iy = std::nearbyint(sy);
      const bool tie = std::fabs(std::fabs(sx - std::floor(sx)) - 0.5) < 1e-3 ||
                       std::fabs(std::fabs(sy - std::floor(sy)) - 0.5) < 1e-3;
      const bool inside = ix >= 0 && ix < src.width && iy >= 0 && iy < src.height;
      for (int64_t k = 0; k < src.channels; ++k) {
        const int want =
            inside ? px(src, static_cast<int64_t>(iy), static_cast<int64_t>(ix), k) : 0;
        if (tie) continue;
        ASSERT_EQ(px(got, y, x, k), want)
            << what << " at " << y << "," << x << " from " << sy << "," << sx;
      }
    }
  }
}

Image run(const Image& src, AugmentOp op, double m) {
  Image out = src;
  apply_augment_op(out, op, m);
  return out;
}

const int64_t kShapes[][3] = {{7, 9, 3}, {12, 10, 1}, {16, 16, 3}};

TEST(DataAutoAugment, GeometricOpsMatchTorchvisionsAffine) {
  for (const auto& s : kShapes) {
    const Image im = test_image(s[0], s[1], s[2], 3);
    const double w = static_cast<double>(s[1]), h = static_cast<double>(s[0]);
    for (const double m : {0.27, -0.3, 0.99}) {
      expect_sampling(
          im, run(im, AugmentOp::shear_x, m),
          [&](double x, double y) {
            return std::pair{x + m * (y + 0.5), y};
          },
          "ShearX");
      expect_sampling(
          im, run(im, AugmentOp::shear_y, m),
          [&](double x, double y) {
            return std::pair{x, y + m * (x + 0.5)};
          },
          "ShearY");
    }
    for (const double t : {3.9, -2.2, 0.0, 40.0}) {
      const double ti = std::trunc(t);
      expect_sampling(
          im, run(im, AugmentOp::translate_x, t),
          [&](double x, double y) {
            return std::pair{x - ti, y};
          },
          "TranslateX");
      expect_sampling(
          im, run(im, AugmentOp::translate_y, t),
          [&](double x, double y) {
            return std::pair{x, y - ti};
          },
          "TranslateY");
    }
    for (const double deg : {9.0, -30.0, 90.0, 135.0}) {
      const double r = -deg * M_PI / 180.0;
      expect_sampling(
          im, run(im, AugmentOp::rotate, deg),
          [&](double x, double y) {
            const double xc = x - w / 2 + 0.5, yc = y - h / 2 + 0.5;
            return std::pair{std::cos(r) * xc + std::sin(r) * yc + w / 2 - 0.5,
                             -std::sin(r) * xc + std::cos(r) * yc + h / 2 - 0.5};
          },
          "Rotate");
    }
  }
  // Rotating by 90 degrees is counter-clockwise: the top-right corner goes to the top-left.
  const Image sq = test_image(6, 6, 1, 9);
  EXPECT_EQ(px(run(sq, AugmentOp::rotate, 90.0), 0, 0, 0), px(sq, 0, 5, 0));
}

TEST(DataAutoAugment, ColourOpsMatchTorchvisionsBlends) {
  for (const auto& s : kShapes) {
    const Image im = test_image(s[0], s[1], s[2], 4);
    const int64_t h = s[0], w = s[1], c = s[2];
    for (const double m : {0.27, -0.6, 0.99, -0.99}) {
      const double f = 1 + m;
      std::vector<double> bright, sat, con, sharp;
      double mean = 0;
      for (int64_t y = 0; y < h; ++y) {
        for (int64_t x = 0; x < w; ++x) mean += c == 3 ? ref_grey(im, y, x) : px(im, y, x, 0);
      }
      mean /= static_cast<double>(h * w);
      for (int64_t y = 0; y < h; ++y) {
        for (int64_t x = 0; x < w; ++x) {
          for (int64_t k = 0; k < c; ++k) {
            const double v = px(im, y, x, k);
            bright.push_back(f * v);
            sat.push_back(c == 3 ? f * v + (1 - f) * ref_grey(im, y, x) : v);
            con.push_back(f * v + (1 - f) * mean);
            double blur = v;
            if (y > 0 && x > 0 && y + 1 < h && x + 1 < w) {
              double sum = 4 * v;
              for (int dy = -1; dy <= 1; ++dy) {
                for (int dx = -1; dx <= 1; ++dx) sum += px(im, y + dy, x + dx, k);
              }
              blur = std::nearbyint(sum / 13.0);
            }
            sharp.push_back(f * v + (1 - f) * blur);
          }
        }
      }
      expect_blend(run(im, AugmentOp::brightness, m), bright, "Brightness");
      expect_blend(run(im, AugmentOp::color, m), sat, "Color");
      expect_blend(run(im, AugmentOp::contrast, m), con, "Contrast");
      expect_blend(run(im, AugmentOp::sharpness, m), sharp, "Sharpness");
    }
  }
}

TEST(DataAutoAugment, PointOpsAreExact) {
  for (const auto& s : kShapes) {
    const Image im = test_image(s[0], s[1], s[2], 5);
    const int64_t n = static_cast<int64_t>(im.pixels.size()), c = s[2];
    for (const int bits : {8, 7, 4, 2}) {
      const Image got = run(im, AugmentOp::posterize, bits);
      for (int64_t i = 0; i < n; ++i) {
        const int v = im.pixels[static_cast<size_t>(i)];
        ASSERT_EQ(got.pixels[static_cast<size_t>(i)], v - v % (1 << (8 - bits))) << bits;
      }
    }
    for (const double t : {178.5, 255.0, 0.0, 100.0}) {
      const Image got = run(im, AugmentOp::solarize, t);
      for (int64_t i = 0; i < n; ++i) {
        const int v = im.pixels[static_cast<size_t>(i)];
        ASSERT_EQ(got.pixels[static_cast<size_t>(i)], v >= t ? 255 - v : v) << t;
      }
    }
    // AutoContrast per channel: (v - min) * 255 / (max - min), truncated.
    const Image ac = run(im, AugmentOp::autocontrast, 0);
    std::vector<double> want(static_cast<size_t>(n));
    for (int64_t k = 0; k < c; ++k) {
      int lo = 255, hi = 0;
      for (int64_t i = k; i < n; i += c)
        lo = std::min<int>(lo, im.pixels[i]), hi = std::max<int>(hi, im.pixels[i]);
      for (int64_t i = k; i < n; i += c) want[i] = (im.pixels[i] - lo) * 255.0 / (hi - lo);
    }
    expect_blend(ac, want, "AutoContrast");
    // Equalize per channel, torchvision's _scale_channel in integers.
    const Image eq = run(im, AugmentOp::equalize, 0);
    for (int64_t k = 0; k < c; ++k) {
      std::vector<int64_t> hist(256, 0);
      for (int64_t i = k; i < n; i += c) ++hist[im.pixels[i]];
      std::vector<int64_t> nonzero;
      for (int64_t v : hist) {
        if (v) nonzero.push_back(v);
      }
      int64_t step = 0;
      for (size_t i = 0; i + 1 < nonzero.size(); ++i) step += nonzero[i];
      step /= 255;
      std::vector<int64_t> lut(256, 0);
      int64_t cum = 0;
      for (int v = 0; v < 256; ++v) {
        cum += hist[v];
        if (v < 255 && step) lut[v + 1] = std::min<int64_t>(255, (cum + step / 2) / step);
      }
      for (int64_t i = k; i < n; i += c) {
        ASSERT_EQ(eq.pixels[i], step ? lut[im.pixels[i]] : im.pixels[i]) << "Equalize " << i;
      }
    }
    EXPECT_EQ(run(im, AugmentOp::identity, 0).pixels, im.pixels);
  }
  // A flat channel: autocontrast leaves it, equalize too (step 0).
  Image flat = test_image(4, 4, 1, 1);
  std::fill(flat.pixels.begin(), flat.pixels.end(), uint8_t{77});
  EXPECT_EQ(run(flat, AugmentOp::autocontrast, 0).pixels, flat.pixels);
  EXPECT_EQ(run(flat, AugmentOp::equalize, 0).pixels, flat.pixels);
}

TEST(DataAutoAugment, MagnitudesAreTorchvisions) {
  // torch.linspace's float32 values and the posterize bins, by hand.
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 2, 9, 31);
  EXPECT_FLOAT_EQ(static_cast<float>(ra.magnitude(AugmentOp::shear_x, 9, 224, 224)), 0.09f);
  EXPECT_FLOAT_EQ(static_cast<float>(ra.magnitude(AugmentOp::rotate, 9, 224, 224)), 9.0f);
  EXPECT_FLOAT_EQ(static_cast<float>(ra.magnitude(AugmentOp::brightness, 9, 224, 224)), 0.27f);
  EXPECT_FLOAT_EQ(static_cast<float>(ra.magnitude(AugmentOp::translate_x, 9, 100, 331)), 45.0f);
  EXPECT_FLOAT_EQ(static_cast<float>(ra.magnitude(AugmentOp::translate_y, 30, 331, 100)), 150.0f);
  EXPECT_EQ(ra.magnitude(AugmentOp::solarize, 9, 224, 224), 178.5);
  EXPECT_EQ(ra.magnitude(AugmentOp::posterize, 9, 224, 224), 7.0);  // 8 - round(9 / 7.5)
  EXPECT_EQ(ra.magnitude(AugmentOp::posterize, 30, 224, 224), 4.0);
  EXPECT_EQ(ra.magnitude(AugmentOp::equalize, 9, 224, 224), 0.0);
  const AutoAugment ta(AutoAugmentPolicy::trivial_augment_wide);
  EXPECT_FLOAT_EQ(static_cast<float>(ta.magnitude(AugmentOp::rotate, 30, 1, 1)), 135.0f);
  EXPECT_FLOAT_EQ(static_cast<float>(ta.magnitude(AugmentOp::translate_x, 15, 1, 1)), 16.0f);
  EXPECT_EQ(ta.magnitude(AugmentOp::posterize, 30, 1, 1), 2.0);  // 8 - round(30 / 5)
  EXPECT_EQ(ta.magnitude(AugmentOp::posterize, 12, 1, 1), 6.0);  // round(2.4) = 2
  // linspace's second half counts back from the end, as torch's kernel.
  EXPECT_EQ(linspace_f32(0.0, 0.99, 31, 30), 0.99f);
  EXPECT_EQ(linspace_f32(255.0, 0.0, 31, 30), 0.0f);
}

TEST(DataAutoAugment, DrawsFollowTorchvisionsOrder) {
  // RandAugment: per op, randint(14), then for signed ops randint(2); TrivialAugmentWide:
  // randint(14), randint(31) for ops with magnitudes, then the sign.
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 3, 9, 31);
  const AutoAugment ta(AutoAugmentPolicy::trivial_augment_wide);
  std::vector<int64_t> seen(kAugmentOps, 0);
  for (uint64_t s = 0; s < 700; ++s) {
    Rng a = Rng::derive(1, 4, s), b = Rng::derive(1, 4, s);
    const auto ops = ra.draw(64, 48, a);
    ASSERT_EQ(ops.size(), 3u);
    for (const auto& [op, m] : ops) {
      const auto want = static_cast<AugmentOp>(b.below(14));
      ASSERT_EQ(op, want);
      double mag = ra.magnitude(want, 9, 64, 48);
      if (AutoAugment::signed_op(want) && b.below(2)) mag = -mag;
      ASSERT_EQ(m, mag);
      ++seen[static_cast<size_t>(op)];
    }
    ASSERT_EQ(a.next_u64(), b.next_u64());
    Rng c = Rng::derive(2, 4, s), d = Rng::derive(2, 4, s);
    const auto one = ta.draw(64, 48, c);
    ASSERT_EQ(one.size(), 1u);
    const auto op = static_cast<AugmentOp>(d.below(14));
    ASSERT_EQ(one[0].first, op);
    double mag = 0;
    if (op != AugmentOp::identity && op != AugmentOp::autocontrast && op != AugmentOp::equalize) {
      mag = ta.magnitude(op, static_cast<int>(d.below(31)), 64, 48);
    }
    if (AutoAugment::signed_op(op) && d.below(2)) mag = -mag;
    ASSERT_EQ(one[0].second, mag);
    ASSERT_EQ(c.next_u64(), d.next_u64());
  }
  // 2100 uniform picks of 14: 150 each, sd about 12.
  for (int64_t n : seen) EXPECT_NEAR(static_cast<double>(n), 150.0, 60.0);
}

TEST(DataAutoAugment, TransformRoundsToBytesAndNeedsToFloat) {
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 2, 9, 31);
  FloatImage f(10, 12, 3);
  for (size_t i = 0; i < f.data.size(); ++i)
    f.data[i] = static_cast<float>((i * 37) % 256) / 255.0f + 0.001f;
  Image bytes;
  bytes.height = 10, bytes.width = 12, bytes.channels = 3;
  for (float v : f.data) bytes.pixels.push_back(static_cast<uint8_t>(std::lround(v * 255.0f)));
  Rng a(3), b(3);
  ra.apply(f, a);
  for (const auto& [op, m] : ra.draw(10, 12, b)) apply_augment_op(bytes, op, m);
  for (size_t i = 0; i < f.data.size(); ++i)
    ASSERT_EQ(f.data[i], bytes.pixels[i] * (1.0f / 255.0f));
  Pipeline p;
  EXPECT_THROW(p.add<AutoAugment>(AutoAugmentPolicy::trivial_augment_wide), Error);
  p.add<ToFloat>().add<AutoAugment>(AutoAugmentPolicy::trivial_augment_wide);
  std::string why;
  EXPECT_FALSE(p.geometric(&why));
  EXPECT_NE(why.find("TrivialAugmentWide"), std::string::npos) << why;
  EXPECT_THROW(AutoAugment(AutoAugmentPolicy::rand_augment, 2, 31, 31), Error);
  EXPECT_THROW(parse_auto_augment("aa"), Error);
}

}  // namespace
}  // namespace kiln
