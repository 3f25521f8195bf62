// The loader's data-parallel sharding as the Trainer sets it up (rank and world from the
// process group): over every rank, each epoch visits every sample of the dataset exactly
// once, in batches of equal count on every rank. Under mpirun the ranks' indices are gathered
// over MPI; in one process the same check runs for worlds 2, 3 and 4 rank by rank.
#include <gtest/gtest.h>

#include <map>

#include "kiln/data/loader.h"
#include "kiln/process_group/process_group.h"

namespace kiln {
namespace {

// Sample i: a 2x2x1 image, label i (so a batch says which samples it holds).
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  int64_t num_classes() const override { return n_; }
  Sample sample(int64_t i) const override {
    Sample s;
    s.image.height = s.image.width = 2;
    s.image.channels = 1;
    s.image.pixels.assign(4, static_cast<uint8_t>(i % 251));
    s.label = static_cast<int32_t>(i);
    return s;
  }
  std::string describe() const override { return "index"; }

 private:
  int64_t n_;
};

// The dataset indices rank `rank` of `world` sees in `epoch`, and its batch count.
std::vector<int32_t> shard(int64_t n, int64_t batch, int rank, int world, int64_t epoch,
                           int64_t* batches) {
  Pipeline p;
  p.add<ToFloat>();
  LoaderOptions o;
  o.batch_size = batch;
  o.workers = 1;
  o.seed = 7;
  o.rank = rank;
  o.world = world;
  Loader loader(std::make_shared<IndexDataset>(n), std::move(p), o);
  loader.start_epoch(epoch);
  std::vector<float> images(static_cast<size_t>(batch * 4));
  std::vector<int32_t> labels(static_cast<size_t>(batch)), seen;
  *batches = 0;
  while (const int64_t got = loader.next(images.data(), labels.data())) {
    seen.insert(seen.end(), labels.begin(), labels.begin() + got);
    ++*batches;
  }
  return seen;
}

void expect_exactly_once(const std::vector<int32_t>& all, int64_t n, const std::string& what) {
  std::map<int32_t, int> count;
  for (int32_t i : all) ++count[i];
  EXPECT_EQ(static_cast<int64_t>(count.size()), n) << what;
  for (const auto& [i, c] : count) EXPECT_EQ(c, 1) << what << ": sample " << i;
}

TEST(DistSharding, EveryRankTogetherSeesEachSampleOncePerEpoch) {
  const int world = dist::world(), rank = dist::rank();
  const int64_t batch = 4, n = 6 * batch * world;  // divisible: nothing is left over
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    int64_t batches = 0;
    std::vector<int32_t> mine = shard(n, batch, rank, world, epoch, &batches);
    EXPECT_EQ(batches, 6);
    ASSERT_EQ(static_cast<int64_t>(mine.size()), 6 * batch);
    std::vector<int32_t> all(static_cast<size_t>(n));
    dist::allgather(mine.data(), all.data(), static_cast<int64_t>(mine.size()), DType::I32,
                    "sample indices");
    expect_exactly_once(all, n, "epoch " + std::to_string(epoch));
  }
}

TEST(DistSharding, WorldsTwoToFourInOneProcess) {
  for (int world = 2; world <= 4; ++world) {
    const int64_t batch = 3, n = 5 * batch * world;
    std::vector<int32_t> all;
    for (int rank = 0; rank < world; ++rank) {
      int64_t batches = 0;
      const std::vector<int32_t> mine = shard(n, batch, rank, world, /*epoch=*/1, &batches);
      EXPECT_EQ(batches, 5) << "world " << world << " rank " << rank;
      all.insert(all.end(), mine.begin(), mine.end());
    }
    expect_exactly_once(all, n, "world " + std::to_string(world));
  }
}

}  // namespace
}  // namespace kiln
