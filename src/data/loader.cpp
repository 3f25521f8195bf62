#include "kiln/data/loader.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"

namespace kiln {

namespace {

using Clock = std::chrono::steady_clock;

const char* output_name(LoaderOutput o) {
  switch (o) {
    case LoaderOutput::float32:
      return "float32";
    case LoaderOutput::uint8:
      return "uint8";
    case LoaderOutput::encoded:
      return "encoded";
  }
  return "?";
}

}  // namespace

void apply_loader_switches(LoaderOptions& o, const Switches& s) {
  o.decode.resample =
      s.resample_vertical_first ? ResampleOrder::vertical_first : ResampleOrder::horizontal_first;
  o.decode.math = s.resample_fixed_point ? ResampleMath::fixed16 : ResampleMath::float32;
  o.decode.tight_margin = s.jpeg_tight_margin;
  o.decode.batch_rows = s.jpeg_batch_rows;
  o.decode.progressive_stop = s.jpeg_progressive_stop;
  o.swap_u8 = s.loader_swap;
}

int default_loader_workers() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

Loader::Loader(std::shared_ptr<const Dataset> dataset, Pipeline transforms, LoaderOptions options)
    : dataset_(std::move(dataset)), pipeline_(std::move(transforms)), options_(options) {
  const LoaderOptions& o = options_;
  KILN_CHECK(dataset_ != nullptr, InvalidArgument, "Loader needs a dataset, got null");
  KILN_CHECK(o.batch_size > 0, InvalidArgument, "batch size must be > 0, got ", o.batch_size);
  KILN_CHECK(o.workers >= 0, InvalidArgument, "loader workers must be >= 0, got ", o.workers);
  KILN_CHECK(o.prefetch >= 1, InvalidArgument, "loader prefetch must be >= 1, got ", o.prefetch);
  KILN_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, InvalidArgument, "rank ", o.rank,
             " is outside [0, world = ", o.world, ")");
  const int64_t n = dataset_->size();
  per_rank_ = n / o.world;
  if (o.drop_last) {
    batches_ = per_rank_ / o.batch_size;
    samples_ = batches_ * o.batch_size;
  } else {
    batches_ = (per_rank_ + o.batch_size - 1) / o.batch_size;
    samples_ = per_rank_;
  }
  KILN_CHECK(batches_ > 0, InvalidArgument, dataset_->describe(), " gives each of the ", o.world,
             " rank(s) ", per_rank_, " samples, fewer than one batch of ", o.batch_size,
             "; lower the batch size or turn drop_last off");

  // Every batch has a fixed shape; take it from sample 0 (the Pipeline's output size does not
  // depend on the random draws, only on the input size, and workers check each sample).
  Rng rng = Rng::derive(o.seed, 0, 1);
  if (o.output == LoaderOutput::float32) {
    const FloatImage first = pipeline_(dataset_->sample(0).image, rng);
    hwc_ = {first.height, first.width, first.channels};
  } else {
    std::string why;
    KILN_CHECK(pipeline_.geometric_with_augments(&why), InvalidArgument, "the ",
               output_name(o.output),
               " input path runs the transforms as one crop-and-resize per sample, which the "
               "pipeline ",
               pipeline_.describe(), " cannot be: ", why,
               "; use the float32 loader output (kiln train --decode cpu --no-input-u8)");
    KILN_CHECK(o.output != LoaderOutput::encoded || dataset_->has_encoded(), InvalidArgument,
               "encoded input needs a dataset of image files (an image folder); ",
               dataset_->describe(), " has none: use the uint8 output");
    int64_t h = 0, w = 0, c = 0;
    if (dataset_->has_encoded()) {
      const Dataset::Encoded e = dataset_->encoded(0);
      h = e.height, w = e.width, c = dataset_->channels();
    } else {
      const Sample s = dataset_->sample(0);
      h = s.image.height, w = s.image.width, c = s.image.channels;
    }
    SampleAugment augment;
    const SampleGeometry g = pipeline_.geometry(h, w, rng, augment);
    hwc_ = {g.out_h(), g.out_w(), c};
    augments_ = pipeline_.has_augments();
  }
  KILN_CHECK(sample_floats() > 0, InvalidArgument, "the transforms made an empty image");

