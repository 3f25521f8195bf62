// SampleGeometry's resampling against a float64 reference of PIL's bilinear filter written here
// from Pillow's Resample.c (precompute_coeffs: support = max(scale, 1), taps from
// (int)(centre - support + 0.5) to (int)(centre + support + 0.5) clamped to the box, triangle
// weights normalised), applied separably without intermediate rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "kiln/core/rng.h"
#include "kiln/data/sample_geometry.h"
#include "kiln/data/transforms.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

// One axis of the reference: out pixels from the source box [b0, b1) of an image of n pixels.
std::vector<std::vector<std::pair<int64_t, double>>> ref_coeffs(double b0, double b1, int64_t out,
                                                                int64_t clamp_lo,
                                                                int64_t clamp_hi) {
  const double scale = (b1 - b0) / static_cast<double>(out);
  const double fs = scale < 1 ? 1 : scale;
  const double support = 1.0 * fs;
  std::vector<std::vector<std::pair<int64_t, double>>> k(static_cast<size_t>(out));
  for (int64_t xx = 0; xx < out; ++xx) {
    const double centre = b0 + (xx + 0.5) * scale;
    int64_t xmin = static_cast<int64_t>(centre - support + 0.5);
    int64_t xmax = static_cast<int64_t>(centre + support + 0.5);
    if (xmin < clamp_lo) xmin = clamp_lo;
    if (xmax > clamp_hi) xmax = clamp_hi;
    double ww = 0;
    for (int64_t x = xmin; x < xmax; ++x) {
      double v = std::fabs((x - centre + 0.5) / fs);
      const double w = v < 1 ? 1 - v : 0;
      k[static_cast<size_t>(xx)].push_back({x, w});
      ww += w;
    }
    for (auto& p : k[static_cast<size_t>(xx)]) p.second /= ww;
  }
  return k;
}

// PIL's crop-then-resize of box (top, left, bh, bw) to oh x ow, mirrored when flip.
std::vector<double> ref_resample(const std::vector<uint8_t>& img, int64_t w, int64_t c, int64_t top,
                                 int64_t left, int64_t bh, int64_t bw, int64_t oh, int64_t ow,
                                 bool flip) {
  // Coordinates relative to the crop, clamped to it (PIL's resize of the cropped image).
  const auto ky = ref_coeffs(0, static_cast<double>(bh), oh, 0, bh);
  const auto kx = ref_coeffs(0, static_cast<double>(bw), ow, 0, bw);
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
        const int64_t xo = flip ? ow - 1 - x : x;
        out[static_cast<size_t>((y * ow + xo) * c + ch)] = s;
      }
    }
  }
  return out;
}

// Smooth gradients plus a deterministic texture, so every filter tap matters.
std::vector<uint8_t> test_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint8_t> img(static_cast<size_t>(h * w * c));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t ch = 0; ch < c; ++ch) {
        const double v = 128 + 60 * std::sin(0.07 * x + 0.5 * ch) * std::cos(0.05 * y) +
                         40 * (rng.uniform() - 0.5) + ((x / 7 + y / 5) % 2) * 20;
        img[static_cast<size_t>((y * w + x) * c + ch)] =
            static_cast<uint8_t>(std::lround(std::min(255.0, std::max(0.0, v))));
      }
    }
  }
  return img;
}

SampleGeometry box_geometry(int64_t h, int64_t w, int64_t top, int64_t left, int64_t bh, int64_t bw,
                            int64_t oh, int64_t ow, bool flip) {
  SampleGeometry g = SampleGeometry::identity(h, w);
  auto axis = [](int64_t start, int64_t len, int64_t out) {
    ResampleAxis a;
    a.out = out;
    a.origin = static_cast<double>(start);
    a.scale = static_cast<double>(len) / static_cast<double>(out);
    a.lo = start, a.hi = start + len;
    a.valid_lo = 0, a.valid_hi = out;
    return a;
  };
  g.y = axis(top, bh, oh);
  g.x = axis(left, bw, ow);
  g.flip = flip;
  return g;
}

struct Case {
  int64_t h, w, c, top, left, bh, bw, oh, ow;
  bool flip;
};

// Both orders of the separable passes: each must meet every bound on its own.
const ResampleOrder kOrders[] = {ResampleOrder::horizontal_first, ResampleOrder::vertical_first};
const char* order_name(ResampleOrder o) {
  return o == ResampleOrder::vertical_first ? "vertical_first" : "horizontal_first";
}

