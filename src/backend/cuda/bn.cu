// Batch normalisation on the GPU (NHWC; features f32 or f16, gamma/beta/statistics f32).
// Own kernels rather than cuDNN's: three small passes that later fuse with their neighbours
// (SPEC S12, S15), and the statistics convention is kiln's, exactly:
//  - saved = [mean; invstd] (2 x C), invstd = 1 / sqrt(biased_var + eps);
//  - running = (1 - m) running + m batch, with the unbiased variance n/(n-1) var (PyTorch),
//    computed in double from the FP32-rounded batch mean and variance, as the CPU kernel.
// Per-channel sums are taken in double (block partials in the stream's workspace, then one
// finalize pass), so the statistics do not depend on the batch size's rounding.
#include "backend/cuda/bn_stats.cuh"
#include "backend/cuda/channel_sums.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/fused_kernels.h"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

// ---- finalize passes ---------------------------------------------------------------------
// The reductions leave one double2 partial per channel and row chunk ([chunks][C], chunks =
// 4 per multiprocessor: 528 on the H200); a block of 8 channels (one 128-byte line of each
// partial row) x 64 slices adds them up: slice j takes chunks j, j + 64, ... in two
// independent chains (loads in flight), then the slices combine in a fixed tree, so the sums
// are deterministic. The first form, 32 channels x 16 slices with one chain each, took ~10 us
// a launch on the H200 (ResNet-50: 106 launches, 1.0 ms a step): too few blocks for small C
// and each thread's 33 loads one after another.
constexpr int kFinC = 8, kFinS = 64;

// The channel's [sum, second sum] over all chunks, in every thread of the block.
__device__ __forceinline__ double2 sum_partials(const double2* __restrict__ partial, int gy,
                                                int64_t C, int64_t c) {
  __shared__ double2 sm[kFinS][kFinC];
  double2 a = make_double2(0.0, 0.0), b = make_double2(0.0, 0.0);
  if (c < C) {
    int j = threadIdx.y;
    for (; j + kFinS < gy; j += 2 * kFinS) {
      const double2 p = partial[static_cast<int64_t>(j) * C + c];
      const double2 q = partial[static_cast<int64_t>(j + kFinS) * C + c];
      a.x += p.x;
      a.y += p.y;
      b.x += q.x;
      b.y += q.y;
    }
    if (j < gy) {
      const double2 p = partial[static_cast<int64_t>(j) * C + c];
      a.x += p.x;
      a.y += p.y;
    }
  }
  sm[threadIdx.y][threadIdx.x] = make_double2(a.x + b.x, a.y + b.y);
  __syncthreads();
#pragma unroll
  for (int w = kFinS / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.y) < w) {
      sm[threadIdx.y][threadIdx.x].x += sm[threadIdx.y + w][threadIdx.x].x;
      sm[threadIdx.y][threadIdx.x].y += sm[threadIdx.y + w][threadIdx.x].y;
    }
    __syncthreads();
  }
  return sm[0][threadIdx.x];
}

// saved = [mean; invstd], the running statistics, and the apply pass's coefficients
// coef[c] = (mean, gamma * invstd, beta).
__global__ void __launch_bounds__(kFinC* kFinS)
    stats_finalize_kernel(const double2* partial, int gy, int64_t rows, int64_t C, float eps,
                          float momentum, float* saved, float* running_mean, float* running_var,
                          const float* gamma, const float* beta, const float* conv_bias,
                          float4* coef) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinC + threadIdx.x;
  const double2 sums = sum_partials(partial, gy, C, c);
  if (threadIdx.y != 0 || c >= C) return;
  const double n = static_cast<double>(rows);
  const double mean = sums.x / n;
  const double var = fmax(sums.y / n - mean * mean, 0.0);
  const auto mean_f = static_cast<float>(mean), var_f = static_cast<float>(var);
  const float invstd_f = formula::bn_invstd(var_f, eps);
  saved[c] = mean_f;
  saved[C + c] = invstd_f;
  const double unbias = formula::bn_unbias(n);
  const double m = momentum;
  // A fused convolution's bias, which BN cancels, still moves the running mean (ops.def).
  const double batch_mean =
      conv_bias ? static_cast<double>(mean_f) + conv_bias[c] : static_cast<double>(mean_f);
  running_mean[c] = formula::running_mean_update(running_mean[c], m, batch_mean);
  running_var[c] = formula::running_var_update(running_var[c], m, unbias, var_f);
  coef[c] = make_float4(mean_f, gamma[c] * invstd_f, beta[c], 0.0f);
}

// The per-channel sums that conv+genstats produced (FP32: [sum; sum of squares]) as the one
// partial row the finalize pass reads.
__global__ void sums_to_partial(const float* sums, int64_t C, double2* partial) {
  KILN_GRID_STRIDE(c, C) partial[c] = make_double2(sums[c], sums[C + c]);
}

// dgamma = sum g xhat, dbeta = sum g; coefficients of dx = k1 (g - mg - (x - mean) k3).
__global__ void __launch_bounds__(kFinC* kFinS)
    bwd_finalize_kernel(const double2* partial, int gy, int64_t rows, int64_t C, const float* saved,
                        const float* gamma, float* dgamma, float* dbeta, float4* coef) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinC + threadIdx.x;
  const double2 sums = sum_partials(partial, gy, C, c);
  if (threadIdx.y != 0 || c >= C) return;
  const double s = sums.x, sx = sums.y;
  const double invstd = saved[C + c], n = static_cast<double>(rows);
  dbeta[c] = static_cast<float>(s);
  dgamma[c] = static_cast<float>(sx * invstd);
  coef[c] = make_float4(saved[c], static_cast<float>(gamma[c] * invstd), static_cast<float>(s / n),
                        static_cast<float>(sx * invstd * invstd / n));
}