  // One slot being copied out by next() plus `prefetch` being made ahead; with no workers the
  // caller makes one batch at a time.
  const int slots = o.workers == 0 ? 1 : o.prefetch + 1;
  slots_.resize(static_cast<size_t>(slots));
  for (Slot& s : slots_) {
    if (o.output == LoaderOutput::float32) {
      s.images.resize(static_cast<size_t>(o.batch_size * sample_floats()));
    } else {
      s.pixels.resize(static_cast<size_t>(o.batch_size * sample_floats()));
    }
    if (o.output == LoaderOutput::encoded) s.encoded.resize(static_cast<size_t>(o.batch_size));
    if (o.output == LoaderOutput::uint8 && augments_) {
      s.augments.resize(static_cast<size_t>(o.batch_size));
    }
    s.labels.resize(static_cast<size_t>(o.batch_size));
  }
  stats_.workers = o.workers;
  for (int w = 0; w < o.workers; ++w) threads_.emplace_back([this] { worker_loop(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int64_t Loader::batch_samples(int64_t batch) const {
  return std::min(options_.batch_size, samples_ - batch * options_.batch_size);
}

void Loader::start_epoch(int64_t epoch, int64_t first_batch) {
  KILN_CHECK(first_batch >= 0 && first_batch <= batches_, InvalidArgument, "start_epoch: batch ",
             first_batch, " is outside the epoch's 0..", batches_,
             " batches (a checkpoint made with another --batch-size "
             "or dataset?)");
  std::unique_lock<std::mutex> lock(mutex_);
  // Retire the old epoch: nothing new is claimed, and what is being made is waited for, because
  // it writes into the slots we are about to reuse.
  ++generation_;
  active_ = false;
  ready_cv_.wait(lock, [this] { return in_flight_ == 0; });

  const int64_t n = dataset_->size();
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  if (options_.shuffle) {
    Rng rng = Rng::derive(options_.seed, static_cast<uint64_t>(epoch));
    for (int64_t i = n - 1; i > 0; --i) {
      std::swap(perm[static_cast<size_t>(i)],
                perm[static_cast<size_t>(rng.below(static_cast<uint64_t>(i + 1)))]);
    }
  }
  order_.resize(static_cast<size_t>(samples_));
  for (int64_t k = 0; k < samples_; ++k) {
    order_[static_cast<size_t>(k)] = perm[static_cast<size_t>(options_.rank + k * options_.world)];
  }
  epoch_ = epoch;
  // The shuffle above is the whole epoch's, so skipping is only moving the cursor.
  next_position_ = first_batch * options_.batch_size;
  consumed_ = first_batch;
  for (Slot& s : slots_) {
    s.batch = -1;
    s.remaining = 0;
    s.error_at = -1;
    s.error = nullptr;
  }
  active_ = true;
  lock.unlock();
  work_cv_.notify_all();
}

bool Loader::claim(int64_t max, int64_t& first, int64_t& count, uint64_t& generation) {
  // Called with mutex_ held.
  if (!active_ || next_position_ >= samples_) return false;
  const int64_t batch = next_position_ / options_.batch_size;
  if (batch >= consumed_ + static_cast<int64_t>(slots_.size())) return false;  // ring is full
  Slot& slot = slots_[static_cast<size_t>(batch) % slots_.size()];
  if (slot.batch != batch) {  // first claim in this batch: the slot held batch - slots, consumed
    slot.batch = batch;
    slot.remaining = batch_samples(batch);
    slot.error_at = -1;
    slot.error = nullptr;
  }
  const int64_t batch_end = batch * options_.batch_size + batch_samples(batch);
  first = next_position_;
  count = std::min(max, batch_end - first);
  next_position_ += count;
  generation = generation_;
  ++in_flight_;
  return true;
}

SampleGeometry Loader::checked_geometry(int64_t h, int64_t w, Rng rng, int64_t index,
                                        SampleAugment* augment) const {
  SampleAugment unused;
  const SampleGeometry g = pipeline_.geometry(h, w, rng, augment ? *augment : unused);
  KILN_CHECK(g.out_h() == hwc_[0] && g.out_w() == hwc_[1], InvalidArgument,
             "the transforms make a ", g.out_h(), "x", g.out_w(), " image from sample ", index,
             " but batches hold ", hwc_[0], "x", hwc_[1],
             " (the shape made from sample 0); end the pipeline with a fixed-size crop "
             "(RandomResizedCrop, CenterCrop, RandomCrop) so that every sample has the same shape");
  return g;
}

int32_t Loader::decode_on_host(Dataset::Encoded enc, const Rng& rng, uint8_t* out,
                               EncodedImage* decoded) const {
  // Each failure marks one more file corrupt, so this ends within size() rounds (encoded()
  // throws once every file is marked).
  for (int64_t round = 0;; ++round) {
    SampleAugment augment;
    const SampleGeometry g = checked_geometry(enc.height, enc.width, rng, enc.index, &augment);
    try {
      decode_resampled(enc.bytes.data(), enc.bytes.size(), hwc_[2], g, out, enc.name,
                       options_.decode);
      if (decoded) {
        decoded->bytes.clear();
        decoded->geometry = g;
        decoded->augment = std::move(augment);
        decoded->name = enc.name;
      }
      return enc.label;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Data) throw;
      KILN_CHECK(round < dataset_->size(), Internal, dataset_->describe(),
                 " keeps handing out files that fail to decode: ", e.what());
      dataset_->mark_corrupt(enc.index, e.what());
      enc = dataset_->encoded((enc.index + 1) % dataset_->size());
    }
  }
}

int32_t Loader::make_u8(int64_t index, const Rng& rng, uint8_t* out, SampleAugment* augment) const {
  if (dataset_->has_encoded()) {
    if (!augment) return decode_on_host(dataset_->encoded(index), rng, out, nullptr);
    EncodedImage decoded;
    const int32_t label = decode_on_host(dataset_->encoded(index), rng, out, &decoded);
    *augment = std::move(decoded.augment);
    return label;
  }
  // Datasets held in memory (IDX, CIFAR, synthetic): the bytes are there, resample them.
  const Sample s = dataset_->sample(index);
  const Image& im = s.image;
  KILN_CHECK(im.channels == hwc_[2], InvalidArgument, "sample ", index, " has ", im.channels,
             " channels but batches hold ", hwc_[2], " (those of sample 0)");
  const SampleGeometry g = checked_geometry(im.height, im.width, rng, index, augment);
  resample_u8(im.pixels.data(), im.height, im.width, im.channels, im.width * im.channels, g, out,
              options_.decode.resample, options_.decode.math);
  return s.label;
}

void Loader::make_one(int64_t position, Slot& slot, int64_t& error_at, std::exception_ptr& error) {
  const int64_t index = order_[static_cast<size_t>(position)];
  const int64_t k = position % options_.batch_size;
  try {
    Rng rng =
        Rng::derive(options_.seed, static_cast<uint64_t>(epoch_), static_cast<uint64_t>(index) + 1);
    int32_t& label = slot.labels[static_cast<size_t>(k)];
    uint8_t* pixels = options_.output == LoaderOutput::float32
                          ? nullptr
                          : slot.pixels.data() + k * sample_floats();
    if (options_.output == LoaderOutput::uint8) {
      label =
          make_u8(index, rng, pixels, augments_ ? &slot.augments[static_cast<size_t>(k)] : nullptr);
      return;
    }
    if (options_.output == LoaderOutput::encoded) {
      // The worker only reads the file and draws its geometry; the device decodes it, unless
      // it cannot (PNG, CMYK, a truncated JPEG), and then it is decoded here.
      Dataset::Encoded enc = dataset_->encoded(index);
      EncodedImage& out = slot.encoded[static_cast<size_t>(k)];
      if (!enc.device_decodable) {
        label = decode_on_host(std::move(enc), rng, pixels, &out);
        return;
      }
      out.geometry = checked_geometry(enc.height, enc.width, rng, enc.index, &out.augment);
      out.name = std::move(enc.name);
      out.bytes = std::move(enc.bytes);
      label = enc.label;
      return;
    }
    Sample s = dataset_->sample(index);
    const FloatImage img = pipeline_(s.image, rng);
    KILN_CHECK(img.height == hwc_[0] && img.width == hwc_[1] && img.channels == hwc_[2],
               InvalidArgument, "the transforms made a ", img.height, "x", img.width, "x",
               img.channels, " image from sample ", index, " but batches hold ", hwc_[0], "x",
               hwc_[1], "x", hwc_[2],
               " (the shape made from sample 0); end the pipeline with a "
               "fixed-size crop (RandomResizedCrop, CenterCrop, RandomCrop) so that every sample "
               "has the same shape");
    std::memcpy(slot.images.data() + k * sample_floats(), img.data.data(),
                static_cast<size_t>(sample_floats()) * sizeof(float));
    label = s.label;
  } catch (...) {
    if (error_at < 0) {  // positions rise, so the first failure is the lowest
      error_at = position;
      error = std::current_exception();
    }
  }
}

void Loader::make_samples(int64_t first, int64_t count, uint64_t generation) {
  // No lock while making samples: the claimed positions are ours alone, and order_, epoch_ and
  // the slot buffers do not change until in_flight_ drops back to zero.
  const int64_t batch = first / options_.batch_size;
  Slot& slot = slots_[static_cast<size_t>(batch) % slots_.size()];
  int64_t error_at = -1;
  std::exception_ptr error;
  const auto t0 = Clock::now();
  for (int64_t p = first; p < first + count; ++p) make_one(p, slot, error_at, error);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  std::lock_guard<std::mutex> lock(mutex_);
  --in_flight_;
  stats_.samples += count;
  stats_.make_seconds += secs;
  if (generation == generation_) {
    slot.remaining -= count;
    if (error && (slot.error_at < 0 || error_at < slot.error_at)) {
      slot.error_at = error_at;
      slot.error = std::move(error);
    }
  }
  // Drop our reference under the lock: the exception must not be freed by this thread after
  // start_epoch() has already let go of it (the refcount would be the only ordering).
  error = nullptr;
  ready_cv_.notify_all();
}

void Loader::worker_loop() {
  // Claim a few samples at a time: enough to keep lock traffic low for tiny images (MNIST),
  // few enough that all workers share even a small batch.
  const int64_t chunk = std::clamp<int64_t>(options_.batch_size / (4 * options_.workers), 1, 16);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    int64_t first = 0, count = 0;
    uint64_t generation = 0;
    work_cv_.wait(lock, [&] { return stop_ || claim(chunk, first, count, generation); });
    if (stop_) return;  // stop_ is tested first, so nothing was claimed
    lock.unlock();
    make_samples(first, count, generation);
    lock.lock();
  }
}

Loader::Slot* Loader::wait_batch(const char* caller, LoaderOutput wanted) {
  static const char* const reader[] = {"next", "next_u8", "next_encoded"};
  KILN_CHECK(
      options_.output == wanted, InvalidArgument, "Loader::", caller, " reads ",
      output_name(wanted), " batches but this loader makes ", output_name(options_.output),
      " ones (LoaderOptions::output); call Loader::", reader[static_cast<int>(options_.output)]);
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  KILN_CHECK(active_, State, "Loader::", caller,
             " called with no epoch running; call start_epoch(e) "
             "first (also after an error, which ends the epoch)");
  if (consumed_ >= batches_) return nullptr;
  const int64_t batch = consumed_;
  Slot& slot = slots_[static_cast<size_t>(batch) % slots_.size()];
  auto ready = [&] { return slot.batch == batch && slot.remaining == 0; };
  if (threads_.empty()) {
    // No workers: make the batch here, through the same claim path.
    int64_t first = 0, count = 0;
    uint64_t generation = 0;
    while (!ready() && claim(options_.batch_size, first, count, generation)) {
      lock.unlock();
      make_samples(first, count, generation);
      lock.lock();
    }
  } else {
    ready_cv_.wait(lock, ready);
  }
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  if (slot.error) {
    active_ = false;
    std::exception_ptr e = slot.error;
    lock.unlock();
    std::rethrow_exception(e);
  }
  // The slot is ours until consumed_ moves on: workers only claim batches < consumed_ + slots.
  return &slot;
}

void Loader::release_batch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++consumed_;
  }
  work_cv_.notify_all();
}

