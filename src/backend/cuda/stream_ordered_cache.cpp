#include "backend/cuda/stream_ordered_cache.h"

#include <cstdio>

namespace kiln::cuda {

namespace {

void warn(const char* what, cudaError_t e) {
  if (e != cudaSuccess) std::fprintf(stderr, "kiln: %s failed: %s\n", what, cudaGetErrorString(e));
}

}  // namespace

size_t StreamOrderedCache::size_class(size_t bytes) {
  if (bytes <= 4096) return 4096;
  // Round up to a multiple of an eighth of the request's power of two: <= 25% over.
  size_t top = 1;
  while (top * 2 <= bytes) top *= 2;
  const size_t step = top / 8;
  return (bytes + step - 1) / step * step;
}

StreamOrderedCache::~StreamOrderedCache() {
  for (std::vector<Block>* pool : {&device_, &pinned_}) {
    for (Block& b : *pool) {
      if (b.released) {
        warn("cudaEventSynchronize", cudaEventSynchronize(b.released));
        warn("cudaEventDestroy", cudaEventDestroy(b.released));
      }
      warn(pool == &device_ ? "cudaFree" : "cudaFreeHost",
           pool == &device_ ? cudaFree(b.ptr) : cudaFreeHost(b.ptr));
    }
  }
}

int StreamOrderedCache::alloc(std::vector<Block>& pool, bool pinned, void** ptr, size_t bytes,
                              cudaStream_t stream) {
  if (!ptr) return 1;
  const size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  for (Block& b : pool) {
    if (b.in_use || b.bytes != cls) continue;
    if (b.released) {
      if (pinned) {
        // The host may write it as soon as it is handed out: only once its last reader ended.
        const cudaError_t q = cudaEventQuery(b.released);
        if (q == cudaErrorNotReady) continue;
        if (q != cudaSuccess) return 1;
      } else if (b.stream != stream && cudaStreamWaitEvent(stream, b.released, 0) != cudaSuccess) {
        return 1;
      }
    }
    b.in_use = true;
    *ptr = b.ptr;
    ++reused_;
    return 0;
  }
  Block b;
  b.bytes = cls;
  const cudaError_t e =
      pinned ? cudaHostAlloc(&b.ptr, cls, cudaHostAllocDefault) : cudaMalloc(&b.ptr, cls);
  if (e != cudaSuccess) {
    cudaGetLastError();  // nvJPEG reports NVJPEG_STATUS_ALLOCATOR_FAILURE; the error is not sticky
    return 1;
  }
  b.in_use = true;
  pool.push_back(b);
  *ptr = b.ptr;
  return 0;
}

int StreamOrderedCache::release(std::vector<Block>& pool, void* ptr, cudaStream_t stream) {
  if (!ptr) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  for (Block& b : pool) {
    if (b.ptr != ptr) continue;
    if (!b.in_use) return 1;
    if (!b.released && cudaEventCreateWithFlags(&b.released, cudaEventDisableTiming) != cudaSuccess)
      return 1;
    if (cudaEventRecord(b.released, stream) != cudaSuccess) return 1;
    b.stream = stream;
    b.in_use = false;
    return 0;
  }
  return 1;  // not one of ours
}

int StreamOrderedCache::device_alloc(void** ptr, size_t bytes, cudaStream_t stream) {
  return alloc(device_, false, ptr, bytes, stream);
}
int StreamOrderedCache::device_free(void* ptr, cudaStream_t stream) {
  return release(device_, ptr, stream);
}
int StreamOrderedCache::pinned_alloc(void** ptr, size_t bytes, cudaStream_t stream) {
  return alloc(pinned_, true, ptr, bytes, stream);
}
int StreamOrderedCache::pinned_free(void* ptr, cudaStream_t stream) {
  return release(pinned_, ptr, stream);
}

StreamOrderedCache::Counts StreamOrderedCache::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Counts c;
  for (const Block& b : device_) c.device_bytes += static_cast<int64_t>(b.bytes);
  for (const Block& b : pinned_) c.pinned_bytes += static_cast<int64_t>(b.bytes);
  c.device_blocks = static_cast<int64_t>(device_.size());
  c.pinned_blocks = static_cast<int64_t>(pinned_.size());
  c.reused = reused_;
  return c;
}

}  // namespace kiln::cuda
