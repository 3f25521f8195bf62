// Fused ops on the CPU (in FP32): each is its unfused chain's own kernels run in
// sequence on the fused node's tensors, with the ReLU folded into one pass that also writes
// the bit mask, and the ReLU backward folded into the pass that applies the mask. The
// arithmetic is the unfused chain's, operation for operation, so a fused step equals the
// unfused one bit for bit (tests/e2e: FusedStepEqualsUnfused); what fusion saves here is the
// BatchNorm output map and the ReLU passes. These kernels are also the reference the CUDA
// fused kernels are tested against.
//
// Mask layout (ops.def): bit (i % 8) of byte i / 8 is set where y[i] > 0.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_util.h"
#include "backend/fused_nodes.h"

namespace kiln::cpu {

namespace {

// Runs its parts in order; owns the buffer they share beyond the regions, if any.
class Sequence final : public Kernel {
 public:
  explicit Sequence(std::vector<KernelPtr> parts, std::vector<float> shared = {})
      : parts_(std::move(parts)), shared_(std::move(shared)) {}
  void run(Context& ctx) override {
    for (auto& k : parts_) k->run(ctx);
  }

 private:
  std::vector<KernelPtr> parts_;
  std::vector<float> shared_;  // moved in: its heap buffer, which the parts point into, stays
};

// y = relu(y + residual) in place (residual may be absent), mask bit = y > 0. ReLU as
// make_relu_fwd: NaN passes (and its mask bit is 0, as relu_bwd's y > 0 test says).
KernelPtr relu_with_mask(float* y, const float* residual, uint8_t* mask, int64_t count) {
  return make_loop([=](Context&) {
    // The ReLU as relu_fwd's vectorised loop, then the mask from its output (y > 0 exactly
    // where the input was > 0; NaN stays NaN with bit 0).
    if (residual) {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) {
        const float v = y[i] + residual[i];
        y[i] = !(v <= 0.0f) ? v : 0.0f;
      }
    } else {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) y[i] = !(y[i] <= 0.0f) ? y[i] : 0.0f;
    }
    const int64_t bytes = (count + 7) / 8, full = count / 8;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < full; ++b) {
      const float* v = y + 8 * b;
      unsigned bits = 0;
#pragma omp simd reduction(| : bits)
      for (int j = 0; j < 8; ++j) bits |= (v[j] > 0.0f ? 1u : 0u) << j;
      mask[b] = static_cast<uint8_t>(bits);
    }
    if (full < bytes) {
      unsigned bits = 0;
      for (int64_t i = 8 * full; i < count; ++i) bits |= (y[i] > 0.0f ? 1u : 0u) << (i - 8 * full);
      mask[full] = static_cast<uint8_t>(bits);
    }
  });
}

// g = mask ? dy : 0 (relu_bwd from the mask). Each mask byte selects one row of a 256 x 8
// table of all-ones / all-zeros words that is ANDed onto eight gradients' bits: exactly the
// select (dy where the bit is set, +0 elsewhere) in a form the compiler vectorises; a
// per-element shift of a gathered byte ran at ~0.6 G elements/s here.
using AliasU32 = uint32_t __attribute__((may_alias));

const std::array<std::array<uint32_t, 8>, 256>& byte_to_lanes() {
  static const auto table = [] {
    std::array<std::array<uint32_t, 8>, 256> t{};
    for (unsigned m = 0; m < 256; ++m) {
      for (unsigned j = 0; j < 8; ++j) t[m][j] = (m >> j) & 1u ? 0xFFFFFFFFu : 0u;
    }
    return t;
  }();
  return table;
}

// g = mask ? dy + dy2 : 0, the gradient-sum add (make_add's a + b) and the ReLU backward in
// one pass; then the masking above on g.
KernelPtr apply_mask_sum(const float* dy, const float* dy2, const uint8_t* mask, float* g,
                         int64_t count) {
  return make_loop([=](Context&) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const float s = dy[i] + dy2[i];
      g[i] = (mask[i >> 3] >> (i & 7)) & 1u ? s : 0.0f;
    }
  });
}

