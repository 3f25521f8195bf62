// Data-parallel ops on the GPU, the twins of src/backend/cpu/dist.cpp:
//  - allreduce / allgather as NCCL calls on the node's stream (so they are captured into the
//    phase's CUDA Graph like any kernel; NCCL supports graph capture since 2.9). One NCCL
//    communicator per process, made when the first such node is compiled: rank 0's unique
//    id is broadcast over MPI (kiln::dist), then ncclCommInitRank. Its asynchronous errors
//    are polled by kiln::dist's watchdog, which aborts the communicator and the process.
//  - SyncBN's split of BatchNorm (bn_stats, bn_fwd_sync, bn_bwd_reduce, bn_bwd_sync) with
//    bn.cu's conventions: NHWC, f32 or f16 features, per-channel sums in double (block
//    partials in the stream's workspace, then a per-channel pass).
//  - cuda_bind_rank_device(): one GPU per process, by local rank, before the backend starts.
#include <mutex>

#include "backend/cuda/channel_sums.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/formulas.h"
#include "kiln/process_group/process_group.h"

#if defined(KILN_HAVE_NCCL)
#include <nccl.h>
#endif

#if defined(KILN_HAVE_NCCL)
#define NCCL_CHECK(call)                                                                       \
  do {                                                                                         \
    const ncclResult_t kiln_r_ = (call);                                                       \
    if (kiln_r_ != ncclSuccess) {                                                              \
      KILN_FAIL(Backend, #call, " failed: ", ncclGetErrorString(kiln_r_), " (", __FILE__, ":", \
                __LINE__, "); NCCL_DEBUG=INFO says more");                                     \
    }                                                                                          \
  } while (0)
#endif