inline unsigned finalize_grid(int64_t C) {
  return static_cast<unsigned>((C + kFinC - 1) / kFinC);
}

// ---- plain elementwise kernels (any C, any alignment) ----------------------------------

template <typename T>
__global__ void apply_kernel(const T* x, T* y, int64_t count, int64_t C, const float4* coef) {
  KILN_GRID_STRIDE(i, count) {
    const float4 k = coef[i % C];
    y[i] = from_f<T>((to_f(x[i]) - k.x) * k.y + k.z);
  }
}

// Inference BatchNorm with the running statistics; with Relu (bn_relu_infer) the value is
// rounded to T, the residual added and rounded again (the add op's rounding), then relu_fwd's
// ReLU (NaN passes): the unfused chain's bits.
template <typename T, bool Relu>
__global__ void infer_kernel(const T* x, const T* residual, T* y, int64_t count, int64_t C,
                             const float* rm, const float* rv, const float* gamma,
                             const float* beta, float eps) {
  KILN_GRID_STRIDE(i, count) {
    const int64_t c = i % C;
    const float scale = gamma[c] / sqrtf(rv[c] + eps);
    T v = from_f<T>((to_f(x[i]) - rm[c]) * scale + beta[c]);
    if constexpr (Relu) {
      if (residual) v = from_f<T>(to_f(v) + to_f(residual[i]));
      const float f = to_f(v);
      v = f > 0.0f || isnan(f) ? v : from_f<T>(0.0f);
    }
    y[i] = v;
  }
}

// g = dy where the mask passes it (fused ops; a null mask passes all), written to dres when
// asked (BN+add+ReLU's residual gradient); dx from g. Any of dy, dres, dx may alias.
template <typename T>
__global__ void bwd_dx_kernel(const T* x, const T* dy, const T* dy2, const uint8_t* mask, T* dx,
                              T* dres, int64_t count, int64_t C, const float4* coef,
                              PoolMap pm = {}) {
  KILN_GRID_STRIDE(i, count) {
    const float4 k = coef[i % C];
    const T g =
        mask_bit(mask, i) ? grad_sum(dy[pm.row(i / C) * C + i % C], dy2, i) : from_f<T>(0.0f);
    const float v = k.y * (to_f(g) - k.z - (to_f(x[i]) - k.x) * k.w);
    if (dres) dres[i] = g;
    dx[i] = from_f<T>(v);
  }
}

// The forward epilogue of the fused ops, any C: y = relu(bn(x) [+ residual]) with its bit
// mask, one thread per mask byte (eight elements) so that no two threads share a byte. The
// arithmetic and its roundings are the unfused chain's (apply, add, relu_fwd), so the fused
// forward gives the same bits: the BN output is rounded to T before the residual is added,
// the sum rounded again.
template <typename T>
__device__ __forceinline__ T bn_relu_one(float x, const T* res, float4 k, unsigned& bits, int j) {
  T v = from_f<T>((x - k.x) * k.y + k.z);
  if (res) v = from_f<T>(to_f(v) + to_f(*res));
  const float f = to_f(v);
  bits |= (f > 0.0f ? 1u : 0u) << j;
  return f > 0.0f || isnan(f) ? v : from_f<T>(0.0f);  // relu_fwd: NaN passes, its bit is 0
}

template <typename T>
__global__ void apply_relu_mask_kernel(const T* x, const T* residual, T* y, uint8_t* mask,
                                       int64_t count, int64_t C, const float4* coef) {
  KILN_GRID_STRIDE(g, (count + 7) / 8) {
    unsigned bits = 0;
    for (int j = 0; j < 8 && g * 8 + j < count; ++j) {
      const int64_t e = g * 8 + j;
      y[e] = bn_relu_one(to_f(x[e]), residual ? residual + e : nullptr, coef[e % C], bits, j);
    }
    mask[g] = static_cast<uint8_t>(bits);
  }
}

// ---- 16-byte kernels (KILN_VECTOR_KERNELS, on by default) ------------------------------
// The statistics reduction and its helpers are in bn_stats.cuh.

// The mask bits of 16-byte vector vi (V elements from element vi * V): a whole byte for f16,
// half of one for f32.
template <int V>
__device__ __forceinline__ unsigned vec_mask_bits(const uint8_t* mask, int64_t vi) {
  static_assert(V == 8 || V == 4, "16-byte vectors of f16 or f32");
  if (mask == nullptr) return 0xFFu;
  if constexpr (V == 8) {
    return mask[vi];
  } else {
    return (mask[vi >> 1] >> ((vi & 1) * 4)) & 0xFu;
  }
}

