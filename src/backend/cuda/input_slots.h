// The CUDA backend's two staged input slots, A and B, and every way a batch gets into one.
//
// Staging: stage_batch() copies into a pinned host buffer (on KILN_STAGE_COPY_THREADS threads,
// piece by piece under KILN_STAGE_IN_PIECES) and from there, on the transfer stream, into input
// slot A or B, so the copy overlaps the step in flight; the copy waits for the last phase that read
// the slot, and phases that read the slot wait for it. stage_batch_u8 moves uint8 pixels (a quarter
// of the bytes) and normalises them there; stage_batch_encoded decodes JPEGs with nvJPEG and
// resamples them there (jpeg_stage.h), and stage_batch_device copies a batch already on the GPU
// after its producer's stream, all on the same stream and under the same events.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <string>

#include "backend/cuda/augment_stage.h"
#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/jpeg_stage.h"
#include "kiln/backend/backend.h"

namespace kiln::cuda {

class InputSlots {
 public:
  explicit InputSlots(Context& ctx) : ctx_(ctx) {}
  // Pinned buffers and events for each slot the program has; notes the current device.
  void allocate(const Program& program);
  // Waits for the JPEG stage's last batch and frees the buffers (before the streams go).
  void release();
  // A phase that reads a slot waits for its pending copy, and records that it read it.
  void wait_for_copies(cudaStream_t s, const std::array<bool, 2>& reads_slot);
  void record_reads(cudaStream_t s, const std::array<bool, 2>& reads_slot);

  void stage_batch(int slot, const float* images, const int32_t* labels);
  void stage_batch_u8(int slot, const uint8_t* images, const int32_t* labels,
                      const InputNormalization& norm, const SampleAugment* augments);
  void stage_batch_device(int slot, const DeviceBatch& b, const InputNormalization* norm);
  DeviceStaging device_staging() const;
  bool decodes_jpeg(std::string* why_not) const;
  void stage_batch_encoded(int slot, const EncodedBatch& batch, const InputNormalization& norm);
  DecodeCounters decode_counters() const { return decoded_; }

 private:
  struct Staging {
    void* host = nullptr;
    void* dev_u8 = nullptr;  // stage_batch_u8's device copy of the bytes, made at its first call
    size_t img_bytes = 0, lab_bytes = 0;
    cudaEvent_t copied = nullptr;    // the H2D copy into the slot ended
    cudaEvent_t read = nullptr;      // the last phase that reads the slot ended
    cudaEvent_t produced = nullptr;  // stage_batch_device: the producer's stream reached the batch
    bool copy_pending = false, read_recorded = false;
  };
  // A host batch into a slot's pinned buffer and from there to `device` on stream s: one copy
  // and one transfer, or (KILN_STAGE_IN_PIECES) 8 MB pieces, each piece's transfer queued once
  // it is copied, so that after a synchronize the step waits for the copy and one piece's
  // transfer, not the whole transfer after it. The copy's time goes into decoded_.
  void copy_in(void* device, void* pinned, const void* batch, size_t bytes, cudaStream_t s);
  JpegStageOptions jpeg_options() const;
  uint8_t* address(const DTensor& t);

  Context& ctx_;
  std::array<Staging, 2> staging_{};
  int device_ = 0;  // the CUDA device prepare() ran on, which stage_batch_device reads from
  std::unique_ptr<JpegStage> jpeg_;        // made at the first stage_batch_encoded
  std::unique_ptr<AugmentStage> augment_;  // made at the first batch staged through it
  AugmentStage& augment_stage() {
    if (!augment_) augment_ = std::make_unique<AugmentStage>();
    return *augment_;
  }
  DecodeCounters decoded_;  // summed over every JpegStage this backend made, and host copies
};

}  // namespace kiln::cuda
