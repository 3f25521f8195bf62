// Image folders and the JPEG/PNG codecs. PNG fixtures in tests/data/png were written by
// tests/data/make_png_fixtures.py with Python's zlib alone, so the decoder is checked against
// files kiln did not write; the JPEG tree is written here with kiln's encoder (checked for
// lossy closeness, not bytes).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "kiln/data/dataset.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/loader.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;
using data_test::read_file;
using data_test::TempDir;
using data_test::write_file;

const std::string kPngDir = std::string(KILN_SOURCE_DIR) + "/tests/data/png/";

Image make_image(int64_t h, int64_t w, int64_t c, uint8_t (*f)(int64_t, int64_t, int64_t)) {
  Image img;
  img.height = h;
  img.width = w;
  img.channels = c;
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int64_t k = 0; k < c; ++k) img.pixels.push_back(f(y, x, k));
  return img;
}

// A smooth colour gradient: JPEG keeps it well, so a small tolerance is meaningful.
uint8_t gradient(int64_t y, int64_t x, int64_t c) {
  return static_cast<uint8_t>(40 + 6 * x + 4 * y + 30 * c);
}
uint8_t gray_gradient(int64_t y, int64_t x, int64_t) {
  return static_cast<uint8_t>(50 + 5 * x + 3 * y);
}
uint8_t png_pattern(int64_t y, int64_t x, int64_t c) {
  return static_cast<uint8_t>((y * 31 + x * 17 + c * 101) % 256);  // not smooth: PNG is exact
}

uint8_t luma(int r, int g, int b) {  // PIL's convert('L'): 0.299 R + 0.587 G + 0.114 B, rounded
  return static_cast<uint8_t>((19595 * r + 38470 * g + 7471 * b + 0x8000) >> 16);
}

Image decode_fixture(const std::string& name, int64_t channels) {
  const auto bytes = read_file(kPngDir + name);
  return decode_png(bytes.data(), bytes.size(), channels, name);
}

// JPEG at quality 95 with 4:2:0 chroma subsampling on a smooth gradient: the errors come from
// quantisation (steps of 1-3 levels at this quality for the low frequencies a gradient has)
// and chroma upsampling; measured 1 level at most. Allowed: 4 levels max, 1.5 mean, which
// still catches a channel swap, a shifted row or a wrong colour conversion.
void expect_close_jpeg(const Image& got, const Image& want) {
  ASSERT_EQ(got.height, want.height);
  ASSERT_EQ(got.width, want.width);
  ASSERT_EQ(got.channels, want.channels);
  double total = 0;
  int worst = 0;
  for (size_t i = 0; i < got.pixels.size(); ++i) {
    const int d = std::abs(int{got.pixels[i]} - int{want.pixels[i]});
    total += d;
    worst = std::max(worst, d);
  }
  EXPECT_LE(worst, 4);
  EXPECT_LE(total / static_cast<double>(got.pixels.size()), 1.5);
}

TEST(DataImageCodec, PngFixturesDecodeExactly) {
  const Image rgb = decode_fixture("rgb_3x2.png", 3);
  ASSERT_EQ(rgb.height, 2);
  ASSERT_EQ(rgb.width, 3);
  for (int y = 0; y < 2; ++y) {
    for (int x = 0; x < 3; ++x) {
      EXPECT_EQ(rgb.at(y, x, 0), 10 + 40 * x + 100 * y);
      EXPECT_EQ(rgb.at(y, x, 1), 20 * x);
      EXPECT_EQ(rgb.at(y, x, 2), 255 - 50 * y);
    }
  }
  const Image gray = decode_fixture("rgb_3x2.png", 1);
  ASSERT_EQ(gray.channels, 1);
  EXPECT_EQ(gray.at(1, 2, 0), luma(190, 40, 205));

  const Image pal = decode_fixture("palette_2x2.png", 3);  // tRNS alpha dropped
  EXPECT_EQ(pal.pixels, (std::vector<uint8_t>{255, 0, 0, 0, 255, 0, 0, 0, 255, 7, 8, 9}));

  EXPECT_EQ(decode_fixture("gray_alpha_2x1.png", 3).pixels,
            (std::vector<uint8_t>{60, 60, 60, 200, 200, 200}));
  EXPECT_EQ(decode_fixture("gray_alpha_2x1.png", 1).pixels, (std::vector<uint8_t>{60, 200}));
  // 16-bit samples are scaled (0x12FF -> 19), not truncated (which would give 18).
  EXPECT_EQ(decode_fixture("rgb16_2x1.png", 3).pixels,
            (std::vector<uint8_t>{18, 255, 0, 128, 127, 19}));
}