KernelPtr apply_mask(const float* dy, const uint8_t* mask, float* g, int64_t count) {
  const auto* lanes = &byte_to_lanes();
  return make_loop([=](Context&) {
    const auto* d = reinterpret_cast<const AliasU32*>(dy);
    auto* o = reinterpret_cast<AliasU32*>(g);
    const int64_t full = count / 8;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < full; ++b) {
      const uint32_t* e = (*lanes)[mask[b]].data();
#pragma omp simd
      for (int j = 0; j < 8; ++j) o[8 * b + j] = d[8 * b + j] & e[j];
    }
    for (int64_t i = 8 * full; i < count; ++i) g[i] = (mask[i >> 3] >> (i & 7)) & 1u ? dy[i] : 0.0f;
  });
}

// The convolution bias a CBR's BatchNorm cancels (ops.def): the running mean tracks z + b,
// i.e. gains momentum * b.
KernelPtr cancelled_bias_moves_running_mean(const Node& n, Context& ctx, TensorId b, TensorId rm) {
  expect_dtype(ctx, n, b, DType::F32, "b");
  expect_numel(ctx, n, b, ctx.tensor(rm).numel(), "b (one per output channel)");
  float* rmp = ctx.ptr<float>(rm);
  const float* bp = ctx.ptr<float>(b);
  const float m = n.attrs.bn_momentum;
  const int64_t c = ctx.tensor(rm).numel();
  return make_loop([=](Context&) {
    for (int64_t i = 0; i < c; ++i) rmp[i] += m * bp[i];
  });
}

// cbr_bwd and cbr_pool_bwd: `to_dz` writes the gradient at BatchNorm's output into dz; then
// BatchNorm's backward in place there, the weight and data gradients (none for the first
// layer), and the cancelled bias's gradient: the sum of dz per channel, exactly 0 (ops.def).
KernelPtr cbr_backward(const Node& n, Context& ctx, const CbrBwdTensors& t, KernelPtr to_dz) {
  std::vector<KernelPtr> parts;
  parts.push_back(std::move(to_dz));
  parts.push_back(make_bn_bwd(
      fused_part(OpKind::bn_bwd, {t.z, t.dz, t.gamma, t.saved}, {t.dz, t.dgamma, t.dbeta}, n, "bn"),
      ctx));
  parts.push_back(make_conv_bwd_weight(
      fused_part(OpKind::conv_bwd_weight, {t.x, t.dz}, {t.dw}, n, "wgrad"), ctx));
  if (t.dx != kNoTensor) {
    parts.push_back(make_conv_bwd_data(
        fused_part(OpKind::conv_bwd_data, {t.dz, t.w}, {t.dx}, n, "dgrad"), ctx));
  }
  if (t.db != kNoTensor) {
    expect_dtype(ctx, n, t.db, DType::F32, "db");
    float* dbp = ctx.ptr<float>(t.db);
    const int64_t c = ctx.tensor(t.db).numel();
    parts.push_back(make_loop([=](Context&) { std::fill(dbp, dbp + c, 0.0f); }));
  }
  return std::make_unique<Sequence>(std::move(parts));
}

}  // namespace

// "x, w, gamma, beta, running_mean, running_var, [b] -> z, y, saved, mask"
KernelPtr make_cbr_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const auto [x, w, gamma, beta, rm, rv, b, z, y, saved, mask, zp, mp] = cbr_fwd_tensors(n);
  (void)zp, (void)mp;  // cbr_pool_fwd's alone (cbr_fwd_tensors checks)
  expect_mask(ctx, n, mask, y);
  std::vector<KernelPtr> parts;
  parts.push_back(make_conv_fwd(fused_part(OpKind::conv_fwd, {x, w}, {z}, n, "conv"), ctx));
  parts.push_back(make_bn_fwd_train(
      fused_part(OpKind::bn_fwd_train, {z, gamma, beta, rm, rv}, {y, saved}, n, "bn"), ctx));
  parts.push_back(
      relu_with_mask(ctx.ptr<float>(y), nullptr, ctx.ptr<uint8_t>(mask), ctx.tensor(y).numel()));
  if (b != kNoTensor) parts.push_back(cancelled_bias_moves_running_mean(n, ctx, b, rm));
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, w, z, dy, mask, gamma, saved -> [dx], dw, dgamma, dbeta, dz, [db]"
KernelPtr make_cbr_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const CbrBwdTensors t = cbr_bwd_tensors(n);
  expect_same_size(ctx, n, t.z, t.dy);
  expect_same_size(ctx, n, t.z, t.dz);
  expect_mask(ctx, n, t.mask, t.dy);
  // The ReLU's backward into dz, then BatchNorm's backward in place there (oneDNN's BN
  // backward reads each diff_dst element before writing the same diff_src element).
  return cbr_backward(n, ctx, t,
                      apply_mask(ctx.ptr<float>(t.dy), ctx.ptr<uint8_t>(t.mask),
                                 ctx.ptr<float>(t.dz), ctx.tensor(t.dy).numel()));
}

