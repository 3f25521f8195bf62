// The input kernels of input_stage.h. One thread per output pixel (all its channels): the
// sample's row taps outside, its column taps inside, accumulated in float; then the host's
// normalisation with the same roundings (__fmul_rn / __fadd_rn: no FMA contraction), so a
// copied sample is bit-identical to normalize_u8.
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/input_stage.h"

namespace kiln::cuda {

NormParams make_norm_params(const InputNormalization& norm, int64_t channels, const char* who) {
  KILN_CHECK(channels >= 1 && channels <= kMaxInputChannels, InvalidArgument, who, ": input of ",
             channels, " channels; the GPU input stage takes 1 to ", kMaxInputChannels);
  KILN_CHECK(static_cast<int64_t>(norm.mean.size()) == channels &&
                 static_cast<int64_t>(norm.std.size()) == channels,
             InvalidArgument, who, ": ", channels,
             "-channel input needs one mean and one std per channel, got ", norm.mean.size(),
             " and ", norm.std.size());
  NormParams p;
  p.channels = static_cast<int32_t>(channels);
  for (int64_t c = 0; c < channels; ++c) {
    const float sd = norm.std[static_cast<size_t>(c)];
    KILN_CHECK(sd > 0, InvalidArgument, who, ": input std of channel ", c, " must be > 0, got ",
               sd);
    p.scale[c] = 1.0f / (255.0f * sd);
    p.shift[c] = -norm.mean[static_cast<size_t>(c)] / sd;
  }
  return p;
}

AxisDesc axis_desc(const ResampleAxis& a, int64_t size) {
  KILN_CHECK(a.out > 0 && a.scale > 0 && a.lo <= a.hi && size > 0 && size < (int64_t{1} << 30),
             InvalidArgument, "sample geometry axis: out ", a.out, ", scale ", a.scale,
             ", source [", a.lo, ", ", a.hi, ") of ", size,
             " pixels is not a resampling (out and scale > 0, lo <= hi)");
  AxisDesc d;
  d.origin = a.origin;
  d.scale = a.scale;
  d.out = static_cast<int32_t>(a.out);
  auto clamp32 = [](int64_t v) {
    return static_cast<int32_t>(std::clamp<int64_t>(v, -(int64_t{1} << 30), int64_t{1} << 30));
  };
  d.lo = clamp32(a.lo);
  d.hi = clamp32(a.hi);
  d.valid_lo = clamp32(a.valid_lo);
  d.valid_hi = clamp32(a.valid_hi);
  d.size = static_cast<int32_t>(size);
  d.win_lo = 0;
  d.win_n = static_cast<int32_t>(size);
  d.bicubic = a.filter == ResampleFilter::bicubic ? 1 : 0;
  return d;
}

SampleDesc copy_desc(const uint8_t* src, int64_t h, int64_t w, int64_t c) {
  ResampleAxis ay, ax;
  ay.out = ay.hi = ay.valid_hi = h;
  ax.out = ax.hi = ax.valid_hi = w;
  SampleDesc d;
  d.src = src;
  d.pitch = w * c;
  d.y = axis_desc(ay, h);
  d.x = axis_desc(ax, w);
  return d;
}

void axis_span(const AxisDesc& a, int64_t* first, int64_t* last) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (int32_t i = 0; i < a.out; ++i) {
    const Taps t = axis_taps(a, i);
    if (t.count == 0) continue;
    lo = std::min<int64_t>(lo, t.first);
    hi = std::max<int64_t>(hi, int64_t{t.first} + t.count);
  }
  *first = lo <= hi ? lo : 0;
  *last = lo <= hi ? hi : 0;
}

