// IDX (MNIST-style) reading, checked against Fashion-MNIST as Debian ships it and against
// small files the test writes itself.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "kiln/data/dataset.h"
#include "kiln/data/idx.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;
using data_test::idx_bytes;
using data_test::TempDir;
using data_test::write_file;

const char* kFashion = "/usr/share/datasets/fashion-mnist";

bool have_fashion() {
  return std::filesystem::exists(std::string(kFashion) + "/train-images-idx3-ubyte.gz");
}

int64_t pixel_sum(const Image& img) {
  int64_t s = 0;
  for (uint8_t v : img.pixels) s += v;
  return s;
}

// Expected values were read once with Python's gzip module, independently of kiln:
//   d = gzip.open('/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz').read()
//   img = d[16:16+784]; sum(img); list(img[14*28:15*28])
// and the same for the labels (d[8:]) and the t10k files.
TEST(DataIdx, FashionMnistTrainMatchesKnownContent) {
  if (!have_fashion()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh)";
  DatasetSpec spec;
  spec.kind = "fashion-mnist";  // empty root: Debian's path
  spec.split = "train";
  const auto ds = open_dataset(spec);
  ASSERT_EQ(ds->size(), 60000);
  EXPECT_EQ(ds->num_classes(), 10);
  const Sample first = ds->sample(0);
  EXPECT_EQ(first.label, 9);  // Ankle boot
  EXPECT_EQ(first.image.height, 28);
  EXPECT_EQ(first.image.width, 28);
  EXPECT_EQ(first.image.channels, 1);
  EXPECT_EQ(pixel_sum(first.image), 76247);
  const std::vector<uint8_t> row14 = {0,   0,   1,   4,   6,   7,   2,   0,   0,   0,
                                      0,   0,   237, 226, 217, 223, 222, 219, 222, 221,
                                      216, 223, 229, 215, 218, 255, 77,  0};
  for (int x = 0; x < 28; ++x) EXPECT_EQ(first.image.at(14, x, 0), row14[x]) << "x=" << x;
  const Sample last = ds->sample(59999);
  EXPECT_EQ(last.label, 5);
  EXPECT_EQ(pixel_sum(last.image), 16684);
  EXPECT_EQ(last.image.pixels[400], 129);
  EXPECT_EQ(ds->sample(1).label, 0);
  EXPECT_EQ(ds->sample(3).label, 3);
}

TEST(DataIdx, FashionMnistTestMatchesKnownContent) {
  if (!have_fashion()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh)";
  DatasetSpec spec;
  spec.kind = "fashion-mnist";
  spec.split = "test";
  const auto ds = open_dataset(spec);
  ASSERT_EQ(ds->size(), 10000);
  const Sample first = ds->sample(0);
  EXPECT_EQ(first.label, 9);
  EXPECT_EQ(pixel_sum(first.image), 33456);
  EXPECT_EQ(first.image.at(14, 14, 0), 110);
  EXPECT_EQ(ds->sample(1).label, 2);
  EXPECT_EQ(ds->sample(9999).label, 5);
}

TEST(DataIdx, GzipAndPlainGiveTheSame) {
  if (!have_fashion()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh)";
  TempDir dir;
  // Decompress with the gzip tool, not with kiln, so the plain files are independent of it.
  for (const char* name : {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    const std::string cmd =
        std::string("gzip -dc ") + kFashion + "/" + name + ".gz > " + dir.file(name);
    if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "no gzip tool to make plain files";
  }
  DatasetSpec spec;
  spec.kind = "mnist";
  spec.split = "test";
  spec.root = dir.path();
  const auto plain = open_dataset(spec);
  spec.root = kFashion;
  const auto gz = open_dataset(spec);
  ASSERT_EQ(plain->size(), gz->size());
  for (int64_t i = 0; i < plain->size(); i += 997) {
    const Sample a = plain->sample(i), b = gz->sample(i);
    EXPECT_EQ(a.label, b.label);
    EXPECT_EQ(a.image.pixels, b.image.pixels);
  }
  EXPECT_EQ(pixel_sum(plain->sample(0).image), 33456);
}

TEST(DataIdx, ParsesSmallArrays) {
  const auto bytes = idx_bytes({2, 3}, {1, 2, 3, 4, 5, 6});
  const IdxArray a = parse_idx(bytes.data(), bytes.size(), "mem");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));

  // Images N x H x W with labels: sample i is image i, row-major.
  const auto image_bytes = idx_bytes({2, 1, 2}, {10, 11, 20, 21});
  const auto label_bytes = idx_bytes({2}, {4, 1});
  IdxArray images = parse_idx(image_bytes.data(), image_bytes.size(), "img");
  IdxArray labels = parse_idx(label_bytes.data(), label_bytes.size(), "lab");
  IdxDataset ds(images, labels, "img", "lab", "test");
  EXPECT_EQ(ds.size(), 2);
  EXPECT_EQ(ds.num_classes(), 5);  // max label + 1
  EXPECT_EQ(ds.sample(1).image.pixels, (std::vector<uint8_t>{20, 21}));
  EXPECT_EQ(ds.sample(1).label, 1);
  expect_error([&] { ds.sample(2); }, ErrorKind::InvalidArgument, {"outside"});
}

