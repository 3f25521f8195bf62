// The Loader: determinism across worker counts, coverage of an epoch, sharding, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>

#include "kiln/data/loader.h"
#include "kiln/data/synthetic.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;

// Sample i: a 3x3x1 image whose pixels are i % 251 + (row, col) offsets, label i. Index
// `fail_at` throws Error(Data), as a corrupt file would with skipping off.
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n, int64_t fail_at = -1) : n_(n), fail_at_(fail_at) {}
  int64_t size() const override { return n_; }
  int64_t num_classes() const override { return n_; }
  Sample sample(int64_t i) const override {
    KILN_CHECK(i != fail_at_, Data, "sample ", i, " is broken on purpose");
    Sample s;
    s.image.height = s.image.width = 3;
    s.image.channels = 1;
    for (int k = 0; k < 9; ++k) s.image.pixels.push_back(static_cast<uint8_t>((i + k) % 251));
    s.label = static_cast<int32_t>(i);
    return s;
  }
  std::string describe() const override { return "counting"; }

 private:
  int64_t n_, fail_at_;
};

struct Epoch {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<int32_t>> labels;
};

Epoch run_epoch(Loader& loader, int64_t epoch, int64_t first_batch = 0) {
  loader.start_epoch(epoch, first_batch);
  const auto hwc = loader.sample_hwc();
  const int64_t per = hwc[0] * hwc[1] * hwc[2];
  Epoch e;
  for (;;) {
    std::vector<float> images(1024 * per, -1.0f);
    std::vector<int32_t> labels(1024, -1);
    const int64_t n = loader.next(images.data(), labels.data());
    if (n == 0) break;
    images.resize(static_cast<size_t>(n * per));
    labels.resize(static_cast<size_t>(n));
    e.images.push_back(images);
    e.labels.push_back(labels);
  }
  return e;
}

Pipeline random_pipeline() {
  Pipeline p;
  p.add<ToFloat>().add<RandomCrop>(3, 1).add<RandomHorizontalFlip>();
  return p;
}

std::vector<int32_t> flatten(const Epoch& e) {
  std::vector<int32_t> all;
  for (const auto& l : e.labels) all.insert(all.end(), l.begin(), l.end());
  return all;
}

// A resumed mid-epoch checkpoint starts the loader at its batch: the rest of the epoch is the
// uninterrupted epoch's tail, and the skipped batches are never made (the sample that would
// fail sits in batch 0, before the start).
TEST(DataLoader, StartsAnEpochAtAGivenBatch) {
  LoaderOptions o;
  o.batch_size = 8;
  o.seed = 3;
  for (int workers : {0, 2}) {
    o.workers = workers;
    Loader whole(std::make_shared<CountingDataset>(64), random_pipeline(), o);
    const Epoch full = run_epoch(whole, 2);
    ASSERT_EQ(full.labels.size(), 8u);
    const int32_t first_in_batch0 = full.labels[0][0];
    Loader tail(std::make_shared<CountingDataset>(64, first_in_batch0), random_pipeline(), o);
    const Epoch rest = run_epoch(tail, 2, 5);
    ASSERT_EQ(rest.labels.size(), 3u) << "workers " << workers;
    for (size_t b = 0; b < 3; ++b) {
      EXPECT_EQ(rest.labels[b], full.labels[b + 5]) << "workers " << workers << " batch " << b + 5;
      EXPECT_EQ(rest.images[b], full.images[b + 5]) << "workers " << workers << " batch " << b + 5;
    }
    EXPECT_EQ(run_epoch(tail, 2, 8).labels.size(), 0u);  // started at the end: nothing left
  }
  Loader l(std::make_shared<CountingDataset>(64), random_pipeline(), o);
  expect_error([&] { l.start_epoch(0, 9); }, ErrorKind::InvalidArgument, {"batch 9", "0..8"});
}

TEST(DataLoader, SameSeedSameBatchesForAnyWorkerCount) {
  auto ds = std::make_shared<CountingDataset>(200);
  LoaderOptions o;
  o.batch_size = 16;
  o.seed = 42;
  std::vector<Epoch> runs;
  for (int workers : {0, 1, 3}) {
    o.workers = workers;
    Loader loader(ds, random_pipeline(), o);
    runs.push_back(run_epoch(loader, 5));
  }
  ASSERT_EQ(runs[0].labels.size(), 12u);  // 200 / 16, last partial batch dropped
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].labels, runs[0].labels);
    EXPECT_EQ(runs[r].images, runs[0].images);
  }
  // Another epoch gives another order; the same epoch again gives the same one.
  o.workers = 2;
  Loader loader(ds, random_pipeline(), o);
  EXPECT_NE(flatten(run_epoch(loader, 6)), flatten(runs[0]));
  EXPECT_EQ(run_epoch(loader, 5).images, runs[0].images);
}

