// JpegStage (jpeg_stage.h). nvJPEG's calls are checked one by one: a failure while setting up
// (handles, states, buffers) throws Error(Backend) naming the call and its status; a failure
// on one image's bytes logs it (KILN_LOG=debug) and sends that image to the host decoder.
#include "backend/cuda/jpeg_stage.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/stream_ordered_cache.h"
#include "kiln/core/log.h"

#if KILN_HAVE_NVJPEG
#include <nvjpeg.h>
#endif

namespace kiln::cuda {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void warn_cuda(const char* what, cudaError_t e) {
  if (e != cudaSuccess) std::fprintf(stderr, "kiln: %s failed: %s\n", what, cudaGetErrorString(e));
}

int64_t align256(int64_t v) {
  return (v + 255) / 256 * 256;
}

#if KILN_HAVE_NVJPEG
const char* nvjpeg_status_name(nvjpegStatus_t s) {
  switch (s) {
    case NVJPEG_STATUS_SUCCESS:
      return "NVJPEG_STATUS_SUCCESS";
    case NVJPEG_STATUS_NOT_INITIALIZED:
      return "NVJPEG_STATUS_NOT_INITIALIZED";
    case NVJPEG_STATUS_INVALID_PARAMETER:
      return "NVJPEG_STATUS_INVALID_PARAMETER";
    case NVJPEG_STATUS_BAD_JPEG:
      return "NVJPEG_STATUS_BAD_JPEG";
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED:
      return "NVJPEG_STATUS_JPEG_NOT_SUPPORTED";
    case NVJPEG_STATUS_ALLOCATOR_FAILURE:
      return "NVJPEG_STATUS_ALLOCATOR_FAILURE";
    case NVJPEG_STATUS_EXECUTION_FAILED:
      return "NVJPEG_STATUS_EXECUTION_FAILED";
    case NVJPEG_STATUS_ARCH_MISMATCH:
      return "NVJPEG_STATUS_ARCH_MISMATCH";
    case NVJPEG_STATUS_INTERNAL_ERROR:
      return "NVJPEG_STATUS_INTERNAL_ERROR";
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED:
      return "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED";
    case NVJPEG_STATUS_INCOMPLETE_BITSTREAM:
      return "NVJPEG_STATUS_INCOMPLETE_BITSTREAM";
  }
  return "an unknown nvjpegStatus_t";
}

[[noreturn]] void throw_nvjpeg(const char* call, nvjpegStatus_t s, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: ", nvjpeg_status_name(s), " (", static_cast<int>(s), ") at ",
            file, ":", line, "; KILN_NVJPEG=0 decodes JPEGs on the host instead");
}
#define NVJPEG_CHECK(call)                                                                  \
  do {                                                                                      \
    const nvjpegStatus_t kiln_s_ = (call);                                                  \
    if (kiln_s_ != NVJPEG_STATUS_SUCCESS) throw_nvjpeg(#call, kiln_s_, __FILE__, __LINE__); \
  } while (0)
// Per image: a failure is that image's, and the caller sends it to the host.
#define NVJPEG_TRY(call, name) nvjpeg_try((call), #call, name)
bool nvjpeg_try(nvjpegStatus_t s, const char* call, const std::string& name) {
  if (s == NVJPEG_STATUS_SUCCESS) return true;
  log_debug("nvjpeg: ", call, " on '", name, "': ", nvjpeg_status_name(s),
            "; decoding it on the host");
  return false;
}
void warn_nvjpeg(const char* call, nvjpegStatus_t s) {
  if (s != NVJPEG_STATUS_SUCCESS)
    std::fprintf(stderr, "kiln: %s failed: %s\n", call, nvjpeg_status_name(s));
}
#endif

// A complete JPEG ends with EOI (FF D9); a truncated one may decode without an error on the
// engines, into a partly grey image, so it goes to the host decoder, which rejects it.
bool ends_with_eoi(const std::vector<uint8_t>& b) {
  size_t n = b.size();
  while (n > 2 && b[n - 1] == 0) --n;  // some writers pad with zeros after EOI
  return n >= 4 && b[n - 2] == 0xFF && b[n - 1] == 0xD9;
}

}  // namespace