TEST(DataGeometry, ResampleMatchesPilBilinearReference) {
  // Down- and upscaling, non-integral scales, boxes touching and away from the edges, 1 to 4
  // channels, flipped and not, 1 to 60 horizontal taps (the vertical-first pass has a kernel
  // per tap count up to 6 and one for more), odd widths. Bound 1 level: the reference is exact,
  // ours accumulates in float and rounds once, so only values within ~1e-4 of a .5 boundary may
  // round the other way.
  const Case cases[] = {
      {375, 500, 3, 40, 70, 300, 280, 224, 224, false},  // typical RandomResizedCrop
      {375, 500, 3, 0, 0, 375, 500, 224, 224, true},     // whole image, anisotropic
      {333, 500, 1, 10, 3, 100, 77, 224, 224, false},    // upscaling
      {37, 23, 3, 0, 0, 37, 23, 13, 29, true},           // down in y, up in x
      {64, 64, 1, 5, 9, 50, 40, 7, 5, false},            // strong shrink (support 8)
      {16, 16, 3, 0, 0, 16, 16, 16, 16, false},          // identity
      {20, 30, 1, 3, 4, 10, 10, 10, 10, true},           // a plain crop, flipped
      {90, 301, 3, 2, 1, 77, 300, 31, 10, true},         // x: 60 taps
      {41, 67, 3, 0, 5, 41, 60, 23, 34, false},          // x: 4 taps
      {50, 61, 3, 1, 2, 48, 59, 17, 20, true},           // x: 6 taps
      {29, 31, 4, 0, 0, 29, 31, 19, 23, false},          // 4 channels
      {33, 17, 2, 3, 1, 25, 15, 30, 7, true},            // 2 channels, up in y
      {12, 9, 3, 0, 0, 12, 9, 1, 1, false},              // one output pixel
  };
  for (const ResampleOrder order : kOrders) {
    for (const Case& k : cases) {
      const auto img = test_image(k.h, k.w, k.c, static_cast<uint64_t>(k.h * 31 + k.w));
      const SampleGeometry g =
          box_geometry(k.h, k.w, k.top, k.left, k.bh, k.bw, k.oh, k.ow, k.flip);
      std::vector<uint8_t> out(static_cast<size_t>(k.oh * k.ow * k.c), 7);
      resample_u8(img.data(), k.h, k.w, k.c, k.w * k.c, g, out.data(), order);
      const auto want = ref_resample(img, k.w, k.c, k.top, k.left, k.bh, k.bw, k.oh, k.ow, k.flip);
      double max_diff = 0;
      int64_t off_by_one = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        const double d = std::fabs(out[i] - std::min(255.0, std::max(0.0, want[i])));
        max_diff = std::max(max_diff, d);
        off_by_one += std::fabs(out[i] - std::floor(want[i] + 0.5)) > 0;
      }
      EXPECT_LE(max_diff, 1.0) << k.h << "x" << k.w << " box " << k.bh << "x" << k.bw << " -> "
                               << k.oh << "x" << k.ow << " " << order_name(order);
      // Rounding the other way happens only next to a .5 boundary: rare.
      EXPECT_LE(off_by_one, static_cast<int64_t>(out.size() / 100 + 1)) << order_name(order);
    }
  }
}

