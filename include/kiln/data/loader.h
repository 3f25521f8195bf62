// Loader (SPEC S23): worker threads turn dataset samples into batches, a few batches ahead of
// the trainer, into a ring of batch buffers: transformed float images, uint8 pixels cut by one
// resampling per sample, or (for a device that decodes JPEGs) the files' bytes and geometries.
//
// Determinism: the epoch's order is a Fisher-Yates shuffle drawn from Rng::derive(seed, epoch),
// and the transforms of dataset sample i in epoch e draw from Rng::derive(seed, e, i + 1) (+1 so
// that sample 0 does not share the shuffle's stream). Workers only choose *who* computes a
// sample, never *what* it is, so batches are identical for any worker count, and a sample's
// augmentation does not depend on rank, world or batch size.
//
// Sharding (data parallel): the epoch's permutation is cut to a multiple of world and rank r
// takes positions r, r + world, r + 2 world, ... (torch's DistributedSampler order), so ranks
// are disjoint and have the same number of samples and batches; the remainder is dropped.
//
// Threads: start_epoch() and next() are called from one thread (the trainer's); the workers
// are the Loader's own. workers = 0 makes each batch inside next(), for debugging.
//
// Errors: an exception thrown while making sample k of batch b (a corrupt file with skipping
// off, a transform whose output has the wrong shape) is rethrown, unchanged, by the next() call
// that would have returned batch b. The epoch is then over; start_epoch() begins a fresh one.
#pragma once
#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/core/switches.h"
#include "kiln/data/dataset.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/input_batch.h"
#include "kiln/data/transforms.h"

