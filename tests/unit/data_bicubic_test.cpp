// The bicubic filter (--interpolation bicubic) against a float64 reference written here from
// Pillow's Resample.c: bicubic_filter with a = -0.5, support 2 widened by max(scale, 1),
// taps from (int)(centre - support + 0.5) to (int)(centre + support + 0.5) clamped to the box,
// weights normalised, applied separably without intermediate rounding, clipped to bytes once.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/sample_geometry.h"
#include "kiln/data/transforms.h"

namespace kiln {
namespace {

double ref_cubic(double x) {
  const double a = -0.5;
  x = std::fabs(x);
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

using Coeffs = std::vector<std::vector<std::pair<int64_t, double>>>;

// out pixels from the source box [0, len): coordinates relative to the crop (PIL's resize of
// the cropped image).
Coeffs ref_coeffs(int64_t len, int64_t out) {
  const double scale = static_cast<double>(len) / static_cast<double>(out);
  const double fs = scale < 1 ? 1 : scale;
  const double support = 2.0 * fs;
  Coeffs k(static_cast<size_t>(out));
  for (int64_t xx = 0; xx < out; ++xx) {
    const double centre = (xx + 0.5) * scale;
    const int64_t xmin = std::max<int64_t>(0, static_cast<int64_t>(centre - support + 0.5));
    const int64_t xmax = std::min<int64_t>(len, static_cast<int64_t>(centre + support + 0.5));
    double ww = 0;
    for (int64_t x = xmin; x < xmax; ++x) {
      const double w = ref_cubic((x - centre + 0.5) / fs);
      k[static_cast<size_t>(xx)].push_back({x, w});
      ww += w;
    }
    for (auto& p : k[static_cast<size_t>(xx)]) p.second /= ww;
  }
  return k;
}

std::vector<double> ref_resample(const std::vector<uint8_t>& img, int64_t w, int64_t c, int64_t top,
                                 int64_t left, int64_t bh, int64_t bw, int64_t oh, int64_t ow,
                                 bool flip) {
  const Coeffs ky = ref_coeffs(bh, oh), kx = ref_coeffs(bw, ow);
  std::vector<double> out(static_cast<size_t>(oh * ow * c), 0.0);
  for (int64_t y = 0; y < oh; ++y) {
    for (int64_t x = 0; x < ow; ++x) {
      for (int64_t ch = 0; ch < c; ++ch) {
        double s = 0;
        for (auto [sy, wy] : ky[static_cast<size_t>(y)]) {
          for (auto [sx, wx] : kx[static_cast<size_t>(x)]) {
            s += wy * wx * img[static_cast<size_t>(((top + sy) * w + left + sx) * c + ch)];
          }
        }
        out[static_cast<size_t>((y * ow + (flip ? ow - 1 - x : x)) * c + ch)] = s;
      }
    }
  }
  return out;
}

// Gradients, a checkerboard and noise: sharp edges, so bicubic overshoots and the clamp matters.
std::vector<uint8_t> test_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint8_t> img(static_cast<size_t>(h * w * c));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t ch = 0; ch < c; ++ch) {
        const double v = 128 + 70 * std::sin(0.09 * x + 0.5 * ch) * std::cos(0.05 * y) +
                         30 * (rng.uniform() - 0.5) + ((x / 6 + y / 4) % 2 ? 60 : -60);
        img[static_cast<size_t>((y * w + x) * c + ch)] =
            static_cast<uint8_t>(std::lround(std::min(255.0, std::max(0.0, v))));
      }
    }
  }
  return img;
}

ResampleAxis box_axis(int64_t start, int64_t len, int64_t out) {
  ResampleAxis a;
  a.out = out;
  a.origin = static_cast<double>(start);
  a.scale = static_cast<double>(len) / static_cast<double>(out);
  a.lo = start, a.hi = start + len;
  a.valid_lo = 0, a.valid_hi = out;
  a.filter = ResampleFilter::bicubic;
  return a;
}

