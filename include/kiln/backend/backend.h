// Backend: runs a compiled Program on a device. The CPU backend (oneDNN + loops) and the
// CUDA backend (cuDNN frontend, cuBLASLt, own kernels, CUDA Graphs) implement it; neither
// includes the other. A backend allocates one buffer per region in prepare() and nothing
// after it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/switches.h"
#include "kiln/data/input_batch.h"
#include "kiln/graph/program.h"

namespace kiln {

struct BackendCaps {
  std::string device;  // "cpu (oneDNN 2.6)", "NVIDIA H200"
  bool fp16 = false;   // AMP with FP16 compute
  bool bf16 = false;
  bool fused_cbr = false;       // cbr_fwd / cbr_bwd
  bool fused_cbr_pool = false;  // cbr_pool_fwd / cbr_pool_bwd
  // ... with a pool whose windows overlap or are padded (ops.def's byte-per-pooled-element mask)
  bool fused_overlapping_pool = false;
  // bn_add_relu_fwd with the residual's BatchNorm applied on the fly (ops.def's gamma2 ...)
  bool fused_residual_bn = false;
  bool fused_bn_add_relu = false;
  bool fused_fp32 = false;           // the fused kernels run in FP32 too (not only under AMP)
  bool fused_grad_sum = false;       // bn_add_relu_bwd takes a second gradient (dy2, ops.def)
  bool fp32_fusion_default = false;  // fuse in FP32 unless asked not to (Switches::fuse_fp32)
};

// How the last prepare() chose its kernels, for the tools to print; a backend without such
// choices (the CPU) leaves it empty (`chooses_engines` false).
struct CompileReport {
  bool chooses_engines = false;
  // Convolution plans: from the experience table, timed while compiling (a graph
  // the table lacks; `remembered` of them timed by an earlier compile or the autotune cache),
  // left to cuDNN's heuristics; `table` is the file consulted or written (empty when none).
  int from_table = 0, heuristics = 0, autotuned = 0, remembered = 0;
  std::string table;
  int cbr_genstats = 0, cbr_fallbacks = 0;  // fused CBR forwards as conv+genstats / kiln's form
  int cbr_cutlass = 0, cbr_cutlass_fallbacks = 0;  // KILN_CUTLASS: on the SM90 GEMM / not
  int cbr_cutlass_conv = 0;  // of those two, on the implicit-GEMM convolution (3x3 layers ...)
  int conv_cutlass = 0, conv_cutlass_fallbacks = 0;    // conv before BN+add+ReLU, likewise
  int dgrad_cutlass = 0, dgrad_cutlass_fallbacks = 0;  // KILN_CUTLASS_DGRAD: data gradients
  int dgrad_cutlass_conv = 0;      // of dgrad_cutlass, on the implicit-GEMM data gradient (3x3 ...)
  int dgrad_cutlass_wide = 0;      // of those, on the 256x128 unit (KILN_CONV_DGRAD_WIDE_TILE)
  int dgrad_cutlass_pingpong = 0;  // of those, on a ping-pong unit (KILN_CONV_DGRAD_PINGPONG)
  // KILN_CUTLASS_TIMED: layers whose SM90-or-cuDNN choice was timed (or found timed), and of
  // those how many kept cuDNN with kiln's pass (counted in the *_fallbacks above too).
  int sm90_timed = 0, sm90_timed_today = 0;
  int sm90_timed_now = 0;  // of sm90_timed, timed by this compile (not found in a table or cache)
  // KILN_PAD_CHANNELS: convolution kernels (forward, data or weight gradient) on channel-padded
  // copies, and of the paddable ones under auto how many were timed or found timed.
  int convs_padded = 0, pad_timed = 0;
  // KILN_PAD_INPUT_ONCE: weight gradients reading their forward's padded copy of x
  int pad_copies_shared = 0;
  int fixed_channels_convs = 0;  // KILN_FIXED_CHANNELS_CONV: padded forwards on CUTLASS's unit
  int first_layer_convs = 0;     // KILN_FIRST_LAYER_CONV: CBR forwards on the direct convolution
  int first_layer_wgrads = 0;    // KILN_FIRST_LAYER_WGRAD: weight gradients on the direct kernel
  int first_layer_bn_folds = 0;  // KILN_FIRST_LAYER_BN_FOLD: of those, forming dz themselves
  int side_stream_wgrads = 0;    // weight gradients forked onto the side stream
  // KILN_RESIDUAL_BN_SUMS_IN_DX: shortcut BatchNorm backwards summed in the dx pass before them
  int residual_bn_sums_in_dx = 0;
  int fp32_transformed_plans = 0;  // FP32 convolutions on Winograd or FFT engines
};

// A batch already in device memory (a CUDA tensor handed over through DLPack, or a C++
// caller's buffer), for Backend::stage_batch_device: copied device to device into the input
// slot, so bytes that are on the GPU never travel through the host.
struct DeviceBatch {
  const void* images = nullptr;    // NHWC, dense, on `device`
  DType dtype = DType::F32;        // F32, or U8 (normalised on the device with the given norm)
  const void* labels = nullptr;    // `count` labels
  DType label_dtype = DType::I32;  // I32 or I64
  bool labels_on_device = false;   // else host memory
  int64_t count = 0;  // valid samples, 0 = the whole batch; the rest of the slot is zero, label -1
  int device = 0;     // the CUDA device ordinal images (and device labels) live on
  // The stream (a cudaStream_t as an integer, 0 = the legacy default stream) whose queued work
  // writes the batch: staging waits for it, and it then waits for the copy, so what it enqueues
  // next may overwrite the buffer. `ordered`: the producer has already ordered its writes before
  // the staging stream (DLPack's __dlpack__(stream=staging().stream)), nothing to wait for.
  uintptr_t stream = 0;
  bool ordered = false;
};

// Where stage_batch_device reads from: the CUDA device the backend runs on (-1: it reads host
// memory only) and, after prepare(), the stream its staging runs on, which a DLPack producer is
// handed so that it orders its pending writes before the copy.
struct DeviceStaging {
  int device = -1;
  uintptr_t stream = 0;
};

// Which list of phases to run.
enum class Schedule : uint8_t { train, eval, eval_ema, init };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual BackendCaps caps() const = 0;
  // Whether the backend has a kernel for this op at this feature dtype.
  virtual bool supports(OpKind op, DType feature_dtype) const = 0;

