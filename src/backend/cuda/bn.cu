// Batch normalisation on the GPU (NHWC; features f32 or f16, gamma/beta/statistics f32).
// Own kernels rather than cuDNN's: three small passes that later fuse with their neighbours
// (SPEC S12, S15), and the statistics convention is kiln's, exactly:
//  - saved = [mean; invstd] (2 x C), invstd = 1 / sqrt(biased_var + eps);
//  - running = (1 - m) running + m batch, with the unbiased variance n/(n-1) var (PyTorch),
//    computed in double from the FP32-rounded batch mean and variance, as the CPU kernel.
// Per-channel sums are taken in double (block partials in the stream's workspace, then one
// finalize pass), so the statistics do not depend on the batch size's rounding.
#include "backend/cuda/channel_sums.cuh"
#include "backend/cuda/device_util.cuh"

namespace kiln::cuda {

namespace {



__global__ void stats_finalize_kernel(const double2* partial, int gy, int64_t rows, int64_t C, float eps,
                                      float momentum, float* saved, float* running_mean, float* running_var) {
  KILN_GRID_STRIDE(c, C) {
    double s = 0.0, ss = 0.0;
    for (int j = 0; j < gy; ++j) {
      s += partial[j * C + c].x;
      ss += partial[j * C + c].y;
    }
    const double n = static_cast<double>(rows);
    const double mean = s / n;
    const double var = fmax(ss / n - mean * mean, 0.0);
    const auto mean_f = static_cast<float>(mean), var_f = static_cast<float>(var);
    saved[c] = mean_f;
    saved[C + c] = static_cast<float>(1.0 / sqrt(static_cast<double>(var_f) + eps));
    const double unbias = rows > 1 ? n / (n - 1.0) : 1.0;
    const double m = momentum;
    running_mean[c] = static_cast<float>((1.0 - m) * running_mean[c] + m * mean_f);
    running_var[c] = static_cast<float>((1.0 - m) * running_var[c] + m * unbias * var_f);
  }
}

template <typename T>
__global__ void apply_kernel(const T* x, T* y, int64_t count, int64_t C, const float* mean, const float* invstd,
                             const float* gamma, const float* beta) {
  KILN_GRID_STRIDE(i, count) {
    const int64_t c = i % C;
    const float v = (to_f(x[i]) - mean[c]) * (gamma[c] * invstd[c]) + beta[c];
    y[i] = from_f<T>(v);
  }
}

template <typename T>
__global__ void infer_kernel(const T* x, T* y, int64_t count, int64_t C, const float* rm, const float* rv,
                             const float* gamma, const float* beta, float eps) {
  KILN_GRID_STRIDE(i, count) {
    const int64_t c = i % C;
    const float scale = gamma[c] / sqrtf(rv[c] + eps);
    y[i] = from_f<T>((to_f(x[i]) - rm[c]) * scale + beta[c]);
  }
}


// dgamma = sum dy xhat, dbeta = sum dy; coefficients of dx = k1 (dy - mdy - (x - mean) k3).
__global__ void bwd_finalize_kernel(const double2* partial, int gy, int64_t rows, int64_t C, const float* saved,
                                    const float* gamma, float* dgamma, float* dbeta, float4* coef) {
  KILN_GRID_STRIDE(c, C) {
    double s = 0.0, sx = 0.0;
    for (int j = 0; j < gy; ++j) {
      s += partial[j * C + c].x;
      sx += partial[j * C + c].y;
    }
    const double invstd = saved[C + c], n = static_cast<double>(rows);
    dbeta[c] = static_cast<float>(s);
    dgamma[c] = static_cast<float>(sx * invstd);
    coef[c] = make_float4(saved[c], static_cast<float>(gamma[c] * invstd), static_cast<float>(s / n),
                          static_cast<float>(sx * invstd * invstd / n));
  }
}

template <typename T>
__global__ void bwd_dx_kernel(const T* x, const T* dy, T* dx, int64_t count, int64_t C, const float4* coef) {
  KILN_GRID_STRIDE(i, count) {
    const float4 k = coef[i % C];
    const float v = k.y * (to_f(dy[i]) - k.z - (to_f(x[i]) - k.x) * k.w);
    dx[i] = from_f<T>(v);
  }
}

// ---- 16-byte paths (KILN_VECTOR_KERNELS, on by default) ------------------------------
// Each thread owns one vector of V channels (cv = C / V vectors per row; 256 % cv == 0) and
// walks rows four at a time with independent 16-byte loads in flight; the block combines the
// threads of each channel vector in shared memory and writes the same [blocks][C] double
// partials as the plain kernels, so the finalize passes are shared.
constexpr int kVecThreads = 256;

template <typename T>
__device__ __forceinline__ uint4 load_row(const uint4* v, int r, int rows, int cv, int cvec) {
  return r < rows ? v[static_cast<int64_t>(r) * cv + cvec] : make_uint4(0, 0, 0, 0);  // zeros add nothing
}

template <int V>
__device__ __forceinline__ void combine_store(double (&a)[V], double (&b)[V], int cv, int cvec, int64_t C,
                                              double2* partial) {
  __shared__ double sm[kVecThreads * 8];
#pragma unroll
  for (int j = 0; j < V; ++j) sm[threadIdx.x * V + j] = a[j];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < cv) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      double acc = 0.0;
      for (int t = threadIdx.x; t < kVecThreads; t += cv) acc += sm[t * V + j];
      a[j] = acc;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < V; ++j) sm[threadIdx.x * V + j] = b[j];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < cv) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      double acc = 0.0;
      for (int t = threadIdx.x; t < kVecThreads; t += cv) acc += sm[t * V + j];
      partial[static_cast<int64_t>(blockIdx.x) * C + cvec * V + j] = make_double2(a[j], acc);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kVecThreads) stats_partial_vec(const T* x, int rows, int C, double2* partial) {
  constexpr int V = kVec<T>;
  const int cv = C / V, cvec = threadIdx.x % cv, rpb = kVecThreads / cv, rstride = gridDim.x * rpb;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  double s[V], ss[V];
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = ss[j] = 0.0;
  for (int r = blockIdx.x * rpb + threadIdx.x / cv; r < rows; r += 4 * rstride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_row<T>(xv, r + u * rstride, rows, cv, cvec);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const double f = to_f(e[j]);
        s[j] += f;
        ss[j] += f * f;
      }
    }
  }
  combine_store<V>(s, ss, cv, cvec, C, partial);
}

