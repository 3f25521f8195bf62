// The Loader's uint8 and encoded outputs: the same samples, labels and (within rounding)
// pixels as the float path; the same batches for any worker count; what a device decoder
// cannot take decoded on the host; and image folders' encoded access to bad files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "kiln/data/image_codec.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/loader.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;
using data_test::TempDir;
using data_test::write_file;

Image pattern(int64_t h, int64_t w, int64_t c, int seed) {
  return data_test::smooth_pattern(h, w, c, seed);
}

// A JPEG whose header parses but whose scan asks for Huffman tables that were never defined:
// decoding fails after the header (a file broken mid-stream).
std::vector<uint8_t> broken_scan_jpeg(const Image& im) {
  std::vector<uint8_t> b = encode_jpeg(im, 90);
  for (size_t i = 0; i + 1 < b.size(); ++i) {
    if (b[i] == 0xFF && b[i + 1] == 0xDA) {  // SOS: FF DA, length (2), Ns, then Cs, Td/Ta each
      const int ns = b[i + 4];
      for (int c = 0; c < ns; ++c) b[i + 6 + 2 * static_cast<size_t>(c)] = 0x33;
      return b;
    }
  }
  ADD_FAILURE() << "no SOS marker";
  return b;
}

// train/<class>/*: a mixed folder of n_good JPEGs of several sizes per class, plus `extra`.
void write_folder(const std::string& root, int n_good,
                  const std::vector<std::pair<std::string, std::vector<uint8_t>>>& extra = {}) {
  const int64_t sizes[][2] = {{40, 36}, {37, 44}, {50, 30}, {33, 33}};
  for (int c = 0; c < 2; ++c) {
    for (int i = 0; i < n_good; ++i) {
      const auto& s = sizes[(i + c) % 4];
      write_file(root + "/train/c" + std::to_string(c) + "/img" + std::to_string(i) + ".jpg",
                 encode_jpeg(pattern(s[0], s[1], 3, 7 * c + i), 92));
    }
  }
  for (const auto& [name, bytes] : extra) write_file(root + "/train/" + name, bytes);
}

std::shared_ptr<ImageFolderDataset> open_folder(const std::string& root) {
  return std::make_shared<ImageFolderDataset>(root + "/train", 3, true);
}

Pipeline crop_pipeline() {
  Pipeline p;
  p.add<ToFloat>().add<RandomResizedCrop>(24).add<RandomHorizontalFlip>();
  return p;
}

struct Batches {
  std::vector<std::vector<uint8_t>> pixels;
  std::vector<std::vector<int32_t>> labels;
};

Batches run_u8(Loader& loader, int64_t epoch) {
  loader.start_epoch(epoch);
  const auto hwc = loader.sample_hwc();
  const int64_t per = hwc[0] * hwc[1] * hwc[2];
  Batches b;
  for (;;) {
    std::vector<uint8_t> px(static_cast<size_t>(64 * per));
    std::vector<int32_t> lb(64);
    const int64_t n = loader.next_u8(px.data(), lb.data());
    if (n == 0) break;
    px.resize(static_cast<size_t>(n * per));
    lb.resize(static_cast<size_t>(n));
    b.pixels.push_back(std::move(px));
    b.labels.push_back(std::move(lb));
  }
  return b;
}

// The same through next_u8's hand-over form, one buffer reused across batches as the
// trainer's (swapped with the loader's where LoaderOptions::swap_u8).
Batches run_u8_handover(Loader& loader, int64_t epoch) {
  loader.start_epoch(epoch);
  const auto hwc = loader.sample_hwc();
  const int64_t per = hwc[0] * hwc[1] * hwc[2];
  Batches b;
  std::vector<uint8_t> px;
  std::vector<int32_t> lb(64);
  for (;;) {
    const int64_t n = loader.next_u8(px, lb.data());
    if (n == 0) break;
    b.pixels.emplace_back(px.begin(), px.begin() + n * per);
    b.labels.emplace_back(lb.begin(), lb.begin() + n);
  }
  return b;
}

