// What every CUDA kernel file shares: the check macros (a failed call or launch throws
// kiln::Error(Backend) naming the call, the file and the line), the execution Context
// (region base pointers, streams with their cuDNN / cuBLASLt handles and workspaces), the
// Kernel interface and one factory per op of ops.def (mirroring src/backend/cpu/cpu_kernel.h).
//
// Lifetime: factories run in prepare(); they check the node, build plans and record how
// much per-stream workspace they need. The workspaces and region buffers are allocated once,
// after every factory ran; Kernel::run() only enqueues work on its stream (no allocation, no
// host synchronisation), so it can be captured into a CUDA Graph.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/node_checks.h"
#include "kiln/backend/engine_table.h"
#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/core/switches.h"
#include "kiln/graph/program.h"

namespace kiln::cuda {

[[noreturn]] void throw_cuda(const char* call, cudaError_t e, const char* file, int line);
[[noreturn]] void throw_cudnn(const char* call, cudnnStatus_t e, const char* file, int line);
[[noreturn]] void throw_cublas(const char* call, cublasStatus_t e, const char* file, int line);

}  // namespace kiln::cuda

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    const cudaError_t kiln_e_ = (call);                                                       \
    if (kiln_e_ != cudaSuccess) ::kiln::cuda::throw_cuda(#call, kiln_e_, __FILE__, __LINE__); \
  } while (0)
