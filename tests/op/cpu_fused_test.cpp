// The CPU's fused ops (cpu_fused.cpp) against their unfused chains, run side by side in one
// program on the same inputs: Conv -> BN -> ReLU against cbr_fwd / cbr_bwd (also the first-
// layer form without dx), and BN -> add -> ReLU against bn_add_relu_fwd / _bwd. The fused ops
// are compositions of the same kernels, so every output must be equal bit for bit: the
// feature maps, the saved and running statistics, every gradient, and the mask, which must
// hold exactly the elements the unfused ReLU passed. (Each unfused kernel is tested against a
// float64 reference in its own file; equality carries that over.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

constexpr Layout kNhwc = Layout::NHWC;

void expect_bitwise(OpHarness& h, TensorId got, TensorId want, const std::string& what) {
  const std::vector<float> a = h.read(got), b = h.read(want);
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t differ = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0 && !(a[i] == 0.0f && b[i] == 0.0f)) {
      ++differ;
      first = std::min(first, i);
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.size() << " elements differ, first at " << first
                        << " (" << (first < a.size() ? a[first] : 0.0f) << " vs " << (first < a.size() ? b[first] : 0.0f)
                        << ")";
}

// mask bit i == (relu output i > 0)
void expect_mask(OpHarness& h, TensorId mask, TensorId relu_out) {
  const std::vector<uint8_t> m = h.read_u8(mask);
  const std::vector<float> y = h.read(relu_out);
  ASSERT_EQ(m.size(), (y.size() + 7) / 8);
  int64_t wrong = 0, set = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const bool bit = (m[i / 8] >> (i % 8)) & 1u;
    wrong += bit != (y[i] > 0.0f);
    set += bit;
  }
  EXPECT_EQ(wrong, 0) << "mask bits that disagree with the unfused ReLU";
  EXPECT_GT(set, 0);
  EXPECT_LT(set, static_cast<int64_t>(y.size())) << "a mask of all ones tests nothing";
  for (size_t i = y.size(); i < 8 * m.size(); ++i) EXPECT_FALSE((m[i / 8] >> (i % 8)) & 1u) << "padding bit " << i;
}

struct CbrCase {
  const char* name;
  int64_t n, h, w, c, k, r, st, pad;
  bool first_layer;
};

class CpuFusedCbr : public ::testing::TestWithParam<CbrCase> {};

