// The input slots' staging paths (input_slots.h): host floats, host uint8, device batches and
// encoded JPEGs, each into slot A or B on the transfer stream.
#include "backend/cuda/input_slots.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/cuda/input_stage.h"
#include "backend/host_copy.h"

namespace kiln::cuda {

void InputSlots::allocate(const Program& program) {
  CUDA_CHECK(cudaGetDevice(&device_));
  for (int slot = 0; slot < 2; ++slot) {
    const TensorId img = program.io.staged_images[static_cast<size_t>(slot)];
    const TensorId lab = program.io.staged_labels[static_cast<size_t>(slot)];
    if (img == kNoTensor || lab == kNoTensor) continue;
    Staging& st = staging_[static_cast<size_t>(slot)];
    st.img_bytes = static_cast<size_t>(program.tensor(img).bytes());
    st.lab_bytes = static_cast<size_t>(program.tensor(lab).bytes());
    CUDA_CHECK(cudaHostAlloc(&st.host, st.img_bytes + st.lab_bytes, cudaHostAllocDefault));
    CUDA_CHECK(cudaEventCreateWithFlags(&st.copied, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&st.read, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&st.produced, cudaEventDisableTiming));
  }
}

void InputSlots::release() {
  jpeg_.reset();  // it waits for its last batch; its buffers go before the streams
  for (Staging& st : staging_) {
    if (st.host) warn("cudaFreeHost", cudaFreeHost(st.host));
    if (st.dev_u8) warn("cudaFree", cudaFree(st.dev_u8));
    for (cudaEvent_t ev : {st.copied, st.read, st.produced}) {
      if (ev) warn("cudaEventDestroy", cudaEventDestroy(ev));
    }
    st = Staging{};
  }
}

void InputSlots::wait_for_copies(cudaStream_t s, const std::array<bool, 2>& reads_slot) {
  for (int slot = 0; slot < 2; ++slot) {
    Staging& st = staging_[static_cast<size_t>(slot)];
    if (reads_slot[static_cast<size_t>(slot)] && st.copy_pending)
      CUDA_CHECK(cudaStreamWaitEvent(s, st.copied, 0));
  }
}

void InputSlots::record_reads(cudaStream_t s, const std::array<bool, 2>& reads_slot) {
  for (int slot = 0; slot < 2; ++slot) {
    Staging& st = staging_[static_cast<size_t>(slot)];
    if (reads_slot[static_cast<size_t>(slot)] && st.read) {
      CUDA_CHECK(cudaEventRecord(st.read, s));
      st.read_recorded = true;
    }
  }
}

void InputSlots::copy_in(void* device, void* pinned, const void* batch, size_t bytes,
                         cudaStream_t s) {
  // Pieces of 8 MB: ResNet-50's float batch in 19, each copied by every thread at once.
  constexpr size_t kPiece = size_t{8} << 20;
  const int threads = ctx_.opts.stage_copy_threads;
  const size_t piece = ctx_.opts.stage_in_pieces ? kPiece : bytes;
  double seconds = 0;
  for (size_t at = 0; at < bytes; at += piece) {
    const size_t n = std::min(piece, bytes - at);
    const auto t0 = std::chrono::steady_clock::now();
    parallel_copy(static_cast<uint8_t*>(pinned) + at, static_cast<const uint8_t*>(batch) + at, n,
                  threads);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(device) + at,
                               static_cast<uint8_t*>(pinned) + at, n, cudaMemcpyHostToDevice, s));
  }
  decoded_.host_batches += 1;
  decoded_.host_copy_seconds += seconds;
}

