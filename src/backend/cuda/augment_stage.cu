// The kernels of augment_stage.h. Each op below mirrors its host form in
// src/data/auto_augment.cpp (named alike) with every float step rounded on its own
// (__fmul_rn / __fadd_rn / __fdiv_rn: nvcc would otherwise fuse multiplies and adds, and a value
// next to an integer would truncate the other way).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>

#include "backend/cuda/augment_stage.h"
#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/device_util.cuh"
#include "kiln/data/auto_augment.h"

namespace kiln::cuda {
namespace {

constexpr int kAugmentThreads = 512;  // one block per sample

// clamp(0, 255).to(uint8): truncation toward zero.
__device__ inline uint8_t to_u8(float v) {
  return static_cast<uint8_t>(static_cast<int32_t>(fminf(255.0f, fmaxf(0.0f, v))));
}

// _blend for one value: r * a + q * b in float32, then to_u8.
__device__ inline uint8_t blend(uint8_t a, float b, float r, float q) {
  return to_u8(__fadd_rn(__fmul_rn(r, static_cast<float>(a)), __fmul_rn(q, b)));
}

// rgb_to_grayscale, truncated to uint8.
__device__ inline uint8_t grey(const uint8_t* p) {
  const float r = __fmul_rn(0.2989f, static_cast<float>(p[0]));
  const float g = __fmul_rn(0.587f, static_cast<float>(p[1]));
  const float b = __fmul_rn(0.114f, static_cast<float>(p[2]));
  return to_u8(__fadd_rn(__fadd_rn(r, g), b));
}

template <int C>
struct OpShared {
  unsigned int hist[C][256];  // equalize
  uint8_t lut[C][256];
  int lo[C], hi[C];        // autocontrast
  unsigned long long sum;  // contrast: the grey image's sum
};

// Threads stride over the sample's n pixels (or n * C values); the caller syncs after each op.
template <int C>
__device__ void affine_nearest(const float* g, const uint8_t* cur, uint8_t* dst, int32_t h,
                               int32_t w) {
  const float fw = static_cast<float>(w), fh = static_cast<float>(h);
  const float hw = __fmul_rn(0.5f, fw), hh = __fmul_rn(0.5f, fh);
  for (int32_t i = threadIdx.x; i < h * w; i += blockDim.x) {
    const int32_t y = i / w, x = i - y * w;
    const float yc = __fadd_rn(__fadd_rn(-hh, 0.5f), static_cast<float>(y));
    const float xc = __fadd_rn(__fadd_rn(-hw, 0.5f), static_cast<float>(x));
    const float gx = __fadd_rn(__fadd_rn(__fmul_rn(xc, g[0]), __fmul_rn(yc, g[1])), g[2]);
    const float gy = __fadd_rn(__fadd_rn(__fmul_rn(xc, g[3]), __fmul_rn(yc, g[4])), g[5]);
    const float ix = rintf(__fdiv_rn(__fsub_rn(__fmul_rn(__fadd_rn(gx, 1.0f), fw), 1.0f), 2.0f));
    const float iy = rintf(__fdiv_rn(__fsub_rn(__fmul_rn(__fadd_rn(gy, 1.0f), fh), 1.0f), 2.0f));
    uint8_t* o = dst + int64_t{i} * C;
    if (!(ix >= 0 && ix < fw && iy >= 0 && iy < fh)) {
#pragma unroll
      for (int c = 0; c < C; ++c) o[c] = 0;
      continue;
    }
    const uint8_t* s = cur + (int64_t{static_cast<int32_t>(iy)} * w + static_cast<int32_t>(ix)) * C;
#pragma unroll
    for (int c = 0; c < C; ++c) o[c] = s[c];
  }
}

// The blur [[1,1,1],[1,5,1],[1,1,1]] / 13 rounded (integers: (2 S + 13) / 26) on the interior,
// the border as it is, then blended with the image over every pixel.
template <int C>
__device__ void adjust_sharpness(const uint8_t* cur, uint8_t* dst, int32_t h, int32_t w, float r,
                                 float q) {
  for (int32_t i = threadIdx.x; i < h * w; i += blockDim.x) {
    const int32_t y = i / w, x = i - y * w;
    const bool border = y == 0 || x == 0 || y == h - 1 || x == w - 1;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint8_t v = cur[int64_t{i} * C + c];
      float blurred = static_cast<float>(v);
      if (!border) {
        int32_t s = 4 * v;
        for (int32_t dy = -1; dy <= 1; ++dy) {
          for (int32_t dx = -1; dx <= 1; ++dx) s += cur[(int64_t{y + dy} * w + x + dx) * C + c];
        }
        blurred = static_cast<float>((2 * s + 13) / 26);
      }
      dst[int64_t{i} * C + c] = blend(v, blurred, r, q);
    }
  }
}

template <int C>
__device__ void adjust_contrast(uint8_t* cur, int32_t n, float r, float q, OpShared<C>& sh) {
  if (threadIdx.x == 0) sh.sum = 0;
  __syncthreads();
  unsigned long long local = 0;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const uint8_t* px = cur + int64_t{i} * C;
    if constexpr (C == 3) {
      local += grey(px);
    } else {
      local += px[0];
    }
  }
  atomicAdd(&sh.sum, local);
  __syncthreads();
  // The mean in float32: the (exact) integer sum over the count, as the host.
  const float mean = __fdiv_rn(__ull2float_rn(sh.sum), __int2float_rn(n));
  for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) cur[i] = blend(cur[i], mean, r, q);
}