namespace {

// The geometry of cbr_pool_*: z (the convolution's output) and y, its max-pool by `pool` x
// `pool` windows at `stride` with `pad` rows and columns of padding (ops.def): windows that tile
// z (the mask a bit an element of z) or overlap (a byte an element of y).
struct PoolGeom {
  Nhwc z, y;
  int64_t pool = 0, stride = 0, pad = 0;
  bool tiles = true;
  // Tiled: the element of y whose window holds element i of z.
  int64_t pooled(int64_t i) const {
    const int64_t c = i % z.c, pix = i / z.c, w = pix % z.w, h = (pix / z.w) % z.h,
                  b = pix / (z.w * z.h);
    return ((b * y.h + h / pool) * y.w + w / pool) * z.c + c;
  }
  // The pooled rows (or columns) [*lo, *hi] whose windows cover z's row (column) i: maxpool_bwd's.
  void covering(int64_t i, int64_t out, int64_t* lo, int64_t* hi) const {
    const int64_t num = i + pad - pool + 1;
    *lo = num <= 0 ? 0 : (num + stride - 1) / stride;
    *hi = std::min((i + pad) / stride, out - 1);
  }
};

PoolGeom pool_geom(const Context& ctx, const Node& n, TensorId z, TensorId y) {
  PoolGeom t;
  t.z = nhwc_of(ctx, n, z, "z");
  t.y = nhwc_of(ctx, n, y, "y (pooled)");
  t.pool = n.attrs.pool;
  t.stride = n.attrs.pool_step();
  t.pad = n.attrs.pool_pad;
  t.tiles = n.attrs.pool_tiles();
  const bool fits =
      t.pool >= 1 && t.stride >= 1 && t.pad >= 0 && t.pad < t.pool && t.y.n == t.z.n &&
      t.y.c == t.z.c &&
      (t.tiles ? t.y.h * t.pool == t.z.h && t.y.w * t.pool == t.z.w
               : t.pool <= 15 && t.y.h == (t.z.h + 2 * t.pad - t.pool) / t.stride + 1 &&
                     t.y.w == (t.z.w + 2 * t.pad - t.pool) / t.stride + 1);
  KILN_CHECK(fits, Shape, op_name(n.op), " node '", n.label, "': y ", ctx.tensor(y).shape.str(),
             " is not z ", ctx.tensor(z).shape.str(), " max-pooled by ", t.pool, "x", t.pool,
             " windows at stride ", t.stride, " with padding ", t.pad,
             t.tiles ? " that tile it" : " (a window of at most 15, padding below it)",
             " (attrs.pool, pool_stride, pool_pad)");
  return t;
}

}  // namespace

