// The CUDA backend's encoded-batch stage (Backend::stage_batch_encoded): decodes each sample's
// JPEG with nvJPEG into device buffers it reuses, and describes every sample for the one
// resample kernel of input_stage.h. Per batch:
//  (a) images the hardware JPEG engines take (nvjpegDecodeBatchedSupported: baseline,
//      4:4:4 / 4:2:2 / 4:2:0 / grey) in one nvjpegDecodeBatched(Ex) call, only the crop's
//      window where region decode applies (KILN_NVJPEG_ROI);
//  (b) the rest (progressive, ...; all of them without engines or with KILN_NVJPEG_HARDWARE=0)
//      one at a time through the decoupled hybrid decoder (CPU Huffman, GPU IDCT);
//  (c) what nvJPEG refuses or fails on (CMYK, corrupt, truncated, not a JPEG) and samples the
//      loader decoded itself (host_pixels) come from the host: batch.host_decode.
// An nvJPEG error on one image sends that image to the host; it never ends the batch. Without
// nvJPEG (a build without it, KILN_NVJPEG=0) every image takes (c).
//
// Buffers grow only when a batch needs more than any before; the stage's pinned and device
// memory is reused until the previous batch's kernel has finished (its `done` event).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/input_stage.h"
#include "kiln/data/input_batch.h"

namespace kiln::cuda {

struct JpegStageOptions {
  bool nvjpeg = true;    // KILN_NVJPEG
  bool hardware = true;  // KILN_NVJPEG_HARDWARE
  bool roi = true;       // KILN_NVJPEG_ROI
  bool cache = true;     // KILN_NVJPEG_CACHE: nvJPEG's memory from a StreamOrderedCache
};

class JpegStage {
 public:
  explicit JpegStage(const JpegStageOptions& o);
  ~JpegStage();
  JpegStage(const JpegStage&) = delete;
  JpegStage& operator=(const JpegStage&) = delete;

  // Whether nvJPEG can be used on this device (probed once per process), and why not.
  static bool available(const JpegStageOptions& o, std::string* why_not);

  struct Prepared {
    const SampleDesc* descs = nullptr;  // device, batch.batch entries, ready on `stream`
    const int32_t* labels =
        nullptr;            // pinned host, batch.batch entries (host_decode may replace some)
    DecodeCounters counts;  // this batch's images by path
  };
  // Enqueues the decodes of `batch` and the descriptors' upload on `stream`; returns before
  // the device is done. The caller then launches launch_stage_samples and calls finished().
  // An exception (host_decode's, a CUDA error) leaves no decode in flight on the buffers.
  Prepared prepare(const EncodedBatch& batch, cudaStream_t stream);
  void finished(cudaStream_t stream);

  bool uses_hardware() const;  // the hardware engines are in use (else the hybrid decoder)
  bool caches_memory() const;  // nvJPEG allocates from a StreamOrderedCache

 private:
  struct Nv;  // nvJPEG's handles, states and buffers (jpeg_stage.cpp)
  Prepared prepare_batch(const EncodedBatch& batch, cudaStream_t stream);
  void ensure_host_buffers(const EncodedBatch& batch);
  uint8_t* arena_reserve(int64_t bytes, cudaStream_t stream, int64_t* offset);
  void host_sample(const EncodedBatch& batch, int64_t k, bool decode, cudaStream_t stream,
                   DecodeCounters& counts);

  JpegStageOptions opts_;
  std::unique_ptr<Nv> nv_;
  cudaEvent_t done_ = nullptr;
  bool pending_ = false;
  // Per sample: pinned descriptors and labels, host pixels (pinned and device).
  int64_t batch_ = 0, sample_bytes_ = 0;
  SampleDesc* host_descs_ = nullptr;
  SampleDesc* dev_descs_ = nullptr;
  int32_t* host_labels_ = nullptr;
  uint8_t* host_pixels_ = nullptr;
  uint8_t* dev_pixels_ = nullptr;
  std::vector<int64_t> arena_offset_;  // per sample: where its window lies in the arena, or -1
  // Decoded windows of one batch, bump-allocated; bitstreams copied to pinned memory so that
  // nvJPEG's asynchronous reads outlive the caller's batch.
  uint8_t* arena_ = nullptr;
  int64_t arena_cap_ = 0, arena_used_ = 0;
  uint8_t* bits_ = nullptr;
  int64_t bits_cap_ = 0;
  // Where the copies that pad an engine call to the compiled batch decode (never read).
  uint8_t* pad_ = nullptr;
  int64_t pad_cap_ = 0;
};

}  // namespace kiln::cuda