template <typename T>
__global__ void __launch_bounds__(kVecThreads)
    bwd_partial_vec(const T* x, const T* dy, const T* dy2, const uint8_t* mask, const float* mean,
                    int rows, int C, double2* partial, PoolMap pm = {}) {
  constexpr int V = kVec<T>, U = 4;  // U rows (2U loads) in flight
  const int cv = C / V, cvec = threadIdx.x % cv, rpb = kVecThreads / cv, rstride = gridDim.x * rpb;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  const auto* gv = reinterpret_cast<const uint4*>(dy);
  const auto* g2v = reinterpret_cast<const uint4*>(dy2);
  double s[V], sx[V], mu[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s[j] = sx[j] = 0.0;
    mu[j] = mean[cvec * V + j];
  }
  for (int r = blockIdx.x * rpb + threadIdx.x / cv; r < rows; r += U * rstride) {
    uint4 a[U], g[U], g2[U];
    unsigned m[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ru = r + u * rstride;
      a[u] = load_row<T>(xv, ru, rows, cv, cvec);
      g[u] = ru < rows ? gv[pm.row(ru) * cv + cvec]
                       : make_uint4(0, 0, 0, 0);  // a zero dy adds nothing
      if (dy2) g2[u] = load_row<T>(g2v, ru, rows, cv, cvec);
      m[u] = ru < rows ? vec_mask_bits<V>(mask, static_cast<int64_t>(ru) * cv + cvec) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* xe = reinterpret_cast<const T*>(&a[u]);
      const T* ge = reinterpret_cast<const T*>(&g[u]);
      const T* g2e = reinterpret_cast<const T*>(&g2[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const T gs = dy2 ? from_f<T>(to_f(ge[j]) + to_f(g2e[j])) : ge[j];  // grad_sum's rounding
        const double gj = (m[u] >> j) & 1u ? static_cast<double>(to_f(gs)) : 0.0;
        s[j] += gj;
        sx[j] += gj * (static_cast<double>(to_f(xe[j])) - mu[j]);
      }
    }
  }
  combine_store<V>(s, sx, cv, cvec, C, partial);
}

// Elementwise passes over groups of eight channels (one 16-byte vector of f16, two of f32;
// one mask byte). Each thread keeps one group's channels - and so their coefficients, in
// registers - and walks rows, two groups in flight: a pass reads each coefficient once per
// thread instead of once per element (the first version read a float4 per element and ran
// at ~0.9-1.4 TB/s). cg = C / 8 groups per row, 256 % cg == 0; the arithmetic is the plain
// kernels', expression for expression.
template <typename T>
inline constexpr int kWords8 = 8 * static_cast<int>(sizeof(T)) / 16;

template <typename T>
__device__ __forceinline__ void load8(const T* p, T (&v)[8]) {
#pragma unroll
  for (int w = 0; w < kWords8<T>; ++w)
    reinterpret_cast<uint4*>(v)[w] = reinterpret_cast<const uint4*>(p)[w];
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const T (&v)[8]) {
#pragma unroll
  for (int w = 0; w < kWords8<T>; ++w)
    reinterpret_cast<uint4*>(p)[w] = reinterpret_cast<const uint4*>(v)[w];
}

// Relu: the fused epilogue (mask non-null; residual optional), else BatchNorm's apply.
template <typename T, bool Relu>
__global__ void __launch_bounds__(kVecThreads)
    apply_group(const T* x, const T* residual, T* y, uint8_t* mask, int rows, int cg,
                const float4* coef) {
  const int gi = threadIdx.x % cg, rpb = kVecThreads / cg, rstride = gridDim.x * rpb;
  float4 k[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) k[j] = coef[gi * 8 + j];
  for (int r = blockIdx.x * rpb + threadIdx.x / cg; r < rows; r += 2 * rstride) {
    alignas(16) T a[2][8], b[2][8];
    int64_t g[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      g[u] = static_cast<int64_t>(r + u * rstride) * cg + gi;
      if (u == 0 || r + rstride < rows) {
        load8(x + g[u] * 8, a[u]);
        if (Relu && residual) load8(residual + g[u] * 8, b[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && r + rstride >= rows) break;
      alignas(16) T o[8];
      if constexpr (Relu) {
        unsigned bits = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          o[j] = bn_relu_one(to_f(a[u][j]), residual ? &b[u][j] : nullptr, k[j], bits, j);
        mask[g[u]] = static_cast<uint8_t>(bits);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = from_f<T>((to_f(a[u][j]) - k[j].x) * k[j].y + k[j].z);
      }
      store8(y + g[u] * 8, o);
    }
  }
}

// cbr_pool_fwd's epilogue (ops.def): y = the max-pool of relu(bn(z)) over pool x pool windows
// that tile z, and the routing mask over z. One thread per pooled pixel and group of eight
// channels, so each mask byte (eight channels of one pixel of z) has one writer; the group's
// coefficients stay in registers, and the window's loads are all issued before the
// arithmetic (P = 2, VGG's pool: four 16-byte loads in flight; P = 0: any window, read
// position by position). The values are bn_relu_one's and the window scan maxpool_fwd's
// (first maximum in window order, NaN wins), so the unfused chain's bits; a mask bit is set
// where the pool took the element and the ReLU passed it. Vec: 16-byte loads and stores
// (aligned maps). Thread indices are 32-bit (the host checks pixels x groups < 2^31).
template <typename T>
__device__ __forceinline__ void pool_take(const T (&a)[8], const float4 (&k)[8], int pos,
                                          T (&best)[8], float (&bestf)[8], int (&at)[8]) {
  unsigned unused = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const T v = bn_relu_one(to_f(a[j]), static_cast<const T*>(nullptr), k[j], unused, j);
    const float f = to_f(v);
    if (f > bestf[j] || isnan(f) || at[j] < 0) {
      bestf[j] = f;
      best[j] = v;
      at[j] = pos;
    }
  }
}

template <typename T, bool Vec>
__device__ __forceinline__ void load_group(const T* p, T (&v)[8]) {
  if constexpr (Vec) {
    load8(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = p[j];
  }
}

template <typename T, bool Vec, int P>
__global__ void __launch_bounds__(kVecThreads)
    apply_relu_pool(const T* z, T* y, uint8_t* mask, int total, int cg, int hp, int wp, int pool_rt,
                    const float4* coef) {
  const int pool = P ? P : pool_rt;
  const int zw = wp * pool;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const int gi = t % cg, pix = t / cg;
    const int pq = pix / wp,
              pw = pix - pq * wp;  // pq = b hp + ph: z's image row of the window's top is pq * pool
    float4 k[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) k[j] = coef[gi * 8 + j];
    alignas(16) T best[8];
    float bestf[8];
    int at[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      bestf[j] = -INFINITY;
      at[j] = -1;
    }
    // Element (pixel, group) of z's top-left window position; (dh, dw) moves by rows and pixels.
    const int64_t top =
        ((static_cast<int64_t>(pq) * pool * zw + static_cast<int64_t>(pw) * pool) * cg + gi) * 8;
    const int64_t drow = static_cast<int64_t>(zw) * cg * 8, dpix = static_cast<int64_t>(cg) * 8;
    if constexpr (P == 2) {
      alignas(16) T a[4][8];
      load_group<T, Vec>(z + top, a[0]);
      load_group<T, Vec>(z + top + dpix, a[1]);
      load_group<T, Vec>(z + top + drow, a[2]);
      load_group<T, Vec>(z + top + drow + dpix, a[3]);
#pragma unroll
      for (int q = 0; q < 4; ++q) pool_take(a[q], k, q, best, bestf, at);
    } else {
      for (int dh = 0; dh < pool; ++dh) {
        for (int dw = 0; dw < pool; ++dw) {
          alignas(16) T a[8];
          load_group<T, Vec>(z + top + dh * drow + dw * dpix, a);
          pool_take(a, k, dh * pool + dw, best, bestf, at);
        }
      }
    }
    if constexpr (Vec) {
      store8(y + static_cast<int64_t>(t) * 8, best);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) y[static_cast<int64_t>(t) * 8 + j] = best[j];
    }
    for (int dh = 0; dh < pool; ++dh) {
      for (int dw = 0; dw < pool; ++dw) {
        unsigned bits = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          bits |= (at[j] == dh * pool + dw && bestf[j] > 0.0f ? 1u : 0u) << j;
        mask[(top + dh * drow + dw * dpix) / 8] = static_cast<uint8_t>(bits);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kVecThreads)
    bwd_dx_group(const T* x, const T* dy, const T* dy2, const uint8_t* mask, T* dx, T* dres,
                 int rows, int cg, const float4* coef, PoolMap pm = {}) {
  const int gi = threadIdx.x % cg, rpb = kVecThreads / cg, rstride = gridDim.x * rpb;
  float4 k[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) k[j] = coef[gi * 8 + j];
  for (int r = blockIdx.x * rpb + threadIdx.x / cg; r < rows; r += 2 * rstride) {
    alignas(16) T a[2][8], d[2][8];
    unsigned m[2] = {0xFFu, 0xFFu};
    int64_t g[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      g[u] = static_cast<int64_t>(r + u * rstride) * cg + gi;
      if (u == 0 || r + rstride < rows) {
        load8(x + g[u] * 8, a[u]);
        load8(dy + (pm.row(r + u * rstride) * cg + gi) * 8, d[u]);
        if (dy2) {
          alignas(16) T d2[8];
          load8(dy2 + g[u] * 8, d2);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            d[u][j] = from_f<T>(to_f(d[u][j]) + to_f(d2[j]));  // grad_sum's rounding
        }
        if (mask) m[u] = mask[g[u]];
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && r + rstride >= rows) break;
      alignas(16) T o[8];
      if (mask) {
#pragma unroll
        for (int j = 0; j < 8; ++j) d[u][j] = (m[u] >> j) & 1u ? d[u][j] : from_f<T>(0.0f);
        if (dres) store8(dres + g[u] * 8, d[u]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[j] = from_f<T>(k[j].y * (to_f(d[u][j]) - k[j].z - (to_f(a[u][j]) - k[j].x) * k[j].w));
      }
      store8(dx + g[u] * 8, o);
    }
  }
}

// The 16-byte plan of a reduction over one BN node's map (vectors of V channels), or none.
struct BnVec {
  bool on = false;
  int cv = 0, blocks = 0;
};

BnVec bn_vec(const Context& ctx, DType dt, int64_t rows, int64_t C,
             std::initializer_list<const void*> ptrs) {
  BnVec v;
  const int width = dt == DType::F32 ? 4 : 8;
  if (C % width != 0 || !vec_fits(ctx.opts, rows * C, width, ptrs)) return v;
  const int64_t cv = C / width;
  if (cv > kVecThreads || kVecThreads % cv != 0) return v;
  v.on = true;
  v.cv = static_cast<int>(cv);
  v.blocks = stats_vec_blocks(rows, cv, ctx.sm_count);
  return v;
}

// The plan of an elementwise pass over groups of eight channels, or none.
struct GroupPlan {
  bool on = false;
  int cg = 0, blocks = 0;
};

GroupPlan group_plan(const Context& ctx, int64_t rows, int64_t C,
                     std::initializer_list<const void*> ptrs) {
  GroupPlan p;
  if (C % 8 != 0 || !vec_fits(ctx.opts, rows * C, 8, ptrs) || rows >= (int64_t{1} << 31)) return p;
  const int64_t cg = C / 8;
  if (cg > kVecThreads || kVecThreads % cg != 0) return p;
  const int64_t rpb = kVecThreads / cg;
  p.on = true;
  p.cg = static_cast<int>(cg);
  // Two rows per thread per trip; up to 8 blocks of 256 per multiprocessor.
  p.blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((rows + 2 * rpb - 1) / (2 * rpb), ctx.sm_count * 8)));
  return p;
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

Nhwc bn_check(const Context& ctx, const Node& n, TensorId x,
              std::initializer_list<TensorId> same_shape,
              std::initializer_list<TensorId> per_channel) {
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_float(ctx, n, x, "x");
  for (TensorId id : same_shape) {
    if (id == kNoTensor) continue;  // cbr_pool_fwd's y is pooled (checked by its caller)
    expect_same_dtype(ctx, n, x, id);
    KILN_CHECK(ctx.tensor(id).numel() == ctx.tensor(x).numel(), Shape, op_name(n.op), " node '",
               n.label, "': '", ctx.tensor(id).name, "' has shape ", ctx.tensor(id).shape.str(),
               ", x has ", ctx.tensor(x).shape.str());
  }
  expect_per_channel(ctx, n, per_channel, s.c);
  KILN_CHECK(n.attrs.eps > 0.0f, InvalidArgument, op_name(n.op), " node '", n.label,
             "': eps must be > 0, is ", n.attrs.eps);
  return s;
}

constexpr int kThreads = 256;

// What one BatchNorm training forward reads and writes. residual and mask are the fused
// BN+ReLU epilogue's (mask non-null: y = relu(bn(x) [+ residual]) with its bit mask).
struct BnFwd {
  const void* x = nullptr;
  const void* residual = nullptr;
  void* y = nullptr;
  uint8_t* mask = nullptr;
  float *saved = nullptr, *rm = nullptr, *rv = nullptr;
  const float *gamma = nullptr, *beta = nullptr;
  const float* conv_bias = nullptr;  // cbr_fwd's optional b (ops.def)
  const float* sums = nullptr;  // x's [sum; sum of squares] per channel from conv+genstats, or none
  float eps = 0.0f, momentum = 0.0f;
  int pool = 0;  // cbr_pool_fwd: y is the max-pool of the ReLU output by pool x pool windows, mask
                 // covers x
};

// What one BatchNorm backward reads and writes. mask non-null: the gradient at BN's output is
// dy where the mask passes it (the fused ReLU backward), written to dres when that is given.
struct BnBwd {
  const void* x = nullptr;
  const void* dy = nullptr;
  const void* dy2 = nullptr;  // bn_add_relu_bwd's second gradient contribution, added to dy
  const uint8_t* mask = nullptr;
  void *dx = nullptr, *dres = nullptr;
  const float *saved = nullptr, *gamma = nullptr;
  float *dgamma = nullptr, *dbeta = nullptr;
  PoolMap pm;  // cbr_pool_bwd: dy is the max-pooled map's gradient
};

// Statistics (per-channel double sums, then the finalize pass, which also forms the apply
// coefficients), then the apply pass (with the fused ReLU and mask when a.mask is set): the
// 16-byte kernels where the shape and pointers allow, else the plain ones.
KernelPtr bn_forward(Context& ctx, int stream, const Nhwc& s, DType dt, const BnFwd& a) {
  const ChannelDims d = channel_dims(ctx, s);
  const auto C = d.c;
  const BnVec v = bn_vec(ctx, dt, d.rows, C, {a.x});
  const GroupPlan gp = group_plan(ctx, d.rows, C, {a.x, a.residual, a.y});
  // cbr_pool_fwd: one thread per pooled pixel and group of eight channels (C % 8 == 0, as the
  // merge pass plans it), 16-byte accesses where the maps allow.
  KILN_CHECK(!a.pool || (C % 8 == 0 && a.mask && s.h % a.pool == 0 && s.w % a.pool == 0), Internal,
             "BatchNorm with a merged max-pool needs C % 8 == 0 and windows that tile the map (C ",
             C, ", ", s.h, "x", s.w, ", pool ", a.pool, ")");
  const bool pool_vec = a.pool && vec_fits(ctx.opts, d.rows * C, 8, {a.x, a.y});
  const int64_t pooled_pixels = a.pool ? d.rows / (a.pool * a.pool) : 0;
  KILN_CHECK(pooled_pixels * (C / 8) < (int64_t{1} << 31), Unsupported,
             "BatchNorm with a merged max-pool: ", pooled_pixels, " pooled pixels x ", C / 8,
             " channel groups; the kernel indexes them in 32 bits");
  const unsigned pgrid = a.pool ? grid_for(ctx, pooled_pixels * (C / 8), kVecThreads) : 1;
  const int hp = a.pool ? static_cast<int>(s.h / a.pool) : 0,
            wp = a.pool ? static_cast<int>(s.w / a.pool) : 0;
  const int chunks = a.sums ? 1 : v.on ? v.blocks : d.gy;
  const size_t coef_off =
      align256(sizeof(double2) * static_cast<size_t>(chunks) * static_cast<size_t>(C));
  ctx.need_workspace(stream, coef_off + sizeof(float4) * static_cast<size_t>(C));
  const dim3 rgrid(static_cast<unsigned>((C + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const int64_t count = d.rows * C;
  const unsigned egrid = grid_for(ctx, a.mask ? (count + 7) / 8 : count, kThreads);
  const unsigned cgrid = grid_for(ctx, C, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
      auto* partial = reinterpret_cast<double2*>(ws);
      auto* coef = reinterpret_cast<float4*>(ws + coef_off);
      const T* x = static_cast<const T*>(a.x);
      const T* res = static_cast<const T*>(a.residual);
      T* y = static_cast<T*>(a.y);
      if (a.sums) {
        sums_to_partial<<<cgrid, kThreads, 0, st>>>(a.sums, C, partial);
        KILN_LAUNCH_CHECK("bn stats from conv+genstats");
      } else if (v.on) {
        stats_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(x, static_cast<int>(d.rows),
                                                               static_cast<int>(C), partial);
        KILN_LAUNCH_CHECK("bn stats (vec)");
      } else {
        stats_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(x, d.rows, C, partial);
        KILN_LAUNCH_CHECK("bn stats");
      }
      stats_finalize_kernel<<<finalize_grid(C), dim3(kFinC, kFinS), 0, st>>>(
          partial, chunks, d.rows, C, a.eps, a.momentum, a.saved, a.rm, a.rv, a.gamma, a.beta,
          a.conv_bias, coef);
      KILN_LAUNCH_CHECK("bn stats finalize");
      if (a.pool) {
        const int cg = static_cast<int>(C / 8), total = static_cast<int>(pooled_pixels * (C / 8));
        if (a.pool == 2 && pool_vec) {
          apply_relu_pool<T, true, 2>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, 2, coef);
        } else if (a.pool == 2) {
          apply_relu_pool<T, false, 2>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, 2, coef);
        } else if (pool_vec) {
          apply_relu_pool<T, true, 0>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, a.pool, coef);
        } else {
          apply_relu_pool<T, false, 0>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, a.pool, coef);
        }
        KILN_LAUNCH_CHECK("bn apply + relu + max-pool + mask");
      } else if (gp.on && a.mask) {
        apply_group<T, true><<<gp.blocks, kVecThreads, 0, st>>>(
            x, res, y, a.mask, static_cast<int>(d.rows), gp.cg, coef);
        KILN_LAUNCH_CHECK("bn apply + relu + mask (vec)");
      } else if (gp.on) {
        apply_group<T, false><<<gp.blocks, kVecThreads, 0, st>>>(
            x, nullptr, y, nullptr, static_cast<int>(d.rows), gp.cg, coef);
        KILN_LAUNCH_CHECK("bn apply (vec)");
      } else if (a.mask) {
        apply_relu_mask_kernel<T><<<egrid, kThreads, 0, st>>>(x, res, y, a.mask, count, C, coef);
        KILN_LAUNCH_CHECK("bn apply + relu + mask");
      } else {
        apply_kernel<T><<<egrid, kThreads, 0, st>>>(x, y, count, C, coef);
        KILN_LAUNCH_CHECK("bn apply");
      }
    });
  });
  return k;
}

