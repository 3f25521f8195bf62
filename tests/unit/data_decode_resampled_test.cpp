// The cropped and DCT-scaled JPEG decode (decode_resampled) against the full decode followed by
// the same resampling, and read_image_info on the kinds of file an image folder holds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "kiln/core/rng.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/transforms.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;

// Gradients, a few soft stripes and blobs and a little noise: photograph-like content, which
// JPEG keeps to a level or two at quality 90.
Image photo(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  Rng rng(seed);
  Image img;
  img.height = h, img.width = w, img.channels = c;
  img.pixels.resize(static_cast<size_t>(h * w * c));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t k = 0; k < c; ++k) {
        const double v =
            60 + 0.25 * x + 0.2 * y + 25 * k + 30 * std::sin(0.045 * x + 0.03 * y + k) +
            20 * std::cos(0.11 * y - 0.02 * x) * std::sin(0.07 * x) + 6 * (rng.uniform() - 0.5);
        img.pixels[static_cast<size_t>((y * w + x) * c + k)] =
            static_cast<uint8_t>(std::lround(std::min(255.0, std::max(0.0, v))));
      }
    }
  }
  return img;
}

struct Diff {
  double mean = 0;
  int max = 0;
};
Diff diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  Diff d;
  double total = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const int e = std::abs(int{a[i]} - int{b[i]});
    total += e;
    d.max = std::max(d.max, e);
  }
  d.mean = total / static_cast<double>(a.size());
  return d;
}

std::vector<uint8_t> decode(const std::vector<uint8_t>& jpg, int64_t channels,
                            const SampleGeometry& g, bool dct, bool crop,
                            ResampleMath math = ResampleMath::fixed16) {
  std::vector<uint8_t> out(static_cast<size_t>(g.out_h() * g.out_w() * channels));
  ResampledDecodeOptions o;
  o.dct_scaling = dct;
  o.crop = crop;
  o.math = math;
  decode_resampled(jpg.data(), jpg.size(), channels, g, out.data(), "test.jpg", o);
  return out;
}

struct JpegCase {
  int64_t h, w, c;
  JpegSubsampling sub;
  bool progressive;
};

const JpegCase kCases[] = {
    {375, 500, 3, JpegSubsampling::s420, false}, {500, 333, 3, JpegSubsampling::s420, false},
    {375, 500, 3, JpegSubsampling::s444, false}, {375, 500, 1, JpegSubsampling::s420, false},
    {333, 500, 3, JpegSubsampling::s422, true},
};

// Training geometries (RandomResizedCrop + flip) and the evaluation one (Resize, CenterCrop)
// for an h x w image, at an output size of `size` (224: ImageNet's; smaller ones make libjpeg's
// DCT scaling apply to 500 x 375 images).
std::vector<SampleGeometry> geometries(int64_t h, int64_t w, int n, int64_t size = 224) {
  Pipeline train, eval;
  train.add<ToFloat>().add<RandomResizedCrop>(size).add<RandomHorizontalFlip>();
  eval.add<ToFloat>().add<Resize>(size * 8 / 7).add<CenterCrop>(size);
  std::vector<SampleGeometry> out;
  for (int i = 0; i < n; ++i) {
    Rng rng = Rng::derive(11, 0, static_cast<uint64_t>(i));
    out.push_back(train.geometry(h, w, rng));
  }
  Rng rng(0);
  out.push_back(eval.geometry(h, w, rng));
  return out;
}

TEST(DataCodecGeometry, CroppedDecodeIsTheFullDecode) {
  // The window's pixels are the full decode's, bit for bit: libjpeg-turbo decodes whole iMCU
  // columns (jpeg_crop_scanline widens the window to them), skipped rows still feed the chroma
  // upsampler's context, and the margin decode_resampled keeps beside the window covers the
  // columns where fancy upsampling replicates the crop's edge (without it 4:2:0 / 4:2:2
  // colour images differ there). With and without DCT scaling.
  for (const JpegCase& k : kCases) {
    const Image img = photo(k.h, k.w, k.c, static_cast<uint64_t>(k.h * k.w));
    const auto jpg = encode_jpeg(img, 90, {k.progressive, k.sub});
    auto gs = geometries(k.h, k.w, 6);
    for (const SampleGeometry& g : geometries(k.h, k.w, 6, 64)) gs.push_back(g);
    for (const SampleGeometry& g : gs) {
      for (int64_t channels : {int64_t{1}, int64_t{3}}) {
        EXPECT_EQ(decode(jpg, channels, g, false, true), decode(jpg, channels, g, false, false))
            << k.h << "x" << k.w << "x" << k.c << " to " << channels;
        EXPECT_EQ(decode(jpg, channels, g, true, true), decode(jpg, channels, g, true, false))
            << k.h << "x" << k.w << "x" << k.c << " to " << channels << ", DCT-scaled";
      }
    }
  }
}