std::vector<EncodedBatch> run_encoded(Loader& loader, int64_t epoch) {
  loader.start_epoch(epoch);
  std::vector<EncodedBatch> out;
  for (;;) {
    EncodedBatch b;
    if (loader.next_encoded(b) == 0) break;
    out.push_back(std::move(b));
  }
  return out;
}

// The host-decoded samples' pixels (the rest of host_pixels is not defined).
std::vector<uint8_t> host_part(const EncodedBatch& b, int64_t k) {
  if (!b.images[static_cast<size_t>(k)].bytes.empty()) return {};
  const auto* p = b.host_pixels.data() + k * b.sample_bytes();
  return {p, p + b.sample_bytes()};
}

void expect_same(const std::vector<EncodedBatch>& a, const std::vector<EncodedBatch>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size, b[i].size);
    EXPECT_EQ(a[i].labels, b[i].labels);
    for (int64_t k = 0; k < a[i].size; ++k) {
      const EncodedImage &x = a[i].images[static_cast<size_t>(k)],
                         &y = b[i].images[static_cast<size_t>(k)];
      EXPECT_EQ(x.bytes, y.bytes) << x.name;
      EXPECT_TRUE(x.geometry == y.geometry) << x.name;
      EXPECT_EQ(x.name, y.name);
      EXPECT_EQ(host_part(a[i], k), host_part(b[i], k)) << x.name;
    }
  }
}

TEST(DataLoaderU8, MatchesTheFloatPathOnAFolder) {
  // Both orders of the resample's passes (KILN_RESAMPLE_VERTICAL_FIRST), each within a level.
  for (const ResampleOrder order :
       {ResampleOrder::horizontal_first, ResampleOrder::vertical_first}) {
    SCOPED_TRACE(order == ResampleOrder::vertical_first ? "vertical first" : "horizontal first");
    TempDir dir;
    write_folder(dir.path(), 6, {{"c1/p.png", encode_png(pattern(30, 41, 3, 3))}});
    auto ds = open_folder(dir.path());
    LoaderOptions o;
    o.batch_size = 4;
    o.seed = 11;
    o.workers = 2;
    Loader f32(ds, crop_pipeline(), o);
    o.output = LoaderOutput::uint8;
    o.decode.resample = order;
    // The float path decodes whole images; compare against the same decode (the cropped decode's
    // edge columns, chroma-upsampled without their neighbours, and the DCT-scaled one differ by a
    // few levels: the codec's own tests bound them).
    o.decode.dct_scaling = false;
    o.decode.crop = false;
    Loader u8(ds, crop_pipeline(), o);
    ASSERT_EQ(u8.sample_hwc(), f32.sample_hwc());
    ASSERT_EQ(u8.sample_hwc(), (std::array<int64_t, 3>{24, 24, 3}));
    const Batches b = run_u8(u8, 2);
    f32.start_epoch(2);
    const int64_t per = 24 * 24 * 3;
    std::vector<float> images(static_cast<size_t>(4 * per));
    std::vector<int32_t> labels(4);
    ASSERT_EQ(b.labels.size(), 3u);  // 13 files, batches of 4
    for (size_t i = 0; i < b.labels.size(); ++i) {
      ASSERT_EQ(f32.next(images.data(), labels.data()), 4);
      EXPECT_EQ(b.labels[i], labels);
      // Both resample the same box with the same filter; uint8 rounds once to the nearest level.
      for (int64_t j = 0; j < 4 * per; ++j) {
        ASSERT_NEAR(b.pixels[i][static_cast<size_t>(j)], images[static_cast<size_t>(j)] * 255.0f,
                    1.0f)
            << "batch " << i << " value " << j;
      }
    }
  }
}