// The two reductions (sum g, sum g (x - mean)), their finalize (dgamma, dbeta and the dx
// coefficients), then dx: the 16-byte kernels where the shape and pointers allow.
KernelPtr bn_backward(Context& ctx, int stream, const Nhwc& s, DType dt, const BnBwd& a) {
  const ChannelDims d = channel_dims(ctx, s);
  const auto C = d.c;
  const BnVec v = bn_vec(ctx, dt, d.rows, C, {a.x, a.dy, a.dy2});
  const GroupPlan gp = group_plan(ctx, d.rows, C, {a.x, a.dy, a.dy2, a.dx, a.dres});
  const int chunks = v.on ? v.blocks : d.gy;
  const size_t coef_off =
      align256(sizeof(double2) * static_cast<size_t>(chunks) * static_cast<size_t>(C));
  ctx.need_workspace(stream, coef_off + sizeof(float4) * static_cast<size_t>(C));
  const dim3 rgrid(static_cast<unsigned>((C + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const int64_t count = d.rows * C;
  const unsigned egrid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
      auto* partial = reinterpret_cast<double2*>(ws);
      auto* coef = reinterpret_cast<float4*>(ws + coef_off);
      const T *x = static_cast<const T*>(a.x), *dy = static_cast<const T*>(a.dy),
              *dy2 = static_cast<const T*>(a.dy2);
      T *dx = static_cast<T*>(a.dx), *dres = static_cast<T*>(a.dres);
      if (v.on) {
        bwd_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(x, dy, dy2, a.mask, a.saved,
                                                             static_cast<int>(d.rows),
                                                             static_cast<int>(C), partial, a.pm);
        KILN_LAUNCH_CHECK("bn bwd sums (vec)");
      } else {
        bwd_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(x, dy, dy2, a.mask, a.saved, d.rows,
                                                                C, partial, a.pm);
        KILN_LAUNCH_CHECK("bn bwd sums");
      }
      bwd_finalize_kernel<<<finalize_grid(C), dim3(kFinC, kFinS), 0, st>>>(
          partial, chunks, d.rows, C, a.saved, a.gamma, a.dgamma, a.dbeta, coef);
      KILN_LAUNCH_CHECK("bn bwd finalize");
      if (gp.on) {
        bwd_dx_group<T><<<gp.blocks, kVecThreads, 0, st>>>(
            x, dy, dy2, a.mask, dx, dres, static_cast<int>(d.rows), gp.cg, coef, a.pm);
        KILN_LAUNCH_CHECK("bn bwd dx (vec)");
      } else {
        bwd_dx_kernel<T>
            <<<egrid, kThreads, 0, st>>>(x, dy, dy2, a.mask, dx, dres, count, C, coef, a.pm);
        KILN_LAUNCH_CHECK("bn bwd dx");
      }
    });
  });
  return k;
}