template <typename T>
__global__ void __launch_bounds__(kVecThreads) bwd_partial_vec(const T* x, const T* dy, const float* mean, int rows,
                                                                int C, double2* partial) {
  constexpr int V = kVec<T>;
  const int cv = C / V, cvec = threadIdx.x % cv, rpb = kVecThreads / cv, rstride = gridDim.x * rpb;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  const auto* gv = reinterpret_cast<const uint4*>(dy);
  double s[V], sx[V], mu[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s[j] = sx[j] = 0.0;
    mu[j] = mean[cvec * V + j];
  }
  for (int r = blockIdx.x * rpb + threadIdx.x / cv; r < rows; r += 2 * rstride) {
    uint4 a[2], g[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      a[u] = load_row<T>(xv, r + u * rstride, rows, cv, cvec);
      g[u] = load_row<T>(gv, r + u * rstride, rows, cv, cvec);  // a zero dy adds nothing
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const T* xe = reinterpret_cast<const T*>(&a[u]);
      const T* ge = reinterpret_cast<const T*>(&g[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const double gj = to_f(ge[j]);
        s[j] += gj;
        sx[j] += gj * (static_cast<double>(to_f(xe[j])) - mu[j]);
      }
    }
  }
  combine_store<V>(s, sx, cv, cvec, C, partial);
}

// coef[c] = (mean, gamma * invstd, beta): the plain apply kernel's factors, formed once.
__global__ void fwd_coef_kernel(const float* saved, const float* gamma, const float* beta, int64_t C, float4* coef) {
  KILN_GRID_STRIDE(c, C) coef[c] = make_float4(saved[c], gamma[c] * saved[C + c], beta[c], 0.0f);
}

template <typename T>
__global__ void apply_vec(const T* x, T* y, int nvec, int cv, const float4* coef) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += gridDim.x * blockDim.x) {
    const uint4 raw = reinterpret_cast<const uint4*>(x)[i];
    const T* e = reinterpret_cast<const T*>(&raw);
    const int c0 = (i % cv) * V;
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4 k = coef[c0 + j];
      o[j] = from_f<T>((to_f(e[j]) - k.x) * k.y + k.z);
    }
    reinterpret_cast<uint4*>(y)[i] = out;
  }
}

