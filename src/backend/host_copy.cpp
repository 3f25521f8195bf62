#include "backend/host_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "kiln/core/error.h"

namespace kiln {

int stage_copy_threads(int64_t requested) {
  KILN_CHECK(requested >= 0, InvalidArgument, "KILN_STAGE_COPY_THREADS=", requested,
             " is not a thread count; use 0 (auto) or a count of threads (at most 64 are used)");
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, 64));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::clamp(cores / 2, 1, 8);
}

void parallel_copy(void* dst, const void* src, size_t bytes, int threads) {
  // Below this, waking the threads costs about what they save.
  constexpr size_t kParallelFrom = size_t{4} << 20;
  constexpr size_t kPage = 4096;
  if (threads <= 1 || bytes < kParallelFrom) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  const size_t piece =
      ((bytes + static_cast<size_t>(threads) - 1) / threads + kPage - 1) / kPage * kPage;
  const int pieces = static_cast<int>((bytes + piece - 1) / piece);
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#pragma omp parallel for num_threads(pieces) schedule(static, 1)
  for (int i = 0; i < pieces; ++i) {
    const size_t from = static_cast<size_t>(i) * piece;
    std::memcpy(d + from, s + from, std::min(piece, bytes - from));
  }
}

}  // namespace kiln
