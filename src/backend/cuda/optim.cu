// Fused optimizers and the EMA over whole ranges of the parameter regions,
// the GPU twins of src/backend/cpu/optim.cpp: the same element formulas
// (backend/formulas.h), in FP32 without FMA contraction, so the two agree to the bit
// (AdamW's bias corrections use the device's double pow, which may differ from glibc's in
// the last bit of a double, hence "within 1 ulp"). Every kernel reads lr, loss scale and
// overflow from their device scalars and returns at once when overflow != 0: a skipped step
// is decided on the device, so a captured graph never changes.
#include "backend/cuda/device_util.cuh"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

struct StepScalars {
  DevScalar lr, scale, overflow;
  float average = 1.0f;  // attrs.grad_average: 1/world after a summing all-reduce
  DevScalar coef;        // grad_norm's clip factor (absent: 1)
};

__device__ __forceinline__ bool skipped(const StepScalars& s) {
  return load_scalar(s.overflow, 0.0) != 0.0;
}
__device__ __forceinline__ float inv_scale(const StepScalars& s) {
  return formula::inv_loss_scale(static_cast<float>(load_scalar(s.scale, 1.0)), s.average,
                                 static_cast<float>(load_scalar(s.coef, 1.0)));
}

// An optimizer's [w16] output (ops.def): w's compute copy, rounded as the cast op rounds.
struct ComputeCopy {
  void* p = nullptr;
  bool bf16 = false;
  __device__ __forceinline__ void put(int64_t i, float w) const {
    if (!p) return;
    if (bf16) {
      static_cast<__nv_bfloat16*>(p)[i] = from_f<__nv_bfloat16>(w);
    } else {
      static_cast<__half*>(p)[i] = from_f<__half>(w);
    }
  }
};

__global__ void sgd_kernel(const float* w, const float* g, const float* m, float* wo, float* mo,
                           ComputeCopy w16, int64_t count, float mom, float wd, bool nesterov,
                           StepScalars sc) {
  if (skipped(sc)) return;
  const float lr = static_cast<float>(load_scalar(sc.lr, 0.0));
  const float inv = inv_scale(sc);
  const formula::SgdParams p{lr, inv, mom, wd, nesterov};
  KILN_GRID_STRIDE(i, count) {
    const formula::WeightMoment r = formula::sgd_update(w[i], g[i], m ? &m[i] : nullptr, p);
    if (m) mo[i] = r.m;
    wo[i] = r.w;
    w16.put(i, r.w);
  }
}

struct AdamAttrs {
  float beta1, beta2, eps, wd;
};

__global__ void adamw_kernel(const float* w, const float* g, const float* m, const float* v,
                             float* wo, float* mo, float* vo, ComputeCopy w16, int64_t count,
                             AdamAttrs a, StepScalars sc, DevScalar step) {
  if (skipped(sc)) return;
  const float lr = static_cast<float>(load_scalar(sc.lr, 0.0));
  const float inv = inv_scale(sc);
  const double t = load_scalar(step, 0.0) + 1.0;
  const formula::AdamwParams p = formula::adamw_params(lr, inv, t, a.beta1, a.beta2, a.eps, a.wd);
  KILN_GRID_STRIDE(i, count) {
    const formula::AdamwElement r = formula::adamw_update(w[i], g[i], m[i], v[i], p);
    mo[i] = r.m;
    vo[i] = r.v;
    wo[i] = r.w;
    w16.put(i, r.w);
  }
}