template <int C>
__device__ void autocontrast(uint8_t* cur, int32_t n, OpShared<C>& sh) {
  if (threadIdx.x < C) sh.lo[threadIdx.x] = 255, sh.hi[threadIdx.x] = 0;
  __syncthreads();
  int lo[C], hi[C];
#pragma unroll
  for (int c = 0; c < C; ++c) lo[c] = 255, hi[c] = 0;
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int v = cur[int64_t{i} * C + c];
      lo[c] = min(lo[c], v);
      hi[c] = max(hi[c], v);
    }
  }
#pragma unroll
  for (int c = 0; c < C; ++c) atomicMin(&sh.lo[c], lo[c]), atomicMax(&sh.hi[c], hi[c]);
  __syncthreads();
  float minimum[C], scale[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    minimum[c] = static_cast<float>(sh.lo[c]);
    scale[c] = __fdiv_rn(255.0f, __fsub_rn(static_cast<float>(sh.hi[c]), minimum[c]));
    if (!isfinite(scale[c])) minimum[c] = 0.0f, scale[c] = 1.0f;
  }
  for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) {
    const int c = i % C;
    cur[i] = to_u8(__fmul_rn(__fsub_rn(static_cast<float>(cur[i]), minimum[c]), scale[c]));
  }
}

// Per channel: the histogram, then the host's integer lookup table (one thread per channel
// walks the 256 bins), then the lookup. A channel whose step is 0 stays as it is.
template <int C>
__device__ void equalize(uint8_t* cur, int32_t n, OpShared<C>& sh) {
  for (int i = threadIdx.x; i < C * 256; i += blockDim.x) (&sh.hist[0][0])[i] = 0;
  __syncthreads();
  for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) atomicAdd(&sh.hist[i % C][cur[i]], 1u);
  __syncthreads();
  if (threadIdx.x < C) {
    const unsigned int* hist = sh.hist[threadIdx.x];
    uint8_t* lut = sh.lut[threadIdx.x];
    int last = 255;
    while (last > 0 && hist[last] == 0) --last;
    long long rest = 0;
    for (int v = 0; v < last; ++v) rest += hist[v];
    const long long step = rest / 255;
    long long cum = 0;
    for (int v = 0; v < 256; ++v) {
      const long long q = step == 0 ? v : (cum + step / 2) / step;
      const long long mapped = q < 255 ? q : 255;
      lut[v] = static_cast<uint8_t>(mapped);
      cum += hist[v];
    }
  }
  __syncthreads();
  for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) cur[i] = sh.lut[i % C][cur[i]];
}