int64_t Loader::next(float* images, int32_t* labels) {
  KILN_CHECK(images != nullptr && labels != nullptr, InvalidArgument,
             "Loader::next needs image and label buffers, got null");
  Slot* slot = wait_batch("next", LoaderOutput::float32);
  if (!slot) return 0;
  const int64_t n = batch_samples(slot->batch);
  std::memcpy(images, slot->images.data(),
              static_cast<size_t>(n * sample_floats()) * sizeof(float));
  std::memcpy(labels, slot->labels.data(), static_cast<size_t>(n) * sizeof(int32_t));
  release_batch();
  return n;
}

int64_t Loader::next_u8(uint8_t* images, int32_t* labels) {
  KILN_CHECK(images != nullptr && labels != nullptr, InvalidArgument,
             "Loader::next_u8 needs image and label buffers, got null");
  KILN_CHECK(!augments_, InvalidArgument, "the pipeline ", pipeline_.describe(),
             " draws value augmentations that this form of Loader::next_u8 would drop; call "
             "next_u8(images, labels, &augments) and hand them to the backend");
  Slot* slot = wait_batch("next_u8", LoaderOutput::uint8);
  if (!slot) return 0;
  const int64_t n = batch_samples(slot->batch);
  std::memcpy(images, slot->pixels.data(), static_cast<size_t>(n * sample_floats()));
  std::memcpy(labels, slot->labels.data(), static_cast<size_t>(n) * sizeof(int32_t));
  release_batch();
  return n;
}