TEST(DataCodecGeometry, DctScaledDecodeIsCloseToTheFullDecode) {
  // DCT scaling by M/8 keeps the block's lowest M x M frequencies, a different low-pass than
  // the triangle filter applied to the full decode (then a triangle of support >= 1 on the
  // scaled image), so outputs differ where the image has detail near the output's Nyquist
  // frequency. Measured on these photograph-like images at quality 90: worst mean 0.5 levels,
  // max 5 (see the printout). Allowed: mean 1.0, max 10, which a wrong scale (a shifted or
  // stretched sample) exceeds many times over.
  for (const JpegCase& k : kCases) {
    const Image img = photo(k.h, k.w, k.c, static_cast<uint64_t>(k.h + k.w));
    const auto jpg = encode_jpeg(img, 90, {k.progressive, k.sub});
    Diff worst;
    int scaled = 0;
    for (int64_t size : {64, 112}) {
      for (const SampleGeometry& g : geometries(k.h, k.w, 10, size)) {
        scaled += dct_scale_for(g) < 8;
        const auto out = decode(jpg, k.c, g, true, true);
        const Diff d = diff(out, decode(jpg, k.c, g, false, false));
        EXPECT_LT(d.mean, 1.0) << k.h << "x" << k.w << "x" << k.c << " to " << size;
        EXPECT_LE(d.max, 10) << k.h << "x" << k.w << "x" << k.c << " to " << size;
        worst.mean = std::max(worst.mean, d.mean);
        worst.max = std::max(worst.max, d.max);
      }
    }
    EXPECT_GE(scaled, 8) << "too few of the geometries use DCT scaling for the test to mean much";
    std::printf(
        "  %lldx%lldx%lld %s: DCT-scaled vs full (%d of 22 scaled), worst mean %.3f, "
        "max %d levels\n",
        static_cast<long long>(k.h), static_cast<long long>(k.w), static_cast<long long>(k.c),
        k.progressive ? "progressive" : "baseline", scaled, worst.mean, worst.max);
  }
}

TEST(DataCodecGeometry, FullDecodeOptionsMatchDecodeImage) {
  // dct_scaling and crop off: decode_image, then resample_u8 (channel conversion first, as
  // decode_image does it). Grey, colour to grey, CMYK and PNG take the same route.
  const Image colour = photo(60, 70, 3, 1), grey = photo(60, 70, 1, 2);
  Image cmyk = photo(60, 70, 4, 3);
  std::vector<std::vector<uint8_t>> files = {encode_jpeg(colour, 90), encode_jpeg(grey, 90),
                                             encode_jpeg(cmyk, 95), encode_png(colour)};
  const SampleGeometry g = geometries(60, 70, 1)[0];
  for (const auto& f : files) {
    for (int64_t channels : {int64_t{1}, int64_t{3}}) {
      for (const ResampleMath m : {ResampleMath::float32, ResampleMath::fixed16}) {
        const Image full = decode_image(f.data(), f.size(), channels, "f");
        std::vector<uint8_t> want(static_cast<size_t>(224 * 224 * channels));
        resample_u8(full.pixels.data(), 60, 70, channels, 70 * channels, g, want.data(),
                    ResampleOrder::vertical_first, m);
        EXPECT_EQ(decode(f, channels, g, false, false, m), want);
        EXPECT_EQ(decode(f, channels, g, false, true, m), want);
      }
    }
  }
}

TEST(DataCodecGeometry, TinyImages) {
  // Images smaller than one iMCU, and outputs larger and smaller than them: the window logic
  // (crop widened to the image, rows skipped) still gives the full decode's pixels.
  for (auto [h, w] : {std::pair<int64_t, int64_t>{1, 1}, {2, 3}, {9, 17}, {16, 16}, {33, 8}}) {
    for (int64_t c : {int64_t{1}, int64_t{3}}) {
      const auto jpg = encode_jpeg(photo(h, w, c, static_cast<uint64_t>(h * w)), 90);
      for (int64_t size : {1, 5, 24}) {
        for (const SampleGeometry& g : geometries(h, w, 4, size)) {
          EXPECT_EQ(decode(jpg, 3, g, false, true), decode(jpg, 3, g, false, false))
              << h << "x" << w << "x" << c << " to " << size;
          EXPECT_EQ(decode(jpg, 3, g, true, true), decode(jpg, 3, g, true, false))
              << h << "x" << w << "x" << c << " to " << size << ", DCT-scaled";
        }
      }
    }
  }
}