// LARS pass 1: per-block partial sums of ||w||^2 and ||g / scale||^2, in double.
__global__ void lars_norms_kernel(const float* w, const float* g, int64_t count, StepScalars sc,
                                  double2* partial) {
  const double inv = static_cast<double>(inv_scale(sc));
  double ww = 0.0, gg = 0.0;
  KILN_GRID_STRIDE(i, count) {
    const double wi = w[i], gi = static_cast<double>(g[i]) * inv;
    ww += wi * wi;
    gg += gi * gi;
  }
  for (int o = 16; o > 0; o >>= 1) {
    ww += __shfl_down_sync(0xffffffffu, ww, o);
    gg += __shfl_down_sync(0xffffffffu, gg, o);
  }
  __shared__ double sw[kThreads / 32], sg[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sw[warp] = ww;
    sg[warp] = gg;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double a = 0.0, b = 0.0;
    for (int i = 0; i < kThreads / 32; ++i) {
      a += sw[i];
      b += sg[i];
    }
    partial[blockIdx.x] = make_double2(a, b);
  }
}

__global__ void lars_update_kernel(const float* w, const float* g, const float* m, float* wo,
                                   float* mo, ComputeCopy w16, int64_t count, float mom, float wd,
                                   float eta, bool nesterov, StepScalars sc, const double2* partial,
                                   int blocks) {
  if (skipped(sc)) return;
  __shared__ float trust_s;
  if (threadIdx.x == 0) {
    double ww = 0.0, gg = 0.0;
    for (int b = 0; b < blocks; ++b) {
      ww += partial[b].x;
      gg += partial[b].y;
    }
    trust_s = formula::lars_trust(sqrt(ww), sqrt(gg), eta, wd);
  }
  __syncthreads();
  const float lr = static_cast<float>(load_scalar(sc.lr, 0.0));
  const formula::LarsParams p{lr, inv_scale(sc), trust_s, mom, wd, nesterov};
  KILN_GRID_STRIDE(i, count) {
    const formula::WeightMoment r = formula::lars_update(w[i], g[i], m[i], p);
    mo[i] = r.m;
    wo[i] = r.w;
    w16.put(i, r.w);
  }
}

// grad_norm pass 1: per-block partial sums of (g * average / scale)^2, in double as the CPU.
__global__ void grad_norm_partial_kernel(const float* g, int64_t count, DevScalar scale,
                                         double average, double* partial) {
  const double inv = average / load_scalar(scale, 1.0);
  double ss = 0.0;
  KILN_GRID_STRIDE(i, count) {
    const double gi = static_cast<double>(g[i]) * inv;
    ss += gi * gi;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, o);
  __shared__ double sw[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sw[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double a = 0.0;
    for (int i = 0; i < kThreads / 32; ++i) a += sw[i];
    partial[blockIdx.x] = a;
  }
}

// grad_norm pass 2 (one thread, fixed order): coef = min(1, max / (norm + 1e-6)), NaN kept.
__global__ void grad_norm_finish_kernel(const double* partial, int blocks, double max_norm,
                                        DevScalar coef) {
  double ss = 0.0;
  for (int b = 0; b < blocks; ++b) ss += partial[b];
  store_scalar(coef, formula::clip_coef(ss, max_norm));
}

__global__ void step_count_kernel(DevScalar overflow, DevScalar count, DevScalar out) {
  const double k = load_scalar(count, 0.0);
  store_scalar(out, load_scalar(overflow, 0.0) != 0.0 ? k : k + 1.0);
}

__global__ void ema_kernel(const float* w, float* e, int64_t count, float d, float one_minus_d,
                           DevScalar overflow) {
  if (load_scalar(overflow, 0.0) != 0.0) return;
  KILN_GRID_STRIDE(i, count) e[i] = formula::ema_update(e[i], w[i], d, one_minus_d);
}

float* region_f32(Context& ctx, const Node& n, TensorId id, int64_t count, const char* role) {
  expect_dtype(ctx, n, id, DType::F32, role);
  expect_numel(ctx, n, id, count, role);
  return ctx.ptr<float>(id);
}

StepScalars step_scalars(Context& ctx, const Node& n, TensorId lr, TensorId scale,
                         TensorId overflow, TensorId coef) {
  return {dev_scalar(ctx, n, lr, "lr"), dev_scalar(ctx, n, scale, "loss_scale"),
          dev_scalar(ctx, n, overflow, "overflow"), n.attrs.grad_average,
          dev_scalar(ctx, n, coef, "clip_coef")};
}

// The [w16] output at `index`: absent, or f16 / bf16 of w's count.
ComputeCopy compute_copy(Context& ctx, const Node& n, size_t index, int64_t count) {
  const TensorId id = out_at(n, index);
  if (id == kNoTensor) return {};
  return {ctx.ptr(id), expect_compute_copy(ctx, n, id, count) == DType::BF16};
}

}  // namespace