// One op on the sample at `cur`; true when it wrote its result to `other` instead.
template <int C>
__device__ bool apply_op(const AugmentOpParams& p, uint8_t* cur, uint8_t* other, int32_t h,
                         int32_t w, OpShared<C>& sh) {
  const int32_t n = h * w;
  switch (static_cast<AugmentOp>(p.op)) {
    case AugmentOp::shear_x:
    case AugmentOp::shear_y:
    case AugmentOp::translate_x:
    case AugmentOp::translate_y:
    case AugmentOp::rotate:
      affine_nearest<C>(p.grid, cur, other, h, w);
      return true;
    case AugmentOp::brightness:
      for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) {
        cur[i] = blend(cur[i], 0.0f, p.ratio, p.rest);
      }
      return false;
    case AugmentOp::color:  // 1-channel images stay as they are
      if constexpr (C == 3) {
        for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
          uint8_t* px = cur + int64_t{i} * 3;
          const float g = grey(px);
#pragma unroll
          for (int c = 0; c < 3; ++c) px[c] = blend(px[c], g, p.ratio, p.rest);
        }
      }
      return false;
    case AugmentOp::contrast:
      adjust_contrast<C>(cur, n, p.ratio, p.rest, sh);
      return false;
    case AugmentOp::sharpness:
      if (w <= 2 || h <= 2) return false;
      adjust_sharpness<C>(cur, other, h, w, p.ratio, p.rest);
      return true;
    case AugmentOp::posterize: {
      const int mask = -(1 << (8 - p.bits));
      for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) {
        cur[i] = static_cast<uint8_t>(cur[i] & mask);
      }
      return false;
    }
    case AugmentOp::solarize:
      for (int32_t i = threadIdx.x; i < n * C; i += blockDim.x) {
        const uint8_t v = cur[i];
        cur[i] = v >= p.bits ? static_cast<uint8_t>(255 - v) : v;
      }
      return false;
    case AugmentOp::autocontrast:
      autocontrast<C>(cur, n, sh);
      return false;
    case AugmentOp::equalize:
      equalize<C>(cur, n, sh);
      return false;
    default:  // identity
      return false;
  }
}

// Block k: sample k's ops in order (pixels <-> scratch), then normalise, erase and store.
template <typename T, int C>
__global__ void __launch_bounds__(kAugmentThreads)
    augment_normalize_kernel(uint8_t* pixels, uint8_t* scratch, const AugmentDesc* descs,
                             const AugmentOpParams* ops, int32_t h, int32_t w, NormParams norm,
                             T* __restrict__ out) {
  __shared__ OpShared<C> sh;
  const int64_t k = blockIdx.x;
  const int32_t n = h * w;
  const int64_t per = int64_t{n} * C;
  uint8_t* cur = pixels + k * per;
  uint8_t* other = scratch + k * per;
  const AugmentDesc d = descs[k];
  T* o = out + k * per;
  if (d.zero) {
    for (int64_t i = threadIdx.x; i < per; i += blockDim.x) o[i] = from_f<T>(0.0f);
    return;
  }
  for (int32_t r = 0; r < d.ops; ++r) {
    // Every thread reads the same op, so the branches below are the block's, syncs included.
    const AugmentOpParams p = ops[d.first_op + r];
    if (apply_op<C>(p, cur, other, h, w, sh)) {
      uint8_t* t = cur;
      cur = other;
      other = t;
    }
    __syncthreads();  // the next op reads what every thread wrote
  }
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t y = i / w, x = i - y * w;
    const bool erase = erased(d, y, x);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float v = static_cast<float>(cur[int64_t{i} * C + c]);
      o[int64_t{i} * C + c] =
          from_f<T>(erase ? d.erase_value : __fadd_rn(__fmul_rn(v, norm.scale[c]), norm.shift[c]));
    }
  }
}

template <typename T>
void launch_augment_t(uint8_t* pixels, uint8_t* scratch, const AugmentDesc* descs,
                      const AugmentOpParams* ops, int64_t batch, int32_t h, int32_t w,
                      const NormParams& norm, T* out, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(batch);
  switch (norm.channels) {
    case 1:
      augment_normalize_kernel<T, 1>
          <<<blocks, kAugmentThreads, 0, stream>>>(pixels, scratch, descs, ops, h, w, norm, out);
      break;
    case 2:
      augment_normalize_kernel<T, 2>
          <<<blocks, kAugmentThreads, 0, stream>>>(pixels, scratch, descs, ops, h, w, norm, out);
      break;
    case 3:
      augment_normalize_kernel<T, 3>
          <<<blocks, kAugmentThreads, 0, stream>>>(pixels, scratch, descs, ops, h, w, norm, out);
      break;
    case 4:
      augment_normalize_kernel<T, 4>
          <<<blocks, kAugmentThreads, 0, stream>>>(pixels, scratch, descs, ops, h, w, norm, out);
      break;
    default:
      KILN_FAIL(InvalidArgument, "GPU augmentation: ", norm.channels, " channels; it takes 1 to ",
                kMaxInputChannels);
  }
  KILN_LAUNCH_CHECK("augment_normalize_kernel");
}

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