TEST_P(CpuFusedCbr, EqualsConvBnReluBitForBit) {
  const CbrCase& t = GetParam();
  const int64_t p = (t.h + 2 * t.pad - t.r) / t.st + 1, q = (t.w + 2 * t.pad - t.r) / t.st + 1;
  const Shape xs{t.n, t.h, t.w, t.c}, ys{t.n, p, q, t.k};
  OpHarness h;
  auto feat = [&](const char* name, const Shape& s) { return h.tensor(name, s, Region::features, DType::F32, kNhwc); };
  auto chan = [&](const char* name, Region r) { return h.tensor(name, {t.k}, r); };
  const TensorId x = feat("x", xs), dy = feat("dy", ys);
  const TensorId w = h.tensor("w", {t.k, t.r, t.r, t.c}, Region::params_f32, DType::F32, Layout::KRSC);
  const TensorId gamma = chan("gamma", Region::params_f32), beta = chan("beta", Region::params_f32);
  // Each chain updates its own running statistics (the BN forward writes them in place).
  const TensorId rm_u = chan("rm_u", Region::bn_running), rv_u = chan("rv_u", Region::bn_running);
  const TensorId rm_f = chan("rm_f", Region::bn_running), rv_f = chan("rv_f", Region::bn_running);
  const TensorId saved_u = h.tensor("saved_u", {2, t.k}, Region::bn_saved);
  const TensorId saved_f = h.tensor("saved_f", {2, t.k}, Region::bn_saved);
  const TensorId z_u = feat("z_u", ys), b_u = feat("b_u", ys), y_u = feat("y_u", ys), g_u = feat("g_u", ys),
                 dz_u = feat("dz_u", ys), dx_u = feat("dx_u", xs);
  const TensorId z_f = feat("z_f", ys), y_f = feat("y_f", ys), dz_f = feat("dz_f", ys), dx_f = feat("dx_f", xs);
  const TensorId mask = h.tensor("mask", {(t.n * p * q * t.k + 7) / 8}, Region::aux, DType::U8);
  const TensorId dw_u = h.tensor("dw_u", {t.k, t.r, t.r, t.c}, Region::grads_f32, DType::F32, Layout::KRSC);
  const TensorId dw_f = h.tensor("dw_f", {t.k, t.r, t.r, t.c}, Region::grads_f32, DType::F32, Layout::KRSC);
  const TensorId dg_u = chan("dg_u", Region::grads_f32), db_u = chan("db_u", Region::grads_f32);
  const TensorId dg_f = chan("dg_f", Region::grads_f32), db_f = chan("db_f", Region::grads_f32);
  Attrs a;
  a.kh = a.kw = static_cast<int>(t.r);
  a.sh = a.sw = static_cast<int>(t.st);
  a.ph = a.pw = static_cast<int>(t.pad);
  a.eps = 1e-5f;
  a.bn_momentum = 0.1f;
  a.first_layer = t.first_layer;
  h.node(OpKind::conv_fwd, {x, w}, {z_u}, a);
  h.node(OpKind::bn_fwd_train, {z_u, gamma, beta, rm_u, rv_u}, {b_u, saved_u}, a);
  h.node(OpKind::relu_fwd, {b_u}, {y_u}, a);
  h.node(OpKind::relu_bwd, {y_u, dy}, {g_u}, a);
  h.node(OpKind::bn_bwd, {z_u, g_u, gamma, saved_u}, {dz_u, dg_u, db_u}, a);
  h.node(OpKind::conv_bwd_weight, {x, dz_u}, {dw_u}, a);
  if (!t.first_layer) h.node(OpKind::conv_bwd_data, {dz_u, w}, {dx_u}, a);
  h.node(OpKind::cbr_fwd, {x, w, gamma, beta, rm_f, rv_f}, {z_f, y_f, saved_f, mask}, a);
  h.node(OpKind::cbr_bwd, {x, w, z_f, dy, mask, gamma, saved_f},
         {t.first_layer ? kNoTensor : dx_f, dw_f, dg_f, db_f, dz_f}, a);
  compile_cpu(h);
  h.write(x, rand_vec(xs.numel(), 1));
  h.write(w, rand_vec(t.k * t.r * t.r * t.c, 2, -0.5f, 0.5f));
  h.write(dy, rand_vec(ys.numel(), 3));
  h.write(gamma, rand_vec(t.k, 4, 0.5f, 1.5f));
  h.write(beta, rand_vec(t.k, 5, -0.3f, 0.3f));
  for (TensorId id : {rm_u, rm_f}) h.write(id, rand_vec(t.k, 6));
  for (TensorId id : {rv_u, rv_f}) h.write(id, rand_vec(t.k, 7, 0.5f, 1.5f));
  h.run();
  expect_bitwise(h, z_f, z_u, "z (convolution output)");
  expect_bitwise(h, y_f, y_u, "y");
  expect_mask(h, mask, y_u);
  expect_bitwise(h, saved_f, saved_u, "saved statistics");
  expect_bitwise(h, rm_f, rm_u, "running mean");
  expect_bitwise(h, rv_f, rv_u, "running variance");
  expect_bitwise(h, dz_f, dz_u, "dz");
  expect_bitwise(h, dw_f, dw_u, "dw");
  expect_bitwise(h, dg_f, dg_u, "dgamma");
  expect_bitwise(h, db_f, db_u, "dbeta");
  if (!t.first_layer) expect_bitwise(h, dx_f, dx_u, "dx");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuFusedCbr,
                         ::testing::Values(CbrCase{"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false},
                                           CbrCase{"n3_8x7_c16_k8_3x3_s2", 3, 8, 7, 16, 8, 3, 2, 1, false},
                                           CbrCase{"n2_6x6_c8_k24_1x1", 2, 6, 6, 8, 24, 1, 1, 0, false},
                                           CbrCase{"n1_5x5_c3_k8_first_layer", 1, 5, 5, 3, 8, 3, 1, 1, true},
                                           CbrCase{"n4_3x3_c8_k5_odd_mask", 4, 3, 3, 8, 5, 1, 1, 0, false}),
                         [](const auto& info) { return std::string(info.param.name); });

// cbr_fwd / cbr_bwd with a convolution bias (VGG's), which BatchNorm cancels (ops.def): the
// same op without the bias on the same inputs gives the same z, y, mask, statistics and
// gradients bit for bit; the bias moves only the running mean, by momentum * b; db is 0.
TEST(CpuFusedCbrBias, BiasMovesOnlyTheRunningMean) {
  const int64_t n = 2, h = 6, w = 5, c = 8, k = 16;
  const Shape xs{n, h, w, c}, ys{n, h, w, k}, ws{k, 3, 3, c};
  OpHarness hs;
  auto feat = [&](const std::string& name, const Shape& s) {
    return hs.tensor(name, s, Region::features, DType::F32, kNhwc);
  };
  auto chan = [&](const std::string& name, Region r) { return hs.tensor(name, {k}, r); };
  const TensorId x = feat("x", xs), dy = feat("dy", ys);
  const TensorId wt = hs.tensor("w", ws, Region::params_f32, DType::F32, Layout::KRSC);
  const TensorId gamma = chan("gamma", Region::params_f32), beta = chan("beta", Region::params_f32);
  const TensorId b = chan("b", Region::params_f32);
  struct Side {
    TensorId rm, rv, saved, z, y, mask, dz, dx, dw, dg, db, dbias;
  };
  Side side[2];
  for (int i = 0; i < 2; ++i) {
    const std::string t = i ? "_bias" : "_plain";
    Side& e = side[i];
    e.rm = chan("rm" + t, Region::bn_running);
    e.rv = chan("rv" + t, Region::bn_running);
    e.saved = hs.tensor("saved" + t, {2, k}, Region::bn_saved);
    e.z = feat("z" + t, ys);
    e.y = feat("y" + t, ys);
    e.dz = feat("dz" + t, ys);
    e.dx = feat("dx" + t, xs);
    e.mask = hs.tensor("mask" + t, {(ys.numel() + 7) / 8}, Region::aux, DType::U8);
    e.dw = hs.tensor("dw" + t, ws, Region::grads_f32, DType::F32, Layout::KRSC);
    e.dg = chan("dg" + t, Region::grads_f32);
    e.db = chan("dbeta" + t, Region::grads_f32);
    e.dbias = i ? chan("dbias", Region::grads_f32) : kNoTensor;
  }
  Attrs a;
  a.kh = a.kw = 3;
  a.sh = a.sw = 1;
  a.ph = a.pw = 1;
  a.eps = 1e-5f;
  a.bn_momentum = 0.1f;
  for (int i = 0; i < 2; ++i) {
    const Side& e = side[i];
    std::vector<TensorId> in{x, wt, gamma, beta, e.rm, e.rv};
    std::vector<TensorId> out{e.dx, e.dw, e.dg, e.db, e.dz};
    if (i) {
      in.push_back(b);
      out.push_back(e.dbias);
    }
    hs.node(OpKind::cbr_fwd, in, {e.z, e.y, e.saved, e.mask}, a);
    hs.node(OpKind::cbr_bwd, {x, wt, e.z, dy, e.mask, gamma, e.saved}, out, a);
  }
  compile_cpu(hs);
  hs.write(x, rand_vec(xs.numel(), 31));
  hs.write(wt, rand_vec(ws.numel(), 32, -0.5f, 0.5f));
  hs.write(dy, rand_vec(ys.numel(), 33));
  hs.write(gamma, rand_vec(k, 34, 0.5f, 1.5f));
  hs.write(beta, rand_vec(k, 35, -0.3f, 0.3f));
  const std::vector<float> bias = rand_vec(k, 36, -2.0f, 2.0f), rm0 = rand_vec(k, 37);
  hs.write(b, bias);
  hs.write(side[1].dbias, std::vector<float>(static_cast<size_t>(k), 7.0f));  // must be overwritten
  for (const Side& e : side) {
    hs.write(e.rm, rm0);
    hs.write(e.rv, rand_vec(k, 38, 0.5f, 1.5f));
  }
  hs.run();
  const Side &p = side[0], &q = side[1];
  expect_bitwise(hs, q.z, p.z, "z");
  expect_bitwise(hs, q.y, p.y, "y");
  EXPECT_EQ(hs.read_u8(q.mask), hs.read_u8(p.mask)) << "mask";
  expect_bitwise(hs, q.saved, p.saved, "saved statistics");
  expect_bitwise(hs, q.rv, p.rv, "running variance");
  for (auto [got, want, what] : {std::tuple{q.dz, p.dz, "dz"}, {q.dx, p.dx, "dx"}, {q.dw, p.dw, "dw"},
                                 {q.dg, p.dg, "dgamma"}, {q.db, p.db, "dbeta"}}) {
    expect_bitwise(hs, got, want, what);
  }
  const std::vector<float> rm_plain = hs.read(p.rm), rm_bias = hs.read(q.rm);
  for (int64_t i = 0; i < k; ++i) {
    const auto j = static_cast<size_t>(i);
    EXPECT_EQ(rm_bias[j], rm_plain[j] + a.bn_momentum * bias[j]) << "running mean, channel " << i;
  }
  for (float v : hs.read(q.dbias)) EXPECT_EQ(v, 0.0f) << "the cancelled bias's gradient";
}

struct BarCase {
  const char* name;
  Shape shape;
};

class CpuFusedBnAddRelu : public ::testing::TestWithParam<BarCase> {};

TEST_P(CpuFusedBnAddRelu, EqualsBnAddReluBitForBit) {
  const Shape s = GetParam().shape;
  const int64_t c = s[3];
  OpHarness h;
  auto feat = [&](const char* name) { return h.tensor(name, s, Region::features, DType::F32, kNhwc); };
  auto chan = [&](const char* name, Region r) { return h.tensor(name, {c}, r); };
  const TensorId x = feat("x"), r = feat("residual"), dy = feat("dy");
  const TensorId gamma = chan("gamma", Region::params_f32), beta = chan("beta", Region::params_f32);
  const TensorId rm_u = chan("rm_u", Region::bn_running), rv_u = chan("rv_u", Region::bn_running);
  const TensorId rm_f = chan("rm_f", Region::bn_running), rv_f = chan("rv_f", Region::bn_running);
  const TensorId saved_u = h.tensor("saved_u", {2, c}, Region::bn_saved);
  const TensorId saved_f = h.tensor("saved_f", {2, c}, Region::bn_saved);
  const TensorId b_u = feat("b_u"), s_u = feat("s_u"), y_u = feat("y_u"), g_u = feat("g_u"), dx_u = feat("dx_u");
  const TensorId y_f = feat("y_f"), dx_f = feat("dx_f"), dres_f = feat("dres_f");
  const TensorId mask = h.tensor("mask", {(s.numel() + 7) / 8}, Region::aux, DType::U8);
  const TensorId dg_u = chan("dg_u", Region::grads_f32), db_u = chan("db_u", Region::grads_f32);
  const TensorId dg_f = chan("dg_f", Region::grads_f32), db_f = chan("db_f", Region::grads_f32);
  Attrs a;
  a.eps = 1e-5f;
  a.bn_momentum = 0.1f;
  h.node(OpKind::bn_fwd_train, {x, gamma, beta, rm_u, rv_u}, {b_u, saved_u}, a);
  h.node(OpKind::add, {b_u, r}, {s_u}, a);
  h.node(OpKind::relu_fwd, {s_u}, {y_u}, a);
  h.node(OpKind::relu_bwd, {y_u, dy}, {g_u}, a);
  h.node(OpKind::bn_bwd, {x, g_u, gamma, saved_u}, {dx_u, dg_u, db_u}, a);
  h.node(OpKind::bn_add_relu_fwd, {x, gamma, beta, rm_f, rv_f, r}, {y_f, saved_f, mask}, a);
  h.node(OpKind::bn_add_relu_bwd, {x, dy, mask, gamma, saved_f}, {dx_f, dres_f, dg_f, db_f}, a);
  compile_cpu(h);
  h.write(x, rand_vec(s.numel(), 11, 1.0f, 3.0f));
  h.write(r, rand_vec(s.numel(), 12));
  h.write(dy, rand_vec(s.numel(), 13));
  h.write(gamma, rand_vec(c, 14, 0.5f, 1.5f));
  h.write(beta, rand_vec(c, 15, -0.3f, 0.3f));
  for (TensorId id : {rm_u, rm_f}) h.write(id, rand_vec(c, 16));
  for (TensorId id : {rv_u, rv_f}) h.write(id, rand_vec(c, 17, 0.5f, 1.5f));
  h.run();
  expect_bitwise(h, y_f, y_u, "y");
  expect_mask(h, mask, y_u);
  expect_bitwise(h, saved_f, saved_u, "saved statistics");
  expect_bitwise(h, rm_f, rm_u, "running mean");
  expect_bitwise(h, rv_f, rv_u, "running variance");
  expect_bitwise(h, dres_f, g_u, "dresidual (the masked gradient)");
  expect_bitwise(h, dx_f, dx_u, "dx");
  expect_bitwise(h, dg_f, dg_u, "dgamma");
  expect_bitwise(h, db_f, db_u, "dbeta");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuFusedBnAddRelu,
                         ::testing::Values(BarCase{"n2_7x7_c16", {2, 7, 7, 16}}, BarCase{"n1_3x5_c8", {1, 3, 5, 8}},
                                           BarCase{"n4_2x2_c3_odd_mask", {4, 2, 2, 3}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::test