  // Allocates the regions (zero-filled) and prepares every node of every phase. The
  // program must outlive the backend. Throws Unsupported for an op it cannot run.
  virtual void prepare(const Program& program) = 0;

  // An evaluation variant (Engine::eval_variant) computes with its training engine's weights in
  // place. region_memory: where region r lies after prepare() (null when the program has none).
  // share_region, before prepare(): region r is `memory` (`bytes` long; another backend's region,
  // of this kind and on this device, which outlives this one) rather than an allocation of this
  // backend's; prepare() neither allocates nor zeroes it, and nothing here frees it.
  virtual uint8_t* region_memory(Region r) const = 0;
  virtual void share_region(Region r, uint8_t* memory, int64_t bytes) = 0;

  // Runs a schedule. For train, `slot` (0 = A, 1 = B) picks the staged batch.
  virtual void run(Schedule schedule, int slot = 0) = 0;

  // Host access, in the tensor's own dtype and byte size (t.bytes()). Synchronous.
  virtual void write(const DTensor& t, const void* host) = 0;
  virtual void read(const DTensor& t, void* host) = 0;
  // Stages a batch into input slot A/B; may return before the copy ends (the CUDA backend
  // overlaps it with the running step) — the next run(train, slot) waits for it.
  virtual void stage_batch(int slot, const float* images, const int32_t* labels) = 0;
  // The same from uint8 NHWC pixels (a quarter of the bytes), normalised where they land: the
  // CUDA backend copies the bytes and normalises on its transfer stream, the CPU backend in its
  // staging pass. `norm` has one mean and std per channel. `augments`: null, or one per sample
  // of the batch, applied there too (augment_normalize_u8).
  virtual void stage_batch_u8(int slot, const uint8_t* images, const int32_t* labels,
                              const InputNormalization& norm,
                              const SampleAugment* augments = nullptr) = 0;
  // Whether stage_batch_encoded decodes JPEGs on the device (CUDA builds with nvJPEG on a GPU
  // that runs it); the reason when not, for the line the trainer prints.
  virtual bool decodes_jpeg(std::string* why_not = nullptr) const {
    if (why_not) *why_not = std::string(name()) + " backend has no JPEG decoder";
    return false;
  }
  // Decodes, crops, resizes, flips, augments (each image's SampleAugment) and normalises an
  // encoded batch into input slot A/B on the device (hardware JPEG engines where the GPU has
  // them, else its CUDA cores; what nvJPEG refuses goes through batch.host_decode). Returns
  // before the work ends, as stage_batch.
  virtual void stage_batch_encoded(int slot, const EncodedBatch& batch,
                                   const InputNormalization& norm) {
    (void)slot, (void)batch, (void)norm;
    KILN_FAIL(Unsupported, name(), " backend cannot decode JPEGs; use --decode cpu");
  }
  virtual DecodeCounters decode_counters() const { return {}; }
  // Stages a batch that is already on the device into input slot A/B, after `batch.stream`'s
  // work (see DeviceBatch); `norm` for U8. Returns before the copy ends, as stage_batch. A
  // backend that reads host memory only refuses it.
  virtual void stage_batch_device(int slot, const DeviceBatch& batch,
                                  const InputNormalization* norm) {
    (void)slot, (void)batch, (void)norm;
    KILN_FAIL(Unsupported, name(),
              " backend reads host memory only, and the batch is in CUDA memory (device ",
              batch.device,
              "); pass a CPU tensor (tensor.cpu()), or make the engine with device=\"cuda\"");
  }
  virtual DeviceStaging device_staging() const { return {}; }
  virtual void synchronize() = 0;