// The checks and pointers shared by the unfused BatchNorm passes and the fused ones.
BnFwd bn_fwd_args(const Context& ctx, const Node& n, TensorId x, TensorId gamma, TensorId beta,
                  TensorId rm, TensorId rv, TensorId y, TensorId saved, Nhwc* shape) {
  *shape = bn_check(ctx, n, x, {y}, {gamma, beta, rm, rv});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * shape->c, "saved (2 x C)");
  BnFwd a;
  a.x = ctx.ptr(x);
  a.y = ctx.ptr(y);
  a.saved = ctx.ptr<float>(saved);
  a.rm = ctx.ptr<float>(rm);
  a.rv = ctx.ptr<float>(rv);
  a.gamma = ctx.ptr<float>(gamma);
  a.beta = ctx.ptr<float>(beta);
  a.eps = n.attrs.eps;
  a.momentum = n.attrs.bn_momentum;
  return a;
}

BnBwd bn_bwd_args(const Context& ctx, const Node& n, TensorId x, TensorId dy, TensorId gamma,
                  TensorId saved, TensorId dx, TensorId dgamma, TensorId dbeta, Nhwc* shape) {
  *shape = bn_check(ctx, n, x, {dy, dx}, {gamma, dgamma, dbeta});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * shape->c, "saved (2 x C)");
  BnBwd a;
  a.x = ctx.ptr(x);
  a.dy = ctx.ptr(dy);
  a.dx = ctx.ptr(dx);
  a.saved = ctx.ptr<float>(saved);
  a.gamma = ctx.ptr<float>(gamma);
  a.dgamma = ctx.ptr<float>(dgamma);
  a.dbeta = ctx.ptr<float>(dbeta);
  return a;
}

}  // namespace