TEST(DataImageCodec, RoundTripsAndCorruptInput) {
  const Image rgb = make_image(5, 7, 3, png_pattern);
  const auto png = encode_png(rgb);
  EXPECT_EQ(sniff_image_format(png.data(), png.size()), ImageFormat::Png);
  EXPECT_EQ(decode_image(png.data(), png.size(), 3, "p").pixels, rgb.pixels);

  const Image grad = make_image(16, 16, 3, gradient);
  const auto jpg = encode_jpeg(grad, 95);
  EXPECT_EQ(sniff_image_format(jpg.data(), jpg.size()), ImageFormat::Jpeg);
  const Image back = decode_image(jpg.data(), jpg.size(), 3, "j");
  expect_close_jpeg(back, grad);

  // CMYK (Adobe, inverted): pure inks give pure colours. Solid 8x8 blocks survive JPEG within
  // 2 levels (no edges, so only DC rounding and the colour transform's rounding remain).
  Image cmyk;
  cmyk.height = 8;
  cmyk.width = 16;
  cmyk.channels = 4;
  for (int y = 0; y < 8; ++y) {
    for (int x = 0; x < 16; ++x) {
      // Left block: red (C=0, M=Y=255, K=0); right: 50% grey from K alone. Stored inverted.
      const std::vector<uint8_t> ink =
          x < 8 ? std::vector<uint8_t>{0, 255, 255, 0} : std::vector<uint8_t>{0, 0, 0, 128};
      for (uint8_t v : ink) cmyk.pixels.push_back(static_cast<uint8_t>(255 - v));
    }
  }
  const auto cmyk_jpg = encode_jpeg(cmyk, 100);
  const Image rgb_from_cmyk = decode_jpeg(cmyk_jpg.data(), cmyk_jpg.size(), 3, "cmyk.jpg");
  const std::vector<int> red = {255, 0, 0}, grey = {127, 127, 127};  // (255-128)*255/255
  for (int c = 0; c < 3; ++c) {
    EXPECT_NEAR(rgb_from_cmyk.at(4, 3, c), red[static_cast<size_t>(c)], 2);
    EXPECT_NEAR(rgb_from_cmyk.at(4, 12, c), grey[static_cast<size_t>(c)], 2);
  }

  // Cut in the middle of the scan data: libjpeg would fill the rest with grey; kiln calls it
  // truncated. (A busy 64x64 image, so that the headers are a small part of the file.)
  const auto busy = encode_jpeg(make_image(64, 64, 3, png_pattern), 90);
  expect_error([&] { decode_jpeg(busy.data(), busy.size() / 2, 3, "half.jpg"); }, ErrorKind::Data,
               {"'half.jpg'", "truncated"});
  std::vector<uint8_t> junk = {0xFF, 0xD8, 0xFF, 0x00, 1, 2, 3, 4, 5, 6, 7, 8};
  expect_error([&] { decode_image(junk.data(), junk.size(), 3, "junk.jpg"); }, ErrorKind::Data,
               {"'junk.jpg'", "corrupt JPEG"});
  std::vector<uint8_t> cut_png(png.begin(), png.begin() + static_cast<long>(png.size()) - 20);
  expect_error([&] { decode_image(cut_png.data(), cut_png.size(), 3, "cut.png"); }, ErrorKind::Data,
               {"cut.png", "PNG"});
  std::vector<uint8_t> text = {'h', 'e', 'l', 'l', 'o'};
  expect_error([&] { decode_image(text.data(), text.size(), 3, "t.jpg"); }, ErrorKind::Data,
               {"t.jpg", "neither JPEG nor PNG"});
  expect_error([&] { decode_image(png.data(), png.size(), 2, "p"); }, ErrorKind::InvalidArgument,
               {"1 or 3"});
  // A header asking for more pixels than the limit is refused before anything is allocated.
  expect_error([&] { decode_image(png.data(), png.size(), 3, "big.png", 34); }, ErrorKind::Data,
               {"big.png", "7x5", "limit"});
  expect_error([&] { decode_image(jpg.data(), jpg.size(), 3, "big.jpg", 255); }, ErrorKind::Data,
               {"big.jpg", "16x16", "limit"});
}

// root/train/{ant,cat,dog}: files sorted by path give, with labels ant=0, cat=1, dog=2:
//   0 ant/x.PNG (grey PNG)   1 cat/a.jpg (RGB JPEG)   2 cat/b.png (RGB PNG)
//   3 dog/bad.jpg (corrupt)  4 dog/c.jpg (grey JPEG)  5 dog/sub/d.jpeg (RGB JPEG, nested)
class DataImageFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string t = dir_.path() + "/train/";
    write_file(t + "ant/x.PNG", encode_png(make_image(3, 2, 1, gray_gradient)));
    write_file(t + "cat/a.jpg", encode_jpeg(make_image(16, 16, 3, gradient), 95));
    write_file(t + "cat/b.png", encode_png(make_image(4, 5, 3, png_pattern)));
    write_file(t + "dog/bad.jpg", {0xFF, 0xD8, 0xFF, 0xE0, 0, 16, 'J', 'F', 'I', 'F', 0, 9, 9});
    write_file(t + "dog/c.jpg", encode_jpeg(make_image(8, 8, 1, gray_gradient), 95));
    write_file(t + "dog/sub/d.jpeg", encode_jpeg(make_image(16, 16, 3, gradient), 95));
    write_file(t + "dog/notes.txt", {'n', 'o'});  // ignored: not an image extension
  }
  TempDir dir_;
};