// "x, w, gamma, beta, running_mean, running_var, [b] -> z, y (pooled), saved, mask": the
// convolution, BatchNorm into the kernel's own full-resolution buffer, the ReLU there, then the
// max-pool (maxpool_fwd's rule: first maximum in window order, NaN wins) with the routing mask
// (ops.def). The buffer is this kernel's: the CPU runs fused programs only when asked (tests,
// KILN_FUSE_FP32=1), and sharing it would cost a rebinding per run.
KernelPtr make_cbr_pool_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const auto [x, w, gamma, beta, rm, rv, b, z, y, saved, mask, zp, picked_bits] =
      cbr_fwd_tensors(n);
  const PoolGeom t = pool_geom(ctx, n, z, y);
  expect_dtype(ctx, n, y, DType::F32, "y");
  if (t.tiles) {
    expect_mask(ctx, n, mask, z);
  } else {
    expect_dtype(ctx, n, mask, DType::U8, "mask");
    expect_numel(ctx, n, mask, ctx.tensor(y).numel(), "mask (a byte per pooled element)");
  }
  expect_pooled_pick(ctx, n, t.tiles, y, zp, picked_bits);
  std::vector<float> relu(static_cast<size_t>(t.z.numel()));
  float* a = relu.data();
  std::vector<KernelPtr> parts;
  parts.push_back(make_conv_fwd(fused_part(OpKind::conv_fwd, {x, w}, {z}, n, "conv"), ctx));
  parts.push_back(make_bn_fwd_train_into(
      fused_part(OpKind::bn_fwd_train, {z, gamma, beta, rm, rv}, {z, saved}, n, "bn"), ctx, a));
  float* yp = ctx.ptr<float>(y);
  uint8_t* mp = ctx.ptr<uint8_t>(mask);
  const float* zv = ctx.ptr<float>(z);
  float* zpp = zp != kNoTensor ? ctx.ptr<float>(zp) : nullptr;
  uint8_t* mpp = zp != kNoTensor ? ctx.ptr<uint8_t>(picked_bits) : nullptr;
  const int64_t count = t.z.numel(), pooled = t.y.numel();
  // The z element each pooled element took, allocated here: run() allocates nothing.
  auto took = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(t.y.numel()));
  parts.push_back(make_loop([=](Context&) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < count; ++i) a[i] = !(a[i] <= 0.0f) ? a[i] : 0.0f;  // relu_fwd's
    // The max-pool: each pooled element's value and the z element it took, in its window
    // clipped to the map.
    int64_t* arg = took->data();
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < t.y.n * t.y.h; ++row) {
      const int64_t bi = row / t.y.h, ph = row % t.y.h, h0 = ph * t.stride - t.pad;
      const int64_t hs = std::max<int64_t>(h0, 0), he = std::min(h0 + t.pool, t.z.h);
      for (int64_t pw = 0; pw < t.y.w; ++pw) {
        const int64_t w0 = pw * t.stride - t.pad;
        const int64_t ws = std::max<int64_t>(w0, 0), we = std::min(w0 + t.pool, t.z.w);
        for (int64_t c = 0; c < t.z.c; ++c) {
          float best = -INFINITY;
          int64_t at = -1;
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) {
              const int64_t i = ((bi * t.z.h + ih) * t.z.w + iw) * t.z.c + c;
              if (a[i] > best || a[i] != a[i] || at < 0) {
                best = a[i];
                at = i;
              }
            }
          }
          const int64_t o = ((bi * t.y.h + ph) * t.y.w + pw) * t.z.c + c;
          yp[o] = best;
          arg[o] = at;
          if (!t.tiles) {
            // The window position of the element taken, 255 where the ReLU did not pass it.
            const int64_t pix = at / t.z.c, iw = pix % t.z.w, ih = (pix / t.z.w) % t.z.h;
            mp[o] = a[at] > 0.0f ? static_cast<uint8_t>((ih - h0) * t.pool + (iw - w0)) : 255;
          }
        }
      }
    }
    if (!t.tiles) return;
    if (zpp != nullptr) {
      // zp and mp (ops.def): z at the element each pooled element took, and the ReLU's bit there.
#pragma omp parallel for schedule(static)
      for (int64_t by = 0; by < (pooled + 7) / 8; ++by) {
        unsigned bits = 0;
        for (int64_t j = 0; j < 8 && 8 * by + j < pooled; ++j) {
          const int64_t o = 8 * by + j;
          zpp[o] = zv[arg[o]];
          bits |= (a[arg[o]] > 0.0f ? 1u : 0u) << j;
        }
        mpp[by] = static_cast<uint8_t>(bits);
      }
    }
    // The routing mask: the element the pool took, where the ReLU passed it.
    const int64_t bytes = (count + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int64_t by = 0; by < bytes; ++by) {
      unsigned bits = 0;
      for (int64_t j = 0; j < 8 && 8 * by + j < count; ++j) {
        const int64_t i = 8 * by + j;
        bits |= (arg[t.pooled(i)] == i && a[i] > 0.0f ? 1u : 0u) << j;
      }
      mp[by] = static_cast<uint8_t>(bits);
    }
  }));
  if (b != kNoTensor) parts.push_back(cancelled_bias_moves_running_mean(n, ctx, b, rm));
  return std::make_unique<Sequence>(std::move(parts), std::move(relu));
}