TEST(DataGeometry, ResampleOrdersAgreeOnRandomCrops) {
  // RandomResizedCrop draws on images of odd sizes, to outputs smaller and larger than the
  // crops, grey and RGB, flipped or not. Each order stays within 1 level of the exact
  // reference; the two differ only where float rounding (~1e-5 of a level) tips a value lying
  // that close to a .5 boundary, 2e-4 of the values here: allowed 1e-3 of them.
  Rng draw(21);
  int64_t values = 0, differ = 0;
  for (int i = 0; i < 24; ++i) {
    const int64_t h = 20 + static_cast<int64_t>(draw.below(150));
    const int64_t w = 20 + static_cast<int64_t>(draw.below(150));
    const int64_t c = draw.below(4) == 0 ? 1 : 3;
    const int64_t oh = 5 + static_cast<int64_t>(draw.below(120));
    const int64_t ow = 5 + static_cast<int64_t>(draw.below(120));
    Pipeline p;
    p.add<RandomResizedCrop>(oh, ow, std::array{0.08f, 1.0f}, std::array{0.75f, 4.0f / 3.0f})
        .add<RandomHorizontalFlip>();
    Rng rng = Rng::derive(5, 0, static_cast<uint64_t>(i));
    const SampleGeometry g = p.geometry(h, w, rng);
    const auto img = test_image(h, w, c, static_cast<uint64_t>(i));
    // The crop box in whole pixels, as RandomResizedCrop draws it (origin and lo agree).
    const int64_t top = g.y.lo, left = g.x.lo, bh = g.y.hi - g.y.lo, bw = g.x.hi - g.x.lo;
    const auto want = ref_resample(img, w, c, top, left, bh, bw, oh, ow, g.flip);
    std::vector<uint8_t> hf(static_cast<size_t>(oh * ow * c)), vf(hf.size());
    resample_u8(img.data(), h, w, c, w * c, g, hf.data(), ResampleOrder::horizontal_first);
    resample_u8(img.data(), h, w, c, w * c, g, vf.data(), ResampleOrder::vertical_first);
    for (size_t k = 0; k < hf.size(); ++k) {
      const double exact = std::min(255.0, std::max(0.0, want[k]));
      ASSERT_LE(std::fabs(hf[k] - exact), 1.0) << "crop " << i << " value " << k;
      ASSERT_LE(std::fabs(vf[k] - exact), 1.0) << "crop " << i << " value " << k;
      differ += hf[k] != vf[k];
    }
    values += static_cast<int64_t>(hf.size());
  }
  EXPECT_LE(differ, values / 1000 + 1) << differ << " of " << values << " values differ";
}

TEST(DataGeometry, IdentityAndCropAreCopies) {
  const auto img = test_image(20, 30, 3, 5);
  const SampleGeometry crop = box_geometry(20, 30, 3, 4, 10, 12, 10, 12, false);
  EXPECT_TRUE(crop.y.is_copy() && crop.x.is_copy());
  for (const ResampleOrder order : kOrders) {
    std::vector<uint8_t> out(20 * 30 * 3);
    resample_u8(img.data(), 20, 30, 3, 90, SampleGeometry::identity(20, 30), out.data(), order);
    EXPECT_EQ(out, img) << order_name(order);
    std::vector<uint8_t> c(10 * 12 * 3);
    resample_u8(img.data(), 20, 30, 3, 90, crop, c.data(), order);
    for (int64_t y = 0; y < 10; ++y) {
      for (int64_t x = 0; x < 12 * 3; ++x) {
        ASSERT_EQ(c[static_cast<size_t>(y * 36 + x)],
                  img[static_cast<size_t>((y + 3) * 90 + 12 + x)])
            << order_name(order);
      }
    }
  }
  // A copy reads exactly its pixels (zero-weight neighbours are trimmed).
  const SourceWindow win = source_window(crop);
  EXPECT_EQ(win.top, 3);
  EXPECT_EQ(win.left, 4);
  EXPECT_EQ(win.height, 10);
  EXPECT_EQ(win.width, 12);
}

TEST(DataGeometry, InvalidOutputsAndPaddingAreZero) {
  // A 4x4 crop of a 2x2 image at offset -1: the outside reads 0 (RandomCrop's padding), and
  // outputs outside [valid_lo, valid_hi) are 0 however the axis maps them.
  const std::vector<uint8_t> img = {10, 20, 30, 40};
  SampleGeometry g = SampleGeometry::identity(2, 2);
  g.y.out = g.x.out = 4;
  g.y.origin = g.x.origin = -1;
  g.y.lo = g.x.lo = -1;
  g.y.hi = g.x.hi = 3;
  g.y.valid_hi = g.x.valid_hi = 4;
  for (const ResampleOrder order : kOrders) {
    SampleGeometry h = g;
    std::vector<uint8_t> out(16, 7);
    resample_u8(img.data(), 2, 2, 1, 2, h, out.data(), order);
    EXPECT_EQ(out, (std::vector<uint8_t>{0, 0, 0, 0, 0, 10, 20, 0, 0, 30, 40, 0, 0, 0, 0, 0}))
        << order_name(order);
    h.x.valid_lo = 2;  // the left half does not read the source
    resample_u8(img.data(), 2, 2, 1, 2, h, out.data(), order);
    EXPECT_EQ(out, (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 20, 0, 0, 0, 40, 0, 0, 0, 0, 0}))
        << order_name(order);
    h.y.valid_hi = 0;  // no output reads the source
    resample_u8(img.data(), 2, 2, 1, 2, h, out.data(), order);
    EXPECT_EQ(out, std::vector<uint8_t>(16, 0)) << order_name(order);
  }
  g.x.valid_lo = 2;
  EXPECT_EQ(source_window(g).left, 1);
  EXPECT_EQ(source_window(g).width, 1);
}