int64_t Loader::next_u8(std::vector<uint8_t>& images, int32_t* labels,
                        std::vector<SampleAugment>* augments) {
  KILN_CHECK(labels != nullptr, InvalidArgument, "Loader::next_u8 needs a label buffer, got null");
  KILN_CHECK(!augments_ || augments != nullptr, InvalidArgument, "the pipeline ",
             pipeline_.describe(),
             " draws value augmentations; pass next_u8 a vector for them and hand them to the "
             "backend");
  Slot* slot = wait_batch("next_u8", LoaderOutput::uint8);
  if (!slot) return 0;
  const int64_t n = batch_samples(slot->batch);
  images.resize(slot->pixels.size());  // the slot gets back a buffer of its own size
  if (options_.swap_u8) {
    images.swap(slot->pixels);
  } else {
    std::memcpy(images.data(), slot->pixels.data(), static_cast<size_t>(n * sample_floats()));
  }
  std::memcpy(labels, slot->labels.data(), static_cast<size_t>(n) * sizeof(int32_t));
  if (augments) {
    // Swapped (the slot reuses the caller's vectors next time); past n, none.
    augments->swap(slot->augments);
    augments->resize(static_cast<size_t>(options_.batch_size));
    slot->augments.resize(augments_ ? static_cast<size_t>(options_.batch_size) : 0);
    for (size_t k = static_cast<size_t>(n); k < augments->size(); ++k) (*augments)[k] = {};
  }
  release_batch();
  return n;
}