namespace kiln {

// Called by make_backend("cuda") before the backend touches the device.
void cuda_bind_rank_device() {
  if (dist::world() <= 1) return;
  int n = 0;
  CUDA_CHECK(cudaGetDeviceCount(&n));
  const int local = dist::local_rank();
  int device = 0;
  if (n > 1) {  // with one visible GPU the launcher already gave each process its own
    KILN_CHECK(local < n, InvalidArgument, "rank ", dist::rank(), " has local rank ", local,
               " but only ", n, " GPUs are visible on its node; start at most ", n,
               " processes per node (mpirun --npernode ", n, ", srun --ntasks-per-node=", n, ")");
    device = local;
  }
  CUDA_CHECK(cudaSetDevice(device));
}

namespace cuda {

namespace {

#if defined(KILN_HAVE_NCCL)
// The process's communicator, over every rank, on the current device.
ncclComm_t nccl_comm() {
  static std::mutex mu;
  static ncclComm_t comm = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (comm) return comm;
  KILN_CHECK(
      dist::active() && dist::world() > 1, State,
      "NCCL needs the process group started first (kiln::dist::init) with more than one process");
  ncclUniqueId id{};
  if (dist::rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  dist::broadcast(&id, sizeof id, 0, "the NCCL unique id");
  {
    dist::Watch watch("ncclCommInitRank");
    NCCL_CHECK(ncclCommInitRank(&comm, dist::world(), id, dist::rank()));
  }
  ncclComm_t c = comm;
  dist::add_health_check([c]() -> std::string {
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError(c, &r) != ncclSuccess) return "";
    if (r == ncclSuccess || r == ncclInProgress) return "";
    return std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(r) +
           " (another rank has probably died; NCCL_DEBUG=INFO says more)";
  });
  dist::add_finalizer([c](bool aborting) {
    if (aborting) {
      ncclCommAbort(c);
    } else {
      ncclCommDestroy(c);
    }
  });
  return comm;
}

ncclDataType_t nccl_type(const Context& ctx, const Node& n, TensorId id) {
  switch (ctx.tensor(id).dtype) {
    case DType::F32:
      return ncclFloat32;
    case DType::I32:
      return ncclInt32;
    default:
      KILN_FAIL(Unsupported, op_name(n.op), " node '", n.label, "': '", ctx.tensor(id).name,
                "' is ", dtype_name(ctx.tensor(id).dtype), "; it reduces f32 or i32");
  }
}
#else
[[noreturn]] void no_nccl(const Node& n) {
  KILN_FAIL(
      Unsupported, op_name(n.op), " node '", n.label,
      "': this kiln was built without NCCL, so the CUDA ",
      "backend trains on one GPU only; configure with NCCL (it comes with the CUDA toolkit or the ",
      "libnccl-dev package) for data-parallel training");
}
#endif

// ---- SyncBN kernels ------------------------------------------------------------------
constexpr int kThreads = 256;

__global__ void local_stats_kernel(const double2* partial, int gy, int64_t rows, int64_t C,
                                   float* stats) {
  KILN_GRID_STRIDE(c, C) {
    double s = 0.0, ss = 0.0;
    for (int j = 0; j < gy; ++j) {
      s += partial[j * C + c].x;
      ss += partial[j * C + c].y;
    }
    const double n = static_cast<double>(rows), mean = s / n;
    stats[c] = static_cast<float>(mean);
    stats[C + c] = static_cast<float>(fmax(ss / n - mean * mean, 0.0));
  }
}

// The ranks' (mean, var) -> the global batch's, in double (equal counts).
__global__ void combine_kernel(const float* all, int world, int64_t C, double total, float eps,
                               float momentum, float* saved, float* running_mean,
                               float* running_var) {
  KILN_GRID_STRIDE(c, C) {
    const formula::MeanVar mv = formula::combine_rank_stats(all, world, C, c);
    const auto mean_f = static_cast<float>(mv.mean), var_f = static_cast<float>(mv.var);
    saved[c] = mean_f;
    saved[C + c] = formula::bn_invstd(var_f, eps);
    const double unbias = formula::bn_unbias(total), m = momentum;
    running_mean[c] = formula::running_mean_update(running_mean[c], m, mean_f);
    running_var[c] = formula::running_var_update(running_var[c], m, unbias, var_f);
  }
}

template <typename T>
__global__ void apply_kernel(const T* x, T* y, int64_t count, int64_t C, const float* saved,
                             const float* gamma, const float* beta) {
  KILN_GRID_STRIDE(i, count) {
    const int64_t c = i % C;
    y[i] = from_f<T>((to_f(x[i]) - saved[c]) * (gamma[c] * saved[C + c]) + beta[c]);
  }
}

__global__ void bwd_local_kernel(const double2* partial, int gy, int64_t C, const float* saved,
                                 float* dgamma, float* dbeta, float* sums) {
  KILN_GRID_STRIDE(c, C) {
    double s = 0.0, sx = 0.0;
    for (int j = 0; j < gy; ++j) {
      s += partial[j * C + c].x;
      sx += partial[j * C + c].y;
    }
    const auto db = static_cast<float>(s), dg = static_cast<float>(sx * saved[C + c]);
    dbeta[c] = db;
    dgamma[c] = dg;
    sums[c] = db;
    sums[C + c] = dg;
  }
}

// dx = k.y (dy - k.z - (x - k.x) k.w), the coefficients of the global batch.
__global__ void bwd_coef_kernel(const float* saved, const float* gamma, const float* sums,
                                int64_t C, double total, float4* coef) {
  KILN_GRID_STRIDE(c, C) {
    const double invstd = saved[C + c];
    coef[c] = make_float4(saved[c], static_cast<float>(gamma[c] * invstd),
                          static_cast<float>(sums[c] / total),
                          static_cast<float>(sums[C + c] * invstd / total));
  }
}

template <typename T>
__global__ void bwd_dx_kernel(const T* x, const T* dy, T* dx, int64_t count, int64_t C,
                              const float4* coef) {
  KILN_GRID_STRIDE(i, count) {
    const float4 k = coef[i % C];
    dx[i] = from_f<T>(k.y * (to_f(dy[i]) - k.z - (to_f(x[i]) - k.x) * k.w));
  }
}

Nhwc feature_check(const Context& ctx, const Node& n, TensorId x,
                   std::initializer_list<TensorId> same,
                   std::initializer_list<TensorId> per_channel) {
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_float(ctx, n, x, "x");
  for (TensorId id : same) {
    expect_same_dtype(ctx, n, x, id);
    expect_numel(ctx, n, id, s.numel(), "feature (the shape of x)");
  }
  expect_per_channel(ctx, n, per_channel, s.c);
  return s;
}

void expect_f32(const Context& ctx, const Node& n, TensorId id, int64_t numel, const char* role) {
  expect_dtype(ctx, n, id, DType::F32, role);
  expect_numel(ctx, n, id, numel, role);
}

}  // namespace

// "x -> x (in place, f32 or i32): the sum over the ranks, or the max with attrs.reduce_max"
KernelPtr make_allreduce(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x");
  const TensorId y = out_at(n, 0) != kNoTensor ? out_at(n, 0) : x;
  KILN_CHECK(ctx.ptr(x) == ctx.ptr(y) && ctx.tensor(x).numel() == ctx.tensor(y).numel(),
             InvalidArgument, "allreduce node '", n.label, "' works in place; '",
             ctx.tensor(x).name, "' and '", ctx.tensor(y).name, "' are different tensors");
  expect_world(n);
#if defined(KILN_HAVE_NCCL)
  const ncclDataType_t type = nccl_type(ctx, n, x);
  const ncclRedOp_t op = n.attrs.reduce_max ? ncclMax : ncclSum;
  const auto count = static_cast<size_t>(ctx.tensor(x).numel());
  void* p = ctx.ptr(x);
  ncclComm_t comm = nccl_comm();
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    NCCL_CHECK(ncclAllReduce(p, p, count, type, op, comm, s));
  });
#else
  (void)stream;
  no_nccl(n);
#endif
}