// Destructors report instead of throwing.
void warn_cuda(const char* what, cudaError_t e) {
  if (e != cudaSuccess) log_warn(what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

void launch_augment_normalize(uint8_t* pixels, uint8_t* scratch, const AugmentDesc* descs,
                              const AugmentOpParams* ops, int64_t batch, int64_t h, int64_t w,
                              const NormParams& norm, void* out, DType dtype, cudaStream_t stream) {
  KILN_CHECK(batch > 0 && batch < (int64_t{1} << 31) && h > 0 && w > 0 &&
                 h * w * norm.channels < (int64_t{1} << 31),
             InvalidArgument, "GPU augmentation: a batch of ", batch, " samples of ", h, "x", w,
             "x", norm.channels, " (at most 2^31 values a sample)");
  const auto h32 = static_cast<int32_t>(h), w32 = static_cast<int32_t>(w);
  if (dtype == DType::F32) {
    launch_augment_t(pixels, scratch, descs, ops, batch, h32, w32, norm, static_cast<float*>(out),
                     stream);
  } else if (dtype == DType::F16) {
    launch_augment_t(pixels, scratch, descs, ops, batch, h32, w32, norm, static_cast<__half*>(out),
                     stream);
  } else {
    KILN_FAIL(Unsupported, "GPU augmentation: the input slot is ", dtype_name(dtype),
              "; it writes F32 or F16");
  }
}

void build_augment_descs(const SampleAugment* const* augments, int64_t batch, int64_t valid,
                         int64_t h, int64_t w, int64_t channels, std::vector<AugmentDesc>* descs,
                         std::vector<AugmentOpParams>* ops) {
  KILN_CHECK(batch >= 0 && h > 0 && w > 0 && h * w * channels < (int64_t{1} << 31), InvalidArgument,
             "GPU augmentation: a batch of ", batch, " samples of ", h, "x", w, "x", channels,
             " (at most 2^31 values a sample)");
  descs->assign(static_cast<size_t>(batch), AugmentDesc{});
  ops->clear();
  for (int64_t k = 0; k < batch; ++k) {
    AugmentDesc& d = (*descs)[static_cast<size_t>(k)];
    d.zero = k >= valid;
    const SampleAugment* a = augments[k];
    if (a == nullptr || d.zero) continue;
    if (!a->ops.empty()) {
      KILN_CHECK(channels == 1 || channels == 3, InvalidArgument, "sample ", k, " has ",
                 a->ops.size(), " AutoAugment ops, which take 1- or 3-channel images, not ",
                 channels);
      d.first_op = static_cast<int32_t>(ops->size());
      d.ops = static_cast<int32_t>(a->ops.size());
      for (const auto& [op, m] : a->ops) ops->push_back(augment_op_params(op, m, h, w));
    }
    const EraseBox& e = a->erase;
    if (e.height == 0 || e.width == 0) continue;
    KILN_CHECK(e.top >= 0 && e.left >= 0 && e.height > 0 && e.width > 0 && e.top + e.height <= h &&
                   e.left + e.width <= w,
               InvalidArgument, "sample ", k, "'s erase box ", e.height, "x", e.width, " at (",
               e.top, ", ", e.left, ") is not inside its ", h, "x", w, " image");
    d.erase_top = static_cast<int32_t>(e.top);
    d.erase_left = static_cast<int32_t>(e.left);
    d.erase_h = static_cast<int32_t>(e.height);
    d.erase_w = static_cast<int32_t>(e.width);
    d.erase_value = e.value;
  }
}

AugmentStage::~AugmentStage() {
  if (upload_pending_) warn_cuda("cudaEventSynchronize", cudaEventSynchronize(uploaded_));
  if (host_) warn_cuda("cudaFreeHost", cudaFreeHost(host_));
  for (void* p : {dev_, static_cast<void*>(scratch_), static_cast<void*>(resampled_)}) {
    if (p) warn_cuda("cudaFree", cudaFree(p));
  }
  if (uploaded_) warn_cuda("cudaEventDestroy", cudaEventDestroy(uploaded_));
}

AugmentStage::Uploaded AugmentStage::upload(const SampleAugment* const* augments, int64_t batch,
                                            int64_t valid, int64_t h, int64_t w, int64_t channels,
                                            cudaStream_t stream) {
  build_augment_descs(augments, batch, valid, h, w, channels, &descs_, &ops_);
  Uploaded up;
  up.any_ops = !ops_.empty();
  for (const AugmentDesc& d : descs_) up.any_erase = up.any_erase || d.erase_h > 0;
  if (!up.any_ops && !up.any_erase) return up;
  const size_t desc_bytes = align256(descs_.size() * sizeof(AugmentDesc));
  const size_t bytes = desc_bytes + ops_.size() * sizeof(AugmentOpParams);
  if (upload_pending_) CUDA_CHECK(cudaEventSynchronize(uploaded_));  // host_ is free again
  upload_pending_ = false;
  if (bytes > cap_) {
    CUDA_CHECK(cudaStreamSynchronize(stream));  // no kernel still reads dev_
    if (host_) CUDA_CHECK(cudaFreeHost(host_));
    if (dev_) CUDA_CHECK(cudaFree(dev_));
    host_ = dev_ = nullptr;
    cap_ = 0;
    const size_t cap = align256(bytes * 5 / 4);
    CUDA_CHECK(cudaHostAlloc(&host_, cap, cudaHostAllocDefault));
    CUDA_CHECK(cudaMalloc(&dev_, cap));
    cap_ = cap;
  }
  if (!uploaded_) CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  auto* host = static_cast<uint8_t*>(host_);
  std::memcpy(host, descs_.data(), descs_.size() * sizeof(AugmentDesc));
  if (!ops_.empty()) {
    std::memcpy(host + desc_bytes, ops_.data(), ops_.size() * sizeof(AugmentOpParams));
  }
  CUDA_CHECK(cudaMemcpyAsync(dev_, host_, bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  upload_pending_ = true;
  auto* dev = static_cast<uint8_t*>(dev_);
  up.descs = reinterpret_cast<const AugmentDesc*>(dev);
  up.ops = reinterpret_cast<const AugmentOpParams*>(dev + desc_bytes);
  return up;
}

namespace {

// Grows a device buffer to `bytes` (never shrinks); the old one may still be read on `stream`.
uint8_t* grow(uint8_t*& buf, int64_t& cap, int64_t bytes, cudaStream_t stream) {
  if (bytes <= cap) return buf;
  if (buf) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaFree(buf));
    buf = nullptr;
    cap = 0;
  }
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&buf), static_cast<size_t>(bytes)));
  cap = bytes;
  return buf;
}

}  // namespace