void InputSlots::stage_batch(int slot, const float* images, const int32_t* labels) {
  KILN_CHECK(ctx_.program != nullptr, State, "cuda backend: stage_batch() before prepare()");
  KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch: slot must be 0 or 1");
  const Program& p = *ctx_.program;
  Staging& st = staging_[static_cast<size_t>(slot)];
  KILN_CHECK(st.host != nullptr, State, "stage_batch: the program has no staged input slot ", slot);
  // The pinned buffer is free once its previous copy ended (normally long ago).
  CUDA_CHECK(cudaEventSynchronize(st.copied));
  cudaStream_t s = ctx_.streams[2].stream;
  if (st.read_recorded) CUDA_CHECK(cudaStreamWaitEvent(s, st.read, 0));
  copy_in(address(p.tensor(p.io.staged_images[static_cast<size_t>(slot)])), st.host, images,
          st.img_bytes, s);
  std::memcpy(static_cast<uint8_t*>(st.host) + st.img_bytes, labels, st.lab_bytes);
  CUDA_CHECK(cudaMemcpyAsync(address(p.tensor(p.io.staged_labels[static_cast<size_t>(slot)])),
                             static_cast<uint8_t*>(st.host) + st.img_bytes, st.lab_bytes,
                             cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaEventRecord(st.copied, s));
  st.copy_pending = true;
}

// The bytes go through the slot's pinned buffer (a quarter of its size is used) into a
// device copy, which a kernel normalises into the slot once the slot's last reader is done.
void InputSlots::stage_batch_u8(int slot, const uint8_t* images, const int32_t* labels,
                                const InputNormalization& norm, const SampleAugment* augments) {
  KILN_CHECK(ctx_.program != nullptr, State, "cuda backend: stage_batch_u8() before prepare()");
  KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch_u8: slot must be 0 or 1");
  const Program& p = *ctx_.program;
  Staging& st = staging_[static_cast<size_t>(slot)];
  KILN_CHECK(st.host != nullptr, State, "stage_batch_u8: the program has no staged input slot ",
             slot);
  const DTensor& t = p.tensor(p.io.staged_images[static_cast<size_t>(slot)]);
  const int64_t channels = static_cast<int64_t>(norm.mean.size());
  KILN_CHECK(channels > 0 && t.numel() % channels == 0, InvalidArgument,
             "stage_batch_u8: ", channels, " channel statistics for an input of ", t.numel(),
             " values");
  const NormParams np = make_norm_params(norm, channels, "stage_batch_u8");
  const auto bytes = static_cast<size_t>(t.numel());
  if (!st.dev_u8) CUDA_CHECK(cudaMalloc(&st.dev_u8, bytes));
  CUDA_CHECK(cudaEventSynchronize(st.copied));  // the pinned buffer's previous copy
  cudaStream_t s = ctx_.streams[2].stream;
  copy_in(st.dev_u8, st.host, images, bytes, s);
  std::memcpy(static_cast<uint8_t*>(st.host) + st.img_bytes, labels, st.lab_bytes);
  if (st.read_recorded) CUDA_CHECK(cudaStreamWaitEvent(s, st.read, 0));
  if (augments) {
    KILN_CHECK(t.shape.rank() == 4 && t.shape[3] == channels, InvalidArgument,
               "stage_batch_u8: augmented samples need an NHWC input of ", channels, " channels");
    augment_stage().stage_u8(static_cast<uint8_t*>(st.dev_u8), augments, t.shape[0], t.shape[1],
                             t.shape[2], np, address(t), t.dtype, s);
  } else {
    launch_normalize_u8(static_cast<const uint8_t*>(st.dev_u8), t.numel() / channels, np,
                        address(t), t.dtype, s);
  }
  CUDA_CHECK(cudaMemcpyAsync(address(p.tensor(p.io.staged_labels[static_cast<size_t>(slot)])),
                             static_cast<uint8_t*>(st.host) + st.img_bytes, st.lab_bytes,
                             cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaEventRecord(st.copied, s));
  st.copy_pending = true;
}

// The copy (or, for U8, the normalising kernel, reading the caller's bytes in place) goes on
// the transfer stream after the producer's work and the slot's last reader, as the host forms do.
void InputSlots::stage_batch_device(int slot, const DeviceBatch& b,
                                    const InputNormalization* norm) {
  KILN_CHECK(ctx_.program != nullptr, State, "cuda backend: stage_batch_device() before prepare()");
  KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch_device: slot must be 0 or 1");
  const Program& p = *ctx_.program;
  Staging& st = staging_[static_cast<size_t>(slot)];
  KILN_CHECK(st.host != nullptr, State, "stage_batch_device: the program has no staged input slot ",
             slot);
  KILN_CHECK(b.device == device_, InvalidArgument,
             "stage_batch_device: the batch is on cuda:", b.device,
             " but the engine runs on cuda:", device_,
             "; move it there first (tensor.to('cuda:", device_, "'))");
  KILN_CHECK(b.images != nullptr && b.labels != nullptr, InvalidArgument,
             "stage_batch_device: the batch needs its images and labels");
  const DTensor& t = p.tensor(p.io.staged_images[static_cast<size_t>(slot)]);
  const DTensor& lt = p.tensor(p.io.staged_labels[static_cast<size_t>(slot)]);
  KILN_CHECK(lt.dtype == DType::I32, Internal, "stage_batch_device: labels are ",
             dtype_name(lt.dtype), ", not I32");
  const int64_t n = lt.numel(), per = t.numel() / n, count = b.count == 0 ? n : b.count;
  KILN_CHECK(count > 0 && count <= n, InvalidArgument, "stage_batch_device: ", count,
             " samples for a step compiled for a batch of ", n);
  KILN_CHECK(b.dtype == t.dtype || b.dtype == DType::U8, InvalidArgument,
             "stage_batch_device: images are ", dtype_name(b.dtype), " but the step's input is ",
             dtype_name(t.dtype), "; pass ", dtype_name(t.dtype), " or uint8 (U8) images");
  KILN_CHECK(b.label_dtype == DType::I32 || b.label_dtype == DType::I64, InvalidArgument,
             "stage_batch_device: labels are ", dtype_name(b.label_dtype),
             "; they must be int32 or int64");
  const auto classes = static_cast<int32_t>(p.num_classes);
  NormParams np;
  if (b.dtype == DType::U8) {
    KILN_CHECK(norm != nullptr, InvalidArgument,
               "stage_batch_device: uint8 images need their normalisation");
    np = make_norm_params(*norm, t.shape[t.shape.rank() - 1], "stage_batch_device");
  }
  if (!b.labels_on_device) {
    // Host labels go through the slot's pinned buffer, which is free once its last copy ended.
    CUDA_CHECK(cudaEventSynchronize(st.copied));
    auto* dst = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(st.host) + st.img_bytes);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = i >= count                    ? -1
                        : b.label_dtype == DType::I32 ? static_cast<const int32_t*>(b.labels)[i]
                                                      : static_cast<const int64_t*>(b.labels)[i];
      KILN_CHECK(i >= count || (v >= 0 && v < classes), InvalidArgument,
                 "stage_batch_device: label ", v, " at index ", i, " is outside 0..", classes - 1);
      dst[i] = static_cast<int32_t>(v);
    }
  }
  cudaStream_t s = ctx_.streams[2].stream;
  const auto producer = reinterpret_cast<cudaStream_t>(b.stream);
  if (!b.ordered) {
    CUDA_CHECK(cudaEventRecord(st.produced, producer));
    CUDA_CHECK(cudaStreamWaitEvent(s, st.produced, 0));
  }
  if (st.read_recorded) CUDA_CHECK(cudaStreamWaitEvent(s, st.read, 0));
  uint8_t* img = address(t);
  const size_t elem = dtype_size(t.dtype);
  if (b.dtype == DType::U8) {
    launch_normalize_u8(static_cast<const uint8_t*>(b.images), count * per / np.channels, np, img,
                        t.dtype, s);
  } else {
    CUDA_CHECK(cudaMemcpyAsync(img, b.images, static_cast<size_t>(count * per) * elem,
                               cudaMemcpyDeviceToDevice, s));
  }
  if (count < n) {
    CUDA_CHECK(cudaMemsetAsync(img + static_cast<size_t>(count * per) * elem, 0,
                               static_cast<size_t>((n - count) * per) * elem, s));
  }
  if (b.labels_on_device) {
    launch_stage_labels(b.labels, b.label_dtype, count, n, classes,
                        reinterpret_cast<int32_t*>(address(lt)), s);
  } else {
    CUDA_CHECK(cudaMemcpyAsync(address(lt), static_cast<uint8_t*>(st.host) + st.img_bytes,
                               st.lab_bytes, cudaMemcpyHostToDevice, s));
  }
  CUDA_CHECK(cudaEventRecord(st.copied, s));
  st.copy_pending = true;
  if (!b.ordered) CUDA_CHECK(cudaStreamWaitEvent(producer, st.copied, 0));
}
DeviceStaging InputSlots::device_staging() const {
  DeviceStaging d;
  d.device = device_;
  d.stream = ctx_.program ? reinterpret_cast<uintptr_t>(ctx_.streams[2].stream) : 0;
  return d;
}

