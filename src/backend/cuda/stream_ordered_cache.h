// Device and pinned host memory for nvJPEG (its V2 allocator interface: every allocation and
// release names a stream), kept for reuse instead of returned to CUDA.
//
// Why: cudaFree and cudaFreeHost wait for the whole device, so an nvJPEG call that frees a
// buffer to grow it would wait for the step running beside it. Here a release only records an
// event on its stream; a later request takes a block of the same size class once that event says
// the stream is done with it (pinned memory: the host may write it at once, so the event must have
// passed) or makes the new stream wait for it (device memory: the ordering stays on the GPU).
// Nothing is freed until the cache is destroyed, after the device has finished with it. On the
// benchmark folder it made no measured difference (bench/RESULTS.md); it stays on
// because the measured fast configuration has it (KILN_NVJPEG_CACHE=0 turns it off).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace kiln::cuda {

class StreamOrderedCache {
 public:
  StreamOrderedCache() = default;
  ~StreamOrderedCache();
  StreamOrderedCache(const StreamOrderedCache&) = delete;
  StreamOrderedCache& operator=(const StreamOrderedCache&) = delete;

  // 0 on success, as nvJPEG's allocator callbacks return; never throws (they are C callbacks).
  int device_alloc(void** ptr, size_t bytes, cudaStream_t stream);
  int device_free(void* ptr, cudaStream_t stream);
  int pinned_alloc(void** ptr, size_t bytes, cudaStream_t stream);
  int pinned_free(void* ptr, cudaStream_t stream);

  // Blocks obtained from CUDA so far (a test's window on reuse), and bytes held.
  struct Counts {
    int64_t device_blocks = 0, pinned_blocks = 0;
    int64_t device_bytes = 0, pinned_bytes = 0;
    int64_t reused = 0;  // requests served from the cache
  };
  Counts counts() const;

  // The size class a request is served from: at most a quarter larger than asked, so a cache
  // of varying requests converges to a few sizes.
  static size_t size_class(size_t bytes);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t bytes = 0;                // the size class
    cudaEvent_t released = nullptr;  // recorded on the releasing stream
    cudaStream_t stream = nullptr;   // that stream
    bool in_use = false;
  };
  int alloc(std::vector<Block>& pool, bool pinned, void** ptr, size_t bytes, cudaStream_t stream);
  int release(std::vector<Block>& pool, void* ptr, cudaStream_t stream);

  mutable std::mutex mutex_;  // nvJPEG may call from its own threads
  std::vector<Block> device_, pinned_;
  int64_t reused_ = 0;
};

}  // namespace kiln::cuda