namespace {

template <typename T>
__device__ inline T to_out(float v);
template <>
__device__ inline float to_out<float>(float v) {
  return v;
}
template <>
__device__ inline __half to_out<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ inline uint8_t to_out<uint8_t>(float v) {  // the zero of padding samples only
  return static_cast<uint8_t>(v);
}

// T = uint8_t: the resampled bytes (no normalisation, no erasing), rounded as resample_u8.
template <typename T, int C>
__global__ void stage_samples_kernel(const SampleDesc* __restrict__ descs, int64_t batch, int32_t h,
                                     int32_t w, NormParams norm, const AugmentDesc* augments,
                                     T* __restrict__ out) {
  constexpr bool kBytes = std::is_same_v<T, uint8_t>;
  const int64_t plane = int64_t{h} * w;
  const int64_t total = batch * plane;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t k = idx / plane;
    const int64_t rem = idx - k * plane;
    const int32_t oy = static_cast<int32_t>(rem / w), ox = static_cast<int32_t>(rem % w);
    const SampleDesc& s = descs[k];
    T* o = out + idx * C;
    if (s.zero) {
#pragma unroll
      for (int c = 0; c < C; ++c) o[c] = to_out<T>(0.0f);
      continue;
    }
    // The flip is applied last: output column ox is column w - 1 - ox of the unflipped output.
    const Taps ty = axis_taps(s.y, oy);
    const Taps tx = axis_taps(s.x, s.flip ? w - 1 - ox : ox);
    float acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    if (s.src != nullptr && ty.count > 0 && tx.count > 0) {
      for (int32_t jy = ty.first; jy < ty.first + ty.count; ++jy) {
        const int32_t ry = jy - s.y.win_lo;
        if (ry < 0 || ry >= s.y.win_n) continue;  // outside the decoded window: never, by axis_span
        const uint8_t* row = s.src + ry * s.pitch;
        float racc[C];
#pragma unroll
        for (int c = 0; c < C; ++c) racc[c] = 0.0f;
        for (int32_t jx = tx.first; jx < tx.first + tx.count; ++jx) {
          const int32_t rx = jx - s.x.win_lo;
          if (rx < 0 || rx >= s.x.win_n) continue;
          const float wx = tap_weight(tx, jx);
          const uint8_t* p = row + int64_t{rx} * C;
#pragma unroll
          for (int c = 0; c < C; ++c) racc[c] += wx * static_cast<float>(p[c]);
        }
        const float wy = tap_weight(ty, jy);
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] += wy * racc[c];
      }
    }
    if constexpr (kBytes) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float v = fminf(255.0f, fmaxf(0.0f, __fadd_rn(acc[c], 0.5f)));
        o[c] = static_cast<uint8_t>(static_cast<int32_t>(v));
      }
    } else {
      // Bicubic overshoots the source's range: clamp to bytes' as the host's rounding does.
      if (ty.bicubic) {
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] = fminf(255.0f, fmaxf(0.0f, acc[c]));
      }
      const bool erase = augments != nullptr && erased(augments[k], oy, ox);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        o[c] = to_out<T>(erase ? augments[k].erase_value
                               : __fadd_rn(__fmul_rn(acc[c], norm.scale[c]), norm.shift[c]));
      }
    }
  }
}

template <typename T>
__global__ void normalize_u8_kernel(const uint8_t* __restrict__ in, int64_t n, NormParams norm,
                                    T* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int c = static_cast<int>(i % norm.channels);
    out[i] =
        to_out<T>(__fadd_rn(__fmul_rn(static_cast<float>(in[i]), norm.scale[c]), norm.shift[c]));
  }
}

template <typename L>
__global__ void stage_labels_kernel(const L* __restrict__ in, int64_t count, int64_t batch,
                                    int32_t classes, int32_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < batch;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (i >= count) {
      out[i] = -1;
      continue;
    }
    const L v = in[i];
    out[i] = v >= 0 && v < static_cast<L>(classes) ? static_cast<int32_t>(v) : classes;
  }
}

constexpr int kThreads = 256;
unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, int64_t{1} << 20));
}

template <typename T>
void launch_samples_t(const SampleDesc* descs, int64_t batch, int32_t h, int32_t w,
                      const NormParams& norm, const AugmentDesc* augments, T* out,
                      cudaStream_t stream) {
  const unsigned blocks = blocks_for(batch * h * w);
  switch (norm.channels) {
    case 1:
      stage_samples_kernel<T, 1>
          <<<blocks, kThreads, 0, stream>>>(descs, batch, h, w, norm, augments, out);
      break;
    case 3:
      stage_samples_kernel<T, 3>
          <<<blocks, kThreads, 0, stream>>>(descs, batch, h, w, norm, augments, out);
      break;
    case 2:
      stage_samples_kernel<T, 2>
          <<<blocks, kThreads, 0, stream>>>(descs, batch, h, w, norm, augments, out);
      break;
    case 4:
      stage_samples_kernel<T, 4>
          <<<blocks, kThreads, 0, stream>>>(descs, batch, h, w, norm, augments, out);
      break;
    default:
      KILN_FAIL(InvalidArgument, "GPU input stage: ", norm.channels, " channels; it takes 1 to 4");
  }
  KILN_LAUNCH_CHECK("stage_samples_kernel");
}

}  // namespace