#if KILN_HAVE_NVJPEG
struct JpegStage::Nv {
  // Declared first, so destroyed last: every handle, state and buffer below allocates from it.
  std::unique_ptr<StreamOrderedCache> cache;  // KILN_NVJPEG_CACHE; null: CUDA's allocators
  nvjpegDevAllocatorV2_t dev_alloc{};
  nvjpegPinnedAllocatorV2_t pinned_alloc{};
  nvjpegHandle_t hw = nullptr;   // NVJPEG_BACKEND_HARDWARE, when the GPU has engines
  nvjpegHandle_t gen = nullptr;  // NVJPEG_BACKEND_DEFAULT: the decoupled decoder's
  nvjpegJpegState_t hw_state = nullptr;
  nvjpegJpegStream_t hw_probe = nullptr;        // parses headers for nvjpegDecodeBatchedSupported
  std::vector<nvjpegDecodeParams_t> hw_params;  // one per sample, reused
  int hw_batch = -1;                            // the batch size hw_state was initialised for
  nvjpegOutputFormat_t hw_format = NVJPEG_OUTPUT_RGBI;
  bool hw_roi = true;  // cleared when the engines refused a region decode once
  unsigned engines = 0, cores = 0;
  nvjpegJpegDecoder_t dec = nullptr;  // NVJPEG_BACKEND_HYBRID (decoupled phases)
  // Two decoupled states, used in turn: the host phase of an image overlaps the device phase
  // of the one before; each is reused once its `done` event has passed.
  struct Dec {
    nvjpegJpegState_t state = nullptr;
    nvjpegBufferPinned_t pinned = nullptr;
    nvjpegBufferDevice_t device = nullptr;
    nvjpegJpegStream_t stream = nullptr;
    nvjpegDecodeParams_t params = nullptr;
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  std::array<Dec, 2> decs{};
  int next_dec = 0;

  ~Nv() {
    if (cache)
      warn_cuda("cudaDeviceSynchronize",
                cudaDeviceSynchronize());  // nothing reads the cache's blocks
    for (Dec& d : decs) {
      if (d.done) {
        if (d.pending) warn_cuda("cudaEventSynchronize", cudaEventSynchronize(d.done));
        warn_cuda("cudaEventDestroy", cudaEventDestroy(d.done));
      }
      if (d.params) warn_nvjpeg("nvjpegDecodeParamsDestroy", nvjpegDecodeParamsDestroy(d.params));
      if (d.stream) warn_nvjpeg("nvjpegJpegStreamDestroy", nvjpegJpegStreamDestroy(d.stream));
      if (d.state) warn_nvjpeg("nvjpegJpegStateDestroy", nvjpegJpegStateDestroy(d.state));
      if (d.pinned) warn_nvjpeg("nvjpegBufferPinnedDestroy", nvjpegBufferPinnedDestroy(d.pinned));
      if (d.device) warn_nvjpeg("nvjpegBufferDeviceDestroy", nvjpegBufferDeviceDestroy(d.device));
    }
    if (dec) warn_nvjpeg("nvjpegDecoderDestroy", nvjpegDecoderDestroy(dec));
    for (nvjpegDecodeParams_t p : hw_params)
      warn_nvjpeg("nvjpegDecodeParamsDestroy", nvjpegDecodeParamsDestroy(p));
    if (hw_probe) warn_nvjpeg("nvjpegJpegStreamDestroy", nvjpegJpegStreamDestroy(hw_probe));
    if (hw_state) warn_nvjpeg("nvjpegJpegStateDestroy", nvjpegJpegStateDestroy(hw_state));
    if (hw) warn_nvjpeg("nvjpegDestroy", nvjpegDestroy(hw));
    if (gen) warn_nvjpeg("nvjpegDestroy", nvjpegDestroy(gen));
  }

  // A handle on `backend`, with the cache's allocators when there is a cache.
  nvjpegStatus_t make_handle(nvjpegBackend_t backend, nvjpegHandle_t* h) {
    return cache ? nvjpegCreateExV2(backend, &dev_alloc, &pinned_alloc, NVJPEG_FLAGS_DEFAULT, h)
                 : nvjpegCreateEx(backend, nullptr, nullptr, NVJPEG_FLAGS_DEFAULT, h);
  }

