// CIFAR-10/100 binary records: the test writes records whose pixel values encode their
// position, reads them back and checks the CHW -> HWC conversion and the labels.
#include <gtest/gtest.h>

#include "kiln/data/cifar.h"
#include "kiln/data/dataset.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;
using data_test::TempDir;
using data_test::write_file;

// Pixel (channel c, row y, column x) of record r, distinct enough to catch a transposition.
uint8_t pixel_value(int r, int c, int y, int x) {
  return static_cast<uint8_t>(r * 7 + c * 90 + y * 3 + x * 5);
}

// Records laid out as the CIFAR binary files are: label byte(s), then R plane, G plane, B plane.
std::vector<uint8_t> cifar_records(const std::vector<std::vector<uint8_t>>& labels) {
  std::vector<uint8_t> out;
  for (size_t r = 0; r < labels.size(); ++r) {
    out.insert(out.end(), labels[r].begin(), labels[r].end());
    for (int c = 0; c < 3; ++c) {
      for (int y = 0; y < 32; ++y) {
        for (int x = 0; x < 32; ++x) out.push_back(pixel_value(static_cast<int>(r), c, y, x));
      }
    }
  }
  return out;
}

void expect_record(const Sample& s, int r, int label) {
  EXPECT_EQ(s.label, label);
  ASSERT_EQ(s.image.height, 32);
  ASSERT_EQ(s.image.width, 32);
  ASSERT_EQ(s.image.channels, 3);
  for (int y : {0, 1, 17, 31}) {
    for (int x : {0, 2, 30, 31}) {
      for (int c = 0; c < 3; ++c) {
        ASSERT_EQ(s.image.at(y, x, c), pixel_value(r, c, y, x)) << r << " " << y << " " << x;
      }
    }
  }
}

TEST(DataCifar, ParsesRecordsIntoHwc) {
  const auto bytes = cifar_records({{3}, {9}, {0}});
  const CifarRecords recs = parse_cifar(bytes.data(), bytes.size(), 1, 10, "mem");
  ASSERT_EQ(recs.count, 3);
  EXPECT_EQ(recs.labels, (std::vector<uint8_t>{3, 9, 0}));
  // HWC: the three channel values of pixel (0, 1) of record 0 are adjacent.
  EXPECT_EQ(recs.hwc[3], pixel_value(0, 0, 0, 1));
  EXPECT_EQ(recs.hwc[4], pixel_value(0, 1, 0, 1));
  EXPECT_EQ(recs.hwc[5], pixel_value(0, 2, 0, 1));
  CifarDataset ds(recs, 10, "mem");
  expect_record(ds.sample(1), 1, 9);
}

TEST(DataCifar, Cifar10TrainSplitReadsFiveBatches) {
  TempDir dir;
  // Two records per batch file; record r of the split is record r % 2 of file r / 2.
  for (int b = 1; b <= 5; ++b) {
    write_file(dir.file("cifar-10-batches-bin/data_batch_" + std::to_string(b) + ".bin"),
               cifar_records({{static_cast<uint8_t>(b)}, {static_cast<uint8_t>(b + 1)}}));
  }
  write_file(dir.file("cifar-10-batches-bin/test_batch.bin"), cifar_records({{7}}));
  DatasetSpec spec;
  spec.kind = "cifar10";
  spec.root = dir.path();  // the parent of the extracted directory is accepted
  const auto train = open_dataset(spec);
  ASSERT_EQ(train->size(), 10);
  EXPECT_EQ(train->num_classes(), 10);
  expect_record(train->sample(0), 0, 1);
  expect_record(train->sample(7), 1, 5);  // file 4, second record
  spec.split = "test";
  const auto test = open_dataset(spec);
  ASSERT_EQ(test->size(), 1);
  expect_record(test->sample(0), 0, 7);
}

TEST(DataCifar, Cifar100UsesTheFineLabel) {
  TempDir dir;
  write_file(dir.file("train.bin"), cifar_records({{1, 42}, {19, 99}}));
  DatasetSpec spec;
  spec.kind = "cifar100";
  spec.root = dir.path();
  const auto ds = open_dataset(spec);
  ASSERT_EQ(ds->size(), 2);
  EXPECT_EQ(ds->num_classes(), 100);
  expect_record(ds->sample(0), 0, 42);
  expect_record(ds->sample(1), 1, 99);
}

TEST(DataCifar, ShortFileIsDataErrorNamingIt) {
  TempDir dir;
  auto bytes = cifar_records({{1}, {2}});
  bytes.pop_back();
  const std::string path = dir.file("test_batch.bin");
  write_file(path, bytes);
  DatasetSpec spec;
  spec.kind = "cifar10";
  spec.split = "test";
  spec.root = dir.path();
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {path, "not a whole number of 3073-byte", "download"});
  write_file(path, {});
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data, {path, "empty"});
}

TEST(DataCifar, LabelOutOfRangeIsDataError) {
  // A CIFAR-100 file read as CIFAR-10 whose sizes happen to line up shows up as bad labels.
  const auto bytes = cifar_records({{2}, {10}});
  expect_error([&] { parse_cifar(bytes.data(), bytes.size(), 1, 10, "x.bin"); }, ErrorKind::Data,
               {"x.bin", "record 1", "label 10"});
}

TEST(DataCifar, MissingFileSaysWhereToGetIt) {
  TempDir dir;
  DatasetSpec spec;
  spec.kind = "cifar10";
  spec.root = dir.path();
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data,
               {dir.file("data_batch_1.bin"), "binary version"});
  spec.kind = "cifar100";
  spec.split = "val";
  expect_error([&] { open_dataset(spec); }, ErrorKind::Data, {dir.file("test.bin")});
}

}  // namespace
}  // namespace kiln