TEST(DataIdx, TruncatedFileIsDataErrorNamingPath) {
  TempDir dir;
  auto bytes = idx_bytes({4, 2, 2}, std::vector<uint8_t>(16, 7));
  bytes.resize(bytes.size() - 3);
  const std::string path = dir.file("train-images-idx3-ubyte");
  write_file(path, bytes);
  // The path quoted, as every data and checkpoint error quotes it (issue 15).
  expect_error([&] { read_idx(path); }, ErrorKind::Data,
               {"'" + path + "'", "truncated", "download"});

  // A header cut short.
  write_file(path, {0, 0, 8, 3, 0, 0});
  expect_error([&] { read_idx(path); }, ErrorKind::Data,
               {"'" + path + "'", "truncated IDX header"});
}

TEST(DataIdx, TruncatedGzipIsDataError) {
  if (!have_fashion()) GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh)";
  TempDir dir;
  auto bytes = data_test::read_file(std::string(kFashion) + "/t10k-labels-idx1-ubyte.gz");
  bytes.resize(bytes.size() / 2);
  const std::string path = dir.file("t10k-labels-idx1-ubyte.gz");
  write_file(path, bytes);
  expect_error([&] { read_idx(path); }, ErrorKind::Data, {path, "truncated"});
}

TEST(DataIdx, WrongMagicIsDataErrorNamingPath) {
  TempDir dir;
  const std::string path = dir.file("labels.idx");
  write_file(path, {'P', 'K', 3, 4, 0, 0, 0, 0});
  expect_error([&] { read_idx(path); }, ErrorKind::Data, {path, "not an IDX file"});
  // A valid magic with a type kiln does not read (int32).
  write_file(path, {0, 0, 0x0C, 1, 0, 0, 0, 1, 0, 0, 0, 0});
  expect_error([&] { read_idx(path); }, ErrorKind::Data, {path, "int32", "not supported"});
  // Trailing bytes after the array.
  write_file(path, idx_bytes({2}, {1, 2, 3}));
  expect_error([&] { read_idx(path); }, ErrorKind::Data, {path, "unexpected bytes"});
}

TEST(DataIdx, CountMismatchNamesBothFiles) {
  TempDir dir;
  const std::string images = dir.file("train-images-idx3-ubyte");
  const std::string labels = dir.file("train-labels-idx1-ubyte");
  write_file(images, idx_bytes({3, 2, 2}, std::vector<uint8_t>(12, 1)));
  write_file(labels, idx_bytes({4}, {0, 1, 2, 3}));
  DatasetSpec spec;
  spec.kind = "mnist";
  spec.root = dir.path();
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {images, labels, "3 images", "4 labels"});
  // Swapped files: labels where images belong.
  expect_error([&] { IdxDataset::open(labels, images, "mnist"); }, ErrorKind::Data,
               {labels, "swap"});
}

TEST(DataIdx, MissingFilesSayWhatWasExpected) {
  DatasetSpec spec;
  spec.kind = "mnist";
  spec.root = "/nonexistent/mnist";
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {"/nonexistent/mnist/train-images-idx3-ubyte.gz", "train-images-idx3-ubyte"});
  spec.root.clear();
  expect_error([&] { open_dataset(spec); }, ErrorKind::InvalidArgument, {"--data"});
  spec.kind = "idx";
  spec.idx_images = "/nonexistent/a";
  spec.idx_labels = "/nonexistent/b";
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data, {"/nonexistent/a"});
}