TEST(DataLoader, EverySampleOncePerEpoch) {
  auto ds = std::make_shared<CountingDataset>(100);
  LoaderOptions o;
  o.batch_size = 8;
  o.workers = 3;
  o.drop_last = false;
  Loader loader(ds, Pipeline().add<ToFloat>(), o);
  EXPECT_EQ(loader.batches_per_epoch(), 13);
  EXPECT_EQ(loader.samples_per_epoch(), 100);
  EXPECT_EQ(loader.sample_hwc(), (std::array<int64_t, 3>{3, 3, 1}));
  const Epoch e = run_epoch(loader, 0);
  ASSERT_EQ(e.labels.size(), 13u);
  EXPECT_EQ(e.labels.back().size(), 4u);  // the last partial batch
  std::vector<int32_t> all = flatten(e);
  std::sort(all.begin(), all.end());
  for (int32_t i = 0; i < 100; ++i) ASSERT_EQ(all[static_cast<size_t>(i)], i);
  // Images travel with their labels: pixel 0 of sample i is (i % 251) / 255.
  for (size_t b = 0; b < e.labels.size(); ++b) {
    for (size_t k = 0; k < e.labels[b].size(); ++k) {
      EXPECT_FLOAT_EQ(e.images[b][k * 9], static_cast<float>(e.labels[b][k] % 251) / 255.0f);
    }
  }
  // Without shuffling the order is the dataset's.
  o.shuffle = false;
  Loader plain(ds, Pipeline().add<ToFloat>(), o);
  const std::vector<int32_t> in_order = flatten(run_epoch(plain, 3));
  for (int32_t i = 0; i < 100; ++i) ASSERT_EQ(in_order[static_cast<size_t>(i)], i);
}

TEST(DataLoader, ShardsAreDisjointAndEqual) {
  auto ds = std::make_shared<CountingDataset>(101);
  LoaderOptions o;
  o.batch_size = 10;
  o.drop_last = false;
  o.world = 2;
  o.seed = 9;
  std::vector<std::vector<int32_t>> shards;
  for (int rank = 0; rank < 2; ++rank) {
    o.rank = rank;
    o.workers = rank + 1;  // worker count does not matter
    Loader loader(ds, Pipeline().add<ToFloat>(), o);
    EXPECT_EQ(loader.samples_per_epoch(), 50);  // 101 / 2, the remainder dropped
    EXPECT_EQ(loader.batches_per_epoch(), 5);
    shards.push_back(flatten(run_epoch(loader, 1)));
  }
  ASSERT_EQ(shards[0].size(), 50u);
  ASSERT_EQ(shards[1].size(), 50u);
  std::set<int32_t> all(shards[0].begin(), shards[0].end());
  all.insert(shards[1].begin(), shards[1].end());
  EXPECT_EQ(all.size(), 100u);  // disjoint: 100 distinct samples of the 101

  // The union of both ranks is the first 100 entries of the world-1 permutation.
  o.world = 1;
  o.rank = 0;
  Loader single(ds, Pipeline().add<ToFloat>(), o);
  const std::vector<int32_t> whole = flatten(run_epoch(single, 1));
  for (size_t k = 0; k < 50; ++k) {
    EXPECT_EQ(shards[0][k], whole[2 * k]);
    EXPECT_EQ(shards[1][k], whole[2 * k + 1]);
  }
}

TEST(DataLoader, WorkerErrorsReachNext) {
  auto ds = std::make_shared<CountingDataset>(60, /*fail_at=*/37);
  LoaderOptions o;
  o.batch_size = 10;
  o.shuffle = false;
  for (int workers : {0, 3}) {
    o.workers = workers;
    Loader loader(ds, Pipeline().add<ToFloat>(), o);
    std::vector<float> images(10 * 9);
    std::vector<int32_t> labels(10);
    for (int round = 0; round < 2; ++round) {  // a new epoch recovers after the error
      loader.start_epoch(0);
      for (int b = 0; b < 3; ++b) ASSERT_EQ(loader.next(images.data(), labels.data()), 10);
      expect_error([&] { loader.next(images.data(), labels.data()); }, ErrorKind::Data,
                   {"sample 37 is broken on purpose"});
      expect_error([&] { loader.next(images.data(), labels.data()); }, ErrorKind::State,
                   {"start_epoch"});
    }
  }
}