// "w, g, m, lr, loss_scale, overflow, [clip_coef] -> w, m, [w16]"
KernelPtr make_sgd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = in_at(n, 2),
                 lr = need_in(n, 3, "lr");
  const int64_t count = ctx.tensor(w).numel();
  const Attrs& a = n.attrs;
  KILN_CHECK(m != kNoTensor || a.momentum == 0.0f, InvalidArgument, "sgd node '", n.label,
             "': momentum ", a.momentum, " needs the moment tensor (input 2)");
  const float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  const float* mp = m != kNoTensor ? region_f32(ctx, n, m, count, "m") : nullptr;
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = m != kNoTensor ? region_f32(ctx, n, out_or(n, 1, m), count, "m (out)") : nullptr;
  const ComputeCopy w16 = compute_copy(ctx, n, 2, count);
  const StepScalars sc = step_scalars(ctx, n, lr, in_at(n, 4), in_at(n, 5), in_at(n, 6));
  const float mom = a.momentum, wd = a.weight_decay;
  const bool nesterov = a.nesterov;
  const unsigned grid = grid_for(ctx, count, kThreads);
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    sgd_kernel<<<grid, kThreads, 0, s>>>(wp, gp, mp, wo, mo, w16, count, mom, wd, nesterov, sc);
    KILN_LAUNCH_CHECK("sgd");
  });
}

// "w, g, m, v, lr, loss_scale, overflow, step, [clip_coef] -> w, m, v, [w16]"
KernelPtr make_adamw(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = need_in(n, 2, "m"),
                 v = need_in(n, 3, "v"), lr = need_in(n, 4, "lr"), step = need_in(n, 7, "step");
  const int64_t count = ctx.tensor(w).numel();
  const float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  const float* mp = region_f32(ctx, n, m, count, "m");
  const float* vp = region_f32(ctx, n, v, count, "v");
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = region_f32(ctx, n, out_or(n, 1, m), count, "m (out)");
  float* vo = region_f32(ctx, n, out_or(n, 2, v), count, "v (out)");
  const ComputeCopy w16 = compute_copy(ctx, n, 3, count);
  const StepScalars sc = step_scalars(ctx, n, lr, in_at(n, 5), in_at(n, 6), in_at(n, 8));
  const DevScalar st = dev_scalar(ctx, n, step, "step");
  const AdamAttrs a{n.attrs.beta1, n.attrs.beta2, n.attrs.adam_eps, n.attrs.weight_decay};
  const unsigned grid = grid_for(ctx, count, kThreads);
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    adamw_kernel<<<grid, kThreads, 0, s>>>(wp, gp, mp, vp, wo, mo, vo, w16, count, a, sc, st);
    KILN_LAUNCH_CHECK("adamw");
  });
}