// "x -> y = [x of rank 0, ..., x of rank world-1] (f32)"
KernelPtr make_allgather(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  expect_world(n);
  const int64_t count = ctx.tensor(x).numel();
  expect_f32(ctx, n, x, count, "x");
  expect_f32(ctx, n, y, count * n.attrs.world, "y (world x the size of x)");
#if defined(KILN_HAVE_NCCL)
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  ncclComm_t comm = nccl_comm();
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    NCCL_CHECK(ncclAllGather(xp, yp, static_cast<size_t>(count), ncclFloat32, comm, s));
  });
#else
  (void)stream;
  no_nccl(n);
#endif
}

// "x -> stats (f32 2xC: this rank's batch mean and biased variance)"
KernelPtr make_bn_stats(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), stats = need_out(n, 0, "stats");
  const Nhwc s = feature_check(ctx, n, x, {}, {});
  expect_f32(ctx, n, stats, 2 * s.c, "stats (2 x C)");
  const ChannelDims d = channel_dims(ctx, s);
  ctx.need_workspace(stream, partial_bytes(d));
  const void* xp = ctx.ptr(x);
  float* sp = ctx.ptr<float>(stats);
  const dim3 rgrid(static_cast<unsigned>((d.c + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const unsigned cgrid = grid_for(ctx, d.c, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(ctx.tensor(x).dtype, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* partial = static_cast<double2*>(c.streams[static_cast<size_t>(stream)].workspace);
      stats_partial_kernel<T>
          <<<rgrid, dim3(kCx, kCy), 0, st>>>(static_cast<const T*>(xp), d.rows, d.c, partial);
      KILN_LAUNCH_CHECK("bn_stats sums");
      local_stats_kernel<<<cgrid, kThreads, 0, st>>>(partial, d.gy, d.rows, d.c, sp);
      KILN_LAUNCH_CHECK("bn_stats");
    });
  });
  return k;
}

// "x, gamma, beta, running_mean, running_var, stats_all -> y, saved"
KernelPtr make_bn_fwd_sync(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var"), all = need_in(n, 5, "stats_all");
  const TensorId y = need_out(n, 0, "y"), saved = need_out(n, 1, "saved");
  const Nhwc s = feature_check(ctx, n, x, {y}, {gamma, beta, rm, rv});
  const int world = n.attrs.world;
  KILN_CHECK(world >= 1 && n.attrs.eps > 0.0f, InvalidArgument, "bn_fwd_sync node '", n.label,
             "': world must be >= 1 and eps > 0");
  expect_f32(ctx, n, saved, 2 * s.c, "saved (2 x C)");
  expect_f32(ctx, n, all, int64_t{world} * 2 * s.c, "stats_all (world x 2 x C)");
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  const float *ap = ctx.ptr<float>(all), *gp = ctx.ptr<float>(gamma), *bp = ctx.ptr<float>(beta);
  float *sp = ctx.ptr<float>(saved), *rmp = ctx.ptr<float>(rm), *rvp = ctx.ptr<float>(rv);
  const float eps = n.attrs.eps, mom = n.attrs.bn_momentum;
  const int64_t C = s.c, count = s.numel();
  const double total = static_cast<double>(s.n * s.h * s.w) * world;
  const unsigned cgrid = grid_for(ctx, C, kThreads), egrid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(ctx.tensor(x).dtype, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t st) {
      combine_kernel<<<cgrid, kThreads, 0, st>>>(ap, world, C, total, eps, mom, sp, rmp, rvp);
      KILN_LAUNCH_CHECK("bn_fwd_sync combine");
      apply_kernel<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp), static_cast<T*>(yp),
                                                  count, C, sp, gp, bp);
      KILN_LAUNCH_CHECK("bn_fwd_sync apply");
    });
  });
  return k;
}