// "x, gamma, beta, running_mean, running_var -> y, saved (2xC: mean, invstd)"
KernelPtr make_bn_fwd_train(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var");
  const TensorId y = need_out(n, 0, "y"), saved = need_out(n, 1, "saved");
  Nhwc s;
  const BnFwd a = bn_fwd_args(ctx, n, x, gamma, beta, rm, rv, y, saved, &s);
  return bn_forward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// The BatchNorm + ReLU part of cbr_fwd (z -> y, saved, mask) and all of bn_add_relu_fwd
// (fused.cpp): "x, gamma, beta, running_mean, running_var, [residual], [b] -> y, saved, mask".
KernelPtr make_bn_relu_mask_fwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId gamma,
                                TensorId beta, TensorId rm, TensorId rv, TensorId residual,
                                TensorId conv_bias, TensorId y, TensorId saved, TensorId mask,
                                const float* conv_sums) {
  Nhwc s;
  BnFwd a = bn_fwd_args(ctx, n, x, gamma, beta, rm, rv, y, saved, &s);
  a.sums = conv_sums;
  if (residual != kNoTensor) {
    expect_same_dtype(ctx, n, x, residual);
    expect_numel(ctx, n, residual, s.numel(), "residual");
  }
  if (conv_bias != kNoTensor) {
    expect_dtype(ctx, n, conv_bias, DType::F32, "b");
    expect_numel(ctx, n, conv_bias, s.c, "b (one per output channel)");
  }
  expect_mask(ctx, n, mask, y);
  a.residual = ctx.ptr(residual);
  a.conv_bias = ctx.ptr<float>(conv_bias);
  a.mask = ctx.ptr<uint8_t>(mask);
  return bn_forward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// The BatchNorm backward of cbr_bwd (z, dy, mask -> dz) and of bn_add_relu_bwd (x, dy, mask,
// [dy2] -> dx, dresidual) (fused.cpp), with the ReLU backward taken from the mask.
KernelPtr make_bn_relu_mask_bwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId dy,
                                TensorId dy2, TensorId mask, TensorId gamma, TensorId saved,
                                TensorId dx, TensorId dres, TensorId dgamma, TensorId dbeta) {
  Nhwc s;
  BnBwd a = bn_bwd_args(ctx, n, x, dy, gamma, saved, dx, dgamma, dbeta, &s);
  if (dy2 != kNoTensor) {
    expect_same_dtype(ctx, n, dy, dy2);
    expect_numel(ctx, n, dy2, s.numel(), "dy2");
    a.dy2 = ctx.ptr(dy2);
  }
  if (dres != kNoTensor) {
    expect_same_dtype(ctx, n, x, dres);
    expect_numel(ctx, n, dres, s.numel(), "dresidual");
  }
  expect_mask(ctx, n, mask, dy);
  a.mask = ctx.ptr<uint8_t>(mask);
  a.dres = ctx.ptr(dres);
  return bn_backward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// cbr_pool_fwd's BatchNorm, ReLU and max-pool (fused.cpp): "z, gamma, beta, running_mean,
// running_var, [b] -> y (pooled), saved, mask (over z)".
KernelPtr make_bn_relu_pool_fwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId gamma,
                                TensorId beta, TensorId rm, TensorId rv, TensorId conv_bias,
                                TensorId y, TensorId saved, TensorId mask, const float* conv_sums) {
  Nhwc s;
  BnFwd a = bn_fwd_args(ctx, n, z, gamma, beta, rm, rv, kNoTensor, saved, &s);
  const int pool = n.attrs.pool;
  const Nhwc ys = nhwc_of(ctx, n, y, "y (pooled)");
  expect_same_dtype(ctx, n, z, y);
  KILN_CHECK(pool >= 1 && ys.n == s.n && ys.c == s.c && ys.h * pool == s.h && ys.w * pool == s.w,
             Shape, op_name(n.op), " node '", n.label, "': y ", ctx.tensor(y).shape.str(),
             " is not z ", ctx.tensor(z).shape.str(), " max-pooled by ", pool, "x", pool,
             " windows that tile it (attrs.pool)");
  if (conv_bias != kNoTensor) {
    expect_dtype(ctx, n, conv_bias, DType::F32, "b");
    expect_numel(ctx, n, conv_bias, s.c, "b (one per output channel)");
  }
  expect_mask(ctx, n, mask, z);
  a.y = ctx.ptr(y);
  a.sums = conv_sums;
  a.conv_bias = ctx.ptr<float>(conv_bias);
  a.mask = ctx.ptr<uint8_t>(mask);
  a.pool = pool;
  return bn_forward(ctx, stream, s, ctx.tensor(z).dtype, a);
}