bool InputSlots::decodes_jpeg(std::string* why_not) const {
  return JpegStage::available(jpeg_options(), why_not);
}

// Decodes go first on the transfer stream (they touch only the stage's own buffers, so they
// may run while the step still reads the slot); the kernel that writes the slot waits for
// the slot's last reader.
void InputSlots::stage_batch_encoded(int slot, const EncodedBatch& batch,
                                     const InputNormalization& norm) {
  KILN_CHECK(ctx_.program != nullptr, State,
             "cuda backend: stage_batch_encoded() before prepare()");
  KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch_encoded: slot must be 0 or 1");
  const Program& p = *ctx_.program;
  Staging& st = staging_[static_cast<size_t>(slot)];
  KILN_CHECK(st.host != nullptr, State,
             "stage_batch_encoded: the program has no staged input slot ", slot);
  const DTensor& t = p.tensor(p.io.staged_images[static_cast<size_t>(slot)]);
  const DTensor& lt = p.tensor(p.io.staged_labels[static_cast<size_t>(slot)]);
  KILN_CHECK(batch.batch * batch.height * batch.width * batch.channels == t.numel() &&
                 lt.numel() == batch.batch,
             InvalidArgument, "stage_batch_encoded: a batch of ", batch.batch, " x ", batch.height,
             "x", batch.width, "x", batch.channels, " for an input slot of ", t.numel(),
             " values and ", lt.numel(), " labels");
  KILN_CHECK(lt.dtype == DType::I32, Internal, "stage_batch_encoded: labels are ",
             dtype_name(lt.dtype), ", not I32");
  const NormParams np = make_norm_params(norm, batch.channels, "stage_batch_encoded");
  const auto t0 = std::chrono::steady_clock::now();
  if (!jpeg_) jpeg_ = std::make_unique<JpegStage>(jpeg_options());
  cudaStream_t s = ctx_.streams[2].stream;
  const JpegStage::Prepared prep = jpeg_->prepare(batch, s);
  if (st.read_recorded) CUDA_CHECK(cudaStreamWaitEvent(s, st.read, 0));
  augment_stage().stage_encoded(prep.descs, batch, np, address(t), t.dtype, s);
  CUDA_CHECK(cudaMemcpyAsync(address(lt), prep.labels, static_cast<size_t>(lt.bytes()),
                             cudaMemcpyHostToDevice, s));
  jpeg_->finished(s);
  CUDA_CHECK(cudaEventRecord(st.copied, s));
  st.copy_pending = true;
  decoded_.hardware += prep.counts.hardware;
  decoded_.gpu_hybrid += prep.counts.gpu_hybrid;
  decoded_.host += prep.counts.host;
  decoded_.batches += 1;
  decoded_.copy_seconds += prep.counts.copy_seconds;
  decoded_.parse_seconds += prep.counts.parse_seconds;
  decoded_.engine_call_seconds += prep.counts.engine_call_seconds;
  decoded_.hybrid_seconds += prep.counts.hybrid_seconds;
  decoded_.host_decode_seconds += prep.counts.host_decode_seconds;
  decoded_.stage_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

JpegStageOptions InputSlots::jpeg_options() const {
  return JpegStageOptions{ctx_.opts.nvjpeg, ctx_.opts.nvjpeg_hardware, ctx_.opts.nvjpeg_roi,
                          ctx_.opts.nvjpeg_cache};
}

uint8_t* InputSlots::address(const DTensor& t) {
  return ctx_.address(t);
}

}  // namespace kiln::cuda