// "x, dy, saved -> dgamma, dbeta, sums"
KernelPtr make_bn_bwd_reduce(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), saved = need_in(n, 2, "saved");
  const TensorId dgamma = need_out(n, 0, "dgamma"), dbeta = need_out(n, 1, "dbeta"),
                 sums = need_out(n, 2, "sums");
  const Nhwc s = feature_check(ctx, n, x, {dy}, {dgamma, dbeta});
  expect_f32(ctx, n, saved, 2 * s.c, "saved (2 x C)");
  expect_f32(ctx, n, sums, 2 * s.c, "sums (2 x C)");
  const ChannelDims d = channel_dims(ctx, s);
  ctx.need_workspace(stream, partial_bytes(d));
  const void *xp = ctx.ptr(x), *dyp = ctx.ptr(dy);
  const float* sp = ctx.ptr<float>(saved);
  float *dgp = ctx.ptr<float>(dgamma), *dbp = ctx.ptr<float>(dbeta), *sump = ctx.ptr<float>(sums);
  const dim3 rgrid(static_cast<unsigned>((d.c + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const unsigned cgrid = grid_for(ctx, d.c, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(ctx.tensor(x).dtype, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* partial = static_cast<double2*>(c.streams[static_cast<size_t>(stream)].workspace);
      bwd_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(static_cast<const T*>(xp),
                                                              static_cast<const T*>(dyp), nullptr,
                                                              nullptr, sp, d.rows, d.c, partial);
      KILN_LAUNCH_CHECK("bn_bwd_reduce sums");
      bwd_local_kernel<<<cgrid, kThreads, 0, st>>>(partial, d.gy, d.c, sp, dgp, dbp, sump);
      KILN_LAUNCH_CHECK("bn_bwd_reduce");
    });
  });
  return k;
}

// "x, dy, gamma, saved, sums -> dx"
KernelPtr make_bn_bwd_sync(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), gamma = need_in(n, 2, "gamma"),
                 saved = need_in(n, 3, "saved"), sums = need_in(n, 4, "sums");
  const TensorId dx = need_out(n, 0, "dx");
  const Nhwc s = feature_check(ctx, n, x, {dy, dx}, {gamma});
  KILN_CHECK(n.attrs.world >= 1, InvalidArgument, "bn_bwd_sync node '", n.label,
             "': world must be >= 1");
  expect_f32(ctx, n, saved, 2 * s.c, "saved (2 x C)");
  expect_f32(ctx, n, sums, 2 * s.c, "sums (2 x C)");
  ctx.need_workspace(stream, sizeof(float4) * static_cast<size_t>(s.c));
  const void *xp = ctx.ptr(x), *dyp = ctx.ptr(dy);
  void* dxp = ctx.ptr(dx);
  const float *sp = ctx.ptr<float>(saved), *gp = ctx.ptr<float>(gamma),
              *sump = ctx.ptr<float>(sums);
  const int64_t C = s.c, count = s.numel();
  const double total = static_cast<double>(s.n * s.h * s.w) * n.attrs.world;
  const unsigned cgrid = grid_for(ctx, C, kThreads), egrid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(ctx.tensor(x).dtype, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      auto* coef = static_cast<float4*>(c.streams[static_cast<size_t>(stream)].workspace);
      bwd_coef_kernel<<<cgrid, kThreads, 0, st>>>(sp, gp, sump, C, total, coef);
      KILN_LAUNCH_CHECK("bn_bwd_sync coefficients");
      bwd_dx_kernel<T><<<egrid, kThreads, 0, st>>>(static_cast<const T*>(xp),
                                                   static_cast<const T*>(dyp), static_cast<T*>(dxp),
                                                   count, C, coef);
      KILN_LAUNCH_CHECK("bn_bwd_sync dx");
    });
  });
  return k;
}

}  // namespace cuda
}  // namespace kiln