template <typename T>
__global__ void bwd_dx_vec(const T* x, const T* dy, T* dx, int nvec, int cv, const float4* coef) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += gridDim.x * blockDim.x) {
    const uint4 rx = reinterpret_cast<const uint4*>(x)[i], rg = reinterpret_cast<const uint4*>(dy)[i];
    const T* xe = reinterpret_cast<const T*>(&rx);
    const T* ge = reinterpret_cast<const T*>(&rg);
    const int c0 = (i % cv) * V;
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4 k = coef[c0 + j];
      o[j] = from_f<T>(k.y * (to_f(ge[j]) - k.z - (to_f(xe[j]) - k.x) * k.w));
    }
    reinterpret_cast<uint4*>(dx)[i] = out;
  }
}

// The vector plan of one BN node, or none.
struct BnVec {
  bool on = false;
  int cv = 0, blocks = 0, nvec = 0;
};

BnVec bn_vec(const Context& ctx, DType dt, int64_t rows, int64_t C, std::initializer_list<const void*> ptrs) {
  BnVec v;
  const int width = dt == DType::F32 ? 4 : 8;
  if (C % width != 0 || !vec_fits(ctx.opts, rows * C, width, ptrs)) return v;
  const int64_t cv = C / width;
  if (cv > kVecThreads || kVecThreads % cv != 0) return v;
  const int64_t rpb = kVecThreads / cv;
  v.on = true;
  v.cv = static_cast<int>(cv);
  v.blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + rpb - 1) / rpb, ctx.sm_count * 4)));
  v.nvec = static_cast<int>(rows * C / width);
  return v;
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

Nhwc bn_check(const Context& ctx, const Node& n, TensorId x, std::initializer_list<TensorId> same_shape,
              std::initializer_list<TensorId> per_channel) {
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_float(ctx, n, x, "x");
  for (TensorId id : same_shape) {
    expect_same_dtype(ctx, n, x, id);
    KILN_CHECK(ctx.tensor(id).numel() == ctx.tensor(x).numel(), Shape, op_name(n.op), " node '", n.label, "': '",
               ctx.tensor(id).name, "' has shape ", ctx.tensor(id).shape.str(), ", x has ", ctx.tensor(x).shape.str());
  }
  for (TensorId id : per_channel) {
    expect_dtype(ctx, n, id, DType::F32, "per-channel tensor");
    expect_numel(ctx, n, id, s.c, "per-channel tensor");
  }
  KILN_CHECK(n.attrs.eps > 0.0f, InvalidArgument, op_name(n.op), " node '", n.label, "': eps must be > 0, is ",
             n.attrs.eps);
  return s;
}

constexpr int kThreads = 256;

}  // namespace