// "x, w, z, dy (pooled), mask, gamma, saved -> [dx], dw, dgamma, dbeta, dz, [db]": the gradient
// at BatchNorm's output (maxpool_bwd then relu_bwd), written to dz - for tiled windows dy of
// the element's window where its mask bit is set, for overlapping ones the sum of dy over the
// windows that took it, in their order - then cbr_bwd's passes.
KernelPtr make_cbr_pool_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const CbrBwdTensors io = cbr_bwd_tensors(n);
  const PoolGeom t = pool_geom(ctx, n, io.z, io.dy);
  expect_same_size(ctx, n, io.z, io.dz);
  if (t.tiles) {
    expect_mask(ctx, n, io.mask, io.z);
  } else {
    expect_dtype(ctx, n, io.mask, DType::U8, "mask");
    expect_numel(ctx, n, io.mask, ctx.tensor(io.dy).numel(), "mask (a byte per pooled element)");
  }
  // zp and mp are checked but not read: oneDNN's BatchNorm backward below takes its sums from
  // dz itself, in one pass with its dx.
  expect_pooled_pick(ctx, n, t.tiles, io.dy, io.zp, io.mp);
  const float* dyp = ctx.ptr<float>(io.dy);
  const uint8_t* mp = ctx.ptr<uint8_t>(io.mask);
  float* g = ctx.ptr<float>(io.dz);
  const int64_t count = t.z.numel();
  if (t.tiles) {
    return cbr_backward(n, ctx, io, make_loop([=](Context&) {
#pragma omp parallel for schedule(static)
                          for (int64_t i = 0; i < count; ++i)
                            g[i] = (mp[i >> 3] >> (i & 7)) & 1u ? dyp[t.pooled(i)] : 0.0f;
                        }));
  }
  auto route = [=](Context&) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < t.z.n * t.z.h; ++row) {
      const int64_t bi = row / t.z.h, ih = row % t.z.h;
      int64_t oh0 = 0, oh1 = 0;
      t.covering(ih, t.y.h, &oh0, &oh1);
      for (int64_t iw = 0; iw < t.z.w; ++iw) {
        int64_t ow0 = 0, ow1 = 0;
        t.covering(iw, t.y.w, &ow0, &ow1);
        for (int64_t c = 0; c < t.z.c; ++c) {
          float sum = 0.0f;
          for (int64_t oh = oh0; oh <= oh1; ++oh) {
            for (int64_t ow = ow0; ow <= ow1; ++ow) {
              const int64_t o = ((bi * t.y.h + oh) * t.y.w + ow) * t.z.c + c;
              const int64_t pos =
                  (ih - (oh * t.stride - t.pad)) * t.pool + (iw - (ow * t.stride - t.pad));
              if (mp[o] == pos) sum += dyp[o];
            }
          }
          g[(row * t.z.w + iw) * t.z.c + c] = sum;
        }
      }
    }
  };
  return cbr_backward(n, ctx, io, make_loop(route));
}