  void create(bool want_hardware, bool use_cache) {
    if (use_cache) {
      cache = std::make_unique<StreamOrderedCache>();
      dev_alloc.dev_ctx = cache.get();
      dev_alloc.dev_malloc = [](void* c, void** p, size_t n, cudaStream_t s) {
        return static_cast<StreamOrderedCache*>(c)->device_alloc(p, n, s);
      };
      dev_alloc.dev_free = [](void* c, void* p, size_t, cudaStream_t s) {
        return static_cast<StreamOrderedCache*>(c)->device_free(p, s);
      };
      pinned_alloc.pinned_ctx = cache.get();
      pinned_alloc.pinned_malloc = [](void* c, void** p, size_t n, cudaStream_t s) {
        return static_cast<StreamOrderedCache*>(c)->pinned_alloc(p, n, s);
      };
      pinned_alloc.pinned_free = [](void* c, void* p, size_t, cudaStream_t s) {
        return static_cast<StreamOrderedCache*>(c)->pinned_free(p, s);
      };
    }
    if (want_hardware) {
      // The engines exist only on some GPUs (A100, H100, H200): a refusal here is normal.
      if (make_handle(NVJPEG_BACKEND_HARDWARE, &hw) == NVJPEG_STATUS_SUCCESS) {
        if (nvjpegGetHardwareDecoderInfo(hw, &engines, &cores) != NVJPEG_STATUS_SUCCESS ||
            engines == 0) {
          warn_nvjpeg("nvjpegDestroy", nvjpegDestroy(hw));
          hw = nullptr;
          engines = cores = 0;
        }
      } else {
        hw = nullptr;
      }
    }
    if (hw) {
      NVJPEG_CHECK(nvjpegJpegStateCreate(hw, &hw_state));
      NVJPEG_CHECK(nvjpegJpegStreamCreate(hw, &hw_probe));
    }
    NVJPEG_CHECK(make_handle(NVJPEG_BACKEND_DEFAULT, &gen));
    NVJPEG_CHECK(nvjpegDecoderCreate(gen, NVJPEG_BACKEND_HYBRID, &dec));
    for (Dec& d : decs) {
      NVJPEG_CHECK(nvjpegDecoderStateCreate(gen, dec, &d.state));
      if (cache) {
        NVJPEG_CHECK(nvjpegBufferPinnedCreateV2(gen, &pinned_alloc, &d.pinned));
        NVJPEG_CHECK(nvjpegBufferDeviceCreateV2(gen, &dev_alloc, &d.device));
      } else {
        NVJPEG_CHECK(nvjpegBufferPinnedCreate(gen, nullptr, &d.pinned));
        NVJPEG_CHECK(nvjpegBufferDeviceCreate(gen, nullptr, &d.device));
      }
      NVJPEG_CHECK(nvjpegStateAttachPinnedBuffer(d.state, d.pinned));
      NVJPEG_CHECK(nvjpegStateAttachDeviceBuffer(d.state, d.device));
      NVJPEG_CHECK(nvjpegJpegStreamCreate(gen, &d.stream));
      NVJPEG_CHECK(nvjpegDecodeParamsCreate(gen, &d.params));
      CUDA_CHECK(cudaEventCreateWithFlags(&d.done, cudaEventDisableTiming));
    }
    log_info("nvjpeg: ",
             hw ? "hardware JPEG engines (" + std::to_string(engines) + " engines, " +
                      std::to_string(cores) +
                      " cores each), the hybrid decoder for what they refuse"
                : std::string("hybrid decoder (no hardware JPEG engines in use)"),
             cache ? "; its memory is cached and reused"
                   : "; its memory comes from CUDA's allocators (KILN_NVJPEG_CACHE=0)");
  }
};
#else
struct JpegStage::Nv {};
#endif

bool JpegStage::available(const JpegStageOptions& o, std::string* why_not) {
  auto say = [&](const std::string& s) {
    if (why_not) *why_not = s;
    return false;
  };
#if KILN_HAVE_NVJPEG
  if (!o.nvjpeg) return say("KILN_NVJPEG=0 turns the GPU JPEG decoder off");
  // One probe per process: creating a handle loads the library and touches the device.
  static std::once_flag once;
  static bool ok = false;
  static std::string reason;
  std::call_once(once, [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      reason = "no CUDA GPU on this machine";
      return;
    }
    nvjpegHandle_t h = nullptr;
    const nvjpegStatus_t s =
        nvjpegCreateEx(NVJPEG_BACKEND_DEFAULT, nullptr, nullptr, NVJPEG_FLAGS_DEFAULT, &h);
    if (s != NVJPEG_STATUS_SUCCESS) {
      reason = std::string("nvjpegCreateEx failed on this GPU: ") + nvjpeg_status_name(s);
      return;
    }
    warn_nvjpeg("nvjpegDestroy", nvjpegDestroy(h));
    ok = true;
  });
  if (!ok) return say(reason);
  if (why_not) why_not->clear();
  return true;
#else
  (void)o;
  return say(
      "this kiln was built without nvJPEG (neither the CUDA toolkit nor .deps/nvjpeg had it; run "
      "scripts/setup.sh and configure again)");
#endif
}

JpegStage::JpegStage(const JpegStageOptions& o) : opts_(o) {
  CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
#if KILN_HAVE_NVJPEG
  std::string why;
  if (opts_.nvjpeg && available(opts_, &why)) {
    nv_ = std::make_unique<Nv>();
    nv_->hw_roi = opts_.roi;
    nv_->create(opts_.hardware, opts_.cache);
  } else if (opts_.nvjpeg) {
    log_warn("nvjpeg: ", why, "; JPEGs are decoded on the host");
  }
#endif
}