int64_t Loader::next_encoded(EncodedBatch& out) {
  Slot* slot = wait_batch("next_encoded", LoaderOutput::encoded);
  if (!slot) return 0;
  const int64_t bs = options_.batch_size, per = sample_floats();
  const int64_t n = batch_samples(slot->batch);
  out.size = n;
  out.batch = bs;
  out.height = hwc_[0], out.width = hwc_[1], out.channels = hwc_[2];
  // Swaps, not copies: the file bytes and host pixels change hands, and the slot keeps the
  // batch's previous buffers for its next use.
  out.images.swap(slot->encoded);
  out.images.resize(static_cast<size_t>(n));
  slot->encoded.resize(static_cast<size_t>(bs));
  out.host_pixels.swap(slot->pixels);
  out.host_pixels.resize(static_cast<size_t>(bs * per));
  slot->pixels.resize(static_cast<size_t>(bs * per));
  std::fill(out.host_pixels.begin() + n * per, out.host_pixels.end(), uint8_t{0});
  out.labels.assign(slot->labels.begin(), slot->labels.begin() + n);
  out.labels.resize(static_cast<size_t>(bs), -1);
  // Sample k again, on the host, from its own index and rng: what the worker drew.
  std::vector<int64_t> indices(order_.begin() + slot->batch * bs,
                               order_.begin() + slot->batch * bs + n);
  const uint64_t epoch = static_cast<uint64_t>(epoch_);
  out.host_decode = [this, epoch, indices = std::move(indices)](int64_t k, uint8_t* pixels,
                                                                int32_t* label) {
    KILN_CHECK(k >= 0 && k < static_cast<int64_t>(indices.size()), InvalidArgument,
               "host_decode: sample ", k, " is outside the batch of ", indices.size());
    const int64_t index = indices[static_cast<size_t>(k)];
    const Rng rng = Rng::derive(options_.seed, epoch, static_cast<uint64_t>(index) + 1);
    const int32_t l = decode_on_host(dataset_->encoded(index), rng, pixels, nullptr);
    if (label) *label = l;
  };
  release_batch();
  return n;
}

LoaderStats Loader::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace kiln