TEST(DataCodecGeometry, BadInput) {
  const Image img = photo(256, 256, 3, 4);
  const auto jpg = encode_jpeg(img, 90);
  // A window at the top of the image: the decode stops early, but data that does not end with
  // EOI is decoded to the end, so a file cut anywhere is still called truncated.
  SampleGeometry top = SampleGeometry::identity(256, 256);
  top.y.out = top.y.valid_hi = top.y.hi = 16;
  std::vector<uint8_t> cut(jpg.begin(), jpg.end() - 200);
  std::vector<uint8_t> out(16 * 256 * 3);
  expect_error([&] { decode_resampled(cut.data(), cut.size(), 3, top, out.data(), "cut.jpg"); },
               ErrorKind::Data, {"cut.jpg", "truncated"});
  EXPECT_NO_THROW(decode_resampled(jpg.data(), jpg.size(), 3, top, out.data(), "ok.jpg"));
  // Zero padding after EOI is common and fine.
  std::vector<uint8_t> padded = jpg;
  padded.resize(padded.size() + 64, 0);
  EXPECT_EQ(decode(padded, 3, top, true, true), decode(jpg, 3, top, true, true));
  std::vector<uint8_t> junk = {0xFF, 0xD8, 0xFF, 0x00, 1, 2, 3, 4, 5, 6, 7, 8};
  expect_error([&] { decode_resampled(junk.data(), junk.size(), 3, top, out.data(), "junk.jpg"); },
               ErrorKind::Data, {"junk.jpg", "corrupt JPEG"});
  std::vector<uint8_t> text = {'h', 'i'};
  expect_error([&] { decode_resampled(text.data(), text.size(), 3, top, out.data(), "t.jpg"); },
               ErrorKind::Data, {"t.jpg", "neither JPEG nor PNG"});
  ResampledDecodeOptions small;
  small.max_pixels = 1000;
  expect_error(
      [&] { decode_resampled(jpg.data(), jpg.size(), 3, top, out.data(), "big.jpg", small); },
      ErrorKind::Data, {"big.jpg", "256x256", "limit"});
  const SampleGeometry other = SampleGeometry::identity(100, 256);
  std::vector<uint8_t> o2(100 * 256 * 3);
  expect_error([&] { decode_resampled(jpg.data(), jpg.size(), 3, other, o2.data(), "x.jpg"); },
               ErrorKind::InvalidArgument, {"x.jpg", "100x256", "256x256"});
}

TEST(DataCodecGeometry, DecodeSwitchesKeepThePixels) {
  // KILN_JPEG_TIGHT_MARGIN, KILN_JPEG_BATCH_ROWS and KILN_JPEG_PROGRESSIVE_STOP, each off and
  // on: the cropped decode gives
  // the full decode's pixels bit for bit (the tight margin still covers the one column fancy
  // upsampling changes at each edge of a cropped region).
  for (const JpegCase& k : kCases) {
    const Image img = photo(k.h, k.w, k.c, static_cast<uint64_t>(k.h * k.w + 1));
    const auto jpg = encode_jpeg(img, 90, {k.progressive, k.sub});
    auto gs = geometries(k.h, k.w, 8);
    for (const SampleGeometry& g : geometries(k.h, k.w, 4, 64)) gs.push_back(g);
    for (const SampleGeometry& g : gs) {
      const auto want = decode(jpg, 3, g, false, false);
      for (int m = 0; m < 8; ++m) {
        std::vector<uint8_t> out(want.size());
        ResampledDecodeOptions o;
        o.dct_scaling = false;
        o.tight_margin = m & 1;
        o.batch_rows = m & 2;
        o.progressive_stop = m & 4;
        decode_resampled(jpg.data(), jpg.size(), 3, g, out.data(), "test.jpg", o);
        EXPECT_EQ(out, want) << k.h << "x" << k.w << "x" << k.c << ", switches " << m;
      }
    }
  }
}