// "w, g, m, lr, loss_scale, overflow -> w, m, [w16]": one parameter per node (cpu/optim.cpp).
KernelPtr make_lars(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = need_in(n, 2, "m"),
                 lr = need_in(n, 3, "lr");
  const int64_t count = ctx.tensor(w).numel();
  const float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  const float* mp = region_f32(ctx, n, m, count, "m");
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = region_f32(ctx, n, out_or(n, 1, m), count, "m (out)");
  const ComputeCopy w16 = compute_copy(ctx, n, 2, count);
  const StepScalars sc = step_scalars(ctx, n, lr, in_at(n, 4), in_at(n, 5), in_at(n, 6));
  const Attrs a = n.attrs;
  const unsigned grid = std::min<unsigned>(grid_for(ctx, count, kThreads), 1024u);
  ctx.need_workspace(stream, sizeof(double2) * grid);
  return make_fn(stream, [=](Context& c, cudaStream_t s) {
    auto* partial = static_cast<double2*>(c.streams[static_cast<size_t>(stream)].workspace);
    lars_norms_kernel<<<grid, kThreads, 0, s>>>(wp, gp, count, sc, partial);
    KILN_LAUNCH_CHECK("lars norms");
    lars_update_kernel<<<grid, kThreads, 0, s>>>(wp, gp, mp, wo, mo, w16, count, a.momentum,
                                                 a.weight_decay, a.lars_eta, a.nesterov, sc,
                                                 partial, static_cast<int>(grid));
    KILN_LAUNCH_CHECK("lars update");
  });
}

// "g, loss_scale -> clip_coef" (see cpu/optim.cpp)
KernelPtr make_grad_norm(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId g = need_in(n, 0, "g"), coef = need_out(n, 0, "clip_coef");
  const int64_t count = ctx.tensor(g).numel();
  const float* gp = region_f32(ctx, n, g, count, "g");
  const DevScalar sc = dev_scalar(ctx, n, in_at(n, 1), "loss_scale");
  expect_dtype(ctx, n, coef, DType::F32, "clip_coef");
  const DevScalar co = dev_scalar(ctx, n, coef, "clip_coef");
  const double max_norm = n.attrs.max_norm, average = n.attrs.grad_average;
  KILN_CHECK(max_norm > 0.0, InvalidArgument, "grad_norm node '", n.label,
             "': max_norm must be > 0, is ", max_norm);
  const unsigned grid = std::min<unsigned>(grid_for(ctx, count, kThreads), 1024u);
  ctx.need_workspace(stream, sizeof(double) * grid);
  return make_fn(stream, [=](Context& c, cudaStream_t s) {
    auto* partial = static_cast<double*>(c.streams[static_cast<size_t>(stream)].workspace);
    grad_norm_partial_kernel<<<grid, kThreads, 0, s>>>(gp, count, sc, average, partial);
    KILN_LAUNCH_CHECK("grad_norm partial");
    grad_norm_finish_kernel<<<1, 1, 0, s>>>(partial, static_cast<int>(grid), max_norm, co);
    KILN_LAUNCH_CHECK("grad_norm finish");
  });
}

// "overflow, count -> count"
KernelPtr make_step_count(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId count = need_in(n, 1, "count");
  const TensorId out = out_or(n, 0, count);
  expect_dtype(ctx, n, count, DType::I32, "count");
  expect_dtype(ctx, n, out, DType::I32, "count (out)");
  const DevScalar ov = dev_scalar(ctx, n, in_at(n, 0), "overflow"),
                  k = dev_scalar(ctx, n, count, "count"),
                  ko = dev_scalar(ctx, n, out, "count (out)");
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    step_count_kernel<<<1, 1, 0, s>>>(ov, k, ko);
    KILN_LAUNCH_CHECK("step_count");
  });
}

// "w, overflow -> ema"
KernelPtr make_ema(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), e = need_out(n, 0, "ema");
  const int64_t count = ctx.tensor(w).numel();
  const float* wp = region_f32(ctx, n, w, count, "w");
  float* ep = region_f32(ctx, n, e, count, "ema");
  const DevScalar ov = dev_scalar(ctx, n, in_at(n, 1), "overflow");
  const float d = n.attrs.ema_decay, one_minus_d = 1.0f - n.attrs.ema_decay;
  const unsigned grid = grid_for(ctx, count, kThreads);
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    ema_kernel<<<grid, kThreads, 0, s>>>(wp, ep, count, d, one_minus_d, ov);
    KILN_LAUNCH_CHECK("ema");
  });
}

}  // namespace kiln::cuda