// MNIST has ten classes whatever its label bytes say: one byte set to 200 is an error naming
// the file and the index, not a 201-class model. A generic idx file takes 1 + its largest.
TEST(DataIdx, LabelOutsideTheKnownClassCountNamesFileAndIndex) {
  TempDir dir;
  const std::string labels = dir.file("train-labels-idx1-ubyte");
  write_file(dir.file("train-images-idx3-ubyte"),
             idx_bytes({3, 2, 2}, std::vector<uint8_t>(12, 1)));
  write_file(labels, idx_bytes({3}, {0, 200, 9}));
  DatasetSpec spec;
  spec.kind = "mnist";
  spec.root = dir.path();
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {labels, "label 200", "index 1", "0..9"});
  write_file(labels, idx_bytes({3}, {0, 3, 1}));
  EXPECT_EQ(open_dataset(spec)->num_classes(), 10)
      << "the dataset's count, not 1 + the largest label";
  spec.kind = "idx";
  spec.idx_images = dir.file("train-images-idx3-ubyte");
  spec.idx_labels = labels;
  EXPECT_EQ(open_dataset(spec)->num_classes(), 4);
}

// A directory where a file belongs: fopen() opens it and ftell() says 2^63-1 bytes; the error
// names the path instead of std::bad_alloc.
TEST(DataIdx, DirectoryInPlaceOfAFileIsADataError) {
  TempDir dir;
  std::filesystem::create_directories(dir.file("train-images-idx3-ubyte"));
  write_file(dir.file("train-labels-idx1-ubyte"), idx_bytes({1}, {0}));
  DatasetSpec spec;
  spec.kind = "mnist";
  spec.root = dir.path();
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {dir.file("train-images-idx3-ubyte"), "is a directory"});
}

TEST(DataIdx, IdxKindTakesExplicitFiles) {
  TempDir dir;
  write_file(dir.file("a.idx"), idx_bytes({1, 2, 2}, {1, 2, 3, 4}));
  write_file(dir.file("b.idx"), idx_bytes({1}, {6}));
  DatasetSpec spec;
  spec.kind = "idx";
  spec.idx_images = dir.file("a.idx");
  spec.idx_labels = dir.file("b.idx");
  const auto ds = open_dataset(spec);
  EXPECT_EQ(ds->size(), 1);
  EXPECT_EQ(ds->sample(0).label, 6);
  EXPECT_EQ(ds->sample(0).image.at(1, 0, 0), 3);
}

TEST(DataFactory, UnknownKindListsValidKinds) {
  DatasetSpec spec;
  spec.kind = "imagenet21k";
  expect_error([&] { open_dataset(spec); }, ErrorKind::InvalidArgument,
               {"imagenet21k", "fashion-mnist", "cifar10", "folder", "synthetic"});
  spec.kind = "mnist";
  spec.split = "dev";
  expect_error([&] { open_dataset(spec); }, ErrorKind::InvalidArgument, {"dev", "train"});
}

TEST(DataFactory, NormalizationStatistics) {
  const Normalization f = normalization_for("fashion-mnist");
  EXPECT_EQ(f.mean, std::vector<float>{0.2860f});
  EXPECT_EQ(f.std, std::vector<float>{0.3530f});
  const Normalization m = normalization_for("mnist", 3);  // replicated to 3 channels
  EXPECT_EQ(m.mean, (std::vector<float>{0.1307f, 0.1307f, 0.1307f}));
  EXPECT_EQ(m.std, (std::vector<float>{0.3081f, 0.3081f, 0.3081f}));
  const Normalization im = normalization_for("folder");
  EXPECT_EQ(im.mean, (std::vector<float>{0.485f, 0.456f, 0.406f}));
  EXPECT_EQ(im.std, (std::vector<float>{0.229f, 0.224f, 0.225f}));
  EXPECT_EQ(normalization_for("cifar10").mean.size(), 3u);
  EXPECT_EQ(normalization_for("cifar100").std.size(), 3u);
  EXPECT_EQ(normalization_for("synthetic", 1).mean, std::vector<float>{0.5f});
  expect_error([] { normalization_for("folder", 1); }, ErrorKind::InvalidArgument, {"3 channels"});
  expect_error([] { normalization_for("idx"); }, ErrorKind::InvalidArgument, {"idx"});
  expect_error([] { normalization_for("nope"); }, ErrorKind::InvalidArgument, {"fashion-mnist"});
}

}  // namespace
}  // namespace kiln
