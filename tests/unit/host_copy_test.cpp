// parallel_copy (host_copy.h), which copies staged batches into the CUDA backend's pinned
// buffers: every byte arrives and none beside the destination is touched, for one thread and
// several, sizes below and above the parallel threshold and not a multiple of a page; and
// KILN_STAGE_COPY_THREADS's count.
#include "backend/host_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "kiln/core/error.h"

namespace kiln {
namespace {

TEST(HostCopy, EveryByteArrivesAndNoneBesideIt) {
  constexpr size_t kGuard = 64;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, (size_t{4} << 20) - 1, size_t{4} << 20,
                       (size_t{4} << 20) + 4097, (size_t{17} << 20) + 3}) {
    std::vector<uint8_t> src(bytes);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>((i * 131 + i / 4096) % 251);
    for (int threads : {1, 2, 3, 8, 13}) {
      std::vector<uint8_t> dst(bytes + 2 * kGuard, 0xA5);
      parallel_copy(dst.data() + kGuard, src.data(), bytes, threads);
      for (size_t i = 0; i < kGuard; ++i) {
        ASSERT_EQ(dst[i], 0xA5) << bytes << " bytes, " << threads << " threads: before, " << i;
        ASSERT_EQ(dst[kGuard + bytes + i], 0xA5)
            << bytes << " bytes, " << threads << " threads: after, " << i;
      }
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(dst[kGuard + i], src[i]) << bytes << " bytes, " << threads << " threads: " << i;
    }
  }
}

TEST(HostCopy, ThreadCountFromTheSwitch) {
  EXPECT_EQ(stage_copy_threads(1), 1);
  EXPECT_EQ(stage_copy_threads(5), 5);
  EXPECT_EQ(stage_copy_threads(1000), 64) << "capped";
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int automatic = stage_copy_threads(0);
  EXPECT_GE(automatic, 1);
  EXPECT_LE(automatic, 8);
  EXPECT_LE(automatic, std::max(1, cores / 2));
  try {
    stage_copy_threads(-2);
    FAIL() << "a negative count is refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("KILN_STAGE_COPY_THREADS=-2"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kiln