// CIFAR's and MNIST's pipeline (pad, crop, flip) on in-memory bytes is a copy: exact.
TEST(DataLoaderU8, InMemoryDatasetsGiveTheFloatPathsBytes) {
  class Bytes : public Dataset {
   public:
    int64_t size() const override { return 40; }
    int64_t num_classes() const override { return 40; }
    Sample sample(int64_t i) const override {
      return {pattern(8, 8, 3, static_cast<int>(i)), static_cast<int32_t>(i)};
    }
    std::string describe() const override { return "bytes"; }
  };
  auto ds = std::make_shared<Bytes>();
  Pipeline p;
  p.add<ToFloat>().add<RandomCrop>(8, 2).add<RandomHorizontalFlip>();
  LoaderOptions o;
  o.batch_size = 8;
  o.seed = 5;
  o.workers = 1;
  Loader f32(ds, p, o);
  f32.start_epoch(0);
  o.output = LoaderOutput::uint8;
  for (int workers : {0, 1, 3}) {
    o.workers = workers;
    Loader u8(ds, p, o);
    const Batches b = run_u8(u8, 0);
    ASSERT_EQ(b.labels.size(), 5u);
    if (workers != 0) continue;
    std::vector<float> images(8 * 8 * 8 * 3);
    std::vector<int32_t> labels(8);
    for (size_t i = 0; i < b.labels.size(); ++i) {
      ASSERT_EQ(f32.next(images.data(), labels.data()), 8);
      EXPECT_EQ(b.labels[i], labels);
      for (size_t j = 0; j < images.size(); ++j)
        ASSERT_EQ(b.pixels[i][j], std::lround(images[j] * 255.0f)) << j;
    }
  }
}

TEST(DataLoaderU8, SameBatchesForAnyWorkerCount) {
  TempDir dir;
  write_folder(dir.path(), 7,
               {{"c0/p.png", encode_png(pattern(30, 41, 3, 3))},
                {"c1/cmyk.jpg", encode_jpeg(pattern(36, 40, 4, 1), 95)},
                {"c1/short.jpg", {0xFF, 0xD8, 0xFF, 0xE0, 0, 16, 'J', 'F', 'I', 'F', 0}}});
  LoaderOptions o;
  o.batch_size = 5;
  o.seed = 3;
  std::vector<Batches> u8;
  std::vector<std::vector<EncodedBatch>> enc;
  for (int workers : {0, 1, 3}) {
    o.workers = workers;
    o.output = LoaderOutput::uint8;
    Loader a(open_folder(dir.path()), crop_pipeline(), o);
    u8.push_back(run_u8(a, 1));
    o.output = LoaderOutput::encoded;
    Loader b(open_folder(dir.path()), crop_pipeline(), o);
    enc.push_back(run_encoded(b, 1));
  }
  ASSERT_EQ(u8[0].labels.size(), 3u);  // 17 files, batches of 5
  for (size_t r = 1; r < u8.size(); ++r) {
    EXPECT_EQ(u8[r].labels, u8[0].labels);
    EXPECT_EQ(u8[r].pixels, u8[0].pixels);
    expect_same(enc[r], enc[0]);
  }
  // The encoded batches carry the uint8 path's labels.
  for (size_t i = 0; i < u8[0].labels.size(); ++i) {
    EXPECT_EQ(std::vector<int32_t>(enc[0][i].labels.begin(), enc[0][i].labels.begin() + 5),
              u8[0].labels[i]);
  }
}

// KILN_LOADER_SWAP off and on: the batches handed over are the batches copied out, over two
// epochs (buffers go round the loader's slots).
TEST(DataLoaderU8, HandingBatchesOverEqualsCopyingThem) {
  TempDir dir;
  write_folder(dir.path(), 13, {});
  LoaderOptions o;
  o.batch_size = 4;
  o.seed = 5;
  o.workers = 2;
  o.drop_last = false;
  o.output = LoaderOutput::uint8;
  Loader copied(open_folder(dir.path()), crop_pipeline(), o);
  const Batches want[2] = {run_u8(copied, 0), run_u8(copied, 1)};
  ASSERT_GE(want[0].labels.size(), 3u);
  for (bool swap : {false, true}) {
    o.swap_u8 = swap;
    Loader l(open_folder(dir.path()), crop_pipeline(), o);
    for (int64_t epoch : {0, 1}) {
      const Batches got = run_u8_handover(l, epoch);
      EXPECT_EQ(got.labels, want[epoch].labels) << "swap " << swap << ", epoch " << epoch;
      EXPECT_EQ(got.pixels, want[epoch].pixels) << "swap " << swap << ", epoch " << epoch;
    }
  }
}