TEST(DataGeometry, DctScaleAndWindowRescaling) {
  // 375 x 500 -> 224 x 224: the shorter axis decides (375 / 224 = 1.67 needs 5/8, 500 / 224
  // alone would allow 4/8), and 5/8 rounds up to the power of two 8/8.
  SampleGeometry g = box_geometry(375, 500, 0, 0, 375, 500, 224, 224, false);
  EXPECT_EQ(dct_scale_for(g), 8);
  EXPECT_EQ(dct_scale_for(box_geometry(500, 500, 0, 0, 500, 500, 224, 224, false)), 4);
  EXPECT_EQ(dct_scale_for(box_geometry(375, 500, 0, 0, 100, 100, 224, 224, false)), 8);
  EXPECT_EQ(dct_scale_for(box_geometry(2000, 2000, 0, 0, 2000, 2000, 224, 224, false)), 1);
  EXPECT_EQ(dct_scale_for(box_geometry(300, 300, 0, 0, 300, 300, 100, 100, false)), 4);  // 3/8
  EXPECT_EQ(dct_scale_for(box_geometry(900, 900, 0, 0, 900, 900, 224, 224, false)), 2);
  // DCT scaling 4/8 of 375 x 500 gives ceil: 188 x 250, with the factor exactly 1/2.
  const SampleGeometry s = rescale_source_dct(g, 4);
  EXPECT_EQ(s.src_h, 188);
  EXPECT_EQ(s.src_w, 250);
  EXPECT_DOUBLE_EQ(s.y.scale, 375.0 / 224.0 / 2.0);
  EXPECT_EQ(s.y.hi, 188);  // 187.5 rounds up: the last partial pixel is kept
  // Shifting to a window and back reads the same pixels.
  const SampleGeometry b = box_geometry(375, 500, 40, 70, 300, 280, 224, 224, true);
  const SourceWindow win = source_window(b);
  EXPECT_EQ(win.top, 40);
  EXPECT_EQ(win.left, 70);
  EXPECT_EQ(win.height, 300);
  EXPECT_EQ(win.width, 280);
  const SampleGeometry shifted = shift_source(b, win.top, win.left, win.height, win.width);
  const auto img = test_image(375, 500, 3, 9);
  std::vector<uint8_t> full(224 * 224 * 3), part(224 * 224 * 3);
  for (const ResampleOrder order : kOrders) {
    resample_u8(img.data(), 375, 500, 3, 1500, b, full.data(), order);
    resample_u8(img.data() + (win.top * 500 + win.left) * 3, win.height, win.width, 3, 1500,
                shifted, part.data(), order);
    EXPECT_EQ(full, part) << order_name(order);
  }
  data_test::expect_error([&] { resample_u8(img.data(), 300, 500, 3, 1500, b, full.data()); },
                          ErrorKind::InvalidArgument, {"geometry refers to 375x500"});
}

Image as_image(const std::vector<uint8_t>& px, int64_t h, int64_t w, int64_t c) {
  Image img;
  img.height = h, img.width = w, img.channels = c;
  img.pixels = px;
  return img;
}

// The float path (operator()) and the uint8 path (geometry + resample_u8, then the
// normalisation the device would apply) on the same (seed, epoch, index) stream.
void expect_paths_agree(const Pipeline& p, int64_t h, int64_t w, int64_t c, int samples) {
  std::string why;
  ASSERT_TRUE(p.geometric(&why)) << why;
  const auto px = test_image(h, w, c, static_cast<uint64_t>(h + w));
  const Image img = as_image(px, h, w, c);
  const InputNormalization norm = p.normalization(c);
  for (int i = 0; i < samples; ++i) {
    Rng a = Rng::derive(3, 1, static_cast<uint64_t>(i)), b = a;
    const FloatImage f = p(img, a);
    const SampleGeometry g = p.geometry(h, w, b);
    // Both paths drew the same numbers: the streams are in the same state.
    EXPECT_EQ(a.next_u64(), b.next_u64());
    ASSERT_EQ(f.height, g.out_h());
    ASSERT_EQ(f.width, g.out_w());
    for (const ResampleOrder order : kOrders) {
      std::vector<uint8_t> u(static_cast<size_t>(g.out_h() * g.out_w() * c));
      resample_u8(px.data(), h, w, c, w * c, g, u.data(), order);
      // Within half a level (plus float slack): the uint8 path rounds once, the float path
      // does not.
      double max_diff = 0;
      for (size_t k = 0; k < u.size(); ++k) {
        const size_t ch = k % static_cast<size_t>(c);
        const double level = (f.data[k] * norm.std[ch] + norm.mean[ch]) * 255.0;
        max_diff = std::max(max_diff, std::fabs(level - u[k]));
      }
      EXPECT_LE(max_diff, 0.5 + 1e-3)
          << p.describe() << " sample " << i << " " << order_name(order);
    }
  }
}