TEST_F(DataImageFolder, ClassesFilesAndLabels) {
  DatasetSpec spec;
  spec.kind = "folder";
  spec.root = dir_.path();
  spec.split = "train";
  const auto base = open_dataset(spec);
  const auto& ds = dynamic_cast<const ImageFolderDataset&>(*base);
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"ant", "cat", "dog"}));
  ASSERT_EQ(ds.size(), 6);
  EXPECT_EQ(ds.num_classes(), 3);
  const std::vector<int32_t> labels = {0, 1, 1, 2, 2, 2};
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(ds.label(i), labels[static_cast<size_t>(i)]) << i;
  EXPECT_NE(ds.file(5).find("dog/sub/d.jpeg"), std::string::npos);

  // Grey PNG replicated to 3 channels, exactly.
  const Sample x = ds.sample(0);
  EXPECT_EQ(x.label, 0);
  ASSERT_EQ(x.image.channels, 3);
  for (int64_t y = 0; y < 3; ++y)
    for (int64_t xx = 0; xx < 2; ++xx)
      for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(x.image.at(y, xx, c), gray_gradient(y, xx, 0));
  EXPECT_EQ(ds.sample(2).image.pixels, make_image(4, 5, 3, png_pattern).pixels);
  expect_close_jpeg(ds.sample(1).image, make_image(16, 16, 3, gradient));
  expect_close_jpeg(ds.sample(5).image, make_image(16, 16, 3, gradient));
  // Grey JPEG replicated.
  const Sample c = ds.sample(4);
  EXPECT_EQ(c.image.at(3, 5, 0), c.image.at(3, 5, 2));
  EXPECT_NEAR(c.image.at(3, 5, 1), gray_gradient(3, 5, 0), 4);  // JPEG, as expect_close_jpeg
}

TEST_F(DataImageFolder, OneChannelGivesLuma) {
  ImageFolderDataset ds(dir_.path() + "/train", 1, true);
  const Sample b = ds.sample(2);
  ASSERT_EQ(b.image.channels, 1);
  for (int64_t y = 0; y < 4; ++y) {
    for (int64_t x = 0; x < 5; ++x) {
      EXPECT_EQ(b.image.at(y, x, 0),
                luma(png_pattern(y, x, 0), png_pattern(y, x, 1), png_pattern(y, x, 2)));
    }
  }
  EXPECT_EQ(ds.sample(0).image.pixels, make_image(3, 2, 1, gray_gradient).pixels);
}

TEST_F(DataImageFolder, CorruptFileIsSkippedOnceAndCounted) {
  ImageFolderDataset ds(dir_.path() + "/train", 3, /*skip_corrupt=*/true);
  EXPECT_EQ(ds.corrupt_skipped(), 0);
  const Sample s = ds.sample(3);  // bad.jpg -> replaced by the next file, c.jpg, with its label
  EXPECT_EQ(s.label, 2);
  EXPECT_EQ(s.image.height, 8);
  EXPECT_EQ(ds.corrupt_skipped(), 1);
  EXPECT_EQ(ds.sample(3).image.pixels, s.image.pixels);
  EXPECT_EQ(ds.corrupt_skipped(), 1);  // counted (and warned about) once per file

  // Through the Loader: every sample of an epoch, with the skip reported.
  Pipeline p;
  p.add<ToFloat>().add<Resize>(4).add<CenterCrop>(4);
  LoaderOptions o;
  o.batch_size = 6;
  o.workers = 2;
  Loader loader(std::make_shared<ImageFolderDataset>(dir_.path() + "/train", 3, true), p, o);
  loader.start_epoch(0);
  std::vector<float> images(6 * 4 * 4 * 3);
  std::vector<int32_t> labels(6);
  EXPECT_EQ(loader.next(images.data(), labels.data()), 6);
  EXPECT_EQ(loader.skipped_samples(), 1);
  EXPECT_EQ(loader.next(images.data(), labels.data()), 0);
}

TEST_F(DataImageFolder, CorruptFileIsErrorWhenSkippingIsOff) {
  ImageFolderDataset ds(dir_.path() + "/train", 3, /*skip_corrupt=*/false);
  EXPECT_EQ(ds.sample(4).label, 2);
  expect_error([&] { ds.sample(3); }, ErrorKind::Data, {"bad.jpg", "skip_corrupt"});
}

TEST_F(DataImageFolder, SplitsAndLayoutErrors) {
  DatasetSpec spec;
  spec.kind = "folder";
  spec.root = dir_.path();
  spec.split = "val";
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {"'" + dir_.path() + "/val' does not exist"});
  // "val" finds a "test" directory.
  write_file(dir_.path() + "/test/ant/y.png", encode_png(make_image(2, 2, 3, png_pattern)));
  EXPECT_EQ(open_dataset(spec)->size(), 1);
  // A class without images is an error naming it.
  std::filesystem::create_directories(dir_.path() + "/test/empty");
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data, {"empty", "no .jpg"});
  spec.root = dir_.path() + "/nowhere";
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data, {"nowhere", "not a directory"});
}

}  // namespace
}  // namespace kiln