// PNG and CMYK go to the host decoder in the worker (the same pixels as the uint8 path); a
// good JPEG travels as its file's bytes with the geometry the uint8 path cut.
TEST(DataLoaderEncoded, HostDecodesWhatTheDeviceCannot) {
  TempDir dir;
  write_folder(dir.path(), 3,
               {{"c0/p.png", encode_png(pattern(30, 41, 3, 3))},
                {"c1/cmyk.jpg", encode_jpeg(pattern(36, 40, 4, 1), 95)}});
  LoaderOptions o;
  o.batch_size = 8;
  o.seed = 9;
  o.workers = 2;
  o.drop_last = false;
  o.output = LoaderOutput::uint8;
  auto ds = open_folder(dir.path());
  Loader u8(ds, crop_pipeline(), o);
  o.output = LoaderOutput::encoded;
  Loader enc(ds, crop_pipeline(), o);
  const Batches want = run_u8(u8, 0);
  const std::vector<EncodedBatch> got = run_encoded(enc, 0);
  ASSERT_EQ(got.size(), 1u);
  const EncodedBatch& b = got[0];
  EXPECT_EQ(b.size, 8);
  EXPECT_EQ(b.batch, 8);
  EXPECT_EQ(b.height, 24);
  EXPECT_EQ(b.channels, 3);
  EXPECT_EQ(b.labels, want.labels[0]);
  int host = 0;
  for (int64_t k = 0; k < b.size; ++k) {
    const EncodedImage& im = b.images[static_cast<size_t>(k)];
    const std::vector<uint8_t> want_px(want.pixels[0].begin() + k * b.sample_bytes(),
                                       want.pixels[0].begin() + (k + 1) * b.sample_bytes());
    const bool png_or_cmyk =
        im.name.find("p.png") != std::string::npos || im.name.find("cmyk") != std::string::npos;
    EXPECT_EQ(im.bytes.empty(), png_or_cmyk) << im.name;
    if (png_or_cmyk) {
      ++host;
      EXPECT_EQ(host_part(b, k), want_px) << im.name;
      continue;
    }
    EXPECT_EQ(im.bytes, data_test::read_file(im.name));
    // What a device decoder does with the bytes: decode, then this geometry.
    std::vector<uint8_t> px(static_cast<size_t>(b.sample_bytes()));
    decode_resampled(im.bytes.data(), im.bytes.size(), 3, im.geometry, px.data(), im.name);
    EXPECT_EQ(px, want_px) << im.name;
  }
  EXPECT_EQ(host, 2);
  // host_decode redoes any sample on the host, as the worker would have.
  std::vector<uint8_t> px(static_cast<size_t>(b.sample_bytes()));
  int32_t label = -7;
  b.host_decode(3, px.data(), &label);
  EXPECT_EQ(label, want.labels[0][3]);
  EXPECT_EQ(px, std::vector<uint8_t>(want.pixels[0].begin() + 3 * b.sample_bytes(),
                                     want.pixels[0].begin() + 4 * b.sample_bytes()));
}

