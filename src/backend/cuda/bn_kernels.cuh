// BatchNorm's device code, included by bn.cu alone: the finalize passes, the plain and the
// 16-byte elementwise kernels, and the fused epilogues (ReLU and mask, max-pool). The
// statistics reduction is in bn_stats.cuh; bn.cu plans and launches them.
#pragma once
#include "backend/cuda/bn_stats.cuh"
#include "backend/cuda/channel_sums.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/fast_divide.h"
#include "backend/formulas.h"

namespace kiln::cuda {
namespace {

// ---- finalize passes ---------------------------------------------------------------------
// The reductions leave one double2 partial per channel and row chunk ([chunks][C], chunks =
// 4 per multiprocessor); a block of 8 channels (one 128-byte line of each partial row) x 64
// slices adds them up: slice j takes chunks j, j + 64, ... in two independent chains (loads in
// flight), then the slices combine in a fixed tree, so the sums are deterministic. Narrow
// blocks and many slices keep small C busy and each thread's loads overlapping.
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

// What the forward's finalize reads and writes. sums: the FP32 [sum; sum of squares] a kernel
// before it took (the SM90 epilogues, conv+genstats), read as they are; null: the double
// partials of kiln's statistics pass.
struct FwdFinalize {
  const float* sums = nullptr;
  int64_t rows = 0, C = 0;
  float eps = 0.0f, momentum = 0.0f;
  float *saved = nullptr, *running_mean = nullptr, *running_var = nullptr;
  const float *gamma = nullptr, *beta = nullptr, *conv_bias = nullptr;
};

// Channel c's finalize from its two sums: the apply coefficients (mean, gamma * invstd, beta),
// and where `write` (the channel's one writer) saved = [mean; invstd] and the running
// statistics. The finalize kernel and an apply pass that finalizes itself share it, bit for bit.
__device__ __forceinline__ float4 fwd_finalize_channel(const FwdFinalize& f, int64_t c, double sum,
                                                       double sumsq, bool write) {
  const double n = static_cast<double>(f.rows);
  const double mean = sum / n;
  const double var = fmax(sumsq / n - mean * mean, 0.0);
  const auto mean_f = static_cast<float>(mean), var_f = static_cast<float>(var);
  const float invstd_f = formula::bn_invstd(var_f, f.eps);
  if (write) {
    f.saved[c] = mean_f;
    f.saved[f.C + c] = invstd_f;
    const double unbias = formula::bn_unbias(n);
    const double m = f.momentum;
    // A fused convolution's bias, which BN cancels, still moves the running mean (ops.def).
    const double batch_mean =
        f.conv_bias ? static_cast<double>(mean_f) + f.conv_bias[c] : static_cast<double>(mean_f);
    f.running_mean[c] = formula::running_mean_update(f.running_mean[c], m, batch_mean);
    f.running_var[c] = formula::running_var_update(f.running_var[c], m, unbias, var_f);
  }
  return make_float4(mean_f, f.gamma[c] * invstd_f, f.beta[c], 0.0f);
}

// A finalize block's channel c's two sums: the FP32 sums a kernel before took (f.sums), else
// the double partials added up (every thread of the block takes part). True in the one thread
// that finalizes c.
template <class Finalize>
__device__ __forceinline__ bool finalize_sums(const double2* partial, int gy, const Finalize& f,
                                              int64_t c, double2& sums) {
  if (f.sums) {
    if (threadIdx.y != 0 || c >= f.C) return false;
    sums = make_double2(f.sums[c], f.sums[f.C + c]);
    return true;
  }
  sums = sum_partials(partial, gy, f.C, c);
  return threadIdx.y == 0 && c < f.C;
}

// saved = [mean; invstd], the running statistics, and the apply pass's coefficients coef[c].
__global__ void __launch_bounds__(kFinC* kFinS)
    stats_finalize_kernel(const double2* partial, int gy, FwdFinalize f, float4* coef) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinC + threadIdx.x;
  double2 sums;
  if (finalize_sums(partial, gy, f, c, sums))
    coef[c] = fwd_finalize_channel(f, c, sums.x, sums.y, true);
}

// The backward's likewise. sums: the FP32 [sum g; sum g (x - mean)] the data gradient before it
// took (cutlass_dgrad.cpp); null: the double partials of kiln's sums pass.
struct BwdFinalize {
  const float* sums = nullptr;
  int64_t rows = 0, C = 0;
  const float *saved = nullptr, *gamma = nullptr;
  float *dgamma = nullptr, *dbeta = nullptr;
};

// dgamma = sum g xhat, dbeta = sum g (where `write`); the coefficients of
// dx = k1 (g - mg - (x - mean) k3).
__device__ __forceinline__ float4 bwd_finalize_channel(const BwdFinalize& f, int64_t c, double s,
                                                       double sx, bool write) {
  const double invstd = f.saved[f.C + c], n = static_cast<double>(f.rows);
  if (write) {
    f.dbeta[c] = static_cast<float>(s);
    f.dgamma[c] = static_cast<float>(sx * invstd);
  }
  return make_float4(f.saved[c], static_cast<float>(f.gamma[c] * invstd), static_cast<float>(s / n),
                     static_cast<float>(sx * invstd * invstd / n));
}

__global__ void __launch_bounds__(kFinC* kFinS)
    bwd_finalize_kernel(const double2* partial, int gy, BwdFinalize f, float4* coef) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinC + threadIdx.x;
  double2 sums;
  if (finalize_sums(partial, gy, f, c, sums))
    coef[c] = bwd_finalize_channel(f, c, sums.x, sums.y, true);
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

// The residual's own BatchNorm applied to r (bn_add_relu_fwd's gamma2 ...: a downsampling
// shortcut's), rounded to T as apply_kernel rounds it.
template <typename T>
__device__ __forceinline__ T bn_one(T r, float4 k) {
  return from_f<T>((to_f(r) - k.x) * k.y + k.z);
}

// res_coef non-null: the residual is z2, its BatchNorm applied on the fly (bn_one).
template <typename T>
__global__ void apply_relu_mask_kernel(const T* x, const T* residual, T* y, uint8_t* mask,
                                       int64_t count, int64_t C, const float4* coef,
                                       const float4* res_coef = nullptr) {
  KILN_GRID_STRIDE(g, (count + 7) / 8) {
    unsigned bits = 0;
    for (int j = 0; j < 8 && g * 8 + j < count; ++j) {
      const int64_t e = g * 8 + j;
      T r{};
      if (residual) r = res_coef ? bn_one(residual[e], res_coef[e % C]) : residual[e];
      y[e] = bn_relu_one(to_f(x[e]), residual ? &r : nullptr, coef[e % C], bits, j);
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
// thread instead of once per element. cg = C / 8 groups per row, 256 % cg == 0; the
// arithmetic is the plain kernels', expression for expression.
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

// Relu: the fused epilogue (mask non-null; residual optional), else BatchNorm's apply. fin.sums
// non-null: the pass finalizes itself (no finalize launch): each thread forms its group's
// coefficients from the sums, and block 0's first row of threads (each group once) writes
// saved and the running statistics.
// ResBn: the residual is z2 and res_coef its BatchNorm's coefficients, applied on the fly
// (bn_add_relu_fwd's gamma2 ...).
// U: rows a thread has in flight (2, or 4 with KILN_BN_DEEP_LOADS).
template <typename T, bool Relu, bool ResBn = false, int U = 2>
__global__ void __launch_bounds__(kVecThreads)
    apply_group(const T* x, const T* residual, T* y, uint8_t* mask, int rows, int cg,
                const float4* coef, FwdFinalize fin = {}, const float4* res_coef = nullptr) {
  const int gi = threadIdx.x % cg, rpb = kVecThreads / cg, rstride = gridDim.x * rpb;
  const bool writer = blockIdx.x == 0 && static_cast<int>(threadIdx.x) < cg;
  float4 k[8], k2[ResBn ? 8 : 1];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = gi * 8 + j;
    k[j] =
        fin.sums ? fwd_finalize_channel(fin, c, fin.sums[c], fin.sums[fin.C + c], writer) : coef[c];
    if constexpr (ResBn) k2[j] = res_coef[c];
  }
  for (int r = blockIdx.x * rpb + threadIdx.x / cg; r < rows; r += U * rstride) {
    alignas(16) T a[U][8], b[U][8];
    int64_t g[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      g[u] = static_cast<int64_t>(r + u * rstride) * cg + gi;
      if (r + u * rstride < rows) {
        load8(x + g[u] * 8, a[u]);
        if (Relu && residual) load8(residual + g[u] * 8, b[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r + u * rstride >= rows) break;
      alignas(16) T o[8];
      if constexpr (Relu) {
        unsigned bits = 0;
        if constexpr (ResBn) {
#pragma unroll
          for (int j = 0; j < 8; ++j) b[u][j] = bn_one(b[u][j], k2[j]);
        }
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
// Z (KILN_POOL_POOLED_SUMS): also zp, z where the pool took it, and mp, the ReLU's bit there,
// a byte a pooled pixel's group (ops.def), for the backward's sums; bestz keeps that z.
template <bool Z = false, typename T>
__device__ __forceinline__ void pool_take(const T (&a)[8], const float4 (&k)[8], int pos,
                                          T (&best)[8], float (&bestf)[8], int (&at)[8],
                                          T* bestz = nullptr) {
  unsigned unused = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const T v = bn_relu_one(to_f(a[j]), static_cast<const T*>(nullptr), k[j], unused, j);
    const float f = to_f(v);
    if (f > bestf[j] || isnan(f) || at[j] < 0) {
      bestf[j] = f;
      best[j] = v;
      at[j] = pos;
      if constexpr (Z) bestz[j] = a[j];
    }
  }
}

// A pooled pixel's group's zp (eight values) and mp byte, where Z.
template <bool Z, bool Vec, typename T>
__device__ __forceinline__ void store_pick(const T (&bestz)[8], const float (&bestf)[8], T* zp,
                                           uint8_t* mp, int64_t group) {
  if constexpr (Z) {
    if constexpr (Vec) {
      store8(zp + group * 8, bestz);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) zp[group * 8 + j] = bestz[j];
    }
    unsigned bits = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) bits |= (bestf[j] > 0.0f ? 1u : 0u) << j;
    mp[group] = static_cast<uint8_t>(bits);
  }
}

// A pooling thread's start: its channel group's coefficients, and no element taken yet.
__device__ __forceinline__ void pool_start(const float4* coef, int gi, float4 (&k)[8],
                                           float (&bestf)[8], int (&at)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    k[j] = coef[gi * 8 + j];
    bestf[j] = -INFINITY;
    at[j] = -1;
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

template <typename T, bool Vec, int P, bool Z = false>
__global__ void __launch_bounds__(kVecThreads)
    apply_relu_pool(const T* z, T* y, uint8_t* mask, int total, int cg, int hp, int wp, int pool_rt,
                    const float4* coef, T* zp = nullptr, uint8_t* mp = nullptr) {
  const int pool = P ? P : pool_rt;
  const int zw = wp * pool;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const int gi = t % cg, pix = t / cg;
    const int pq = pix / wp,
              pw = pix - pq * wp;  // pq = b hp + ph: z's image row of the window's top is pq * pool
    float4 k[8];
    alignas(16) T best[8], bestz[8];
    float bestf[8];
    int at[8];
    pool_start(coef, gi, k, bestf, at);
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
      for (int q = 0; q < 4; ++q) pool_take<Z>(a[q], k, q, best, bestf, at, bestz);
    } else {
      for (int dh = 0; dh < pool; ++dh) {
        for (int dw = 0; dw < pool; ++dw) {
          alignas(16) T a[8];
          load_group<T, Vec>(z + top + dh * drow + dw * dpix, a);
          pool_take<Z>(a, k, dh * pool + dw, best, bestf, at, bestz);
        }
      }
    }
    if constexpr (Vec) {
      store8(y + static_cast<int64_t>(t) * 8, best);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) y[static_cast<int64_t>(t) * 8 + j] = best[j];
    }
    store_pick<Z, Vec>(bestz, bestf, zp, mp, t);
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

// apply_relu_pool's 2x2 form with 16-byte accesses (VGG's pools) where 256 % cg == 0, the same
// values, mask bits and order: a thread keeps one channel group for its life (a block's 256
// threads are whole pooled pixels' groups, and every trip moves them by whole pixels), so its
// coefficients are loaded once rather than per pooled pixel (as apply_group does); a pooled pixel
// is placed by a multiply and a shift rather than two divides; and two pooled pixels' eight loads
// are in flight before either's arithmetic.
template <typename T, bool Z = false>
__global__ void __launch_bounds__(kVecThreads)
    apply_relu_pool2_group(const T* z, T* y, uint8_t* mask, int pixels, int cg, int wp,
                           FastDivide by_wp, const float4* coef, T* zp = nullptr,
                           uint8_t* mp = nullptr) {
  const int gi = threadIdx.x % cg, ppb = kVecThreads / cg, pstride = gridDim.x * ppb;
  float4 k[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) k[j] = coef[gi * 8 + j];
  // Element (pixel, group) steps: one pixel of z, one row of z (2 wp pixels).
  const int64_t dpix = static_cast<int64_t>(cg) * 8, drow = 2 * static_cast<int64_t>(wp) * dpix;
  for (int p = blockIdx.x * ppb + threadIdx.x / cg; p < pixels; p += 2 * pstride) {
    alignas(16) T a[2][4][8];
    int64_t top[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pix = p + u * pstride;
      if (u == 1 && pix >= pixels) break;
      const int pq = by_wp.quotient(pix), pw = pix - pq * wp;  // pq = b hp + ph
      top[u] = (2 * static_cast<int64_t>(pq) * 2 * wp + 2 * pw) * dpix + gi * 8;
      load8(z + top[u], a[u][0]);
      load8(z + top[u] + dpix, a[u][1]);
      load8(z + top[u] + drow, a[u][2]);
      load8(z + top[u] + drow + dpix, a[u][3]);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pix = p + u * pstride;
      if (u == 1 && pix >= pixels) break;
      alignas(16) T best[8], bestz[8];
      float bestf[8];
      int at[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        bestf[j] = -INFINITY;
        at[j] = -1;
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) pool_take<Z>(a[u][q], k, q, best, bestf, at, bestz);
      store8(y + (static_cast<int64_t>(pix) * cg + gi) * 8, best);
      store_pick<Z, true>(bestz, bestf, zp, mp, static_cast<int64_t>(pix) * cg + gi);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        unsigned bits = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) bits |= (at[j] == q && bestf[j] > 0.0f ? 1u : 0u) << j;
        mask[(top[u] + (q / 2) * drow + (q % 2) * dpix) / 8] = static_cast<uint8_t>(bits);
      }
    }
  }
}

// fin.sums non-null: the pass finalizes itself, as apply_group (block 0's first row of threads
// writes dgamma and dbeta).
// ResSums (KILN_RESIDUAL_BN_SUMS_IN_DX; 2-byte T, so a group is bwd_partial_vec's vector): the
// masked gradient it forms - what dres gets, the shortcut BatchNorm's dy - is also summed
// against res_x, that BatchNorm's input (res_mean its mean), into res_partial: launched on the
// shortcut's own sums grid, each thread takes bwd_partial_vec's rows in its order, so the sums
// are the bits its sums pass would have left (out-of-range rows add nothing instead of zeros,
// which can differ only in the sign of an all-zero sum).
// Rows: rows a thread has in flight without ResSums (2, or 4 with KILN_BN_DEEP_LOADS).
template <typename T, bool ResSums = false, int Rows = 2>
__global__ void __launch_bounds__(kVecThreads)
    bwd_dx_group(const T* x, const T* dy, const T* dy2, const uint8_t* mask, T* dx, T* dres,
                 int rows, int cg, const float4* coef, PoolMap pm = {}, BwdFinalize fin = {},
                 const T* res_x = nullptr, const float* res_mean = nullptr,
                 double2* res_partial = nullptr) {
  static_assert(!ResSums || sizeof(T) == 2, "a group of eight is one 16-byte vector");
  constexpr int RS = ResSums ? 8 : 1;
  const int gi = threadIdx.x % cg, rpb = kVecThreads / cg, rstride = gridDim.x * rpb;
  const bool writer = blockIdx.x == 0 && static_cast<int>(threadIdx.x) < cg;
  float4 k[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = gi * 8 + j;
    k[j] =
        fin.sums ? bwd_finalize_channel(fin, c, fin.sums[c], fin.sums[fin.C + c], writer) : coef[c];
  }
  double s[RS], sx[RS];
  float mu[RS];  // widened where used: the same double as bwd_partial_vec's
  if constexpr (ResSums) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j] = sx[j] = 0.0;
      mu[j] = res_mean[gi * 8 + j];
    }
  }
  // Rows rows in flight; one where the sums' registers leave room for no more (no spills).
  constexpr int U = ResSums ? 1 : Rows;
  for (int r = blockIdx.x * rpb + threadIdx.x / cg; r < rows; r += U * rstride) {
    alignas(16) T a[U][8], d[U][8], rx[ResSums ? U : 1][8];
    unsigned m[U];
    int64_t g[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      m[u] = 0xFFu;
      g[u] = static_cast<int64_t>(r + u * rstride) * cg + gi;
      if (r + u * rstride < rows) {
        load8(x + g[u] * 8, a[u]);
        load8(dy + (pm.row(r + u * rstride) * cg + gi) * 8, d[u]);
        if constexpr (ResSums) load8(res_x + g[u] * 8, rx[u]);
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
    for (int u = 0; u < U; ++u) {
      if (r + u * rstride >= rows) break;
      alignas(16) T o[8];
      if (mask) {
#pragma unroll
        for (int j = 0; j < 8; ++j) d[u][j] = (m[u] >> j) & 1u ? d[u][j] : from_f<T>(0.0f);
      }
      if (dres) store8(dres + g[u] * 8, d[u]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[j] = from_f<T>(k[j].y * (to_f(d[u][j]) - k[j].z - (to_f(a[u][j]) - k[j].x) * k[j].w));
      }
      store8(dx + g[u] * 8, o);
      if constexpr (ResSums) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // bwd_partial_vec's arithmetic
          const double gj = static_cast<double>(to_f(d[u][j]));
          s[j] += gj;
          sx[j] += gj * (static_cast<double>(to_f(rx[u][j])) - static_cast<double>(mu[j]));
        }
      }
    }
  }
  if constexpr (ResSums) combine_store<8>(s, sx, cg, gi, static_cast<int64_t>(cg) * 8, res_partial);
}

}  // namespace
}  // namespace kiln::cuda