namespace kiln {

// What next() hands out. float32: the Pipeline's float images. uint8: the pipeline as one
// resampling per sample (Pipeline::geometry; image folders decode only what it reads), bytes
// out, normalised where the batch lands. encoded: for a device that decodes JPEGs, the files'
// bytes and each sample's geometry; what it cannot take is decoded here into host_pixels.
// uint8 and encoded need Pipeline::geometric_with_augments(), and hand out each sample's value
// augmentations (sample_augment.h) for the backend to apply; encoded needs
// Dataset::has_encoded().
enum class LoaderOutput { float32, uint8, encoded };

// Where the loader's time went, summed since start (the progress line's and summary's
// loader rate, and the "input-bound" verdict).
struct LoaderStats {
  int64_t samples = 0;      // made by the workers
  double make_seconds = 0;  // worker time spent making them, over all workers
  double wait_seconds = 0;  // time next() waited for a batch not yet made
  int workers = 0;
  // Samples a second the workers give when none waits: samples / make_seconds * workers.
  double rate() const {
    return make_seconds > 0 ? samples / make_seconds * (workers > 0 ? workers : 1) : 0;
  }
};

struct LoaderOptions {
  int64_t batch_size = 128;
  int workers = 2;  // 0: next() makes each batch itself, on the caller's thread
  bool shuffle = true;
  bool drop_last = true;  // drop the last partial batch (the compiled step has a fixed batch)
  uint64_t seed = 0;
  int rank = 0;
  int world = 1;
  int prefetch = 2;  // batches made ahead of the one next() is waiting for, at most
  LoaderOutput output = LoaderOutput::float32;
  // uint8 and encoded: how image files are decoded on the host (tests turn the DCT scaling
  // off to compare with the float path's full decode).
  ResampledDecodeOptions decode;
  // uint8: next_u8(vector&, ...) takes the finished batch's buffer and leaves its own in the
  // loader, instead of copying the batch out (KILN_LOADER_SWAP).
  bool swap_u8 = true;
};

// The host decode's and the uint8 hand-over's switches (the resample's order and arithmetic,
// the JPEG window's margin, rows a call and progressive stop, KILN_LOADER_SWAP) set on `o`.
void apply_loader_switches(LoaderOptions& o, const Switches& s);

// The machine's cores (std::thread::hardware_concurrency, at least 1): --workers' default.
int default_loader_workers();

class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> dataset, Pipeline transforms, LoaderOptions options);
  ~Loader();  // joins workers
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Resets and starts prefetching that epoch from batch `first_batch` (a resumed mid-epoch
  // checkpoint): the batches before it are neither read nor decoded, and every later batch is
  // the one an uninterrupted epoch would give (each sample draws from (seed, epoch, index)).
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // Copies the next batch into images (NHWC float32, batch_size*H*W*C) and labels (int32);
  // returns the number of samples written (< batch_size only for a last partial batch when
  // drop_last is false), 0 when the epoch is done.
  int64_t next(float* images, int32_t* labels);
  // The same in uint8 mode: batch_size*H*W*C bytes.
  int64_t next_u8(uint8_t* images, int32_t* labels);
  // The same, the batch handed over in `images` (resized to batch_size*H*W*C bytes): a swap
  // of buffers with the loader where options.swap_u8, else a copy. `augments` (batch_size
  // entries) receives each sample's value augmentations; it may be null only when the
  // pipeline has none (has_augments()).
  int64_t next_u8(std::vector<uint8_t>& images, int32_t* labels,
                  std::vector<SampleAugment>* augments = nullptr);
  // The same in encoded mode: fills `batch` (its vectors are reused across calls) with the
  // next batch's samples; batch.host_decode stays valid until the next call.
  int64_t next_encoded(EncodedBatch& batch);
  LoaderOutput output() const { return options_.output; }
  // The pipeline draws value augmentations that the uint8 and encoded batches carry.
  bool has_augments() const { return augments_; }
  LoaderStats stats() const;
  int64_t batches_per_epoch() const { return batches_; }
  int64_t samples_per_epoch() const { return samples_; }
  std::array<int64_t, 3> sample_hwc() const { return hwc_; }  // shape of one transformed sample
  int64_t skipped_samples() const { return dataset_->corrupt_skipped(); }

 private:
  struct Slot {
    int64_t batch = -1;     // which batch of the epoch it holds
    int64_t remaining = 0;  // samples still being made
    int64_t error_at = -1;  // the lowest sample position that failed, -1 if none
    std::exception_ptr error;
    std::vector<float> images;            // float32
    std::vector<uint8_t> pixels;          // uint8; encoded: the samples decoded on the host
    std::vector<EncodedImage> encoded;    // encoded
    std::vector<SampleAugment> augments;  // uint8 with value augmentations
    std::vector<int32_t> labels;
  };

  void worker_loop();
  // Claims up to `max` consecutive sample positions of one batch; false when none is claimable.
  bool claim(int64_t max, int64_t& first, int64_t& count, uint64_t& generation);
  // Makes the samples at positions [first, first + count) of the epoch into their slot.
  void make_samples(int64_t first, int64_t count, uint64_t generation);
  void make_one(int64_t position, Slot& slot, int64_t& error_at, std::exception_ptr& error);
  // One sample as uint8 (out: sample_bytes()); returns its label.
  int32_t make_u8(int64_t index, const Rng& rng, uint8_t* out, SampleAugment* augment) const;
  // Decodes `enc` on the host with its geometry; a file whose pixels turn out corrupt is
  // marked so and the next good one is decoded instead, with the same rng (as sample() and
  // the float path replace). Returns the label of the file decoded.
  int32_t decode_on_host(Dataset::Encoded enc, const Rng& rng, uint8_t* out,
                         EncodedImage* decoded) const;
  // `augment`, where not null, receives the value augmentations drawn after the geometry.
  SampleGeometry checked_geometry(int64_t h, int64_t w, Rng rng, int64_t index,
                                  SampleAugment* augment = nullptr) const;
  // The next batch's slot, made here when there are no workers; null when the epoch is done.
  // release_batch() hands the slot back to the workers.
  Slot* wait_batch(const char* caller, LoaderOutput wanted);
  void release_batch();
  int64_t batch_samples(int64_t batch) const;
  int64_t sample_floats() const { return hwc_[0] * hwc_[1] * hwc_[2]; }

  std::shared_ptr<const Dataset> dataset_;
  Pipeline pipeline_;
  LoaderOptions options_;
  std::array<int64_t, 3> hwc_{};
  bool augments_ = false;
  int64_t per_rank_ = 0, samples_ = 0, batches_ = 0;

  // Epoch state, all under mutex_.
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;   // workers: something to claim, or stop
  std::condition_variable ready_cv_;  // next(): a slot finished; start_epoch: work drained
  uint64_t generation_ = 0;           // bumped by start_epoch; stale work is discarded
  bool active_ = false;
  bool stop_ = false;
  int64_t epoch_ = 0;
  std::vector<int64_t> order_;  // this rank's dataset indices for the epoch
  int64_t next_position_ = 0;   // next sample position to claim
  int64_t consumed_ = 0;        // batches returned by next()
  int64_t in_flight_ = 0;       // claims being worked on
  std::vector<Slot> slots_;
  std::vector<std::thread> threads_;
  LoaderStats stats_;  // under mutex_
};

}  // namespace kiln