void launch_stage_samples(const SampleDesc* descs, int64_t batch, int64_t h, int64_t w,
                          const NormParams& norm, void* out, DType dtype, cudaStream_t stream,
                          const AugmentDesc* augments) {
  KILN_CHECK(batch > 0 && h > 0 && w > 0 && h < (int64_t{1} << 30) && w < (int64_t{1} << 30),
             InvalidArgument, "GPU input stage: a batch of ", batch, " samples of ", h, "x", w);
  if (dtype == DType::F32) {
    launch_samples_t(descs, batch, static_cast<int32_t>(h), static_cast<int32_t>(w), norm, augments,
                     static_cast<float*>(out), stream);
  } else if (dtype == DType::F16) {
    launch_samples_t(descs, batch, static_cast<int32_t>(h), static_cast<int32_t>(w), norm, augments,
                     static_cast<__half*>(out), stream);
  } else {
    KILN_FAIL(Unsupported, "GPU input stage: the input slot is ", dtype_name(dtype),
              "; it writes F32 or F16");
  }
}

void launch_stage_samples_u8(const SampleDesc* descs, int64_t batch, int64_t h, int64_t w,
                             int64_t channels, uint8_t* out, cudaStream_t stream) {
  KILN_CHECK(batch > 0 && h > 0 && w > 0 && h < (int64_t{1} << 30) && w < (int64_t{1} << 30),
             InvalidArgument, "GPU input stage: a batch of ", batch, " samples of ", h, "x", w);
  KILN_CHECK(channels >= 1 && channels <= kMaxInputChannels, InvalidArgument,
             "GPU input stage: ", channels, " channels; it takes 1 to ", kMaxInputChannels);
  NormParams bytes;  // unused by the byte kernel but for its channel count
  bytes.channels = static_cast<int32_t>(channels);
  launch_samples_t(descs, batch, static_cast<int32_t>(h), static_cast<int32_t>(w), bytes, nullptr,
                   out, stream);
}

void launch_normalize_u8(const uint8_t* in, int64_t pixels, const NormParams& norm, void* out,
                         DType dtype, cudaStream_t stream) {
  const int64_t n = pixels * norm.channels;
  if (n == 0) return;
  if (dtype == DType::F32) {
    normalize_u8_kernel<float>
        <<<blocks_for(n), kThreads, 0, stream>>>(in, n, norm, static_cast<float*>(out));
  } else if (dtype == DType::F16) {
    normalize_u8_kernel<__half>
        <<<blocks_for(n), kThreads, 0, stream>>>(in, n, norm, static_cast<__half*>(out));
  } else {
    KILN_FAIL(Unsupported, "stage_batch_u8: the input slot is ", dtype_name(dtype),
              "; it writes F32 or F16");
  }
  KILN_LAUNCH_CHECK("normalize_u8_kernel");
}

void launch_stage_labels(const void* in, DType dtype, int64_t count, int64_t batch, int32_t classes,
                         int32_t* out, cudaStream_t stream) {
  KILN_CHECK(count >= 0 && count <= batch && classes > 0, InvalidArgument, "stage labels: ", count,
             " labels for a batch of ", batch, " and ", classes, " classes");
  if (batch == 0) return;
  if (dtype == DType::I32) {
    stage_labels_kernel<int32_t><<<blocks_for(batch), kThreads, 0, stream>>>(
        static_cast<const int32_t*>(in), count, batch, classes, out);
  } else if (dtype == DType::I64) {
    stage_labels_kernel<int64_t><<<blocks_for(batch), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(in), count, batch, classes, out);
  } else {
    KILN_FAIL(InvalidArgument, "stage labels: labels are ", dtype_name(dtype),
              "; they must be int32 or int64");
  }
  KILN_LAUNCH_CHECK("stage_labels_kernel");
}

}  // namespace kiln::cuda
