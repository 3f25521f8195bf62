// The node checks both backends' factories share (node_checks.h).
#include "backend/node_checks.h"

#include "kiln/core/error.h"
#include "kiln/process_group/process_group.h"

namespace kiln {

TensorId need_in(const Node& n, size_t i, const char* role) {
  const TensorId id = in_at(n, i);
  KILN_CHECK(id != kNoTensor, InvalidArgument, op_name(n.op), " node '", n.label, "': input ", i,
             " (", role, ") is missing; ops.def says: ", op_signature(n.op));
  return id;
}

TensorId need_out(const Node& n, size_t i, const char* role) {
  const TensorId id = out_at(n, i);
  KILN_CHECK(id != kNoTensor, InvalidArgument, op_name(n.op), " node '", n.label, "': output ", i,
             " (", role, ") is missing; ops.def says: ", op_signature(n.op));
  return id;
}

void expect_dtype(const ProgramView& v, const Node& n, TensorId id, DType dtype, const char* role) {
  const DTensor& t = v.tensor(id);
  KILN_CHECK(t.dtype == dtype, Unsupported, op_name(n.op), " node '", n.label, "': ", role, " '",
             t.name, "' is ", dtype_name(t.dtype), "; the ", v.backend, " backend needs ",
             dtype_name(dtype));
}

void expect_rank(const ProgramView& v, const Node& n, TensorId id, int rank, const char* role) {
  const DTensor& t = v.tensor(id);
  KILN_CHECK(t.shape.rank() == rank, Shape, op_name(n.op), " node '", n.label, "': ", role, " '",
             t.name, "' has shape ", t.shape.str(), ", expected rank ", rank);
}

void expect_numel(const ProgramView& v, const Node& n, TensorId id, int64_t numel,
                  const char* role) {
  const DTensor& t = v.tensor(id);
  KILN_CHECK(t.numel() == numel, Shape, op_name(n.op), " node '", n.label, "': ", role, " '",
             t.name, "' has shape ", t.shape.str(), " (", t.numel(), " elements), expected ", numel,
             " elements");
}

DType expect_float(const ProgramView& v, const Node& n, TensorId id, const char* role) {
  const DTensor& t = v.tensor(id);
  KILN_CHECK(t.dtype == DType::F32 || t.dtype == DType::F16 || t.dtype == DType::BF16, Unsupported,
             op_name(n.op), " node '", n.label, "': ", role, " '", t.name, "' is ",
             dtype_name(t.dtype), "; the ", v.backend, " backend takes f32, f16 or bf16");
  return t.dtype;
}

DType expect_compute_copy(const ProgramView& v, const Node& n, TensorId id, int64_t count) {
  const DType dt = expect_float(v, n, id, "w16");
  KILN_CHECK(dt != DType::F32, InvalidArgument, op_name(n.op), " node '", n.label,
             "': its compute copy w16 is f16 or bf16, not f32");
  expect_numel(v, n, id, count, "w16");
  return dt;
}

void expect_same_dtype(const ProgramView& v, const Node& n, TensorId a, TensorId b) {
  const DTensor &ta = v.tensor(a), &tb = v.tensor(b);
  KILN_CHECK(ta.dtype == tb.dtype, Unsupported, op_name(n.op), " node '", n.label, "': '", ta.name,
             "' is ", dtype_name(ta.dtype), " but '", tb.name, "' is ", dtype_name(tb.dtype),
             "; they must match");
}

void expect_same_size(const ProgramView& v, const Node& n, TensorId a, TensorId b) {
  const DTensor &ta = v.tensor(a), &tb = v.tensor(b);
  KILN_CHECK(ta.numel() == tb.numel(), Shape, op_name(n.op), " node '", n.label, "': '", ta.name,
             "' ", ta.shape.str(), " and '", tb.name, "' ", tb.shape.str(), " differ in size");
}

void reject_accumulate(const ProgramView& v, const Node& n) {
  KILN_CHECK(!n.attrs.accumulate, Unsupported, op_name(n.op), " node '", n.label, "': the ",
             v.backend, " backend accumulates (attrs.accumulate) only in add and check_clip; ",
             "emit an add node to sum gradients");
}

void expect_per_channel(const ProgramView& v, const Node& n, std::initializer_list<TensorId> ids,
                        int64_t c) {
  for (TensorId id : ids) {
    expect_dtype(v, n, id, DType::F32, "per-channel tensor");
    expect_numel(v, n, id, c, "per-channel tensor");
  }
}

void expect_argmax(const ProgramView& v, const Node& n, TensorId idx, TensorId y) {
  expect_dtype(v, n, idx, DType::I32, "argmax");
  KILN_CHECK(v.tensor(idx).shape == v.tensor(y).shape, Shape, op_name(n.op), " node '", n.label,
             "': argmax has shape ", v.tensor(idx).shape.str(), ", the pooled map ",
             v.tensor(y).shape.str());
}

void expect_mask(const ProgramView& v, const Node& n, TensorId mask, TensorId of) {
  expect_dtype(v, n, mask, DType::U8, "mask");
  expect_numel(v, n, mask, (v.tensor(of).numel() + 7) / 8, "mask (one bit per element)");
}

void expect_world(const Node& n) {
  KILN_CHECK(
      n.attrs.world == dist::world(), InvalidArgument, op_name(n.op), " node '", n.label,
      "' was compiled for ", n.attrs.world, " processes but this process group has ", dist::world(),
      "; start as many processes as the program was compiled for (mpirun -np ", n.attrs.world,
      ", srun -n ", n.attrs.world, ") or compile with world = ", dist::world());
}

Nhwc nhwc_of(const ProgramView& v, const Node& n, TensorId id, const char* role) {
  const DTensor& t = v.tensor(id);
  Nhwc s;
  if (t.shape.rank() == 4) {
    s = {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
  } else if (t.shape.rank() == 2) {
    s = {t.shape[0], 1, 1, t.shape[1]};
  } else {
    KILN_FAIL(Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name, "' has shape ",
              t.shape.str(), "; expected [N, H, W, C] (or [N, C])");
  }
  KILN_CHECK(s.numel() > 0, Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
             "' is empty: ", t.shape.str());
  return s;
}

ConvGeom conv_geom(const ProgramView& v, const Node& n, TensorId x, TensorId w, TensorId y) {
  expect_rank(v, n, x, 4, "input");
  expect_rank(v, n, y, 4, "output");
  expect_rank(v, n, w, 4, "weight (KRSC)");
  ConvGeom g;
  g.x = nhwc_of(v, n, x, "input");
  g.y = nhwc_of(v, n, y, "output");
  const Shape& ws = v.tensor(w).shape;
  g.k = ws[0];
  g.r = ws[1];
  g.s = ws[2];
  const Attrs& a = n.attrs;
  KILN_CHECK(a.kh == g.r && a.kw == g.s, Shape, op_name(n.op), " node '", n.label,
             "': attrs kernel ", a.kh, "x", a.kw, " but the weight is ", ws.str(), " (KRSC)");
  KILN_CHECK(ws[3] == g.x.c && g.y.c == g.k && g.y.n == g.x.n, Shape, op_name(n.op), " node '",
             n.label, "': input ", v.tensor(x).shape.str(), ", weight ", ws.str(),
             " (KRSC) and output ", v.tensor(y).shape.str(), " do not agree (C_in, K_out or N)");
  KILN_CHECK(a.sh >= 1 && a.sw >= 1 && a.ph >= 0 && a.pw >= 0, Shape, op_name(n.op), " node '",
             n.label, "': stride must be >= 1 and padding >= 0");
  const int64_t p = (g.x.h + 2 * a.ph - g.r) / a.sh + 1;
  const int64_t q = (g.x.w + 2 * a.pw - g.s) / a.sw + 1;
  KILN_CHECK(g.x.h + 2 * a.ph >= g.r && g.x.w + 2 * a.pw >= g.s && p == g.y.h && q == g.y.w, Shape,
             op_name(n.op), " node '", n.label, "': a ", g.r, "x", g.s, " kernel, stride ", a.sh,
             "x", a.sw, ", padding ", a.ph, "x", a.pw, " over ", g.x.h, "x", g.x.w, " gives ", p,
             "x", q, ", but the output is ", g.y.h, "x", g.y.w);
  g.sh = a.sh;
  g.sw = a.sw;
  g.ph = a.ph;
  g.pw = a.pw;
  return g;
}

FcGeom fc_geom(const ProgramView& v, const Node& n, TensorId x, TensorId w, TensorId y) {
  expect_rank(v, n, w, 2, "weight [O, K]");
  expect_rank(v, n, y, 2, "output [N, O]");
  const Shape& xs = v.tensor(x).shape;
  FcGeom g;
  g.o = v.tensor(w).shape[0];
  g.k = v.tensor(w).shape[1];
  g.n = v.tensor(y).shape[0];
  KILN_CHECK(
      xs.rank() >= 2 && xs[0] == g.n && xs.numel() == g.n * g.k && v.tensor(y).shape[1] == g.o,
      Shape, op_name(n.op), " node '", n.label, "': input ", xs.str(), ", weight ",
      v.tensor(w).shape.str(), " ([O, K]) and output ", v.tensor(y).shape.str(), " do not agree");
  return g;
}

MixNode check_mix_batch(const ProgramView& v, const Node& n) {
  reject_accumulate(v, n);
  MixNode m;
  m.x = need_in(n, 0, "x"), m.mix = need_in(n, 1, "mix"), m.y = need_out(n, 0, "y");
  expect_dtype(v, n, m.x, DType::F32, "x (the staged batch)");
  m.g = nhwc_of(v, n, m.x, "x");
  expect_numel(v, n, m.y, m.g.numel(), "y");
  m.to = expect_float(v, n, m.y, "y");
  expect_dtype(v, n, m.mix, DType::F32, "mix");
  expect_numel(v, n, m.mix, 8, "mix (kind, lambda, 1 - lambda, y0, y1, x0, x1, spare)");
  return m;
}

}  // namespace kiln
