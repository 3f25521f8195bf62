// The GPU input paths' value augmentations (sample_augment.h): RandAugment /
// TrivialAugmentWide's ops on each sample's resampled bytes, then the normalisation and cast
// into the input slot with RandomErasing's box set to its value. One block per sample runs its
// ops in order (equalize, autocontrast and contrast need the whole image's histogram, range or
// mean first), in place or, for the ops that read other pixels (the affine ones, sharpness),
// into a scratch copy and back by swapping the two. The host resolves each op's constants
// (augment_op_params) and the kernel repeats apply_augment_params' float32 steps with explicit
// rounding (no contraction), so its bytes are the host's; augment_normalize_u8 is its reference.
//
// Used by stage_batch_u8 (the bytes already on the device) and stage_batch_encoded (the
// resampled bytes from launch_stage_samples_u8 when a sample has ops; erasing alone goes into
// launch_stage_samples, which then keeps its unrounded resample). Buffers grow only when a
// batch needs more than any before; all work goes on the one stream the caller gives.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "backend/cuda/input_stage.h"
#include "kiln/data/input_batch.h"

namespace kiln::cuda {

// pixels: batch x h x w x channels bytes, changed by the ops; scratch: as many bytes;
// descs: batch entries; ops: the AugmentOpParams the descs index (all device memory).
void launch_augment_normalize(uint8_t* pixels, uint8_t* scratch, const AugmentDesc* descs,
                              const AugmentOpParams* ops, int64_t batch, int64_t h, int64_t w,
                              const NormParams& norm, void* out, DType dtype, cudaStream_t stream);

// The device descriptors of `batch` samples whose augmentations are augments[k] (null: none),
// for h x w x channels samples: each op resolved for h x w, each erase box checked to lie in
// the image; samples from `valid` on are padding, written as 0. Host side only; the tests
// build their batches with it too.
void build_augment_descs(const SampleAugment* const* augments, int64_t batch, int64_t valid,
                         int64_t h, int64_t w, int64_t channels, std::vector<AugmentDesc>* descs,
                         std::vector<AugmentOpParams>* ops);

class AugmentStage {
 public:
  AugmentStage() = default;
  ~AugmentStage();
  AugmentStage(const AugmentStage&) = delete;
  AugmentStage& operator=(const AugmentStage&) = delete;

  // A uint8 batch on the device (`pixels`, changed in place) into `out` with its samples'
  // augmentations (augments: batch entries, or null); no augmentation at all is
  // launch_normalize_u8.
  void stage_u8(uint8_t* pixels, const SampleAugment* augments, int64_t batch, int64_t h, int64_t w,
                const NormParams& norm, void* out, DType dtype, cudaStream_t stream);
  // An encoded batch, its decoded windows described by `descs` (device), into `out`, each
  // sample k < batch.size augmented by batch.images[k].augment.
  void stage_encoded(const SampleDesc* descs, const EncodedBatch& batch, const NormParams& norm,
                     void* out, DType dtype, cudaStream_t stream);

 private:
  struct Uploaded {
    const AugmentDesc* descs = nullptr;
    const AugmentOpParams* ops = nullptr;
    bool any_ops = false, any_erase = false;
  };
  // Builds the descriptors and copies them to the device on `stream` through pinned memory
  // (reused once the previous batch's copy has ended).
  Uploaded upload(const SampleAugment* const* augments, int64_t batch, int64_t valid, int64_t h,
                  int64_t w, int64_t channels, cudaStream_t stream);
  uint8_t* scratch(int64_t bytes, cudaStream_t stream);
  uint8_t* resampled(int64_t bytes, cudaStream_t stream);

  std::vector<const SampleAugment*> per_sample_;
  std::vector<AugmentDesc> descs_;
  std::vector<AugmentOpParams> ops_;
  // Pinned staging of the descriptors, then their device copies: [descs | ops].
  void* host_ = nullptr;
  void* dev_ = nullptr;
  size_t cap_ = 0;
  cudaEvent_t uploaded_ = nullptr;  // the last copy out of host_ ended
  bool upload_pending_ = false;
  uint8_t* scratch_ = nullptr;  // the ops' second buffer
  int64_t scratch_cap_ = 0;
  uint8_t* resampled_ = nullptr;  // stage_encoded: the resampled bytes
  int64_t resampled_cap_ = 0;
};

}  // namespace kiln::cuda
