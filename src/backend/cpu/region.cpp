// Region ops on the CPU, one pass each over a contiguous range (1-D tensors): fill, copy,
// cast, the NaN/Inf check with clipping, and the loss-scale update.
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"
#include "kiln/core/dtype.h"

namespace kiln::cpu {

// "-> y = value", in y's dtype (f32, f16, bf16 rounded to nearest even; integers truncated).
KernelPtr make_fill(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId y = need_out(n, 0, "y");
  const DTensor& t = ctx.tensor(y);
  const int64_t count = t.numel();
  const float v = n.attrs.value;
  switch (t.dtype) {
    case DType::F32: {
      float* p = ctx.ptr<float>(y);
      return make_loop([=](Context&) { std::fill(p, p + count, v); });
    }
    case DType::F16:
    case DType::BF16: {
      uint16_t* p = ctx.ptr<uint16_t>(y);
      const uint16_t bits = t.dtype == DType::F16 ? float_to_half(v) : float_to_bf16(v);
      return make_loop([=](Context&) { std::fill(p, p + count, bits); });
    }
    case DType::I32: {
      int32_t* p = ctx.ptr<int32_t>(y);
      const auto iv = static_cast<int32_t>(v);
      return make_loop([=](Context&) { std::fill(p, p + count, iv); });
    }
    case DType::I64: {
      int64_t* p = ctx.ptr<int64_t>(y);
      const auto iv = static_cast<int64_t>(v);
      return make_loop([=](Context&) { std::fill(p, p + count, iv); });
    }
    case DType::U8: {
      uint8_t* p = ctx.ptr<uint8_t>(y);
      const auto iv = static_cast<uint8_t>(v);
      return make_loop([=](Context&) { std::fill(p, p + count, iv); });
    }
  }
  KILN_FAIL(Internal, "fill node '", n.label, "': unknown dtype");
}

// "x -> y": bytes, same dtype and size.
KernelPtr make_copy(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const DTensor &tx = ctx.tensor(x), &ty = ctx.tensor(y);
  KILN_CHECK(tx.dtype == ty.dtype && tx.numel() == ty.numel(), InvalidArgument, "copy node '",
             n.label, "': '", tx.name, "' (", dtype_name(tx.dtype), " ", tx.shape.str(), ") and '",
             ty.name, "' (", dtype_name(ty.dtype), " ", ty.shape.str(),
             ") differ; use cast to change the dtype");
  const uint8_t* xp = ctx.ptr<uint8_t>(x);
  uint8_t* yp = ctx.ptr<uint8_t>(y);
  const auto bytes = static_cast<size_t>(tx.bytes());
  return make_loop([=](Context&) {
    if (xp != yp) std::memmove(yp, xp, bytes);
  });
}

// "x -> y (f32<->f16/bf16)": round to nearest even with kiln's conversions, which are
// bit-exact with CUDA's __float2half_rn / __float2bfloat16_rn (NaN stays a quiet NaN,
// overflow gives Inf, subnormals are kept).
KernelPtr make_cast(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const DTensor &tx = ctx.tensor(x), &ty = ctx.tensor(y);
  auto is_float = [](DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16; };
  KILN_CHECK(is_float(tx.dtype) && is_float(ty.dtype) && tx.numel() == ty.numel(), Unsupported,
             "cast node '", n.label, "': '", tx.name, "' (", dtype_name(tx.dtype), " ",
             tx.shape.str(), ") to '", ty.name, "' (", dtype_name(ty.dtype), " ", ty.shape.str(),
             "): the CPU casts between f32, f16 and bf16 of one size");
  const int64_t count = tx.numel();
  const DType from = tx.dtype, to = ty.dtype;
  const uint8_t* xp = ctx.ptr<uint8_t>(x);
  uint8_t* yp = ctx.ptr<uint8_t>(y);
  return make_loop([=](Context&) {
    if (from == to) {
      if (xp != yp) std::memmove(yp, xp, static_cast<size_t>(count) * dtype_size(from));
      return;
    }
    if (from == DType::F32) {
      const auto* s = reinterpret_cast<const float*>(xp);
      auto* d = reinterpret_cast<uint16_t*>(yp);
      if (to == DType::F16) {
        for (int64_t i = 0; i < count; ++i) d[i] = float_to_half(s[i]);
      } else {
        for (int64_t i = 0; i < count; ++i) d[i] = float_to_bf16(s[i]);
      }
      return;
    }
    const auto* s = reinterpret_cast<const uint16_t*>(xp);
    auto widen = [from](uint16_t h) {
      return from == DType::F16 ? half_to_float(h) : bf16_to_float(h);
    };
    if (to == DType::F32) {
      auto* d = reinterpret_cast<float*>(yp);
      for (int64_t i = 0; i < count; ++i) d[i] = widen(s[i]);
    } else {  // f16 <-> bf16 through f32 (exact widening, one rounding)
      auto* d = reinterpret_cast<uint16_t*>(yp);
      for (int64_t i = 0; i < count; ++i)
        d[i] = to == DType::F16 ? float_to_half(widen(s[i])) : float_to_bf16(widen(s[i]));
    }
  });
}

// "g (f32), loss_scale -> overflow (i32), [g]": overflow = 1 if any g is NaN or Inf, else 0
// (with attrs.accumulate: overflow |= that, for a check split over several nodes after a
// fill). When attrs.clip > 0, every g is clamped in the same pass to +-clip * loss_scale:
// g holds the *scaled* gradient, so this clips the unscaled gradient to +-clip.
// The clamp leaves NaN as NaN; the step is skipped anyway.
KernelPtr make_check_clip(const Node& n, Context& ctx) {
  const TensorId g = need_in(n, 0, "g"), scale = in_at(n, 1);
  const TensorId overflow = need_out(n, 0, "overflow"), gout = out_at(n, 1);
  expect_dtype(ctx, n, g, DType::F32, "g");
  expect_scalar(ctx, n, scale, "loss_scale");
  expect_scalar(ctx, n, overflow, "overflow");
  if (gout != kNoTensor) {
    expect_dtype(ctx, n, gout, DType::F32, "g (out)");
    expect_numel(ctx, n, gout, ctx.tensor(g).numel(), "g (out)");
  }
  KILN_CHECK(n.attrs.clip >= 0.0f, InvalidArgument, "check_clip node '", n.label,
             "': clip must be >= 0 (0 = off), is ", n.attrs.clip);
  float* gp = ctx.ptr<float>(g);
  float* op = gout != kNoTensor ? ctx.ptr<float>(gout) : gp;
  const int64_t count = ctx.tensor(g).numel();
  const float clip = n.attrs.clip;
  const bool acc = n.attrs.accumulate;
  return make_loop([=](Context& c) {
    bool bad = false;
    if (clip > 0.0f) {
      const float bound = clip * static_cast<float>(read_scalar(c, scale, 1.0));
      for (int64_t i = 0; i < count; ++i) {
        const float v = gp[i];
        bad |= !std::isfinite(v);
        op[i] = v > bound ? bound : (v < -bound ? -bound : v);
      }
    } else {
      for (int64_t i = 0; i < count; ++i) bad |= !std::isfinite(gp[i]);
      if (op != gp) std::memmove(op, gp, static_cast<size_t>(count) * sizeof(float));
    }
    const bool before = acc && read_scalar(c, overflow, 0.0) != 0.0;
    write_scalar(c, overflow, (bad || before) ? 1.0 : 0.0);
  });
}

// "overflow, loss_scale, good_steps -> loss_scale, good_steps": formula::
// loss_scale_next (halve on overflow, double after growth_interval clean steps).
KernelPtr make_loss_scale_update(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId overflow = need_in(n, 0, "overflow"), scale = need_in(n, 1, "loss_scale"),
                 good = need_in(n, 2, "good_steps");
  const TensorId scale_out = out_at(n, 0) != kNoTensor ? out_at(n, 0) : scale;
  const TensorId good_out = out_at(n, 1) != kNoTensor ? out_at(n, 1) : good;
  for (auto [id, role] : {std::pair{overflow, "overflow"},
                          {scale, "loss_scale"},
                          {good, "good_steps"},
                          {scale_out, "loss_scale (out)"},
                          {good_out, "good_steps (out)"}}) {
    expect_scalar(ctx, n, id, role);
  }
  const int64_t interval = n.attrs.growth_interval;
  return make_loop([=](Context& c) {
    const formula::LossScale s =
        formula::loss_scale_next({read_scalar(c, scale, 1.0), read_scalar(c, good, 0.0)},
                                 read_scalar(c, overflow, 0.0) != 0.0, interval);
    write_scalar(c, scale_out, s.scale);
    write_scalar(c, good_out, s.good_steps);
  });
}

}  // namespace kiln::cpu