struct Case {
  int64_t h, w, c, top, left, bh, bw, oh, ow;
  bool flip;
};

const Case kCases[] = {
    {375, 500, 3, 40, 70, 300, 280, 224, 224, false},  // typical RandomResizedCrop
    {333, 500, 1, 10, 3, 100, 77, 224, 224, false},    // upscaling: 4 taps
    {37, 23, 3, 0, 0, 37, 23, 13, 29, true},           // down in y, up in x
    {64, 64, 1, 5, 9, 50, 40, 7, 5, false},            // strong shrink (support 16)
    {16, 16, 3, 0, 0, 16, 16, 16, 16, false},          // identity: a copy
    {90, 301, 3, 2, 1, 77, 300, 31, 10, true},         // x: ~120 taps
    {29, 31, 4, 0, 0, 29, 31, 19, 23, false},          // 4 channels
    {12, 9, 3, 0, 0, 12, 9, 1, 1, false},              // one output pixel
};

TEST(DataBicubic, FilterValuesArePils) {
  // PIL's bicubic_filter at a = -0.5, by hand: f(0.5) = (1.5 * 0.5 - 2.5) * 0.25 + 1.
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bicubic, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bicubic, 0.5), 0.5625);
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bicubic, -1.0), 0.0);
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bicubic, 1.5), -0.0625);
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bicubic, 2.0), 0.0);
  EXPECT_DOUBLE_EQ(filter_weight(ResampleFilter::bilinear, 0.25), 0.75);
  EXPECT_EQ(filter_support(ResampleFilter::bicubic), 2.0);
  EXPECT_EQ(parse_filter("bicubic"), ResampleFilter::bicubic);
  EXPECT_EQ(parse_filter("bilinear"), ResampleFilter::bilinear);
  try {
    parse_filter("lanczos");
    FAIL() << "lanczos accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bilinear or bicubic"), std::string::npos) << e.what();
  }
}

TEST(DataBicubic, ResampleU8MatchesPilReference) {
  // Bound 1 level: the reference is exact, ours accumulates in float and rounds once, so only
  // values within ~1e-4 of a .5 boundary may round the other way (rare: 1% allowed).
  for (const ResampleOrder order :
       {ResampleOrder::horizontal_first, ResampleOrder::vertical_first}) {
    for (const Case& k : kCases) {
      const auto img = test_image(k.h, k.w, k.c, static_cast<uint64_t>(k.h * 31 + k.w));
      SampleGeometry g = SampleGeometry::identity(k.h, k.w);
      g.y = box_axis(k.top, k.bh, k.oh);
      g.x = box_axis(k.left, k.bw, k.ow);
      g.flip = k.flip;
      std::vector<uint8_t> out(static_cast<size_t>(k.oh * k.ow * k.c), 7);
      resample_u8(img.data(), k.h, k.w, k.c, k.w * k.c, g, out.data(), order);
      const auto want = ref_resample(img, k.w, k.c, k.top, k.left, k.bh, k.bw, k.oh, k.ow, k.flip);
      double max_diff = 0;
      int64_t off = 0, clipped = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        const double exact = std::min(255.0, std::max(0.0, want[i]));
        clipped += want[i] < -0.5 || want[i] > 255.5;
        max_diff = std::max(max_diff, std::fabs(out[i] - exact));
        off += out[i] != std::floor(exact + 0.5);
      }
      EXPECT_LE(max_diff, 1.0) << k.h << "x" << k.w << " -> " << k.oh << "x" << k.ow;
      EXPECT_LE(off, static_cast<int64_t>(out.size() / 100 + 1)) << k.h << "x" << k.w;
      if (k.oh * k.ow > 100 && k.bh < k.oh) EXPECT_GT(clipped, 0) << "no overshoot to clamp";
    }
  }
}