JpegStage::~JpegStage() {
  if (pending_) warn_cuda("cudaEventSynchronize", cudaEventSynchronize(done_));
  nv_.reset();
  for (void* p : {static_cast<void*>(host_descs_), static_cast<void*>(host_labels_),
                  static_cast<void*>(host_pixels_), static_cast<void*>(bits_)}) {
    if (p) warn_cuda("cudaFreeHost", cudaFreeHost(p));
  }
  for (void* p : {static_cast<void*>(dev_descs_), static_cast<void*>(dev_pixels_),
                  static_cast<void*>(arena_), static_cast<void*>(pad_)}) {
    if (p) warn_cuda("cudaFree", cudaFree(p));
  }
  if (done_) warn_cuda("cudaEventDestroy", cudaEventDestroy(done_));
}

bool JpegStage::uses_hardware() const {
#if KILN_HAVE_NVJPEG
  return nv_ && nv_->hw;
#else
  return false;
#endif
}

bool JpegStage::caches_memory() const {
#if KILN_HAVE_NVJPEG
  return nv_ && nv_->cache;
#else
  return false;
#endif
}

void JpegStage::finished(cudaStream_t stream) {
  CUDA_CHECK(cudaEventRecord(done_, stream));
  pending_ = true;
}

void JpegStage::ensure_host_buffers(const EncodedBatch& b) {
  if (b.batch == batch_ && b.sample_bytes() == sample_bytes_) return;
  for (void* p : {static_cast<void*>(host_descs_), static_cast<void*>(host_labels_),
                  static_cast<void*>(host_pixels_)}) {
    if (p) CUDA_CHECK(cudaFreeHost(p));
  }
  for (void* p : {static_cast<void*>(dev_descs_), static_cast<void*>(dev_pixels_)}) {
    if (p) CUDA_CHECK(cudaFree(p));
  }
  host_descs_ = dev_descs_ = nullptr;
  host_labels_ = nullptr;
  host_pixels_ = dev_pixels_ = nullptr;
  batch_ = b.batch;
  sample_bytes_ = b.sample_bytes();
  const auto n = static_cast<size_t>(batch_);
  const auto px = static_cast<size_t>(batch_ * sample_bytes_);
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_descs_), n * sizeof(SampleDesc),
                           cudaHostAllocDefault));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_labels_), n * sizeof(int32_t),
                           cudaHostAllocDefault));
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_pixels_), px, cudaHostAllocDefault));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_descs_), n * sizeof(SampleDesc)));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev_pixels_), px));
  arena_offset_.assign(n, -1);
}

// Room for `bytes` in this batch's arena. Growing mid-batch (a region decode refused, so the
// whole image is needed) waits for the decodes already enqueued and moves their pixels.
uint8_t* JpegStage::arena_reserve(int64_t bytes, cudaStream_t stream, int64_t* offset) {
  bytes = align256(std::max<int64_t>(bytes, 1));
  if (arena_used_ + bytes > arena_cap_) {
    const int64_t cap = align256((arena_used_ + bytes) * 5 / 4);
    uint8_t* grown = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&grown), static_cast<size_t>(cap)));
    if (arena_) {
      if (arena_used_ > 0) {
        CUDA_CHECK(cudaMemcpyAsync(grown, arena_, static_cast<size_t>(arena_used_),
                                   cudaMemcpyDeviceToDevice, stream));
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaFree(arena_));
    }
    log_debug("nvjpeg: decode buffer grown to ", cap >> 20, " MiB");
    arena_ = grown;
    arena_cap_ = cap;
  }
  *offset = arena_used_;
  arena_used_ += bytes;
  return arena_ + *offset;
}

void JpegStage::host_sample(const EncodedBatch& b, int64_t k, bool decode, cudaStream_t stream,
                            DecodeCounters& counts) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto sb = static_cast<size_t>(sample_bytes_);
  uint8_t* pinned = host_pixels_ + static_cast<size_t>(k) * sb;
  if (decode) {
    KILN_CHECK(static_cast<bool>(b.host_decode), InvalidArgument, "encoded batch: sample ", k,
               " ('", b.images[static_cast<size_t>(k)].name,
               "') needs the host decoder, and the batch has no host_decode");
    int32_t label = host_labels_[k];
    b.host_decode(k, pinned, &label);
    host_labels_[k] = label;
  } else {
    KILN_CHECK(b.host_pixels.size() >= static_cast<size_t>(k + 1) * sb, InvalidArgument,
               "encoded batch: sample ", k,
               " has no bytes, so its pixels are in host_pixels, which holds ",
               b.host_pixels.size(), " bytes");
    std::memcpy(pinned, b.host_pixels.data() + static_cast<size_t>(k) * sb, sb);
  }
  uint8_t* dev = dev_pixels_ + static_cast<size_t>(k) * sb;
  CUDA_CHECK(cudaMemcpyAsync(dev, pinned, sb, cudaMemcpyHostToDevice, stream));
  host_descs_[k] = copy_desc(dev, b.height, b.width, b.channels);
  arena_offset_[static_cast<size_t>(k)] = -1;
  counts.host_decode_seconds += seconds_since(t0);
}