// "x, gamma, beta, running_mean, running_var -> y, saved (2xC: mean, invstd)"
KernelPtr make_bn_fwd_train(const Node& n, Context& ctx, int stream) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"), beta = need_in(n, 2, "beta"),
                 rm = need_in(n, 3, "running_mean"), rv = need_in(n, 4, "running_var");
  const TensorId y = need_out(n, 0, "y"), saved = need_out(n, 1, "saved");
  const Nhwc s = bn_check(ctx, n, x, {y}, {gamma, beta, rm, rv});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * s.c, "saved (2 x C)");
  const ChannelDims d = channel_dims(ctx, s);
  ctx.need_workspace(stream, partial_bytes(d));
  const DType dt = ctx.tensor(x).dtype;
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  float *sp = ctx.ptr<float>(saved), *rmp = ctx.ptr<float>(rm), *rvp = ctx.ptr<float>(rv);
  const float *gp = ctx.ptr<float>(gamma), *bp = ctx.ptr<float>(beta);
  const float eps = n.attrs.eps, mom = n.attrs.bn_momentum;
  const BnVec v = bn_vec(ctx, dt, d.rows, d.c, {xp, yp});
  if (v.on) {
    const size_t coef_off = align256(sizeof(double2) * static_cast<size_t>(v.blocks) * static_cast<size_t>(d.c));
    ctx.need_workspace(stream, coef_off + sizeof(float4) * static_cast<size_t>(d.c));
    const unsigned cgrid = grid_for(ctx, d.c, kThreads), egrid = grid_for(ctx, v.nvec, kThreads);
    const auto rows = static_cast<int>(d.rows), C = static_cast<int>(d.c);
    KernelPtr k;
    KILN_DISPATCH_FLOAT(dt, T, {
      k = make_fn(stream, [=](Context& c, cudaStream_t st) {
        auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
        auto* partial = reinterpret_cast<double2*>(ws);
        auto* coef = reinterpret_cast<float4*>(ws + coef_off);
        stats_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(static_cast<const T*>(xp), rows, C, partial);
        KILN_LAUNCH_CHECK("bn stats (vec)");
        stats_finalize_kernel<<<cgrid, kThreads, 0, st>>>(partial, v.blocks, d.rows, d.c, eps, mom, sp, rmp, rvp);
        KILN_LAUNCH_CHECK("bn stats finalize");
        fwd_coef_kernel<<<cgrid, kThreads, 0, st>>>(sp, gp, bp, d.c, coef);
        KILN_LAUNCH_CHECK("bn coefficients");
        apply_vec<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<T*>(yp), v.nvec, v.cv, coef);
        KILN_LAUNCH_CHECK("bn apply (vec)");
      });
    });
    return k;
  }
  const dim3 rgrid(static_cast<unsigned>((d.c + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const unsigned cgrid = grid_for(ctx, d.c, kThreads), egrid = grid_for(ctx, d.rows * d.c, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* partial = static_cast<double2*>(c.streams[static_cast<size_t>(stream)].workspace);
      stats_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(static_cast<const T*>(xp), d.rows, d.c, partial);
      KILN_LAUNCH_CHECK("bn stats");
      stats_finalize_kernel<<<cgrid, kThreads, 0, st>>>(partial, d.gy, d.rows, d.c, eps, mom, sp, rmp, rvp);
      KILN_LAUNCH_CHECK("bn stats finalize");
      apply_kernel<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<T*>(yp), d.rows * d.c, d.c,
                                                  sp, sp + d.c, gp, bp);
      KILN_LAUNCH_CHECK("bn apply");
    });
  });
  return k;
}

// "x, gamma, beta, running_mean, running_var -> y"
KernelPtr make_bn_fwd_infer(const Node& n, Context& ctx, int stream) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"), beta = need_in(n, 2, "beta"),
                 rm = need_in(n, 3, "running_mean"), rv = need_in(n, 4, "running_var");
  const TensorId y = need_out(n, 0, "y");
  const Nhwc s = bn_check(ctx, n, x, {y}, {gamma, beta, rm, rv});
  const DType dt = ctx.tensor(x).dtype;
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  const float *rmp = ctx.ptr<float>(rm), *rvp = ctx.ptr<float>(rv), *gp = ctx.ptr<float>(gamma),
              *bp = ctx.ptr<float>(beta);
  const float eps = n.attrs.eps;
  const int64_t count = s.numel(), C = s.c;
  const unsigned grid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t st) {
      infer_kernel<T><<<grid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<T*>(yp), count, C, rmp, rvp, gp,
                                                 bp, eps);
      KILN_LAUNCH_CHECK("bn infer");
    });
  });
  return k;
}