// A JPEG whose header is fine (so it goes to the device) but whose data is broken: the device
// refuses it and asks host_decode, which finds it corrupt, counts it, and gives the next good
// file's pixels and label, as the uint8 path does.
TEST(DataLoaderEncoded, HostDecodeReplacesAFileBrokenMidStream) {
  TempDir dir;
  write_folder(dir.path(), 3, {{"c0/img1b.jpg", broken_scan_jpeg(pattern(40, 36, 3, 5))}});
  LoaderOptions o;
  o.batch_size = 7;
  o.seed = 4;
  o.workers = 0;
  o.shuffle = false;
  o.output = LoaderOutput::encoded;
  auto ds_enc = open_folder(dir.path());
  Loader enc(ds_enc, crop_pipeline(), o);
  const std::vector<EncodedBatch> got = run_encoded(enc, 0);
  ASSERT_EQ(got.size(), 1u);
  const EncodedBatch& b = got[0];
  // Sorted: c0/img0, c0/img1, c0/img1b, c0/img2, ...: the broken file is sample 2.
  ASSERT_NE(b.images[2].name.find("img1b.jpg"), std::string::npos) << b.images[2].name;
  EXPECT_FALSE(b.images[2].bytes.empty());
  EXPECT_EQ(ds_enc->corrupt_skipped(), 0);
  std::vector<uint8_t> px(static_cast<size_t>(b.sample_bytes()));
  int32_t label = -7;
  b.host_decode(2, px.data(), &label);
  EXPECT_EQ(ds_enc->corrupt_skipped(), 1);

  o.output = LoaderOutput::uint8;
  auto ds_u8 = open_folder(dir.path());
  Loader u8(ds_u8, crop_pipeline(), o);
  const Batches want = run_u8(u8, 0);
  EXPECT_EQ(ds_u8->corrupt_skipped(), 1);
  EXPECT_EQ(label, want.labels[0][2]);
  EXPECT_EQ(label, 0);  // the replacement, c0/img2, is of class 0 too
  EXPECT_EQ(px, std::vector<uint8_t>(want.pixels[0].begin() + 2 * b.sample_bytes(),
                                     want.pixels[0].begin() + 3 * b.sample_bytes()));
  // The replacement decodes the next file with sample 2's own draw: sample 3 is that file with
  // another draw, so the two differ.
  EXPECT_NE(px, std::vector<uint8_t>(want.pixels[0].begin() + 3 * b.sample_bytes(),
                                     want.pixels[0].begin() + 4 * b.sample_bytes()));
}

TEST(DataLoaderU8, RefusesWhatItCannotRun) {
  TempDir dir;
  write_folder(dir.path(), 2);
  LoaderOptions o;
  o.batch_size = 2;
  o.output = LoaderOutput::uint8;
  Pipeline jitter;
  jitter.add<ToFloat>().add<ColorJitter>(0.4f, 0.4f, 0.4f).add<CenterCrop>(24);
  expect_error([&] { Loader l(open_folder(dir.path()), jitter, o); }, ErrorKind::InvalidArgument,
               {"uint8", "float32"});
  class Tiny : public Dataset {
   public:
    int64_t size() const override { return 4; }
    int64_t num_classes() const override { return 1; }
    Sample sample(int64_t) const override { return {pattern(4, 4, 1, 0), 0}; }
    std::string describe() const override { return "tiny"; }
  };
  o.output = LoaderOutput::encoded;
  Pipeline p;
  p.add<ToFloat>();
  expect_error([&] { Loader l(std::make_shared<Tiny>(), p, o); }, ErrorKind::InvalidArgument,
               {"image folder", "tiny"});
  o.output = LoaderOutput::uint8;
  Loader l(open_folder(dir.path()), crop_pipeline(), o);
  l.start_epoch(0);
  std::vector<float> f(2 * 24 * 24 * 3);
  std::vector<int32_t> labels(2);
  expect_error([&] { l.next(f.data(), labels.data()); }, ErrorKind::InvalidArgument, {"next_u8"});
}