// cbr_pool_bwd's BatchNorm backward (fused.cpp): "z, dy (pooled), mask (over z), gamma, saved
// -> dz, dgamma, dbeta", the gradient at BatchNorm's output read from the pooled dy.
KernelPtr make_bn_relu_pool_bwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId dy,
                                TensorId mask, TensorId gamma, TensorId saved, TensorId dz,
                                TensorId dgamma, TensorId dbeta) {
  Nhwc s;
  BnBwd a = bn_bwd_args(ctx, n, z, dz, gamma, saved, dz, dgamma, dbeta, &s);
  const int pool = n.attrs.pool;
  const Nhwc ds = nhwc_of(ctx, n, dy, "dy (pooled)");
  expect_same_dtype(ctx, n, z, dy);
  KILN_CHECK(pool >= 1 && ds.n == s.n && ds.c == s.c && ds.h * pool == s.h && ds.w * pool == s.w,
             Shape, op_name(n.op), " node '", n.label, "': dy ", ctx.tensor(dy).shape.str(),
             " is not the gradient of z ", ctx.tensor(z).shape.str(), " max-pooled by ", pool, "x",
             pool, " windows (attrs.pool)");
  expect_mask(ctx, n, mask, z);
  a.dy = ctx.ptr(dy);
  a.mask = ctx.ptr<uint8_t>(mask);
  KILN_CHECK(s.numel() / s.c < (int64_t{1} << 31), Unsupported, op_name(n.op), " node '", n.label,
             "': ", s.numel() / s.c,
             " pixels; the pooled backward indexes rows in 32 bits (at most 2^31)");
  a.pm = PoolMap{pool, static_cast<int>(s.w)};
  return bn_backward(ctx, stream, s, ctx.tensor(z).dtype, a);
}