#define CUDNN_CHECK(call)                                            \
  do {                                                               \
    const cudnnStatus_t kiln_e_ = (call);                            \
    if (kiln_e_ != CUDNN_STATUS_SUCCESS)                             \
      ::kiln::cuda::throw_cudnn(#call, kiln_e_, __FILE__, __LINE__); \
  } while (0)
#define CUBLAS_CHECK(call)                                            \
  do {                                                                \
    const cublasStatus_t kiln_e_ = (call);                            \
    if (kiln_e_ != CUBLAS_STATUS_SUCCESS)                             \
      ::kiln::cuda::throw_cublas(#call, kiln_e_, __FILE__, __LINE__); \
  } while (0)
// After every kernel launch: a bad configuration shows up here, not three launches later.
#define KILN_LAUNCH_CHECK(what) CUDA_CHECK((static_cast<void>(what), cudaGetLastError()))

namespace kiln::cuda {

inline constexpr int kStreams = 3;  // Phase::stream: 0 compute, 1 update, 2 transfer
inline constexpr double kAutotuneReportSeconds = 15;  // a progress line per this much autotuning

enum class Fp32Winograd { off, allowed, only };

// The CUDA backend's switches (switches.def) in the form its kernels use.
struct Options {
  bool graphs = true;   // KILN_CUDA_GRAPHS=0: launch node by node
  bool streams = true;  // KILN_STREAMS=1 (or 0): everything on one stream
  bool tf32 = false;    // KILN_TF32=1: allow TF32 in FP32 convolutions and matmuls
  // KILN_FP32_WINOGRAD: whether FP32 convolutions may take Winograd and FFT engines, whose
  // sums are formed in a transformed domain and so rounded differently. 1 (the default, as in
  // PyTorch, which lets cuDNN take them): allowed; autotuning takes them where they are
  // fastest, and the FP32 tests hold them to the same 1e-5 as direct sums. 0: refused (direct
  // sums only). only: Winograd / FFT engines alone wherever cuDNN has one (tests; layers
  // without one take the allowed set).
  Fp32Winograd fp32_winograd = Fp32Winograd::allowed;
  // KILN_SIDE_WGRAD=1: weight gradients on the side stream (side_stream.h); opt-in, as it
  // measured no faster (bench/RESULTS.md).
  bool side_wgrad = false;
  // KILN_AUTOTUNE_CACHE: where autotuning's results persist between processes (engine_table.h's
  // autotune_cache_dir: empty = none).
  std::string autotune_cache;
  bool profile = false;      // KILN_PROFILE=1: per-phase event timings
  bool profile_ops = false;  // KILN_PROFILE_OPS=1: per-op event timings too
  // KILN_STAGE_COPY_THREADS, resolved (host_copy.h): threads that copy a host batch into its
  // pinned staging buffer (input_slots.cpp).
  int stage_copy_threads = 1;
  bool stage_in_pieces = true;  // KILN_STAGE_IN_PIECES: the copy and transfer piece by piece
  bool vector_kernels = true;   // KILN_VECTOR_KERNELS=0: one element per thread, no 16-byte paths
  // KILN_BN_FUSED_FINALIZE: a BatchNorm whose sums a kernel before it took finalizes inside its
  // 16-byte apply or dx pass (bn.cu), the same bits without a launch of its own.
  bool bn_fused_finalize = false;
  // KILN_SUMS_CLEAR_KERNEL: the SM90 units clear the sums they add into with a kernel of their
  // own rather than cudaMemsetAsync (cutlass/column_sums.cuh).
  bool sums_clear_kernel = true;
  // KILN_RESIDUAL_BN_SUMS_IN_DX: a BN+add+ReLU backward whose dresidual feeds the shortcut's
  // BatchNorm backward sums it in its dx pass (bn.cu), and that backward finalizes from them.
  bool residual_bn_sums_in_dx = true;
  // KILN_DGRAD_NO_DY2: a CBR's SM90 data gradient on the units without dy2's staging
  // (cutlass/dgrad_bn.h's *_NODY2 lists).
  bool dgrad_no_dy2 = true;
  // KILN_CONV_DGRAD_WIDE_TILE: a CBR's implicit-GEMM data gradient with >= 128 channels on the
  // 256x128 unit (cutlass/dgrad_bn.h's conv_dgrad_bn_kernel_for).
  bool conv_dgrad_wide_tile = false;
  // KILN_CONV_DGRAD_PINGPONG: a CBR's implicit-GEMM data gradient on the ping-pong units
  // (likewise).
  bool conv_dgrad_pingpong = false;
  // KILN_POOL_ROUTE_EAGER: the overlapping pool's backward gather loads dy beside the mask
  // (pool_route.cuh's routed_grad_unrolled).
  bool pool_route_eager = true;
  // KILN_POOL_GROUP_APPLY: a 2x2 pool's apply pass on apply_relu_pool2_group (bn_kernels.cuh).
  bool pool_group_apply = true;
  // KILN_BN_DEEP_LOADS: apply_group and bwd_dx_group with four rows in flight (bn.cu's group_plan).
  bool bn_deep_loads = true;
  // KILN_PAD_CHANNELS: FP16/BF16 convolutions whose input channels are neither 4 nor a multiple
  // of 8 run on zero-padded copies (conv.cpp): on, off, or auto, the faster per convolution
  // (padding every such layer to 8 measured slower, bench/RESULTS.md's fourth session).
  Auto pad_channels = Auto::automatic;
  // KILN_PAD_INPUT_ONCE: a weight gradient reads the channel-padded copy of x its forward fills
  // each step instead of padding x again (conv.cpp).
  bool pad_input_once = true;
  // KILN_FIXED_CHANNELS_CONV: a padded forward may run on CUTLASS's fixed-channels unit (conv.cpp).
  Auto fixed_channels_conv = Auto::off;
  // KILN_FIRST_LAYER_CONV: a first layer's CBR forward on the direct kernel (fused.cpp).
  Auto first_layer_conv = Auto::automatic;
  // KILN_FIRST_LAYER_WGRAD: a first layer's weight gradient on the direct kernel (conv.cpp).
  Auto first_layer_wgrad = Auto::automatic;
  // KILN_FIRST_LAYER_BN_FOLD: that weight gradient forming dz from BatchNorm's backward
  // (first_layer_bwd.cpp), whose dx pass then goes.
  Auto first_layer_bn_fold = Auto::automatic;
  // KILN_CBR_FORM: how the fused CBR forward takes BatchNorm's statistics. "kiln" (the
  // default): a plain cuDNN convolution, then kiln's statistics pass over z; "genstats": the
  // MLPerf-style form, one cuDNN graph conv_fprop + genstats (fused.cpp), which falls back
  // to "kiln" per layer where cuDNN has no engine for it.
  bool cbr_genstats = false;
  // KILN_CUTLASS: a CBR forward whose convolution is 1x1, stride 1, FP16 with channels in
  // multiples of 8 (and such a conv_fwd before a bn_add_relu_fwd: a bottleneck's conv3) runs it
  // on kiln's SM90 CUTLASS GEMM (cutlass_conv.cpp), whose epilogue also sums z per channel, so
  // BatchNorm skips its statistics pass; other layers keep their form. auto (the default): under
  // AMP on an SM90 GPU with the kernels built; prepare() resolves it into Context::cutlass.
  Auto cutlass = Auto::automatic;
  // KILN_CUTLASS_DGRAD: a data gradient of such a convolution whose output is the gradient at a
  // later BatchNorm's ReLU (cbr_bwd, bn_add_relu_bwd: a bottleneck's conv3 and conv1) runs on
  // kiln's SM90 kernel that also forms BatchNorm's masked gradient and its two sums
  // (cutlass_dgrad.cpp), so that BatchNorm backward skips its sums pass. auto (the default):
  // where KILN_CUTLASS is (sm90_dgrad_tried); prepare() resolves it into Context::cutlass_dgrad.
  Auto cutlass_dgrad = Auto::automatic;
  // KILN_CUTLASS_CONV: a CBR forward whose FP16 convolution is not the GEMM's 1x1 (VGG's and
  // ResNet-50's 3x3 layers) runs it on kiln's SM90 implicit-GEMM convolution with the same
  // statistics epilogue (cutlass_conv.cpp); auto: as kCutlassConvByDefault says, where
  // KILN_CUTLASS is (sm90_implicit_conv_tried); prepare() resolves it into Context::cutlass_conv.
  Auto cutlass_conv = Auto::automatic;
  // KILN_CUTLASS_CONV_DGRAD: likewise a stride-1 data gradient of another filter size that
  // feeds a BatchNorm backward (VGG's 3x3 layers after a CBR) on kiln's SM90 implicit-GEMM data
  // gradient with the same epilogue (cutlass_dgrad.cpp); auto: as kCutlassConvDgradByDefault
  // says, where KILN_CUTLASS_DGRAD is; prepare() resolves it into Context::cutlass_conv_dgrad.
  Auto cutlass_conv_dgrad = Auto::automatic;
  // KILN_CUTLASS_TIMED: each of the four switches above left at auto tries its kernel on every
  // layer it can take, and the layer keeps the faster of it and today's form, timed while
  // compiling (timed_form.h); prepare() resolves it with them (sm90_forms). Not under
  // KILN_DETERMINISTIC.
  bool cutlass_timed = true;
  // KILN_DETERMINISTIC=1: refuse cuDNN engines noted NONDETERMINISTIC (atomics in weight
  // gradients), so a step gives the same bits every run. kiln's own kernels and cuBLASLt are
  // deterministic already (fixed-order partial sums; one algorithm chosen at compile time).
  bool deterministic = false;
  // KILN_ENGINE_TABLE: the engine experience table (engine_table.h). Unset: the file for this GPU
  // and cuDNN version under configs/engines, used when it exists; a path: that file (it must
  // exist); 0: off, every convolution takes cuDNN's heuristic choice.
  bool engine_table = true;
  std::string engine_table_path;
  // KILN_AUTOTUNE=0: a convolution graph the table lacks takes cuDNN's heuristic choice
  // instead of the fastest of a few engines timed while compiling (conv.cpp). On by default,
  // except under KILN_DETERMINISTIC (timing may choose differently from run to run).
  bool autotune = true;
  // KILN_TUNE=<file>: measure every engine of every convolution graph while compiling and
  // merge the three fastest of each into <file> (what `kiln tune` does).
  std::string tune_path;
  // The GPU JPEG decoder (jpeg_stage.h). KILN_NVJPEG=0: no nvJPEG, every image of an encoded
  // batch is decoded on the host (batch.host_decode) and only resampled on the GPU;
  // KILN_NVJPEG_HARDWARE=0: no hardware JPEG engines, nvJPEG's hybrid decoder for every image;
  // KILN_NVJPEG_ROI=0: decode whole images, not only the rows and columns the crop reads.
  // KILN_NVJPEG_CACHE=0: nvJPEG allocates through CUDA's own allocators (stream_ordered_cache.h).
  bool nvjpeg = true;
  bool nvjpeg_hardware = true;
  bool nvjpeg_roi = true;
  bool nvjpeg_cache = true;
};
Options options_from_switches(const Switches& switches);

// For release paths: prints a failed call instead of throwing.
inline void warn(const char* what, cudaError_t e) {
  if (e != cudaSuccess) std::fprintf(stderr, "kiln: %s failed: %s\n", what, cudaGetErrorString(e));
}

struct StreamRes {
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;   // shared by the nodes of this stream (they run in order)
  size_t workspace_bytes = 0;  // what the factories asked for (max over nodes)
};

// Bytes of one region that a node reads or writes (views resolved to their base).
struct ByteRange {
  Region region = Region::features;
  int64_t begin = 0, end = 0;
};
inline bool overlaps(const ByteRange& a, const ByteRange& b) {
  return a.region == b.region && a.begin < b.end && b.begin < a.end;
}

// Work forked to the side stream (side_stream.h) and not yet joined back: the event recorded
// after its last launch and the bytes it reads and writes.
struct SideWork {
  cudaEvent_t done = nullptr;
  std::vector<ByteRange> reads, writes;
};

class DeviceBuffer;

struct Context : ProgramView {
  Context() : ProgramView("CUDA") {}
  Options opts;
  int sm_count = 132;
  int cc_major = 0, cc_minor = 0;  // the device's compute capability
  std::array<uint8_t*, kRegionCount> base{};
  std::array<StreamRes, kStreams> streams{};
  // Plans shared by nodes of the same shape (cuDNN graphs, cuBLASLt algorithms), by key.
  std::unordered_map<std::string, std::shared_ptr<void>> plan_cache;
  // The experience table consulted while compiling (empty when off or absent), what tuning
  // measured, and how many convolution plans came from a table (or tuning), from timing a few
  // engines while compiling, or from cuDNN's heuristics.
  EngineTable engine_table;
  EngineTable tuned;
  int table_hits = 0, table_misses = 0, autotuned = 0;
  int autotune_remembered = 0;  // of `autotuned`: engines timed earlier (this process, the cache)
  // Wall time of building the convolution plans, and the part of it spent autotuning
  // (reported at compile's end: where a long compile goes).
  double plan_seconds = 0, autotune_seconds = 0;
  // Autotuning can take minutes on a first compile (FP32 VGG16-BN: ~90 s): a progress line
  // each time its total passes this mark, then the mark moves on by kAutotuneReportSeconds.
  double autotune_report_at = kAutotuneReportSeconds;
  // KILN_CBR_FORM=genstats: CBR forwards built as conv+genstats, and those that fell back.
  int cbr_genstats = 0, cbr_genstats_fallbacks = 0;
  // Whether this program's eligible layers try the SM90 CUTLASS GEMM: Options::cutlass resolved
  // by prepare() for the device, the build and the program's precision (sm90_conv_gemm_tried).
  bool cutlass = false;
  // CBR forwards on the SM90 CUTLASS GEMM, and those that tried it and kept their form.
  int cbr_cutlass = 0, cbr_cutlass_fallbacks = 0;
  // Whether other CBR forwards try the SM90 implicit-GEMM convolution (KILN_CUTLASS_CONV resolved
  // by prepare()), and how many of cbr_cutlass and conv_cutlass took it.
  bool cutlass_conv = false;
  int cbr_cutlass_conv = 0;
  // Likewise: conv_fwd nodes whose output a later bn_add_relu_fwd normalises (a
  // bottleneck's conv3) on the GEMM, those the GEMM could not take, and the sums each such
  // bn_add_relu_fwd node reads (set while its convolution is built, read when it is built).
  int conv_cutlass = 0, conv_cutlass_fallbacks = 0;
  std::unordered_map<const Node*, const float*> bn_add_relu_sums;
  // ... and where bn_add_relu_fwd also applies its residual's BatchNorm (KILN_FUSE_RESIDUAL_BN),
  // the sums of that residual (a downsampling shortcut's convolution on the SM90 kernels).
  std::unordered_map<const Node*, const float*> bn_add_relu_residual_sums;
  // Whether data gradients that feed a BatchNorm backward try the SM90 data gradient with its
  // sums (KILN_CUTLASS_DGRAD resolved by prepare(): sm90_dgrad_tried).
  bool cutlass_dgrad = false;
  // Data gradients on it, and those that tried it and kept their form; for each consuming
  // BatchNorm backward (cbr_bwd, bn_add_relu_bwd) the sums it reads in place of its sums pass
  // and the tensor holding g, which it reads in place of dy, dy2 and the mask (set while the data
  // gradient is built, read when the consumer is built).
  int dgrad_cutlass = 0, dgrad_cutlass_fallbacks = 0;
  // Whether other stride-1 data gradients try the implicit-GEMM form (KILN_CUTLASS_CONV_DGRAD
  // resolved by prepare()), and how many of dgrad_cutlass took it.
  bool cutlass_conv_dgrad = false;
  int dgrad_cutlass_conv = 0;
  int dgrad_cutlass_wide = 0;  // of dgrad_cutlass, on the 256x128 unit (KILN_CONV_DGRAD_WIDE_TILE)
  int dgrad_cutlass_pingpong = 0;  // likewise on a ping-pong unit (KILN_CONV_DGRAD_PINGPONG)
  // Which of the four families above choose per layer by timing (KILN_CUTLASS_TIMED), and of
  // the layers that did, how many kept today's form.
  bool cutlass_timed = false, cutlass_dgrad_timed = false, cutlass_conv_timed = false,
       cutlass_conv_dgrad_timed = false;
  int sm90_timed = 0, sm90_timed_today = 0, sm90_timed_now = 0;
  // KILN_PAD_CHANNELS: cuDNN convolution kernels running on channel-padded copies, and of the
  // paddable ones under auto how many had a timed (or recorded) choice.
  int convs_padded = 0, pad_timed = 0;
  // KILN_PAD_INPUT_ONCE: the padded copy of a convolution input that a kept forward kernel fills
  // each step (weak: a form built but not kept frees it), and the weight gradients that read one.
  std::unordered_map<TensorId, std::weak_ptr<DeviceBuffer>> padded_inputs;
  int pad_copies_shared = 0;
  int fixed_channels_convs = 0;  // KILN_FIXED_CHANNELS_CONV: padded forwards kept on CUTLASS
  int first_layer_convs = 0;     // KILN_FIRST_LAYER_CONV: CBR forwards on the direct kernel
  int first_layer_wgrads = 0;    // KILN_FIRST_LAYER_WGRAD: weight gradients on the direct kernel
  int first_layer_bn_folds = 0;  // KILN_FIRST_LAYER_BN_FOLD: of those, forming dz themselves
  struct DgradBnSums {
    const float* sums = nullptr;
    TensorId g = kNoTensor;
  };
  std::unordered_map<const Node*, DgradBnSums> dgrad_bn_sums;
  // KILN_RESIDUAL_BN_SUMS_IN_DX: for a shortcut's BatchNorm backward (bn_bwd), the double
  // partials of its sums that the BN+add+ReLU backward before it left in its dx pass
  // (bwd_partial_vec's layout: `blocks` rows of C), read in place of its own sums pass (set
  // while that BN+add+ReLU backward is built, read when the bn_bwd is); and how many did.
  struct ResidualBnPartials {
    const double2* partial = nullptr;
    int blocks = 0;
  };
  std::unordered_map<const Node*, ResidualBnPartials> residual_bn_partials;
  int residual_bn_sums_in_dx = 0;
  // Bytes a node's kernel reads and writes beyond its own tensors (a fused data gradient reads
  // the later BatchNorm's z, mask and saved, and may write its dresidual), for the side stream's
  // joins (side_stream.h): appended to the node's ranges by the executor.
  struct ExtraBytes {
    std::vector<ByteRange> reads, writes;
  };
  std::unordered_map<const Node*, ExtraBytes> extra_bytes;
  int fp32_transformed =
      0;  // FP32 convolution plans on Winograd / FFT engines (KILN_FP32_WINOGRAD)
  // The most workspace one convolution engine may ask for: set by prepare() from the device
  // memory left once the regions are allocated (the fastest FP32 engines of VGG16 at batch
  // 256 want several GiB; a fixed 1 GiB cap left only engines ~40x slower).
  int64_t workspace_cap = int64_t{1} << 30;
  // Weight gradients run on the side stream beside the data gradient and what follows it
  // (side_stream.h); set by prepare(). The forked work the executor has not joined yet.
  bool side_wgrad = false;
  int side_wgrads = 0;  // kernels built to fork there
  std::vector<SideWork> side_pending;

  // Device address of a tensor; valid once the regions are allocated (run time). Factories
  // call it too: regions are allocated before the factories run.
  template <typename T = void>
  T* ptr(TensorId id) const {
    if (id == kNoTensor) return nullptr;
    const DTensor& t = program->tensor(id);
    return reinterpret_cast<T*>(base[static_cast<size_t>(t.region)] + t.offset);
  }
  // The same from a tensor, checked: for the host-side copies (read, write, staging).
  uint8_t* address(const DTensor& t) const {
    KILN_CHECK(program != nullptr, State, "cuda backend: tensor access before prepare()");
    uint8_t* b = base[static_cast<size_t>(t.region)];
    KILN_CHECK(b != nullptr && t.offset >= 0, Internal, "tensor '", t.name, "' is not placed");
    return b + t.offset;
  }
  void need_workspace(int stream, size_t bytes) {
    StreamRes& s = streams[static_cast<size_t>(stream)];
    if (bytes > s.workspace_bytes) s.workspace_bytes = bytes;
  }
};

class Kernel {
 public:
  explicit Kernel(int stream) : stream_(stream) {}
  virtual ~Kernel() = default;
  virtual void run(Context& ctx) = 0;

 protected:
  cudaStream_t stream(const Context& ctx) const {
    return ctx.streams[static_cast<size_t>(stream_)].stream;
  }
  const StreamRes& res(const Context& ctx) const {
    return ctx.streams[static_cast<size_t>(stream_)];
  }
  int stream_;
};
using KernelPtr = std::unique_ptr<Kernel>;

// A kernel that is one lambda: make_fn(stream, [=](Context& ctx, cudaStream_t s) {...}).
template <typename F>
class FnKernel final : public Kernel {
 public:
  FnKernel(int stream, F f) : Kernel(stream), f_(std::move(f)) {}
  void run(Context& ctx) override { f_(ctx, stream(ctx)); }

 private:
  F f_;
};
template <typename F>
KernelPtr make_fn(int stream, F f) {
  return std::make_unique<FnKernel<F>>(stream, std::move(f));
}

// Factories, one per op (defined across src/backend/cuda/*). `stream` is the index of the
// stream the node runs on.
#define KILN_OP(name, category, doc) \
  KernelPtr make_##name(const Node& node, Context& ctx, int stream);
#include "kiln/graph/ops.def"
#undef KILN_OP

bool cuda_supports(OpKind op, DType feature_dtype);

// Compile-time autotuning's process-wide results (conv.cpp) and their file between processes
// (Options::autotune_cache): load merges a file's entries under this process's own (once per
// file and process; an unreadable or foreign file is ignored with a warning); save writes what
// this process timed, merged into the file, when it timed anything new (a failure to write
// is a warning: the cache is disposable).
void autotune_cache_load(const std::string& path, const std::string& gpu, int64_t cudnn);
void autotune_cache_save(const std::string& path, const std::string& gpu, int64_t cudnn);

// A device scalar as kernels see it: a pointer and a dtype code (absent = nullptr).
struct DevScalar {
  void* p = nullptr;
  int kind = 0;  // 0 absent, 1 f32, 2 i32, 3 i64
};
DevScalar dev_scalar(const Context& ctx, const Node& n, TensorId id, const char* role);

// Device memory a kernel owns beyond the regions and the stream workspaces (a convolution's
// channel-padded copies, conv+genstats' sums), allocated while compiling, freed with the kernel.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&p_, bytes)); }
  ~DeviceBuffer() {
    if (p_ && cudaFree(p_) != cudaSuccess)
      log_warn("cudaFree of a kernel's own device buffer failed");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

// Grid for a grid-stride loop over `count` items.
inline unsigned grid_for(const Context& ctx, int64_t count, int threads) {
  const int64_t want = (count + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(ctx.sm_count) * 16;
  return static_cast<unsigned>(want < 1 ? 1 : (want > cap ? cap : want));
}

}  // namespace kiln::cuda