  // Reads that do not stop the device (the training loop's statistics: no host wait
  // inside a step). read_later copies t - a scalar or a few of them, at most kLateReadBytes -
  // once every run() and write() enqueued before it has finished, into storage the backend
  // owns, and returns a ticket; collect(ticket, host) waits for that copy alone and hands its
  // bytes over. Tickets are collected in any order, each once, while fewer than
  // kLateReadSlots newer ones have been issued. A backend that runs synchronously reads at once.
  static constexpr int64_t kLateReadBytes = 64;
  static constexpr uint64_t kLateReadSlots = 64;
  virtual uint64_t read_later(const DTensor& t) = 0;
  virtual void collect(uint64_t ticket, void* host) = 0;

  // Timings for `kiln train --profile` (Switches::profile): from the next run() on, the backend
  // records where the time goes (CPU: per op kind; CUDA: per phase, from CUDA events), and
  // profile_report() prints it (empty when profiling is off).
  virtual void set_profiling(bool on) { (void)on; }
  virtual std::string profile_report() { return {}; }

  virtual CompileReport compile_report() const { return {}; }
  // Starts / stops the range an external profiler records (CUDA: cudaProfilerStart/Stop, for
  // `ncu --profile-from-start off`): the timed steps only, not compilation or warm-up.
  virtual bool has_profiler_range() const { return false; }
  virtual void profiler_range(bool on) {
    (void)on;
    KILN_FAIL(Unsupported, "the ", name(), " backend has no profiler range; use --device cuda");
  }
};

// "cpu" or "cuda"; "auto" = cuda when a GPU is present, else cpu. The backend keeps the
// switches it is given (switches.def); nothing below reads the environment.
std::unique_ptr<Backend> make_backend(const std::string& device,
                                      const Switches& switches = Switches::from_environment());
bool cuda_available();

// x = (p / 255 - mean[c]) / std[c] over `pixels` pixels of norm.mean.size() channels: the
// host's normalisation of uint8 input (the CPU backend's staging; tests' reference).
void normalize_u8(const uint8_t* in, int64_t pixels, const InputNormalization& norm, float* out);
// The same for a batch of h x w x c samples, each with its value augmentations (`augments`,
// `batch` entries, sample_augment.h): the ops on a copy of its bytes, then the normalisation,
// then its erase box. The CPU backend's staging, and the reference of the CUDA kernels.
void augment_normalize_u8(const uint8_t* in, int64_t batch, int64_t h, int64_t w, int64_t c,
                          const SampleAugment* augments, const InputNormalization& norm,
                          float* out);

// Float helpers over read()/write() that convert from/to the tensor's dtype (F32/F16/BF16).
std::vector<float> read_floats(Backend& backend, const DTensor& t);
void write_floats(Backend& backend, const DTensor& t, const std::vector<float>& values);

}  // namespace kiln