// A PNG whose header declares width x height, with a valid CRC (a decompression bomb when big).
std::vector<uint8_t> png_declaring(uint32_t width, uint32_t height) {
  std::vector<uint8_t> b = encode_png(pattern(2, 2, 3, 0));
  for (int i = 0; i < 4; ++i) {
    b[16 + static_cast<size_t>(i)] = static_cast<uint8_t>(width >> (24 - 8 * i));
    b[20 + static_cast<size_t>(i)] = static_cast<uint8_t>(height >> (24 - 8 * i));
  }
  uint32_t crc = 0xFFFFFFFFu;  // CRC-32 of the chunk type and data, bytes 12..28
  for (size_t i = 12; i < 29; ++i) {
    crc ^= b[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  crc ^= 0xFFFFFFFFu;
  for (int i = 0; i < 4; ++i)
    b[29 + static_cast<size_t>(i)] = static_cast<uint8_t>(crc >> (24 - 8 * i));
  return b;
}

// encoded() replaces what cannot be read or whose header fails, as sample() does: one warning
// and one count per file; a huge declared size is refused before anything is decoded.
TEST(DataImageFolderEncoded, ReadsBytesAndHeadersAndReplacesBadFiles) {
  TempDir dir;
  const std::vector<uint8_t> good = encode_jpeg(pattern(40, 36, 3, 1), 90);
  write_file(dir.file("train/a/0good.jpg"), good);
  write_file(dir.file("train/a/1empty.jpg"), {});
  write_file(dir.file("train/a/2text.jpg"), {'h', 'e', 'l', 'l', 'o'});
  write_file(dir.file("train/a/3bomb.png"), png_declaring(200000, 200000));
  write_file(dir.file("train/a/4cmyk.jpg"), encode_jpeg(pattern(20, 30, 4, 2), 90));
  write_file(dir.file("train/b/5.png"), encode_png(pattern(10, 12, 3, 2)));
  ImageFolderDataset ds(dir.file("train"), 3, true);
  EXPECT_TRUE(ds.has_encoded());
  EXPECT_EQ(ds.channels(), 3);
  const Dataset::Encoded e0 = ds.encoded(0);
  EXPECT_EQ(e0.index, 0);
  EXPECT_EQ(e0.bytes, good);
  EXPECT_EQ(e0.height, 40);
  EXPECT_EQ(e0.width, 36);
  EXPECT_TRUE(e0.device_decodable);
  EXPECT_EQ(e0.label, 0);
  for (int64_t i : {1, 2, 3}) {
    const Dataset::Encoded e = ds.encoded(i);
    EXPECT_EQ(e.index, 4) << i;  // the three bad files are replaced by the CMYK one
    EXPECT_FALSE(e.device_decodable);
    EXPECT_EQ(e.height, 20);
  }
  EXPECT_EQ(ds.corrupt_skipped(), 3);
  const Dataset::Encoded png = ds.encoded(5);
  EXPECT_FALSE(png.device_decodable);
  EXPECT_EQ(png.label, 1);
  // sample() agrees, and counts nothing twice.
  EXPECT_EQ(ds.sample(2).image.height, 20);
  EXPECT_EQ(ds.corrupt_skipped(), 3);
  ds.mark_corrupt(0, "found broken by a decoder");
  EXPECT_EQ(ds.encoded(0).index, 4);
  EXPECT_EQ(ds.corrupt_skipped(), 4);
  ImageFolderDataset strict(dir.file("train"), 3, false);
  expect_error([&] { strict.encoded(1); }, ErrorKind::Data, {"1empty.jpg", "skip_corrupt"});
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Progressive JPEGs stay with the loader's workers (the hardware engines refuse them, and the
// hybrid decoder would run on the one staging thread): the encoded path decodes them on the
// host, with the same pixels as the uint8 path.
TEST(DataImageFolderEncoded, ProgressiveJpegsAreDecodedOnTheHost) {
  TempDir dir;
  const std::vector<uint8_t> base = encode_jpeg(pattern(40, 36, 3, 1), 90);
  JpegEncodeOptions prog;
  prog.progressive = true;
  const std::vector<uint8_t> pj = encode_jpeg(pattern(40, 36, 3, 2), 90, prog);
  write_file(dir.file("train/a/0base.jpg"), base);
  write_file(dir.file("train/a/1prog.jpg"), pj);
  ImageFolderDataset ds(dir.file("train"), 3, true);
  EXPECT_TRUE(ds.encoded(0).device_decodable);
  const Dataset::Encoded e = ds.encoded(1);
  EXPECT_EQ(e.index, 1);
  EXPECT_EQ(e.bytes, pj);
  EXPECT_FALSE(e.device_decodable);
  EXPECT_EQ(ds.corrupt_skipped(), 0);
}

}  // namespace
}  // namespace kiln