// FNV-1a over a batch of bytes.
uint64_t checksum(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

TEST(DataCodecGeometry, PinnedBatchChecksum) {
  // A batch of ImageNet-like JPEGs (4:2:0, 4:2:2, 4:4:4, grey, progressive) through the uint8
  // path at 224 with training and evaluation geometries, under every combination of the decode
  // switches: the checksum of the bytes was taken with all of them off (the decode as it was
  // before they existed), so any change to a sample's pixels shows here. The value holds for
  // libjpeg-turbo, whose decoder's output does not depend on its SIMD level. The pinned value
  // is the float resample's (KILN_RESAMPLE_FIXED_POINT=0); the fixed-point one (m >= 8) must
  // give one checksum under every decode switch, and another than the float one.
  std::vector<uint8_t> batch;
  uint64_t fixed = 0;
  for (int m = 0; m < 16; ++m) {
    batch.clear();
    for (const JpegCase& k : kCases) {
      const Image img = photo(k.h, k.w, k.c, static_cast<uint64_t>(k.h + 3 * k.w));
      const auto jpg = encode_jpeg(img, 90, {k.progressive, k.sub});
      for (const SampleGeometry& g : geometries(k.h, k.w, 4)) {
        std::vector<uint8_t> out(static_cast<size_t>(224 * 224 * 3));
        ResampledDecodeOptions o;
        o.crop = m & 1;
        o.tight_margin = m & 2;
        o.batch_rows = m & 4;
        o.math = m & 8 ? ResampleMath::fixed16 : ResampleMath::float32;
        decode_resampled(jpg.data(), jpg.size(), 3, g, out.data(), "test.jpg", o);
        batch.insert(batch.end(), out.begin(), out.end());
      }
    }
    std::printf("  switches %d: checksum %016llx\n", m,
                static_cast<unsigned long long>(checksum(batch)));
    if (m < 8) {
      EXPECT_EQ(checksum(batch), 0xafb27ee91cc33ed3ull) << "switches " << m;
    } else {
      if (m == 8) fixed = checksum(batch);
      EXPECT_EQ(checksum(batch), fixed) << "switches " << m;
      EXPECT_NE(fixed, 0xafb27ee91cc33ed3ull);
    }
  }
}

TEST(DataCodecGeometry, ProgressiveScansStopBelowTheWindow) {
  // KILN_JPEG_PROGRESSIVE_STOP: windows at the top, middle and bottom of progressive files of
  // each subsampling (and grey, and sizes that are not whole iMCU rows), DCT-scaled or not:
  // the window's pixels are the full decode's, bit for bit.
  struct P {
    int64_t h, w, c;
    JpegSubsampling sub;
  };
  const P files[] = {{375, 500, 3, JpegSubsampling::s420},
                     {333, 500, 3, JpegSubsampling::s422},
                     {301, 245, 3, JpegSubsampling::s444},
                     {250, 333, 1, JpegSubsampling::s420}};
  for (const P& f : files) {
    const auto jpg =
        encode_jpeg(photo(f.h, f.w, f.c, static_cast<uint64_t>(f.h)), 90, {true, f.sub});
    std::vector<SampleGeometry> gs;
    for (const int64_t top : {int64_t{0}, f.h / 3, f.h - 40}) {
      for (const int64_t out : {int64_t{24}, int64_t{40}}) {
        SampleGeometry g = SampleGeometry::identity(f.h, f.w);
        g.y.origin = static_cast<double>(top);
        g.y.lo = top, g.y.hi = top + 40;
        g.y.scale = 40.0 / static_cast<double>(out);
        g.y.out = g.y.valid_hi = out;
        g.x.lo = 30, g.x.hi = 130;
        g.x.origin = 30;
        g.x.scale = 100.0 / static_cast<double>(out);
        g.x.out = g.x.valid_hi = out;
        gs.push_back(g);
      }
    }
    for (const SampleGeometry& g : geometries(f.h, f.w, 4, 64)) gs.push_back(g);
    for (const SampleGeometry& g : gs) {
      for (const bool dct : {false, true}) {
        const auto want = decode(jpg, 3, g, dct, false);
        std::vector<uint8_t> out(want.size());
        ResampledDecodeOptions o;
        o.dct_scaling = dct;
        o.progressive_stop = true;
        decode_resampled(jpg.data(), jpg.size(), 3, g, out.data(), "p.jpg", o);
        EXPECT_EQ(out, want) << f.h << "x" << f.w << "x" << f.c << " window from row " << g.y.lo
                             << (dct ? ", DCT-scaled" : "");
      }
    }
    // Cut in its last scans or with bytes after EOI, the data is decoded to its end (and a cut
    // is called truncated) as without the switch.
    SampleGeometry top = SampleGeometry::identity(f.h, f.w);
    top.y.out = top.y.valid_hi = top.y.hi = 16;
    std::vector<uint8_t> out(static_cast<size_t>(16 * f.w * 3));
    const std::vector<uint8_t> cut(jpg.begin(), jpg.end() - 300);
    expect_error([&] { decode_resampled(cut.data(), cut.size(), 3, top, out.data(), "cut.jpg"); },
                 ErrorKind::Data, {"cut.jpg", "truncated"});
    std::vector<uint8_t> trailing = jpg;
    trailing.insert(trailing.end(), {0x12, 0x34, 0xFF, 0xD9, 0x56});
    EXPECT_EQ(decode(trailing, 3, top, false, true), decode(jpg, 3, top, false, false));
  }
}

TEST(DataCodecGeometry, ReadImageInfo) {
  const Image colour = photo(37, 53, 3, 5), grey = photo(20, 30, 1, 6);
  const auto base = encode_jpeg(colour, 90);
  ImageInfo i = read_image_info(base.data(), base.size(), "a.jpg");
  EXPECT_EQ(i.format, ImageFormat::Jpeg);
  EXPECT_EQ(i.height, 37);
  EXPECT_EQ(i.width, 53);
  EXPECT_EQ(i.channels, 3);
  EXPECT_FALSE(i.progressive);
  EXPECT_FALSE(i.cmyk);
  EXPECT_TRUE(i.complete);
  const auto prog = encode_jpeg(colour, 90, {true, JpegSubsampling::s444});
  i = read_image_info(prog.data(), prog.size(), "p.jpg");
  EXPECT_TRUE(i.progressive);
  EXPECT_TRUE(i.complete);
  const auto g = encode_jpeg(grey, 90);
  i = read_image_info(g.data(), g.size(), "g.jpg");
  EXPECT_EQ(i.channels, 1);
  EXPECT_EQ(i.height, 20);
  const auto cmyk = encode_jpeg(photo(8, 16, 4, 7), 95);
  i = read_image_info(cmyk.data(), cmyk.size(), "c.jpg");
  EXPECT_TRUE(i.cmyk);
  EXPECT_EQ(i.channels, 4);
  // Truncated in the scan data (of a larger image, whose headers are a small part of the file):
  // the header is intact, the EOI marker is missing.
  const auto large = encode_jpeg(photo(200, 300, 3, 8), 90);
  const std::vector<uint8_t> cut(large.begin(),
                                 large.begin() + static_cast<long>(large.size() / 2));
  i = read_image_info(cut.data(), cut.size(), "cut.jpg");
  EXPECT_EQ(i.width, 300);
  EXPECT_FALSE(i.complete);
  std::vector<uint8_t> padded = base;
  padded.insert(padded.end(), 10, 0);
  EXPECT_TRUE(read_image_info(padded.data(), padded.size(), "pad.jpg").complete);
  const auto png = encode_png(colour);
  i = read_image_info(png.data(), png.size(), "a.png");
  EXPECT_EQ(i.format, ImageFormat::Png);
  EXPECT_EQ(i.height, 37);
  EXPECT_EQ(i.width, 53);
  EXPECT_EQ(i.channels, 3);
  EXPECT_TRUE(i.complete);
  // Garbage: unknown magic, a JPEG cut inside its header, a PNG signature without IHDR.
  const std::vector<uint8_t> text = {'n', 'o', 't', ' ', 'a', 'n', ' ', 'i', 'm', 'a', 'g', 'e'};
  expect_error([&] { read_image_info(text.data(), text.size(), "t.jpg"); }, ErrorKind::Data,
               {"t.jpg", "neither JPEG nor PNG"});
  const std::vector<uint8_t> head(base.begin(), base.begin() + 40);
  expect_error([&] { read_image_info(head.data(), head.size(), "h.jpg"); }, ErrorKind::Data,
               {"h.jpg", "JPEG"});
  const std::vector<uint8_t> sig(png.begin(), png.begin() + 12);
  expect_error([&] { read_image_info(sig.data(), sig.size(), "s.png"); }, ErrorKind::Data,
               {"s.png", "IHDR"});
}

}  // namespace
}  // namespace kiln