// Images of two sizes: a pipeline without a fixed-size crop cannot batch them.
class MixedSizes : public Dataset {
 public:
  int64_t size() const override { return 8; }
  int64_t num_classes() const override { return 1; }
  Sample sample(int64_t i) const override {
    Sample s;
    s.image.height = i < 4 ? 4 : 5;
    s.image.width = 4;
    s.image.channels = 1;
    s.image.pixels.assign(static_cast<size_t>(s.image.height * 4), 1);
    return s;
  }
  std::string describe() const override { return "mixed"; }
};

TEST(DataLoader, ShapeMismatchIsAClearError) {
  LoaderOptions o;
  o.batch_size = 8;
  o.shuffle = false;
  Loader bad(std::make_shared<MixedSizes>(), Pipeline().add<ToFloat>(), o);
  std::vector<float> images(8 * 25);
  std::vector<int32_t> labels(8);
  bad.start_epoch(0);
  expect_error([&] { bad.next(images.data(), labels.data()); }, ErrorKind::InvalidArgument,
               {"5x4x1", "4x4x1", "fixed-size crop"});
  Loader good(std::make_shared<MixedSizes>(), Pipeline().add<ToFloat>().add<CenterCrop>(4), o);
  good.start_epoch(0);
  EXPECT_EQ(good.next(images.data(), labels.data()), 8);
}

TEST(DataLoader, RestartMidEpochAndBadOptions) {
  auto ds = std::make_shared<SyntheticDataset>(64, 8, 8, 3, 10, 1);
  LoaderOptions o;
  o.batch_size = 4;
  o.workers = 2;
  o.prefetch = 3;
  Loader loader(ds, random_pipeline(), o);
  const Epoch full = run_epoch(loader, 2);
  ASSERT_EQ(full.labels.size(), 16u);
  // Abandon epoch 2 after one batch, while workers are prefetching; a restart is unaffected.
  loader.start_epoch(2);
  std::vector<float> images(4 * 8 * 8 * 3);
  std::vector<int32_t> labels(4);
  ASSERT_EQ(loader.next(images.data(), labels.data()), 4);
  EXPECT_EQ(run_epoch(loader, 2).images, full.images);

  Loader idle(ds, random_pipeline(), o);
  expect_error([&] { idle.next(images.data(), labels.data()); }, ErrorKind::State, {"start_epoch"});
  o.rank = 2;
  o.world = 2;
  expect_error([&] { Loader(ds, random_pipeline(), o); }, ErrorKind::InvalidArgument, {"rank 2"});
  o.rank = 0;
  o.world = 1;
  o.batch_size = 65;
  expect_error([&] { Loader(ds, random_pipeline(), o); }, ErrorKind::InvalidArgument,
               {"fewer than one batch"});
}

TEST(DataSynthetic, DeterministicFromSeed) {
  SyntheticDataset a(10, 4, 5, 3, 7, 123), b(10, 4, 5, 3, 7, 123), c(10, 4, 5, 3, 7, 124);
  EXPECT_EQ(a.sample(3).image.pixels, b.sample(3).image.pixels);
  EXPECT_EQ(a.sample(3).label, b.sample(3).label);
  EXPECT_NE(a.sample(3).image.pixels, c.sample(3).image.pixels);
  EXPECT_NE(a.sample(3).image.pixels, a.sample(4).image.pixels);
  EXPECT_EQ(a.sample(9).image.pixels.size(), 60u);
  std::set<int32_t> labels;
  for (int64_t i = 0; i < 10; ++i) {
    const int32_t l = a.sample(i).label;
    EXPECT_GE(l, 0);
    EXPECT_LT(l, 7);
    labels.insert(l);
  }
  EXPECT_GT(labels.size(), 1u);
  DatasetSpec spec;
  spec.kind = "synthetic";
  spec.samples = 5;
  spec.height = spec.width = 2;
  spec.channels = 1;
  spec.classes = 3;
  EXPECT_EQ(open_dataset(spec)->size(), 5);
  spec.samples = 0;
  expect_error([&] { open_dataset(spec); }, ErrorKind::InvalidArgument, {"positive"});
}

}  // namespace
}  // namespace kiln