// "x, gamma, beta, running_mean, running_var, residual, [gamma2, beta2, running_mean2,
// running_var2] -> y, saved, mask, [saved2]": with the residual's BatchNorm, its output goes to
// the kernel's own buffer (as cbr_pool_fwd's ReLU output), which the add reads.
KernelPtr make_bn_add_relu_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const BnAddReluFwdTensors t = bn_add_relu_fwd_tensors(n);
  expect_same_size(ctx, n, t.y, t.residual);
  expect_dtype(ctx, n, t.residual, DType::F32, "residual");
  expect_mask(ctx, n, t.mask, t.y);
  std::vector<KernelPtr> parts;
  std::vector<float> res_out;
  const float* res = ctx.ptr<float>(t.residual);
  if (t.res_bn) {
    res_out.resize(static_cast<size_t>(ctx.tensor(t.residual).numel()));
    res = res_out.data();
    parts.push_back(
        make_bn_fwd_train_into(residual_bn_part(n, t, t.residual), ctx, res_out.data()));
  }
  parts.push_back(make_bn_fwd_train(
      fused_part(OpKind::bn_fwd_train, {t.x, t.gamma, t.beta, t.rm, t.rv}, {t.y, t.saved}, n, "bn"),
      ctx));
  parts.push_back(
      relu_with_mask(ctx.ptr<float>(t.y), res, ctx.ptr<uint8_t>(t.mask), ctx.tensor(t.y).numel()));
  return std::make_unique<Sequence>(std::move(parts), std::move(res_out));
}

// "x, dy, mask, gamma, saved, [dy2] -> dx, dresidual, dgamma, dbeta": the add passes the
// masked gradient (of dy + dy2 when dy2 is given) to both branches; BatchNorm's backward
// reads it from dresidual.
KernelPtr make_bn_add_relu_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), mask = need_in(n, 2, "mask"),
                 gamma = need_in(n, 3, "gamma"), saved = need_in(n, 4, "saved"), dy2 = in_at(n, 5);
  const TensorId dx = need_out(n, 0, "dx"), dres = need_out(n, 1, "dresidual"),
                 dgamma = need_out(n, 2, "dgamma"), dbeta = need_out(n, 3, "dbeta");
  expect_same_size(ctx, n, dy, dres);
  expect_mask(ctx, n, mask, dy);
  std::vector<KernelPtr> parts;
  if (dy2 != kNoTensor) {
    expect_dtype(ctx, n, dy2, DType::F32, "dy2");
    expect_same_size(ctx, n, dy, dy2);
    parts.push_back(apply_mask_sum(ctx.ptr<float>(dy), ctx.ptr<float>(dy2), ctx.ptr<uint8_t>(mask),
                                   ctx.ptr<float>(dres), ctx.tensor(dy).numel()));
  } else {
    parts.push_back(apply_mask(ctx.ptr<float>(dy), ctx.ptr<uint8_t>(mask), ctx.ptr<float>(dres),
                               ctx.tensor(dy).numel()));
  }
  parts.push_back(make_bn_bwd(
      fused_part(OpKind::bn_bwd, {x, dres, gamma, saved}, {dx, dgamma, dbeta}, n, "bn"), ctx));
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, gamma, beta, running_mean, running_var, [residual] -> y": bn_fwd_infer's kernel, then
// the add and the ReLU (relu_fwd's: NaN passes) in one pass over y.
KernelPtr make_bn_relu_infer(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var"), residual = in_at(n, 5);
  const TensorId y = need_out(n, 0, "y");
  float* yp = ctx.ptr<float>(y);
  const float* rp = nullptr;
  if (residual != kNoTensor) {
    expect_dtype(ctx, n, residual, DType::F32, "residual");
    expect_same_size(ctx, n, y, residual);
    rp = ctx.ptr<float>(residual);
  }
  const int64_t count = ctx.tensor(y).numel();
  std::vector<KernelPtr> parts;
  parts.push_back(make_bn_fwd_infer(
      fused_part(OpKind::bn_fwd_infer, {x, gamma, beta, rm, rv}, {y}, n, "bn"), ctx));
  parts.push_back(make_loop([=](Context&) {
    if (rp) {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) {
        const float v = yp[i] + rp[i];
        yp[i] = !(v <= 0.0f) ? v : 0.0f;
      }
    } else {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) yp[i] = !(yp[i] <= 0.0f) ? yp[i] : 0.0f;
    }
  }));
  return std::make_unique<Sequence>(std::move(parts));
}

}  // namespace kiln::cpu