JpegStage::Prepared JpegStage::prepare(const EncodedBatch& b, cudaStream_t stream) {
  try {
    return prepare_batch(b, stream);
  } catch (...) {
    warn_cuda("cudaStreamSynchronize",
              cudaStreamSynchronize(stream));  // what was enqueued ends first
    throw;
  }
}

JpegStage::Prepared JpegStage::prepare_batch(const EncodedBatch& b, cudaStream_t stream) {
  KILN_CHECK(b.batch > 0 && b.size >= 0 && b.size <= b.batch &&
                 static_cast<int64_t>(b.images.size()) == b.size &&
                 static_cast<int64_t>(b.labels.size()) == b.batch,
             InvalidArgument, "encoded batch: ", b.size, " samples of ", b.batch, " with ",
             b.images.size(), " images and ", b.labels.size(),
             " labels; it needs `size` images and `batch` labels");
  KILN_CHECK(b.channels == 1 || b.channels == 3, InvalidArgument, "encoded batch: ", b.channels,
             " channels; the GPU decoder writes 1 (grey) or 3 (RGB)");
  for (int64_t k = 0; k < b.size; ++k) {
    const SampleGeometry& g = b.images[static_cast<size_t>(k)].geometry;
    KILN_CHECK(g.out_h() == b.height && g.out_w() == b.width, InvalidArgument,
               "encoded batch: sample ", k, " ('", b.images[static_cast<size_t>(k)].name,
               "') has a ", g.out_h(), "x", g.out_w(), " geometry for ", b.height, "x", b.width,
               " samples");
  }
  // The previous batch's kernel has read every buffer below (normally long ago).
  if (pending_) CUDA_CHECK(cudaEventSynchronize(done_));
  pending_ = false;
  ensure_host_buffers(b);
  std::copy(b.labels.begin(), b.labels.end(), host_labels_);
  std::fill(arena_offset_.begin(), arena_offset_.end(), -1);
  arena_used_ = 0;
  Prepared out;
  std::vector<int64_t> jpegs;  // samples for nvJPEG
  for (int64_t k = 0; k < b.size; ++k) {
    const EncodedImage& im = b.images[static_cast<size_t>(k)];
    if (im.bytes.empty()) {
      host_sample(b, k, /*decode=*/false, stream, out.counts);
      ++out.counts.host;
    } else if (!nv_) {
      host_sample(b, k, /*decode=*/true, stream, out.counts);
      ++out.counts.host;
    } else {
      jpegs.push_back(k);
    }
  }
  for (int64_t k = b.size; k < b.batch; ++k) {
    host_descs_[k] = SampleDesc{};
    host_descs_[k].zero = 1;
    arena_offset_[static_cast<size_t>(k)] = -1;
  }
#if KILN_HAVE_NVJPEG
  if (!jpegs.empty()) {
    Nv& nv = *nv_;
    const nvjpegOutputFormat_t format = b.channels == 3 ? NVJPEG_OUTPUT_RGBI : NVJPEG_OUTPUT_Y;
    // The bitstreams, copied where they outlive the caller's batch (nvJPEG reads them
    // asynchronously); pinned, so the engines' uploads are direct.
    int64_t bits = 0;
    for (int64_t k : jpegs)
      bits += align256(static_cast<int64_t>(b.images[static_cast<size_t>(k)].bytes.size()));
    if (bits > bits_cap_) {
      if (bits_) CUDA_CHECK(cudaFreeHost(bits_));
      bits_ = nullptr;
      bits_cap_ = align256(bits * 5 / 4);
      CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&bits_), static_cast<size_t>(bits_cap_),
                               cudaHostAllocDefault));
    }
    std::vector<const unsigned char*> data(static_cast<size_t>(b.batch), nullptr);
    std::vector<size_t> length(static_cast<size_t>(b.batch), 0);
    auto t_phase = std::chrono::steady_clock::now();
    int64_t at = 0;
    for (int64_t k : jpegs) {
      const std::vector<uint8_t>& src = b.images[static_cast<size_t>(k)].bytes;
      std::memcpy(bits_ + at, src.data(), src.size());
      data[static_cast<size_t>(k)] = bits_ + at;
      length[static_cast<size_t>(k)] = src.size();
      at += align256(static_cast<int64_t>(src.size()));
    }
    out.counts.copy_seconds += seconds_since(t_phase);
    t_phase = std::chrono::steady_clock::now();
    if (nv.hw && nv.hw_params.size() < static_cast<size_t>(b.batch)) {
      const size_t have = nv.hw_params.size();
      nv.hw_params.resize(static_cast<size_t>(b.batch), nullptr);
      for (size_t i = have; i < nv.hw_params.size(); ++i)
        NVJPEG_CHECK(nvjpegDecodeParamsCreate(nv.hw, &nv.hw_params[i]));
    }
    // Each image's window: the rows and columns its taps read, widened to whole 16-pixel
    // MCUs (so a region decode upsamples chroma from the same neighbours as a full one).
    struct Plan {
      int64_t k;
      SampleDesc desc;          // axes, window, flip; src filled once the arena is final
      int64_t top, left, h, w;  // the window decoded
      bool roi;                 // a region, not the whole image
      bool empty;               // reads nothing: no decode
    };
    std::vector<Plan> hw_list, dec_list;
    auto to_host = [&](int64_t k) {
      host_sample(b, k, /*decode=*/true, stream, out.counts);
      ++out.counts.host;
    };
    for (int64_t k : jpegs) {
      const EncodedImage& im = b.images[static_cast<size_t>(k)];
      const SampleGeometry& g = im.geometry;
      // Headers parse with the handle whose support is asked (the decoupled states are idle:
      // the previous batch has finished).
      nvjpegHandle_t ph = nv.hw ? nv.hw : nv.gen;
      nvjpegJpegStream_t ps = nv.hw ? nv.hw_probe : nv.decs[0].stream;
      unsigned width = 0, height = 0, comps = 0;
      if (!ends_with_eoi(im.bytes) ||
          !NVJPEG_TRY(nvjpegJpegStreamParseHeader(ph, data[k], length[k], ps), im.name) ||
          !NVJPEG_TRY(nvjpegJpegStreamGetFrameDimensions(ps, &width, &height), im.name) ||
          !NVJPEG_TRY(nvjpegJpegStreamGetComponentsNum(ps, &comps), im.name) ||
          (comps != 1 && comps != 3) || static_cast<int64_t>(height) != g.src_h ||
          static_cast<int64_t>(width) != g.src_w) {
        // CMYK / YCCK (4 components: kiln's host decoder converts them as PIL does), or a
        // header that disagrees with the one the geometry was drawn from.
        to_host(k);
        continue;
      }
      Plan p{k, SampleDesc{}, 0, 0, 0, 0, false, false};
      p.desc.y = axis_desc(g.y, g.src_h);
      p.desc.x = axis_desc(g.x, g.src_w);
      p.desc.flip = g.flip ? 1 : 0;
      int64_t y0, y1, x0, x1;
      axis_span(p.desc.y, &y0, &y1);
      axis_span(p.desc.x, &x0, &x1);
      if (y1 <= y0 || x1 <= x0) {
        p.empty = true;  // every output is padding: nothing to decode
        host_descs_[k] = p.desc;
        arena_offset_[static_cast<size_t>(k)] = -1;
        continue;
      }
      if (opts_.roi) {
        y0 = y0 / 16 * 16, x0 = x0 / 16 * 16;
        y1 = std::min<int64_t>(g.src_h, (y1 + 15) / 16 * 16),
        x1 = std::min<int64_t>(g.src_w, (x1 + 15) / 16 * 16);
      } else {
        y0 = x0 = 0, y1 = g.src_h, x1 = g.src_w;
      }
      p.roi = !(y0 == 0 && x0 == 0 && y1 == g.src_h && x1 == g.src_w);
      bool hw_ok = false;
      if (nv.hw) {
        int sup = 1;
        if (p.roi && nv.hw_roi) {
          nvjpegDecodeParams_t prm = nv.hw_params[static_cast<size_t>(k)];
          hw_ok =
              NVJPEG_TRY(nvjpegDecodeParamsSetOutputFormat(prm, format), im.name) &&
              NVJPEG_TRY(
                  nvjpegDecodeParamsSetROI(prm, static_cast<int>(x0), static_cast<int>(y0),
                                           static_cast<int>(x1 - x0), static_cast<int>(y1 - y0)),
                  im.name) &&
              NVJPEG_TRY(nvjpegDecodeBatchedSupportedEx(nv.hw, ps, prm, &sup), im.name) && sup == 0;
        }
        if (!hw_ok) {
          // The engines without a region (or not at all): the whole image.
          sup = 1;
          if (NVJPEG_TRY(nvjpegDecodeBatchedSupported(nv.hw, ps, &sup), im.name) && sup == 0) {
            hw_ok = true;
            if (p.roi && nv.hw_roi) p.roi = false, y0 = x0 = 0, y1 = g.src_h, x1 = g.src_w;
          }
        }
        if (hw_ok && !nv.hw_roi) p.roi = false, y0 = x0 = 0, y1 = g.src_h, x1 = g.src_w;
      }
      p.top = y0, p.left = x0, p.h = y1 - y0, p.w = x1 - x0;
      (hw_ok ? hw_list : dec_list).push_back(p);
    }
    // The arena for every planned window at once (it grows here, before any decode, if needed).
    int64_t need = 0;
    for (const auto* list : {&hw_list, &dec_list}) {
      for (const Plan& p : *list) need += align256(p.h * p.w * b.channels);
    }
    if (need > arena_cap_) {
      int64_t off;
      arena_reserve(need, stream, &off);
      arena_used_ = 0;
    }
    auto place = [&](Plan& p) {
      int64_t off;
      arena_reserve(p.h * p.w * b.channels, stream, &off);
      arena_offset_[static_cast<size_t>(p.k)] = off;
      p.desc.pitch = p.w * b.channels;
      p.desc.y.win_lo = static_cast<int32_t>(p.top), p.desc.y.win_n = static_cast<int32_t>(p.h);
      p.desc.x.win_lo = static_cast<int32_t>(p.left), p.desc.x.win_n = static_cast<int32_t>(p.w);
      host_descs_[p.k] = p.desc;
      return off;
    };
    out.counts.parse_seconds += seconds_since(t_phase);
    // (a) The engines, in one call.
    if (!hw_list.empty()) {
      const int n = static_cast<int>(hw_list.size());
      std::vector<const unsigned char*> hd;
      std::vector<size_t> hl;
      std::vector<nvjpegImage_t> dst(static_cast<size_t>(n));
      std::vector<nvjpegDecodeParams_t> prm;
      bool any_roi = false;
      for (int i = 0; i < n; ++i) {
        Plan& p = hw_list[static_cast<size_t>(i)];
        const int64_t off = place(p);
        hd.push_back(data[static_cast<size_t>(p.k)]);
        hl.push_back(length[static_cast<size_t>(p.k)]);
        dst[static_cast<size_t>(i)] = nvjpegImage_t{};
        dst[static_cast<size_t>(i)].channel[0] = arena_ + off;
        dst[static_cast<size_t>(i)].pitch[0] = static_cast<size_t>(p.desc.pitch);
        nvjpegDecodeParams_t q = nv.hw_params[static_cast<size_t>(p.k)];
        if (!p.roi) NVJPEG_CHECK(nvjpegDecodeParamsSetROI(q, 0, 0, -1, -1));
        NVJPEG_CHECK(nvjpegDecodeParamsSetOutputFormat(q, format));
        prm.push_back(q);
        any_roi = any_roi || p.roi;
      }
      // The batched state is set up once, for the compiled batch: setting it up again for each
      // batch's count of engine images (which varies with the progressive / CMYK files in it)
      // bounded the step at 1,842 images/s on the H200 (bench/RESULTS.md). The call is padded
      // to that size with copies of the first image, decoded into a scratch buffer no one reads.
      const int full = std::max(n, static_cast<int>(b.batch));
      if (n < full) {
        const Plan& p0 = hw_list.front();
        const int64_t pad_bytes = align256(p0.h * p0.w * b.channels);
        if (pad_bytes > pad_cap_) {
          if (pad_) CUDA_CHECK(cudaFree(pad_));  // the last batch's decodes ended (done_ above)
          pad_ = nullptr;
          CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&pad_), static_cast<size_t>(pad_bytes)));
          pad_cap_ = pad_bytes;
        }
        nvjpegImage_t pad_dst{};
        pad_dst.channel[0] = pad_;
        pad_dst.pitch[0] = dst.front().pitch[0];
        for (int i = n; i < full; ++i) {
          hd.push_back(hd.front());
          hl.push_back(hl.front());
          dst.push_back(pad_dst);
          prm.push_back(prm.front());
        }
      }
      bool ok = true;
      if (nv.hw_batch != full || nv.hw_format != format) {
        const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        ok = NVJPEG_TRY(nvjpegDecodeBatchedInitialize(nv.hw, nv.hw_state, full, threads, format),
                        "the batch");
        nv.hw_batch = ok ? full : -1;
        nv.hw_format = format;
      }
      if (ok) {
        const auto t_call = std::chrono::steady_clock::now();
        const nvjpegStatus_t s =
            any_roi
                ? nvjpegDecodeBatchedEx(nv.hw, nv.hw_state, hd.data(), hl.data(), dst.data(),
                                        prm.data(), stream)
                : nvjpegDecodeBatched(nv.hw, nv.hw_state, hd.data(), hl.data(), dst.data(), stream);
        out.counts.engine_call_seconds += seconds_since(t_call);
        ok = s == NVJPEG_STATUS_SUCCESS;
        if (!ok && any_roi) {
          // A region decode the engines said they take and then refused: whole images on the
          // engines from now on, and this batch through the hybrid decoder.
          log_warn(
              "nvjpeg: the hardware engines refused a region decode (", nvjpeg_status_name(s),
              "); decoding whole images from now on (KILN_NVJPEG_ROI=0 does so from the start)");
          nv.hw_roi = false;
        } else if (!ok) {
          log_warn("nvjpeg: a batched hardware decode of ", n, " images failed (",
                   nvjpeg_status_name(s),
                   "); this batch goes through the hybrid decoder, image by image");
        }
      }
      if (ok) {
        out.counts.hardware += n;
      } else {
        // Their windows were placed already (marked -2 - offset); the hybrid decoder writes
        // the same ones unless it has to widen them.
        for (Plan& p : hw_list) {
          arena_offset_[static_cast<size_t>(p.k)] = -2 - arena_offset_[static_cast<size_t>(p.k)];
          dec_list.push_back(p);
        }
      }
    }
    // (b) The hybrid decoder, one image at a time, two states in turn.
    t_phase = std::chrono::steady_clock::now();
    for (Plan& p : dec_list) {
      const EncodedImage& im = b.images[static_cast<size_t>(p.k)];
      Nv::Dec& d = nv.decs[static_cast<size_t>(nv.next_dec)];
      nv.next_dec ^= 1;
      if (d.pending) CUDA_CHECK(cudaEventSynchronize(d.done));
      d.pending = false;
      const unsigned char* bytes = data[static_cast<size_t>(p.k)];
      const size_t len = length[static_cast<size_t>(p.k)];
      bool ok = NVJPEG_TRY(nvjpegJpegStreamParse(nv.gen, bytes, len, 0, 0, d.stream), im.name) &&
                NVJPEG_TRY(nvjpegDecodeParamsSetOutputFormat(d.params, format), im.name);
      int sup = 1;
      bool moved = false;  // the window differs from the one planned
      if (ok && p.roi) {
        ok = NVJPEG_TRY(
            nvjpegDecodeParamsSetROI(d.params, static_cast<int>(p.left), static_cast<int>(p.top),
                                     static_cast<int>(p.w), static_cast<int>(p.h)),
            im.name);
        if (ok &&
            !(NVJPEG_TRY(nvjpegDecoderJpegSupported(nv.dec, d.stream, d.params, &sup), im.name) &&
              sup == 0)) {
          p.roi = false;  // no region for this one: the whole image, in a new place
          p.top = p.left = 0, p.h = im.geometry.src_h, p.w = im.geometry.src_w;
          moved = true;
        }
      }
      if (ok && !p.roi) {
        ok = NVJPEG_TRY(nvjpegDecodeParamsSetROI(d.params, 0, 0, -1, -1), im.name) &&
             NVJPEG_TRY(nvjpegDecoderJpegSupported(nv.dec, d.stream, d.params, &sup), im.name) &&
             sup == 0;
      }
      if (!ok) {
        to_host(p.k);
        continue;
      }
      int64_t& slot = arena_offset_[static_cast<size_t>(p.k)];
      int64_t off;
      if (slot <= -2 && !moved) {
        off = -2 - slot;  // the window placed for the engines, unchanged
        slot = off;
      } else {
        off = place(p);
      }
      nvjpegImage_t dst{};
      dst.channel[0] = arena_ + off;
      dst.pitch[0] = static_cast<size_t>(p.w * b.channels);
      ok = NVJPEG_TRY(nvjpegDecodeJpegHost(nv.gen, nv.dec, d.state, d.params, d.stream), im.name) &&
           NVJPEG_TRY(nvjpegDecodeJpegTransferToDevice(nv.gen, nv.dec, d.state, d.stream, stream),
                      im.name) &&
           NVJPEG_TRY(nvjpegDecodeJpegDevice(nv.gen, nv.dec, d.state, &dst, stream), im.name);
      CUDA_CHECK(cudaEventRecord(d.done, stream));
      d.pending = true;
      if (ok) {
        ++out.counts.gpu_hybrid;
      } else {
        to_host(p.k);
      }
    }
    out.counts.hybrid_seconds += seconds_since(t_phase);
  }
#endif
  // Every window is in place: the descriptors get their pointers, then go to the device.
  for (int64_t k = 0; k < b.batch; ++k) {
    const int64_t off = arena_offset_[static_cast<size_t>(k)];
    if (off >= 0) host_descs_[k].src = arena_ + off;
  }
  CUDA_CHECK(cudaMemcpyAsync(dev_descs_, host_descs_,
                             static_cast<size_t>(b.batch) * sizeof(SampleDesc),
                             cudaMemcpyHostToDevice, stream));
  out.descs = dev_descs_;
  out.labels = host_labels_;
  return out;
}

}  // namespace kiln::cuda
