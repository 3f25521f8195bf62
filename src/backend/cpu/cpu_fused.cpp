// Fused ops on the CPU (SPEC S12-S15 in FP32): each is its unfused chain's own kernels run in
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
#include <cstdint>
#include <vector>

#include "backend/cpu/cpu_util.h"
#include "backend/fused_part.h"

namespace kiln::cpu {

namespace {

// Runs its parts in order.
class Sequence final : public Kernel {
 public:
  explicit Sequence(std::vector<KernelPtr> parts) : parts_(std::move(parts)) {}
  void run(Context& ctx) override {
    for (auto& k : parts_) k->run(ctx);
  }

 private:
  std::vector<KernelPtr> parts_;
};

void expect_mask(const Context& ctx, const Node& n, TensorId mask, TensorId y) {
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_numel(ctx, n, mask, (ctx.tensor(y).numel() + 7) / 8, "mask (one bit per element of y)");
}

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
KernelPtr apply_mask_sum(const float* dy, const float* dy2, const uint8_t* mask, float* g, int64_t count) {
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

}  // namespace

// "x, w, gamma, beta, running_mean, running_var, [b] -> z, y, saved, mask"
KernelPtr make_cbr_fwd(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), gamma = need_in(n, 2, "gamma"),
                 beta = need_in(n, 3, "beta"), rm = need_in(n, 4, "running_mean"), rv = need_in(n, 5, "running_var"),
                 b = in_at(n, 6);
  const TensorId z = need_out(n, 0, "z"), y = need_out(n, 1, "y"), saved = need_out(n, 2, "saved"),
                 mask = need_out(n, 3, "mask");
  expect_mask(ctx, n, mask, y);
  std::vector<KernelPtr> parts;
  parts.push_back(make_conv_fwd(fused_part(OpKind::conv_fwd, {x, w}, {z}, n, "conv"), ctx));
  parts.push_back(
      make_bn_fwd_train(fused_part(OpKind::bn_fwd_train, {z, gamma, beta, rm, rv}, {y, saved}, n, "bn"), ctx));
  parts.push_back(relu_with_mask(ctx.ptr<float>(y), nullptr, ctx.ptr<uint8_t>(mask), ctx.tensor(y).numel()));
  if (b != kNoTensor) {
    // The bias BatchNorm cancels (ops.def): the running mean tracks z + b, i.e. gains m * b.
    expect_dtype(ctx, n, b, DType::F32, "b");
    expect_numel(ctx, n, b, ctx.tensor(rm).numel(), "b (one per output channel)");
    float* rmp = ctx.ptr<float>(rm);
    const float* bp = ctx.ptr<float>(b);
    const float m = n.attrs.bn_momentum;
    const int64_t c = ctx.tensor(rm).numel();
    parts.push_back(make_loop([=](Context&) {
      for (int64_t i = 0; i < c; ++i) rmp[i] += m * bp[i];
    }));
  }
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, w, z, dy, mask, gamma, saved -> [dx], dw, dgamma, dbeta, dz, [db]"
KernelPtr make_cbr_bwd(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), z = need_in(n, 2, "z"), dy = need_in(n, 3, "dy"),
                 mask = need_in(n, 4, "mask"), gamma = need_in(n, 5, "gamma"), saved = need_in(n, 6, "saved");
  const TensorId dx = out_at(n, 0), dw = need_out(n, 1, "dw"), dgamma = need_out(n, 2, "dgamma"),
                 dbeta = need_out(n, 3, "dbeta"), dz = need_out(n, 4, "dz"), db = out_at(n, 5);
  expect_same_size(ctx, n, z, dy);
  expect_same_size(ctx, n, z, dz);
  expect_mask(ctx, n, mask, dy);
  std::vector<KernelPtr> parts;
  // The ReLU's backward into dz, then BatchNorm's backward in place there (oneDNN's BN
  // backward reads each diff_dst element before writing the same diff_src element).
  parts.push_back(apply_mask(ctx.ptr<float>(dy), ctx.ptr<uint8_t>(mask), ctx.ptr<float>(dz), ctx.tensor(dy).numel()));
  parts.push_back(make_bn_bwd(fused_part(OpKind::bn_bwd, {z, dz, gamma, saved}, {dz, dgamma, dbeta}, n, "bn"), ctx));
  parts.push_back(make_conv_bwd_weight(fused_part(OpKind::conv_bwd_weight, {x, dz}, {dw}, n, "wgrad"), ctx));
  if (dx != kNoTensor) {
    parts.push_back(make_conv_bwd_data(fused_part(OpKind::conv_bwd_data, {dz, w}, {dx}, n, "dgrad"), ctx));
  }
  if (db != kNoTensor) {
    // The cancelled bias's gradient: sum of dz per channel, exactly 0 (ops.def).
    expect_dtype(ctx, n, db, DType::F32, "db");
    float* dbp = ctx.ptr<float>(db);
    const int64_t c = ctx.tensor(db).numel();
    parts.push_back(make_loop([=](Context&) { std::fill(dbp, dbp + c, 0.0f); }));
  }
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, gamma, beta, running_mean, running_var, residual -> y, saved, mask"
KernelPtr make_bn_add_relu_fwd(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"), beta = need_in(n, 2, "beta"),
                 rm = need_in(n, 3, "running_mean"), rv = need_in(n, 4, "running_var"),
                 residual = need_in(n, 5, "residual");
  const TensorId y = need_out(n, 0, "y"), saved = need_out(n, 1, "saved"), mask = need_out(n, 2, "mask");
  expect_same_size(ctx, n, y, residual);
  expect_dtype(ctx, n, residual, DType::F32, "residual");
  expect_mask(ctx, n, mask, y);
  std::vector<KernelPtr> parts;
  parts.push_back(
      make_bn_fwd_train(fused_part(OpKind::bn_fwd_train, {x, gamma, beta, rm, rv}, {y, saved}, n, "bn"), ctx));
  parts.push_back(
      relu_with_mask(ctx.ptr<float>(y), ctx.ptr<float>(residual), ctx.ptr<uint8_t>(mask), ctx.tensor(y).numel()));
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, dy, mask, gamma, saved, [dy2] -> dx, dresidual, dgamma, dbeta": the add passes the
// masked gradient (of dy + dy2 when dy2 is given) to both branches; BatchNorm's backward
// reads it from dresidual.
KernelPtr make_bn_add_relu_bwd(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), mask = need_in(n, 2, "mask"),
                 gamma = need_in(n, 3, "gamma"), saved = need_in(n, 4, "saved"), dy2 = in_at(n, 5);
  const TensorId dx = need_out(n, 0, "dx"), dres = need_out(n, 1, "dresidual"), dgamma = need_out(n, 2, "dgamma"),
                 dbeta = need_out(n, 3, "dbeta");
  expect_same_size(ctx, n, dy, dres);
  expect_mask(ctx, n, mask, dy);
  std::vector<KernelPtr> parts;
  if (dy2 != kNoTensor) {
    expect_dtype(ctx, n, dy2, DType::F32, "dy2");
    expect_same_size(ctx, n, dy, dy2);
    parts.push_back(apply_mask_sum(ctx.ptr<float>(dy), ctx.ptr<float>(dy2), ctx.ptr<uint8_t>(mask),
                                   ctx.ptr<float>(dres), ctx.tensor(dy).numel()));
  } else {
    parts.push_back(
        apply_mask(ctx.ptr<float>(dy), ctx.ptr<uint8_t>(mask), ctx.ptr<float>(dres), ctx.tensor(dy).numel()));
  }
  parts.push_back(make_bn_bwd(fused_part(OpKind::bn_bwd, {x, dres, gamma, saved}, {dx, dgamma, dbeta}, n, "bn"), ctx));
  return std::make_unique<Sequence>(std::move(parts));
}

// "x, gamma, beta, running_mean, running_var, [residual] -> y": bn_fwd_infer's kernel, then
// the add and the ReLU (relu_fwd's: NaN passes) in one pass over y.
KernelPtr make_bn_relu_infer(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"), beta = need_in(n, 2, "beta"),
                 rm = need_in(n, 3, "running_mean"), rv = need_in(n, 4, "running_var"), residual = in_at(n, 5);
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
  parts.push_back(make_bn_fwd_infer(fused_part(OpKind::bn_fwd_infer, {x, gamma, beta, rm, rv}, {y}, n, "bn"), ctx));
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