TEST(DataBicubic, ResampleFloatMatchesPilReferenceUnclamped) {
  // Float weights and sums: about 1e-5 of 255 levels; 1e-3 leaves room for 100+ taps.
  for (const Case& k : kCases) {
    const auto img = test_image(k.h, k.w, k.c, static_cast<uint64_t>(k.h * 7 + k.w));
    FloatImage f(k.h, k.w, k.c);
    for (size_t i = 0; i < img.size(); ++i) f.data[i] = img[i];
    SampleGeometry g = SampleGeometry::identity(k.h, k.w);
    g.y = box_axis(k.top, k.bh, k.oh);
    g.x = box_axis(k.left, k.bw, k.ow);
    g.flip = k.flip;
    const FloatImage out = resample_float(f, g);
    const auto want = ref_resample(img, k.w, k.c, k.top, k.left, k.bh, k.bw, k.oh, k.ow, k.flip);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(out.data[i], want[i], 1e-3) << k.h << "x" << k.w << " value " << i;
    }
  }
}

TEST(DataBicubic, TransformsCarryTheFilterIntoTheGeometry) {
  // The same draws as bilinear (the filter does not consume randomness), the bicubic taps.
  for (uint64_t s = 0; s < 8; ++s) {
    Pipeline bl, bc;
    bl.add<ToFloat>().add<RandomResizedCrop>(32).add<RandomHorizontalFlip>();
    bc.add<ToFloat>()
        .add<RandomResizedCrop>(32, std::array{0.08f, 1.0f}, std::array{0.75f, 4.0f / 3.0f},
                                ResampleFilter::bicubic)
        .add<RandomHorizontalFlip>();
    ASSERT_TRUE(bc.geometric());
    Rng r1 = Rng::derive(3, 1, s), r2 = Rng::derive(3, 1, s);
    SampleGeometry a = bl.geometry(90, 70, r1), b = bc.geometry(90, 70, r2);
    EXPECT_EQ(a.x.filter, ResampleFilter::bilinear);
    EXPECT_EQ(b.x.filter, ResampleFilter::bicubic);
    EXPECT_EQ(b.y.filter, ResampleFilter::bicubic);
    EXPECT_EQ(r1.next_u64(), r2.next_u64());
    b.x.filter = b.y.filter = ResampleFilter::bilinear;
    EXPECT_EQ(a, b);
    // The float path resamples the box the geometry names, with the bicubic taps.
    const auto img = test_image(90, 70, 3, s);
    Image im;
    im.height = 90, im.width = 70, im.channels = 3, im.pixels = img;
    Rng r3 = Rng::derive(3, 1, s);
    const FloatImage out = bc(im, r3);
    const auto want =
        ref_resample(img, 70, 3, a.y.lo, a.x.lo, a.y.hi - a.y.lo, a.x.hi - a.x.lo, 32, 32, a.flip);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(out.data[i] * 255.0, want[i], 1e-3);
  }
  Pipeline r;
  r.add<Resize>(20, ResampleFilter::bicubic).add<CenterCrop>(20);
  Rng rng(0);
  const SampleGeometry g = r.geometry(50, 40, rng);
  EXPECT_EQ(g.y.filter, ResampleFilter::bicubic);
  EXPECT_NE(r.describe().find("bicubic"), std::string::npos) << r.describe();
  Pipeline d;
  d.add<Resize>(20).add<CenterCrop>(20);
  EXPECT_EQ(d.describe().find("bilinear"), std::string::npos) << d.describe();
}

TEST(DataBicubic, SourceWindowCoversTheWiderTaps) {
  // A decoder asked for source_window() must get every pixel the bicubic taps read.
  SampleGeometry g = SampleGeometry::identity(200, 300);
  g.y = box_axis(50, 60, 30);
  g.x = box_axis(100, 90, 45);
  const SourceWindow win = source_window(g);
  const ResampleTaps ty = resample_taps(g.y, g.src_h);
  int64_t lo, hi;
  tap_span(ty, &lo, &hi);
  EXPECT_EQ(win.top, lo);
  EXPECT_EQ(win.height, hi - lo);
  EXPECT_EQ(ty.max_taps, 8);  // support 2 x scale 2 on each side
}

}  // namespace
}  // namespace kiln
