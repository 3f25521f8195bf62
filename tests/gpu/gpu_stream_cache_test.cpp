// StreamOrderedCache (the memory nvJPEG allocates from): a released block is handed out again
// for a request of its size class; a pinned block is not while its stream may still read it;
// device blocks cross streams by an event; foreign and double releases are refused.
#include <cuda_runtime.h>

#include <atomic>
#include <thread>

#include "backend/cuda/stream_ordered_cache.h"
#include "gpu/gpu_test_util.h"

namespace kiln::test {
namespace {

using cuda::StreamOrderedCache;

TEST(StreamOrderedCache, SizeClassCoversTheRequestWithLittleWaste) {
  size_t last = 0;
  for (size_t n = 1; n < (size_t{64} << 20); n = n * 3 / 2 + 1) {
    const size_t c = StreamOrderedCache::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, std::max<size_t>(4096, n + n / 4)) << n;
    EXPECT_GE(c, last) << "size classes rise with the request";
    last = c;
  }
  EXPECT_EQ(StreamOrderedCache::size_class(1000001), StreamOrderedCache::size_class(1000002));
}

class StreamOrderedCacheGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
    ASSERT_EQ(cudaStreamCreateWithFlags(&s1_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&s2_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (s1_) cudaStreamDestroy(s1_);
    if (s2_) cudaStreamDestroy(s2_);
  }
  cudaStream_t s1_ = nullptr, s2_ = nullptr;
};

TEST_F(StreamOrderedCacheGpu, DeviceBlocksAreReusedWithinAndAcrossStreams) {
  StreamOrderedCache cache;
  void* a = nullptr;
  ASSERT_EQ(cache.device_alloc(&a, 1 << 20, s1_), 0);
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(cudaMemsetAsync(a, 7, 1 << 20, s1_), cudaSuccess);
  ASSERT_EQ(cache.device_free(a, s1_), 0);
  void* b = nullptr;
  ASSERT_EQ(cache.device_alloc(&b, (1 << 20) - 100, s2_), 0);  // same class, another stream
  EXPECT_EQ(b, a);
  // s2 was made to wait for s1's memset: a copy on s2 sees its bytes.
  unsigned char host[16] = {};
  ASSERT_EQ(cudaMemcpyAsync(host, b, sizeof host, cudaMemcpyDeviceToHost, s2_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s2_), cudaSuccess);
  EXPECT_EQ(host[0], 7);
  void* c = nullptr;
  ASSERT_EQ(cache.device_alloc(&c, 1 << 20, s1_), 0);  // b is in use: a new block
  EXPECT_NE(c, a);
  EXPECT_EQ(cache.device_free(b, s2_), 0);
  EXPECT_EQ(cache.device_free(c, s1_), 0);
  const StreamOrderedCache::Counts n = cache.counts();
  EXPECT_EQ(n.device_blocks, 2);
  EXPECT_EQ(n.reused, 1);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(StreamOrderedCacheGpu, PinnedBlockWaitsForItsStream) {
  StreamOrderedCache cache;
  void* p = nullptr;
  ASSERT_EQ(cache.pinned_alloc(&p, 65536, s1_), 0);
  // Hold s1 on a host function until the test lets it go: the release below is pending.
  std::atomic<bool> go{false};
  ASSERT_EQ(cudaLaunchHostFunc(
                s1_,
                [](void* flag) {
                  while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
                },
                &go),
            cudaSuccess);
  ASSERT_EQ(cache.pinned_free(p, s1_), 0);
  void* q = nullptr;
  ASSERT_EQ(cache.pinned_alloc(&q, 65536, s1_), 0);
  EXPECT_NE(q, p) << "a pinned block was handed out while its stream could still read it";
  go = true;
  ASSERT_EQ(cudaStreamSynchronize(s1_), cudaSuccess);
  void* r = nullptr;
  ASSERT_EQ(cache.pinned_alloc(&r, 65536, s2_), 0);
  EXPECT_EQ(r, p) << "once its stream passed the release, the block is reused";
  EXPECT_EQ(cache.counts().pinned_blocks, 2);
  EXPECT_EQ(cache.pinned_free(q, s1_), 0);
  EXPECT_EQ(cache.pinned_free(r, s2_), 0);
}

TEST_F(StreamOrderedCacheGpu, RefusesForeignAndDoubleReleases) {
  StreamOrderedCache cache;
  void* p = nullptr;
  ASSERT_EQ(cache.device_alloc(&p, 4096, s1_), 0);
  int not_ours = 0;
  EXPECT_NE(cache.device_free(&not_ours, s1_), 0);
  EXPECT_NE(cache.pinned_free(p, s1_), 0) << "a device block is not a pinned one";
  EXPECT_EQ(cache.device_free(p, s1_), 0);
  EXPECT_NE(cache.device_free(p, s1_), 0) << "released twice";
  EXPECT_EQ(cache.device_free(nullptr, s1_), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace kiln::test