namespace {

// bn_fwd_infer, or with relu bn_relu_infer (residual optional): one pass.
KernelPtr bn_infer(const Node& n, Context& ctx, int stream, bool relu) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var");
  const TensorId residual = relu ? in_at(n, 5) : kNoTensor, y = need_out(n, 0, "y");
  const Nhwc s = bn_check(ctx, n, x, {y}, {gamma, beta, rm, rv});
  if (residual != kNoTensor) {
    expect_same_dtype(ctx, n, x, residual);
    expect_numel(ctx, n, residual, s.numel(), "residual");
  }
  const DType dt = ctx.tensor(x).dtype;
  const void *xp = ctx.ptr(x), *resp = ctx.ptr(residual);
  void* yp = ctx.ptr(y);
  const float *rmp = ctx.ptr<float>(rm), *rvp = ctx.ptr<float>(rv), *gp = ctx.ptr<float>(gamma),
              *bp = ctx.ptr<float>(beta);
  const float eps = n.attrs.eps;
  const int64_t count = s.numel(), C = s.c;
  const unsigned grid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t st) {
      const auto* xt = static_cast<const T*>(xp);
      const auto* rt = static_cast<const T*>(resp);
      auto* yt = static_cast<T*>(yp);
      if (relu) {
        infer_kernel<T, true>
            <<<grid, kThreads, 0, st>>>(xt, rt, yt, count, C, rmp, rvp, gp, bp, eps);
        KILN_LAUNCH_CHECK("bn + relu infer");
      } else {
        infer_kernel<T, false>
            <<<grid, kThreads, 0, st>>>(xt, nullptr, yt, count, C, rmp, rvp, gp, bp, eps);
        KILN_LAUNCH_CHECK("bn infer");
      }
    });
  });
  return k;
}

}  // namespace

// "x, gamma, beta, running_mean, running_var -> y"
KernelPtr make_bn_fwd_infer(const Node& n, Context& ctx, int stream) {
  return bn_infer(n, ctx, stream, false);
}

// "x, dy, gamma, saved -> dx, dgamma, dbeta"
KernelPtr make_bn_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), gamma = need_in(n, 2, "gamma"),
                 saved = need_in(n, 3, "saved");
  const TensorId dx = need_out(n, 0, "dx"), dgamma = need_out(n, 1, "dgamma"),
                 dbeta = need_out(n, 2, "dbeta");
  Nhwc s;
  const BnBwd a = bn_bwd_args(ctx, n, x, dy, gamma, saved, dx, dgamma, dbeta, &s);
  return bn_backward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// "x, gamma, beta, running_mean, running_var, [residual] -> y": the evaluation form of the
// fused ops' BatchNorm, add and ReLU, one pass.
KernelPtr make_bn_relu_infer(const Node& n, Context& ctx, int stream) {
  return bn_infer(n, ctx, stream, true);
}

}  // namespace kiln::cuda
