// Copies a batch into a pinned staging buffer on several host threads. One thread copies
// ~11 GB/s, so ResNet-50's float batch (154 MB at 256) held the staging thread ~14 ms a step.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kiln {

// KILN_STAGE_COPY_THREADS as a thread count: 0 = auto (half the cores, at most 8: a copy
// saturates memory bandwidth well before that), else the count itself (at most 64).
// A negative count is one InvalidArgument error.
int stage_copy_threads(int64_t requested);

// memcpy(dst, src, bytes) split into `threads` contiguous page-aligned pieces copied at once;
// below a few MB, or with one thread, a plain memcpy. dst and src must not overlap.
void parallel_copy(void* dst, const void* src, size_t bytes, int threads);

}  // namespace kiln