TEST(DataGeometry, PipelineGeometryDrawsAsTheFloatPath) {
  const std::vector<float> mean = {0.485f, 0.456f, 0.406f}, std = {0.229f, 0.224f, 0.225f};
  Pipeline train;
  train.add<ToFloat>().add<RandomResizedCrop>(224).add<RandomHorizontalFlip>().add<Normalize>(mean,
                                                                                              std);
  expect_paths_agree(train, 375, 500, 3, 12);
  Pipeline eval;
  eval.add<ToFloat>().add<Resize>(256).add<CenterCrop>(224).add<Normalize>(mean, std);
  expect_paths_agree(eval, 333, 500, 3, 2);
  // CIFAR-style: a padded random crop, flipped; and a flip before crops (mirrored windows).
  Pipeline cifar;
  cifar.add<RandomCrop>(32, 4).add<RandomHorizontalFlip>().add<ToFloat>();
  expect_paths_agree(cifar, 32, 32, 3, 20);
  Pipeline flip_first;
  flip_first.add<RandomHorizontalFlip>().add<RandomCrop>(20, 30, 3).add<CenterCrop>(16, 40);
  expect_paths_agree(flip_first, 24, 33, 1, 20);
  Pipeline flip_rrc;
  flip_rrc.add<RandomHorizontalFlip>().add<RandomResizedCrop>(40, 30, std::array{0.2f, 1.0f},
                                                              std::array{0.5f, 2.0f});
  expect_paths_agree(flip_rrc, 64, 48, 1, 20);
}

TEST(DataGeometry, PipelineGeometricAndNormalization) {
  std::string why;
  Pipeline jitter;
  jitter.add<ToFloat>().add<RandomResizedCrop>(8).add<ColorJitter>(0.4f, 0.4f, 0.4f);
  EXPECT_FALSE(jitter.geometric(&why));
  EXPECT_NE(why.find("ColorJitter"), std::string::npos) << why;
  Pipeline twice;
  twice.add<Resize>(16).add<RandomResizedCrop>(8);
  EXPECT_FALSE(twice.geometric(&why));
  EXPECT_NE(why.find("resamples twice"), std::string::npos) << why;
  Rng rng(1);
  data_test::expect_error([&] { twice.geometry(40, 30, rng); }, ErrorKind::InvalidArgument,
                          {"resamples twice", "float path"});
  Pipeline late;
  late.add<ToFloat>()
      .add<Normalize>(std::vector<float>{0.5f}, std::vector<float>{0.5f})
      .add<CenterCrop>(4);
  EXPECT_FALSE(late.geometric(&why));
  EXPECT_NE(why.find("move Normalize to the end"), std::string::npos) << why;
  // Statistics on [0,1] pixels: as given after ToFloat; divided by 255 without it (the float
  // path then normalises 0..255 values); mean 0, std 1 (or 1/255) with no Normalize.
  Pipeline unit;
  unit.add<ToFloat>().add<Normalize>(std::vector<float>{0.5f, 0.25f}, std::vector<float>{0.2f, 2});
  const InputNormalization n = unit.normalization(2);
  EXPECT_EQ(n.mean, (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(n.std, (std::vector<float>{0.2f, 2.0f}));
  Pipeline bytes;
  bytes.add<Normalize>(std::vector<float>{127.5f}, std::vector<float>{51});
  EXPECT_FLOAT_EQ(bytes.normalization(1).mean[0], 0.5f);
  EXPECT_FLOAT_EQ(bytes.normalization(1).std[0], 0.2f);
  Pipeline none;
  none.add<ToFloat>();
  EXPECT_EQ(none.normalization(3).mean, (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(none.normalization(3).std, (std::vector<float>{1, 1, 1}));
  data_test::expect_error([&] { unit.normalization(3); }, ErrorKind::InvalidArgument,
                          {"2 channel statistics", "3 channels"});
}

}  // namespace
}  // namespace kiln