uint8_t* AugmentStage::scratch(int64_t bytes, cudaStream_t stream) {
  return grow(scratch_, scratch_cap_, bytes, stream);
}

uint8_t* AugmentStage::resampled(int64_t bytes, cudaStream_t stream) {
  return grow(resampled_, resampled_cap_, bytes, stream);
}

void AugmentStage::stage_u8(uint8_t* pixels, const SampleAugment* augments, int64_t batch,
                            int64_t h, int64_t w, const NormParams& norm, void* out, DType dtype,
                            cudaStream_t stream) {
  per_sample_.assign(static_cast<size_t>(batch), nullptr);
  if (augments) {
    for (int64_t k = 0; k < batch; ++k) per_sample_[static_cast<size_t>(k)] = &augments[k];
  }
  const Uploaded up = upload(per_sample_.data(), batch, batch, h, w, norm.channels, stream);
  if (!up.any_ops && !up.any_erase) {
    launch_normalize_u8(pixels, batch * h * w, norm, out, dtype, stream);
    return;
  }
  launch_augment_normalize(pixels, scratch(batch * h * w * norm.channels, stream), up.descs, up.ops,
                           batch, h, w, norm, out, dtype, stream);
}

void AugmentStage::stage_encoded(const SampleDesc* descs, const EncodedBatch& b,
                                 const NormParams& norm, void* out, DType dtype,
                                 cudaStream_t stream) {
  KILN_CHECK(b.size >= 0 && b.size <= b.batch && static_cast<int64_t>(b.images.size()) == b.size,
             InvalidArgument, "encoded batch: ", b.size, " samples of ", b.batch, " with ",
             b.images.size(), " images");
  per_sample_.assign(static_cast<size_t>(b.batch), nullptr);
  for (int64_t k = 0; k < b.size; ++k) {
    per_sample_[static_cast<size_t>(k)] = &b.images[static_cast<size_t>(k)].augment;
  }
  const Uploaded up =
      upload(per_sample_.data(), b.batch, b.size, b.height, b.width, b.channels, stream);
  if (!up.any_ops) {
    // Erasing alone (or nothing): the one resampling kernel, its values unrounded.
    launch_stage_samples(descs, b.batch, b.height, b.width, norm, out, dtype, stream,
                         up.any_erase ? up.descs : nullptr);
    return;
  }
  const int64_t bytes = b.batch * b.sample_bytes();
  uint8_t* px = resampled(bytes, stream);
  launch_stage_samples_u8(descs, b.batch, b.height, b.width, b.channels, px, stream);
  launch_augment_normalize(px, scratch(bytes, stream), up.descs, up.ops, b.batch, b.height, b.width,
                           norm, out, dtype, stream);
}

}  // namespace kiln::cuda
