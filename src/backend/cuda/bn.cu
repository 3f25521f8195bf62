// Batch normalisation on the GPU (NHWC; features f32 or f16, gamma/beta/statistics f32).
// Own kernels rather than cuDNN's: three small passes that later fuse with their neighbours
// (the fused CBR and BN+add+ReLU), and the statistics convention is kiln's, exactly:
//  - saved = [mean; invstd] (2 x C), invstd = 1 / sqrt(biased_var + eps);
//  - running = (1 - m) running + m batch, with the unbiased variance n/(n-1) var (PyTorch),
//    computed in double from the FP32-rounded batch mean and variance, as the CPU kernel.
// Per-channel sums are taken in double (block partials in the stream's workspace, then one
// finalize pass), so the statistics do not depend on the batch size's rounding.
// This file checks the nodes, plans the passes and launches them; the kernels are in
// bn_kernels.cuh.
#include "backend/cuda/bn_kernels.cuh"
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/pool_route.cuh"

namespace kiln::cuda {

namespace {

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
  bool deep = false;  // four rows in flight a thread rather than two (KILN_BN_DEEP_LOADS)
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
  // Two rows (or four) per thread per trip; up to 8 blocks of 256 per multiprocessor; the
  // loop's last trip's rows stay below 2^31.
  const int64_t cap = static_cast<int64_t>(ctx.sm_count) * 8;
  p.deep = ctx.opts.bn_deep_loads && rows + 4 * cap * rpb < (int64_t{1} << 31);
  const int64_t per_trip = (p.deep ? 4 : 2) * rpb;
  p.blocks =
      static_cast<int>(std::max<int64_t>(1, std::min((rows + per_trip - 1) / per_trip, cap)));
  return p;
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

// A statistics pass's room in the stream's workspace: the [chunks][C] double2 partials, then
// the C float4 apply coefficients at the returned (256-byte aligned) offset.
size_t reserve_stats_workspace(Context& ctx, int stream, int chunks, int64_t C) {
  const size_t coef_off =
      align256(sizeof(double2) * static_cast<size_t>(chunks) * static_cast<size_t>(C));
  ctx.need_workspace(stream, coef_off + sizeof(float4) * static_cast<size_t>(C));
  return coef_off;
}
struct StatsScratch {
  double2* partial;
  float4* coef;
};
StatsScratch stats_scratch(const Context& c, int stream, size_t coef_off) {
  auto* ws = static_cast<uint8_t*>(c.streams[static_cast<size_t>(stream)].workspace);
  return {reinterpret_cast<double2*>(ws), reinterpret_cast<float4*>(ws + coef_off)};
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
  // ... or with `overlap`, by op's windows, which overlap or are padded: the mask covers y, a
  // byte an element (pool_route.cuh).
  bool overlap = false;
  OverlapPool op;
  // cbr_pool_fwd's zp and mp (tiled windows, KILN_POOL_POOLED_SUMS), or none.
  void* zp = nullptr;
  uint8_t* mp = nullptr;
  // bn_add_relu_fwd with the residual's BatchNorm: its statistics and finalize (res->x is the
  // residual) run first, into res_coef (the kernel's own), which the apply pass reads.
  const BnFwd* res = nullptr;
  float4* res_coef = nullptr;
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
  // ... and where the forward wrote them (KILN_POOL_POOLED_SUMS), z where the pool took it and
  // the ReLU's bit there, a pooled element each: the sums pass reads those and dy alone.
  const void* zp = nullptr;
  const uint8_t* mp = nullptr;
  // cbr_pool_bwd with overlapping windows (op): dy is the pooled map's gradient and mask a byte
  // per pooled element; the sums pass gathers g into dx, and the dx pass reads it there.
  bool overlap = false;
  OverlapPool op;
  // FP32 [sum g; sum g (x - mean)] that the data gradient before it took (cutlass_dgrad.cpp),
  // which also wrote g itself into dy (masked, dy2 added): no sums pass, and the dx pass reads
  // g alone (no mask or dy2; dres, when given, gets a copy of g).
  const float* sums = nullptr;
  // KILN_RESIDUAL_BN_SUMS_IN_DX. res_*: the dx pass also sums the g it forms against res_x, a
  // shortcut BatchNorm's input (res_mean its mean), into res_partial, on that BatchNorm's sums
  // grid (res_blocks), which `keep` holds. partial: this BatchNorm's sums in that layout, left
  // by such a pass: no sums pass of its own.
  const void* res_x = nullptr;
  const float* res_mean = nullptr;
  double2* res_partial = nullptr;
  int res_blocks = 0;
  std::shared_ptr<DeviceBuffer> keep;
  const double2* partial = nullptr;
  int partial_blocks = 0;
  // No dx pass: the finalize writes its coefficients here instead (fused_kernels.h's fold_coef).
  float4* fold_coef = nullptr;
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
  KILN_CHECK(
      !a.pool || (C % 8 == 0 && a.mask && (a.overlap || (s.h % a.pool == 0 && s.w % a.pool == 0))),
      Internal,
      "BatchNorm with a merged max-pool needs C % 8 == 0 and windows that tile the map or "
      "the overlapping form (C ",
      C, ", ", s.h, "x", s.w, ", pool ", a.pool, ")");
  const bool pool_vec = a.pool && vec_fits(ctx.opts, d.rows * C, 8, {a.x, a.y, a.zp});
  const int64_t pooled_pixels = !a.pool     ? 0
                                : a.overlap ? s.n * a.op.yh * a.op.yw
                                            : d.rows / (a.pool * a.pool);
  KILN_CHECK(pooled_pixels * (C / 8) < (int64_t{1} << 31), Unsupported,
             "BatchNorm with a merged max-pool: ", pooled_pixels, " pooled pixels x ", C / 8,
             " channel groups; the kernel indexes them in 32 bits");
  const unsigned pgrid = a.pool ? grid_for(ctx, pooled_pixels * (C / 8), kVecThreads) : 1;
  const int hp = a.pool ? static_cast<int>(s.h / a.pool) : 0,
            wp = a.pool ? static_cast<int>(s.w / a.pool) : 0;
  // VGG's 2x2 pools: the group-per-thread form where a block's 256 threads are whole pixels'
  // groups and its loop's last step stays below 2^31.
  const bool pool2_group =
      ctx.opts.pool_group_apply && a.pool == 2 && !a.overlap && pool_vec &&
      kVecThreads % (C / 8) == 0 &&
      pooled_pixels + 2 * static_cast<int64_t>(pgrid) * (kVecThreads / (C / 8)) <
          (int64_t{1} << 31);
  const int chunks = a.sums ? 1 : v.on ? v.blocks : d.gy;
  // The residual's BatchNorm (a.res): its statistics pass over the residual, in the same
  // partials, finalized into a.res_coef before x's statistics pass reuses them.
  const BnVec v2 = a.res ? bn_vec(ctx, dt, d.rows, C, {a.res->x}) : BnVec{};
  // Where the shortcut's convolution took the residual's sums, its finalize reads them.
  const bool res_summed = a.res && a.res->sums;
  const int chunks2 = !a.res ? 0 : res_summed ? 1 : v2.on ? v2.blocks : d.gy;
  const size_t coef_off = reserve_stats_workspace(ctx, stream, std::max(chunks, chunks2), C);
  KILN_CHECK(!a.res || (a.mask && a.residual == a.res->x && a.res_coef && !a.pool), Internal,
             "BatchNorm with the residual's BatchNorm needs the fused ReLU and its residual");
  const bool res_bn = a.res != nullptr;  // a.res is the caller's: not read while running
  FwdFinalize fin2;
  if (res_bn) {
    fin2.rows = d.rows, fin2.C = C, fin2.eps = a.res->eps, fin2.momentum = a.res->momentum;
    fin2.saved = a.res->saved, fin2.running_mean = a.res->rm, fin2.running_var = a.res->rv;
    fin2.gamma = a.res->gamma, fin2.beta = a.res->beta, fin2.sums = a.res->sums;
  }
  const dim3 rgrid(static_cast<unsigned>((C + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const int64_t count = d.rows * C;
  const unsigned egrid = grid_for(ctx, a.mask ? (count + 7) / 8 : count, kThreads);
  FwdFinalize fin;
  fin.sums = a.sums, fin.rows = d.rows, fin.C = C, fin.eps = a.eps, fin.momentum = a.momentum;
  fin.saved = a.saved, fin.running_mean = a.rm, fin.running_var = a.rv;
  fin.gamma = a.gamma, fin.beta = a.beta, fin.conv_bias = a.conv_bias;
  // Where a kernel before took the sums, the 16-byte apply pass finalizes itself
  // (KILN_BN_FUSED_FINALIZE): one launch fewer a layer.
  const bool self_finalize = a.sums && gp.on && !a.pool && ctx.opts.bn_fused_finalize;
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      const auto [partial, coef] = stats_scratch(c, stream, coef_off);
      const T* x = static_cast<const T*>(a.x);
      const T* res = static_cast<const T*>(a.residual);
      T* y = static_cast<T*>(a.y);
      if (res_bn && !res_summed && v2.on) {
        stats_partial_vec<T><<<v2.blocks, kVecThreads, 0, st>>>(res, static_cast<int>(d.rows),
                                                                static_cast<int>(C), partial);
        KILN_LAUNCH_CHECK("residual bn stats (vec)");
      } else if (res_bn && !res_summed) {
        stats_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(res, d.rows, C, partial);
        KILN_LAUNCH_CHECK("residual bn stats");
      }
      if (res_bn) {
        stats_finalize_kernel<<<finalize_grid(C), dim3(kFinC, kFinS), 0, st>>>(partial, chunks2,
                                                                               fin2, a.res_coef);
        KILN_LAUNCH_CHECK("residual bn stats finalize");
      }
      // Where a kernel before took the sums, the finalize reads them as they are.
      if (!a.sums && v.on) {
        stats_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(x, static_cast<int>(d.rows),
                                                               static_cast<int>(C), partial);
        KILN_LAUNCH_CHECK("bn stats (vec)");
      } else if (!a.sums) {
        stats_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(x, d.rows, C, partial);
        KILN_LAUNCH_CHECK("bn stats");
      }
      if (!self_finalize) {
        stats_finalize_kernel<<<finalize_grid(C), dim3(kFinC, kFinS), 0, st>>>(partial, chunks, fin,
                                                                               coef);
        KILN_LAUNCH_CHECK("bn stats finalize");
      }
      const FwdFinalize own = self_finalize ? fin : FwdFinalize{};
      if (a.overlap) {
        const int cg = static_cast<int>(C / 8), total = static_cast<int>(pooled_pixels * (C / 8));
        if (pool_vec && a.op.k == 3) {
          apply_relu_pool_overlap<T, true, 3>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, a.op, coef);
        } else if (pool_vec) {
          apply_relu_pool_overlap<T, true, 0>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, a.op, coef);
        } else if (a.op.k == 3) {
          apply_relu_pool_overlap<T, false, 3>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, a.op, coef);
        } else {
          apply_relu_pool_overlap<T, false, 0>
              <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, a.op, coef);
        }
        KILN_LAUNCH_CHECK("bn apply + relu + overlapping max-pool + mask");
      } else if (a.pool) {
        const int cg = static_cast<int>(C / 8), total = static_cast<int>(pooled_pixels * (C / 8));
        T* zp = static_cast<T*>(a.zp);
        // Z: the pass also writes zp and mp (KILN_POOL_POOLED_SUMS).
        const auto launch = [&](auto z) {
          constexpr bool Z = decltype(z)::value;
          if (pool2_group) {
            apply_relu_pool2_group<T, Z>
                <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, static_cast<int>(pooled_pixels), cg,
                                                wp, FastDivide(wp), coef, zp, a.mp);
          } else if (a.pool == 2 && pool_vec) {
            apply_relu_pool<T, true, 2, Z>
                <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, 2, coef, zp, a.mp);
          } else if (a.pool == 2) {
            apply_relu_pool<T, false, 2, Z>
                <<<pgrid, kVecThreads, 0, st>>>(x, y, a.mask, total, cg, hp, wp, 2, coef, zp, a.mp);
          } else if (pool_vec) {
            apply_relu_pool<T, true, 0, Z><<<pgrid, kVecThreads, 0, st>>>(
                x, y, a.mask, total, cg, hp, wp, a.pool, coef, zp, a.mp);
          } else {
            apply_relu_pool<T, false, 0, Z><<<pgrid, kVecThreads, 0, st>>>(
                x, y, a.mask, total, cg, hp, wp, a.pool, coef, zp, a.mp);
          }
        };
        if (zp != nullptr) {
          launch(std::true_type{});
        } else {
          launch(std::false_type{});
        }
        KILN_LAUNCH_CHECK("bn apply + relu + max-pool + mask");
      } else if (gp.on && res_bn) {
        (gp.deep ? apply_group<T, true, true, 4>
                 : apply_group<T, true, true>)<<<gp.blocks, kVecThreads, 0, st>>>(
            x, res, y, a.mask, static_cast<int>(d.rows), gp.cg, coef, own, a.res_coef);
        KILN_LAUNCH_CHECK("bn apply + residual bn + add + relu + mask (vec)");
      } else if (gp.on && a.mask) {
        (gp.deep ? apply_group<T, true, false, 4>
                 : apply_group<T, true>)<<<gp.blocks, kVecThreads, 0, st>>>(
            x, res, y, a.mask, static_cast<int>(d.rows), gp.cg, coef, own, nullptr);
        KILN_LAUNCH_CHECK("bn apply + relu + mask (vec)");
      } else if (gp.on) {
        (gp.deep ? apply_group<T, false, false, 4>
                 : apply_group<T, false>)<<<gp.blocks, kVecThreads, 0, st>>>(
            x, nullptr, y, nullptr, static_cast<int>(d.rows), gp.cg, coef, own, nullptr);
        KILN_LAUNCH_CHECK("bn apply (vec)");
      } else if (a.mask) {
        apply_relu_mask_kernel<T>
            <<<egrid, kThreads, 0, st>>>(x, res, y, a.mask, count, C, coef, a.res_coef);
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
  // The overlapping pool's form reads the pooled dy, writes g into dx in its sums pass and reads
  // the mask a word at a time: all four vector-aligned.
  const BnVec v =
      bn_vec(ctx, dt, d.rows, C,
             {a.x, a.dy, a.dy2, a.overlap ? a.dx : nullptr, a.overlap ? a.mask : nullptr});
  const GroupPlan gp = group_plan(ctx, d.rows, C, {a.x, a.dy, a.dy2, a.dx, a.dres});
  KILN_CHECK(!a.overlap || (!a.sums && !a.dy2 && !a.dres && a.mask), Internal,
             "BatchNorm backward with an overlapping max-pool takes no sums, second gradient or "
             "residual gradient");
  KILN_CHECK(!a.zp || (a.pm.pool > 0 && !a.dy2 && !a.partial && a.mp), Internal,
             "BatchNorm backward from the pooled picks takes a tiled pool's dy and mp, no second "
             "gradient and no sums left by another pass");
  // The pooled picks' sums pass: over the pooled map's rows.
  const ChannelDims dp =
      a.zp ? channel_dims(ctx, Nhwc{s.n, s.h / a.pm.pool, s.w / a.pm.pool, C}) : ChannelDims{};
  const BnVec vp = a.zp ? bn_vec(ctx, dt, dp.rows, C, {a.zp, a.dy}) : BnVec{};
  const int chunks = a.sums      ? 1
                     : a.partial ? a.partial_blocks
                     : a.zp      ? (vp.on ? vp.blocks : dp.gy)
                     : v.on      ? v.blocks
                                 : d.gy;
  KILN_CHECK(!a.partial || (v.on && a.partial_blocks == v.blocks), Internal,
             "BatchNorm backward: sums left by another pass in a layout that is not its own");
  KILN_CHECK(!a.res_partial || (gp.on && (dt == DType::F16 || dt == DType::BF16)), Internal,
             "BatchNorm backward: a shortcut's sums asked of a dx pass without 16-byte groups");
  KILN_CHECK(!a.fold_coef || (!a.res_partial && !a.dres && !a.dy2), Internal,
             "BatchNorm backward without its dx pass takes no shortcut's sums, residual gradient "
             "or second gradient");
  const size_t coef_off = reserve_stats_workspace(ctx, stream, chunks, C);
  const dim3 rgrid(static_cast<unsigned>((C + kCx - 1) / kCx), static_cast<unsigned>(d.gy));
  const int64_t count = d.rows * C;
  const unsigned egrid = grid_for(ctx, count, kThreads);
  BwdFinalize fin;
  fin.sums = a.sums, fin.rows = d.rows, fin.C = C, fin.saved = a.saved, fin.gamma = a.gamma;
  fin.dgamma = a.dgamma, fin.dbeta = a.dbeta;
  const bool self_finalize =
      a.sums && gp.on && ctx.opts.bn_fused_finalize && !a.fold_coef;  // as the forward's
  const bool route_eager = ctx.opts.pool_route_eager;
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t st) {
      const auto [partial, coef] = stats_scratch(c, stream, coef_off);
      const T *x = static_cast<const T*>(a.x), *dy = static_cast<const T*>(a.dy),
              *dy2 = static_cast<const T*>(a.dy2);
      T *dx = static_cast<T*>(a.dx), *dres = static_cast<T*>(a.dres);
      // Where the data gradient took the sums, the finalize reads them as they are.
      if (a.overlap && v.on) {
        // At most two windows a side cover an element (the stem's 3x3 / 2): the unrolled gather.
        const bool two = (a.op.k - 1) / a.op.s + 1 <= 2;
        const auto route = !two          ? route_partial_vec<T, 0>
                           : route_eager ? route_partial_vec<T, 2, true>
                                         : route_partial_vec<T, 2>;
        route<<<v.blocks, kVecThreads, 0, st>>>(x, dy, a.mask, a.saved, static_cast<int>(d.rows),
                                                static_cast<int>(C), a.op, dx, partial);
        KILN_LAUNCH_CHECK("bn bwd overlapping max-pool route + sums (vec)");
      } else if (a.overlap) {
        route_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(x, dy, a.mask, a.saved, d.rows, C,
                                                                  a.op, dx, partial);
        KILN_LAUNCH_CHECK("bn bwd overlapping max-pool route + sums");
      } else if (a.partial) {
        // The BN+add+ReLU backward before it summed g in its dx pass.
      } else if (!a.sums && a.zp && vp.on) {
        bwd_partial_vec<T><<<vp.blocks, kVecThreads, 0, st>>>(
            static_cast<const T*>(a.zp), dy, nullptr, a.mp, a.saved, static_cast<int>(dp.rows),
            static_cast<int>(C), partial);
        KILN_LAUNCH_CHECK("bn bwd sums from the pooled picks (vec)");
      } else if (!a.sums && a.zp) {
        const dim3 pgrid(static_cast<unsigned>((C + kCx - 1) / kCx), static_cast<unsigned>(dp.gy));
        bwd_partial_kernel<T><<<pgrid, dim3(kCx, kCy), 0, st>>>(
            static_cast<const T*>(a.zp), dy, nullptr, a.mp, a.saved, dp.rows, C, partial);
        KILN_LAUNCH_CHECK("bn bwd sums from the pooled picks");
      } else if (!a.sums && v.on) {
        bwd_partial_vec<T><<<v.blocks, kVecThreads, 0, st>>>(x, dy, dy2, a.mask, a.saved,
                                                             static_cast<int>(d.rows),
                                                             static_cast<int>(C), partial, a.pm);
        KILN_LAUNCH_CHECK("bn bwd sums (vec)");
      } else if (!a.sums) {
        bwd_partial_kernel<T><<<rgrid, dim3(kCx, kCy), 0, st>>>(x, dy, dy2, a.mask, a.saved, d.rows,
                                                                C, partial, a.pm);
        KILN_LAUNCH_CHECK("bn bwd sums");
      }
      if (!self_finalize) {
        bwd_finalize_kernel<<<finalize_grid(C), dim3(kFinC, kFinS), 0, st>>>(
            a.partial ? a.partial : partial, chunks, fin, a.fold_coef ? a.fold_coef : coef);
        KILN_LAUNCH_CHECK("bn bwd finalize");
      }
      if (a.fold_coef) return;  // the weight gradient forms dx
      // The overlapping form's dx pass reads g where its sums pass wrote it (dx, in place).
      const T* g = a.overlap ? dx : dy;
      const uint8_t* mask = a.overlap ? nullptr : a.mask;
      const PoolMap pm = a.overlap ? PoolMap{} : a.pm;
      if constexpr (sizeof(T) == 2) {
        if (a.res_partial) {
          bwd_dx_group<T, true><<<a.res_blocks, kVecThreads, 0, st>>>(
              x, g, dy2, mask, dx, dres, static_cast<int>(d.rows), gp.cg, coef, pm,
              self_finalize ? fin : BwdFinalize{}, static_cast<const T*>(a.res_x), a.res_mean,
              a.res_partial);
          KILN_LAUNCH_CHECK("bn bwd dx + the shortcut BatchNorm's sums (vec)");
          return;
        }
      }
      if (gp.on) {
        (gp.deep ? bwd_dx_group<T, false, 4> : bwd_dx_group<T>)<<<gp.blocks, kVecThreads, 0, st>>>(
            x, g, dy2, mask, dx, dres, static_cast<int>(d.rows), gp.cg, coef, pm,
            self_finalize ? fin : BwdFinalize{}, nullptr, nullptr, nullptr);
        KILN_LAUNCH_CHECK("bn bwd dx (vec)");
      } else {
        bwd_dx_kernel<T><<<egrid, kThreads, 0, st>>>(x, g, dy2, mask, dx, dres, count, C, coef, pm);
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

// BN+add+ReLU's residual gradient, when the node has one: x's dtype and size.
void set_dresidual(const Context& ctx, const Node& n, TensorId x, TensorId dres, const Nhwc& s,
                   BnBwd* a) {
  if (dres != kNoTensor) {
    expect_same_dtype(ctx, n, x, dres);
    expect_numel(ctx, n, dres, s.numel(), "dresidual");
  }
  a->dres = ctx.ptr(dres);
}

// KILN_RESIDUAL_BN_SUMS_IN_DX: where the shortcut BatchNorm's backward m (a bn_bwd reading this
// node's dresidual as its dy) would run bwd_partial_vec and this node's dx pass runs on 16-byte
// groups, the dx pass also takes m's sums (a->res_*) and m finalizes from them
// (ctx.residual_bn_partials, make_bn_bwd). Else nothing changes.
void take_shortcut_sums(Context& ctx, const Node& m, const Nhwc& s, DType dt, BnBwd* a) {
  const TensorId mx = in_at(m, 0), mdy = in_at(m, 1), msaved = in_at(m, 3);
  if ((dt != DType::F16 && dt != DType::BF16) || m.op != OpKind::bn_bwd || mx == kNoTensor ||
      mdy == kNoTensor || msaved == kNoTensor || ctx.tensor(mx).dtype != dt ||
      ctx.tensor(mx).numel() != s.numel() || ctx.tensor(msaved).numel() != 2 * s.c)
    return;
  const ChannelDims d = channel_dims(ctx, s);
  // m's own sums pass's plan (bn_backward's bn_vec) and this node's dx pass's, with m's x read.
  const BnVec v = bn_vec(ctx, dt, d.rows, d.c, {ctx.ptr(mx), ctx.ptr(mdy), nullptr});
  const GroupPlan gp =
      group_plan(ctx, d.rows, d.c, {a->x, a->dy, a->dy2, a->dx, a->dres, ctx.ptr(mx)});
  if (!v.on || !gp.on) return;
  a->keep = std::make_shared<DeviceBuffer>(sizeof(double2) * static_cast<size_t>(v.blocks * d.c));
  a->res_x = ctx.ptr(mx);
  a->res_mean = ctx.ptr<float>(msaved);  // saved = [mean; invstd]
  a->res_partial = static_cast<double2*>(a->keep->get());
  a->res_blocks = v.blocks;
  ctx.residual_bn_partials[&m] = {a->res_partial, v.blocks};
  ++ctx.residual_bn_sums_in_dx;
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
                                const float* conv_sums, const BnAddReluFwdTensors* res_bn,
                                const float* res_sums) {
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
  if (res_bn == nullptr || !res_bn->res_bn)
    return bn_forward(ctx, stream, s, ctx.tensor(x).dtype, a);
  // The residual's BatchNorm: the same checks as a bn_fwd_train node of its own, its
  // coefficients in a buffer of this kernel's.
  const Node part = residual_bn_part(n, *res_bn, kNoTensor);
  Nhwc s2;
  BnFwd r = bn_fwd_args(ctx, part, res_bn->residual, res_bn->gamma2, res_bn->beta2, res_bn->rm2,
                        res_bn->rv2, residual, res_bn->saved2, &s2);
  r.sums = res_sums;
  auto coef2 = std::make_shared<DeviceBuffer>(sizeof(float4) * static_cast<size_t>(s.c));
  a.res = &r;
  a.res_coef = static_cast<float4*>(coef2->get());
  std::shared_ptr<Kernel> k = bn_forward(ctx, stream, s, ctx.tensor(x).dtype, a);
  return make_fn(stream, [k, coef2](Context& c, cudaStream_t) { k->run(c); });
}

// The BatchNorm backward of cbr_bwd (z, dy, mask -> dz) and of bn_add_relu_bwd (x, dy, mask,
// [dy2] -> dx, dresidual) (fused.cpp), with the ReLU backward taken from the mask.
KernelPtr make_bn_relu_mask_bwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId dy,
                                TensorId dy2, TensorId mask, TensorId gamma, TensorId saved,
                                TensorId dx, TensorId dres, TensorId dgamma, TensorId dbeta,
                                const Node* shortcut, float4* fold_coef) {
  Nhwc s;
  BnBwd a = bn_bwd_args(ctx, n, x, dy, gamma, saved, dx, dgamma, dbeta, &s);
  a.fold_coef = fold_coef;
  if (dy2 != kNoTensor) {
    expect_same_dtype(ctx, n, dy, dy2);
    expect_numel(ctx, n, dy2, s.numel(), "dy2");
    a.dy2 = ctx.ptr(dy2);
  }
  set_dresidual(ctx, n, x, dres, s, &a);
  expect_mask(ctx, n, mask, dy);
  a.mask = ctx.ptr<uint8_t>(mask);
  if (shortcut != nullptr) take_shortcut_sums(ctx, *shortcut, s, ctx.tensor(x).dtype, &a);
  return bn_backward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// The BatchNorm backward of cbr_bwd (z -> dz) and of bn_add_relu_bwd (x -> dx, [dresidual])
// when the data gradient before it (cutlass_dgrad.cpp) wrote its masked gradient g (dy [+ dy2]
// where the mask passes it, else 0: what the mask and dy2 would give) and g's two sums: the
// finalize and dx passes alone, reading g and x (and copying g to dres when that is given).
KernelPtr make_bn_bwd_from_sums(const Node& n, Context& ctx, int stream, TensorId x, TensorId g,
                                TensorId gamma, TensorId saved, TensorId dx, TensorId dres,
                                TensorId dgamma, TensorId dbeta, const float* sums,
                                const Node* shortcut, float4* fold_coef) {
  Nhwc s;
  BnBwd a = bn_bwd_args(ctx, n, x, g, gamma, saved, dx, dgamma, dbeta, &s);
  a.fold_coef = fold_coef;
  set_dresidual(ctx, n, x, dres, s, &a);
  a.sums = sums;
  if (shortcut != nullptr) take_shortcut_sums(ctx, *shortcut, s, ctx.tensor(x).dtype, &a);
  return bn_backward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

namespace {

// A merged max-pool's geometry (attrs.pool, pool_stride, pool_pad) between z (s) and its
// pooled map (ps), checked: windows that tile z, or the overlapping form (pool_route.cuh).
OverlapPool merged_pool(const Context& ctx, const Node& n, TensorId z, const Nhwc& s, TensorId p,
                        const Nhwc& ps, const char* what) {
  const Attrs& at = n.attrs;
  const int k = at.pool, st = at.pool_step(), pad = at.pool_pad;
  const bool fits = k >= 1 && st >= 1 && pad >= 0 && pad < k && ps.n == s.n && ps.c == s.c &&
                    (at.pool_tiles() ? ps.h * k == s.h && ps.w * k == s.w
                                     : k <= 15 && ps.h == (s.h + 2 * pad - k) / st + 1 &&
                                           ps.w == (s.w + 2 * pad - k) / st + 1);
  KILN_CHECK(fits, Shape, op_name(n.op), " node '", n.label, "': ", what, " ",
             ctx.tensor(p).shape.str(), " is not z ", ctx.tensor(z).shape.str(), " max-pooled by ",
             k, "x", k, " windows at stride ", st, " with padding ", pad,
             at.pool_tiles() ? " that tile it" : " (a window of at most 15, padding below it)",
             " (attrs.pool, pool_stride, pool_pad)");
  KILN_CHECK(s.numel() / s.c < (int64_t{1} << 31), Unsupported, op_name(n.op), " node '", n.label,
             "': ", s.numel() / s.c,
             " pixels; the pooled BatchNorm indexes rows in 32 bits (at most 2^31)");
  OverlapPool op;
  op.zh = static_cast<int>(s.h), op.zw = static_cast<int>(s.w);
  op.yh = static_cast<int>(ps.h), op.yw = static_cast<int>(ps.w);
  op.k = k, op.s = st, op.p = pad;
  return op;
}

// The mask of cbr_pool_*: a bit per element of z for tiled windows, a byte per pooled element
// for overlapping ones (ops.def).
void expect_pool_mask(const Context& ctx, const Node& n, TensorId mask, TensorId z, TensorId p) {
  if (n.attrs.pool_tiles()) {
    expect_mask(ctx, n, mask, z);
    return;
  }
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_numel(ctx, n, mask, ctx.tensor(p).numel(), "mask (a byte per pooled element)");
}

}  // namespace

// cbr_pool_fwd's BatchNorm, ReLU and max-pool (fused.cpp): "z, gamma, beta, running_mean,
// running_var, [b] -> y (pooled), saved, mask".
KernelPtr make_bn_relu_pool_fwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId gamma,
                                TensorId beta, TensorId rm, TensorId rv, TensorId conv_bias,
                                TensorId y, TensorId saved, TensorId mask, const float* conv_sums,
                                TensorId zp, TensorId mp) {
  Nhwc s;
  BnFwd a = bn_fwd_args(ctx, n, z, gamma, beta, rm, rv, kNoTensor, saved, &s);
  const Nhwc ys = nhwc_of(ctx, n, y, "y (pooled)");
  expect_same_dtype(ctx, n, z, y);
  const OverlapPool op = merged_pool(ctx, n, z, s, y, ys, "y");
  if (conv_bias != kNoTensor) {
    expect_dtype(ctx, n, conv_bias, DType::F32, "b");
    expect_numel(ctx, n, conv_bias, s.c, "b (one per output channel)");
  }
  expect_pool_mask(ctx, n, mask, z, y);
  expect_pooled_pick(ctx, n, n.attrs.pool_tiles(), y, zp, mp);
  a.y = ctx.ptr(y);
  a.zp = ctx.ptr(zp);
  a.mp = ctx.ptr<uint8_t>(mp);
  a.sums = conv_sums;
  a.conv_bias = ctx.ptr<float>(conv_bias);
  a.mask = ctx.ptr<uint8_t>(mask);
  a.pool = n.attrs.pool;
  a.overlap = !n.attrs.pool_tiles();
  a.op = op;
  return bn_forward(ctx, stream, s, ctx.tensor(z).dtype, a);
}

// cbr_pool_bwd's BatchNorm backward (fused.cpp): "z, dy (pooled), mask, gamma, saved -> dz,
// dgamma, dbeta", the gradient at BatchNorm's output read from the pooled dy.
KernelPtr make_bn_relu_pool_bwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId dy,
                                TensorId mask, TensorId gamma, TensorId saved, TensorId dz,
                                TensorId dgamma, TensorId dbeta, float4* fold_coef, TensorId zp,
                                TensorId mp, const float* sums) {
  Nhwc s;
  BnBwd a = bn_bwd_args(ctx, n, z, dz, gamma, saved, dz, dgamma, dbeta, &s);
  a.fold_coef = fold_coef;
  const Nhwc ds = nhwc_of(ctx, n, dy, "dy (pooled)");
  expect_same_dtype(ctx, n, z, dy);
  const OverlapPool op = merged_pool(ctx, n, z, s, dy, ds, "dy");
  expect_pool_mask(ctx, n, mask, z, dy);
  expect_pooled_pick(ctx, n, n.attrs.pool_tiles(), dy, zp, mp);
  a.dy = ctx.ptr(dy);
  a.mask = ctx.ptr<uint8_t>(mask);
  KILN_CHECK(sums == nullptr || zp != kNoTensor, Internal, op_name(n.op), " node '", n.label,
             "': sums from a data gradient need the forward's pooled picks");
  if (sums != nullptr) {
    a.sums = sums;  // g is in dy already, masked by mp; the dx pass routes it
  } else {
    a.zp = ctx.ptr(zp);
    a.mp = ctx.ptr<uint8_t>(mp);
  }
  if (n.attrs.pool_tiles()) {
    a.pm = PoolMap{n.attrs.pool, static_cast<int>(s.w)};
  } else {
    a.overlap = true;
    a.op = op;
  }
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
  BnBwd a = bn_bwd_args(ctx, n, x, dy, gamma, saved, dx, dgamma, dbeta, &s);
  // A shortcut's BatchNorm whose sums the BN+add+ReLU backward's dx pass took.
  if (const auto it = ctx.residual_bn_partials.find(&n); it != ctx.residual_bn_partials.end()) {
    a.partial = it->second.partial;
    a.partial_blocks = it->second.blocks;
  }
  return bn_backward(ctx, stream, s, ctx.tensor(x).dtype, a);
}

// "x, gamma, beta, running_mean, running_var, [residual] -> y": the evaluation form of the
// fused ops' BatchNorm, add and ReLU, one pass.
KernelPtr make_bn_relu_infer(const Node& n, Context& ctx, int stream) {
  return bn_infer(n, ctx, stream, true);
}

}  // namespace kiln::cuda