// "x, dy, gamma, saved -> dx, dgamma, dbeta"
KernelPtr make_bn_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), gamma = need_in(n, 2, "gamma"),
                 saved = need_in(n, 3, "saved");
  const TensorId dx = need_out(n, 0, "dx"), dgamma = need_out(n, 1, "dgamma"), dbeta = need_out(n, 2, "dbeta");
  const Nhwc s = bn_check(ctx, n, x, {dy, dx}, {gamma, dgamma, dbeta});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * s.c, "saved (2 x C)");
  const ChannelDims d = channel_dims(ctx, s);
  const size_t coef_off = (partial_bytes(d) + 255) / 256 * 256;
  ctx.need_workspace(stream, coef_off + sizeof(float4) * static_cast<size_t>(d.c));
  const DType dt = ctx.tensor(x).dtype;
  const void *xp = ctx.ptr(x), *dyp = ctx.ptr(dy);
  void* dxp = ctx.ptr(dx);
  const float *sp = ctx.ptr<float>(saved), *gp = ctx.ptr<float>(gamma);
  float *dgp = ctx.ptr<float>(dgamma), *dbp = ctx.ptr<float>(dbeta);
  const BnVec v = bn_vec(ctx, dt, d.rows, d.c, {xp, dyp, dxp});
  if (v.on) {
    const size_t vcoef_off = align256(sizeof(double2) * static_cast<size_t>(v.blocks) * static_cast<size_t>(d.c));
    ctx.need_workspace(stream, vcoef_off + sizeof(float4) * static_cast<size_t>(d.c));
    const unsigned cgrid = grid_for(ctx, d.c, kThreads), egrid = grid_for(ctx, v.nvec, kThreads);
    const auto rows = static_cast<int>(d.rows), C = static_cast<int>(d.c);
    KernelPtr k;
    KILN_DISPATCH_FLOAT(dt, T, {
      k = make_fn(stream, [=](Context& c, cudaStream_t st) {
        auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
        auto* partial = reinterpret_cast<double2*>(ws);
        auto* coef = reinterpret_cast<float4*>(ws + vcoef_off);
        bwd_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<const T*>(dyp), sp,
                                                             rows, C, partial);
        KILN_LAUNCH_CHECK("bn bwd sums (vec)");
        bwd_finalize_kernel<<<cgrid, kThreads, 0, st>>>(partial, v.blocks, d.rows, d.c, sp, gp, dgp, dbp, coef);
        KILN_LAUNCH_CHECK("bn bwd finalize");
        bwd_dx_vec<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<const T*>(dyp),
                                                  static_cast<T*>(dxp), v.nvec, v.cv, coef);
        KILN_LAUNCH_CHECK("bn bwd dx (vec)");
      });
    });
    return k;
  }
  const dim3 rgrid(static_cast<unsigned>((d.c + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const unsigned cgrid = grid_for(ctx, d.c, kThreads), egrid = grid_for(ctx, d.rows * d.c, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
      auto* partial = reinterpret_cast<double2*>(ws);
      auto* coef = reinterpret_cast<float4*>(ws + coef_off);
      bwd_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(static_cast<const T*>(xp), static_cast<const T*>(dyp),
                                                              sp, d.rows, d.c, partial);
      KILN_LAUNCH_CHECK("bn bwd sums");
      bwd_finalize_kernel<<<cgrid, kThreads, 0, st>>>(partial, d.gy, d.rows, d.c, sp, gp, dgp, dbp, coef);
      KILN_LAUNCH_CHECK("bn bwd finalize");
      bwd_dx_kernel<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<const T*>(dyp),
                                                   static_cast<T*>(dxp), d.rows * d.c, d.c, coef);
      KILN_LAUNCH_CHECK("bn bwd dx");
    });
  });
  return k;
}

}  // namespace kiln::cuda
