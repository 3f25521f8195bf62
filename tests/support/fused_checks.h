// The fused ops (CBR, BN+add+ReLU) against their unfused chains, run side by side in one program
// on one backend on the same inputs: Conv -> BN -> ReLU against cbr_fwd / cbr_bwd (also the
// first-layer form without dx), BN -> add -> ReLU against bn_add_relu_fwd / _bwd, and cbr with
// a convolution bias against cbr without one. Each backend's fused ops do their unfused chain's
// arithmetic rounding for rounding, so every output must be equal bit for bit: the feature
// maps, the saved and running statistics, every gradient, and the mask, which must hold exactly
// the elements the unfused ReLU passed; CBR with a max-pool folded in (cbr_pool_*) against
// Conv -> BN -> ReLU -> MaxPool likewise. Shared by the sweep's fused rows
// (tests/sweep/op_sweep_test.cpp: the CPU in FP32, CUDA in FP32 and AMP) and
// tests/gpu/gpu_fused_test.cpp (CUDA with the 16-byte kernels on and off); CUDA runs with
// deterministic engines so that both chains' convolutions run the same ones. Each unfused kernel
// has its own sweep rows against the reference; equality carries that over. The checks hold
// kiln's own form: KILN_CUTLASS's SM90 GEMM (on by default under AMP on an H200) sums a 1x1
// layer's z in another order, so it agrees to rounding only (GpuCutlass* hold it there) and is
// off here whatever the caller's switches say.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kiln/backend/backend.h"
#include "support/op_harness.h"

namespace kiln::test::fused {

// Equal values (NaN equals NaN; +0 equals -0).
inline void expect_equal(OpHarness& h, TensorId got, TensorId want, const std::string& what) {
  const std::vector<float> a = h.read(got), b = h.read(want);
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t differ = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i]) && !(std::isnan(a[i]) && std::isnan(b[i]))) {
      ++differ;
      first = std::min(first, i);
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.size()
                        << " elements differ, first at " << first << " ("
                        << (first < a.size() ? a[first] : 0.0f) << " vs "
                        << (first < a.size() ? b[first] : 0.0f) << ")";
}

// mask bit i == (unfused ReLU output i > 0); the padding bits of the last byte are 0.
inline void expect_mask(OpHarness& h, TensorId mask, TensorId relu_out) {
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
  for (size_t i = y.size(); i < 8 * m.size(); ++i)
    EXPECT_FALSE((m[i / 8] >> (i % 8)) & 1u) << "padding bit " << i;
}

// The caller's switches with kiln's own CBR form: the SM90 GEMM off (see above).
inline Switches kilns_form(Switches sw) {
  sw.cutlass = Auto::off;
  sw.cutlass_dgrad = Auto::off;  // and its data gradient (KILN_CUTLASS_DGRAD=1 would try it)
  return sw;
}

// The tensors of one program: FP16 features and convolution weights under AMP.
struct Maker {
  OpHarness& h;
  bool amp;
  TensorId feature(const std::string& name, const Shape& s) const {
    return h.tensor(name, s, Region::features, amp ? DType::F16 : DType::F32, Layout::NHWC);
  }
  TensorId weight(const std::string& name, const Shape& s) const {
    return h.tensor(name, s, amp ? Region::params_f16 : Region::params_f32,
                    amp ? DType::F16 : DType::F32, Layout::KRSC);
  }
  TensorId weight_grad(const std::string& name, const Shape& s) const {
    return h.tensor(name, s, amp ? Region::grads_f16 : Region::grads_f32,
                    amp ? DType::F16 : DType::F32, Layout::KRSC);
  }
  TensorId channels(const std::string& name, int64_t c, Region r) const {
    return h.tensor(name, {c}, r);
  }
};

inline Attrs conv_bn_attrs(int64_t r, int64_t st, int64_t pad) {
  Attrs a;
  a.kh = a.kw = static_cast<int>(r);
  a.sh = a.sw = static_cast<int>(st);
  a.ph = a.pw = static_cast<int>(pad);
  a.eps = 1e-5f;
  a.bn_momentum = 0.1f;
  return a;
}

struct CbrCase {
  const char* name;
  int64_t n, h, w, c, k, r, st, pad;
  bool first_layer;
};

// A BatchNorm forward's parameters and state over k channels.
struct BnForward {
  TensorId gamma, beta, rm, rv, saved;
};

inline BnForward bn_forward_tensors(const Maker& m, int64_t k) {
  BnForward bn;
  bn.gamma = m.channels("gamma", k, Region::params_f32);
  bn.beta = m.channels("beta", k, Region::params_f32);
  bn.rm = m.channels("rm", k, Region::bn_running);
  bn.rv = m.channels("rv", k, Region::bn_running);
  bn.saved = m.h.tensor("saved", {2, k}, Region::bn_saved);
  return bn;
}

// gamma in [0.5, 1.5], beta in [-0.3, 0.3], the running mean in [-1, 1] and variance in
// [0.5, 1.5], drawn from seeds seed to seed + 3.
inline void write_bn_forward(OpHarness& h, const BnForward& bn, int64_t k, uint64_t seed) {
  const auto n = static_cast<size_t>(k);
  h.write(bn.gamma, random_values(n, seed, 0.5f, 1.5f));
  h.write(bn.beta, random_values(n, seed + 1, -0.3f, 0.3f));
  h.write(bn.rm, random_values(n, seed + 2));
  h.write(bn.rv, random_values(n, seed + 3, 0.5f, 1.5f));
}

// What a CBR forward (or a convolution then BN+add+ReLU) leaves, read back.
struct CbrForwardOut {
  std::vector<float> z, y, saved, rm, rv;
  std::vector<uint8_t> mask;
};

inline CbrForwardOut read_cbr_forward(OpHarness& h, TensorId z, TensorId y, const BnForward& bn,
                                      TensorId mask) {
  return {h.read(z), h.read(y), h.read(bn.saved), h.read(bn.rm), h.read(bn.rv), h.read_u8(mask)};
}

// One cbr_fwd node (cbr_pool_fwd by pool x pool windows where pool > 0) in m's harness on
// `backend` with the switches as given (the caller picks the form: no kilns_form here), inputs
// drawn from seeds 1 to 7 as cbr_equals_chain draws them; the harness keeps the backend for the
// caller to ask how it built the node.
inline CbrForwardOut run_cbr_forward(const Maker& m, const CbrCase& t, int pool,
                                     const char* backend, const Switches& sw) {
  OpHarness& h = m.h;
  const int64_t p = (t.h + 2 * t.pad - t.r) / t.st + 1, q = (t.w + 2 * t.pad - t.r) / t.st + 1;
  const Shape xs{t.n, t.h, t.w, t.c}, zs{t.n, p, q, t.k}, ws{t.k, t.r, t.r, t.c};
  const Shape ys = pool ? Shape{t.n, p / pool, q / pool, t.k} : zs;
  const TensorId x = m.feature("x", xs), w = m.weight("w", ws);
  const BnForward bn = bn_forward_tensors(m, t.k);
  const TensorId z = m.feature("z", zs), y = m.feature("y", ys);
  const TensorId mask = h.tensor("mask", {(zs.numel() + 7) / 8}, Region::aux, DType::U8);
  Attrs a = conv_bn_attrs(t.r, t.st, t.pad);
  a.pool = pool;
  h.node(pool ? OpKind::cbr_pool_fwd : OpKind::cbr_fwd, {x, w, bn.gamma, bn.beta, bn.rm, bn.rv},
         {z, y, bn.saved, mask}, a);
  h.compile(make_backend(backend, sw));
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 1));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 2, -0.5f, 0.5f));
  write_bn_forward(h, bn, t.k, 4);
  h.run();
  return read_cbr_forward(h, z, y, bn, mask);
}

inline void cbr_equals_chain(const CbrCase& t, bool amp, const char* backend,
                             const Switches& switches = Switches::from_environment()) {
  const int64_t p = (t.h + 2 * t.pad - t.r) / t.st + 1, q = (t.w + 2 * t.pad - t.r) / t.st + 1;
  const Shape xs{t.n, t.h, t.w, t.c}, ys{t.n, p, q, t.k}, ws{t.k, t.r, t.r, t.c};
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", xs), dy = m.feature("dy", ys), w = m.weight("w", ws);
  const TensorId gamma = m.channels("gamma", t.k, Region::params_f32),
                 beta = m.channels("beta", t.k, Region::params_f32);
  // Each chain updates its own running statistics (the BN forward writes them in place).
  const TensorId rm_u = m.channels("rm_u", t.k, Region::bn_running),
                 rv_u = m.channels("rv_u", t.k, Region::bn_running);
  const TensorId rm_f = m.channels("rm_f", t.k, Region::bn_running),
                 rv_f = m.channels("rv_f", t.k, Region::bn_running);
  const TensorId saved_u = h.tensor("saved_u", {2, t.k}, Region::bn_saved);
  const TensorId saved_f = h.tensor("saved_f", {2, t.k}, Region::bn_saved);
  const TensorId z_u = m.feature("z_u", ys), b_u = m.feature("b_u", ys), y_u = m.feature("y_u", ys),
                 g_u = m.feature("g_u", ys), dz_u = m.feature("dz_u", ys),
                 dx_u = m.feature("dx_u", xs);
  const TensorId z_f = m.feature("z_f", ys), y_f = m.feature("y_f", ys),
                 dz_f = m.feature("dz_f", ys), dx_f = m.feature("dx_f", xs);
  const TensorId mask = h.tensor("mask", {(ys.numel() + 7) / 8}, Region::aux, DType::U8);
  const TensorId dw_u = m.weight_grad("dw_u", ws), dw_f = m.weight_grad("dw_f", ws);
  const TensorId dg_u = m.channels("dg_u", t.k, Region::grads_f32),
                 db_u = m.channels("db_u", t.k, Region::grads_f32);
  const TensorId dg_f = m.channels("dg_f", t.k, Region::grads_f32),
                 db_f = m.channels("db_f", t.k, Region::grads_f32);
  Attrs a = conv_bn_attrs(t.r, t.st, t.pad);
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
  h.compile(make_backend(backend, kilns_form(switches)));
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 1));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 2, -0.5f, 0.5f));
  h.write(dy, random_values(static_cast<size_t>(ys.numel()), 3));
  h.write(gamma, random_values(static_cast<size_t>(t.k), 4, 0.5f, 1.5f));
  h.write(beta, random_values(static_cast<size_t>(t.k), 5, -0.3f, 0.3f));
  for (TensorId id : {rm_u, rm_f}) h.write(id, random_values(static_cast<size_t>(t.k), 6));
  for (TensorId id : {rv_u, rv_f})
    h.write(id, random_values(static_cast<size_t>(t.k), 7, 0.5f, 1.5f));
  h.run();
  expect_equal(h, z_f, z_u, "z (convolution output)");
  expect_equal(h, y_f, y_u, "y");
  expect_mask(h, mask, y_u);
  expect_equal(h, saved_f, saved_u, "saved statistics");
  expect_equal(h, rm_f, rm_u, "running mean");
  expect_equal(h, rv_f, rv_u, "running variance");
  expect_equal(h, dz_f, dz_u, "dz");
  expect_equal(h, dw_f, dw_u, "dw");
  expect_equal(h, dg_f, dg_u, "dgamma");
  expect_equal(h, db_f, db_u, "dbeta");
  if (!t.first_layer) expect_equal(h, dx_f, dx_u, "dx");
}

// A merged max-pool: its window, stride and padding.
struct PoolSpec {
  int k, s, p;
  bool tiles() const { return k == s && p == 0; }
};

// cbr_pool_fwd / cbr_pool_bwd against Conv -> BN -> ReLU -> MaxPool (with its argmax) and their
// backwards: z, the pooled y, statistics and every gradient equal, and the mask holds exactly
// the elements the unfused max-pool took where the ReLU passed them (ops.def): bits over z for
// windows that tile it (the map's height and width after the convolution must then be
// multiples of the window), else each pooled element's window position, 255 where the ReLU
// did not pass it.
// picks (tiled windows): the forward also writes zp and mp (ops.def), which must hold z and the
// ReLU's bit at the element each pooled element took, and the backward reads them. CUDA's sums
// pass then adds the same nonzero terms in another order, in double: a float it rounds to moves
// only where the two double sums straddle a float rounding boundary (~2^-29 a value), so the
// gradients are still held bit for bit on these fixed inputs.
inline void cbr_pool_equals_chain(const CbrCase& t, PoolSpec pool, bool amp, const char* backend,
                                  const Switches& switches = Switches::from_environment(),
                                  bool picks = false) {
  const int64_t p = (t.h + 2 * t.pad - t.r) / t.st + 1, q = (t.w + 2 * t.pad - t.r) / t.st + 1;
  const bool tiles = pool.tiles();
  ASSERT_TRUE(!tiles || (p % pool.k == 0 && q % pool.k == 0))
      << "the case's map does not tile by " << pool.k;
  const int64_t Hp = (p + 2 * pool.p - pool.k) / pool.s + 1,
                Wp = (q + 2 * pool.p - pool.k) / pool.s + 1;
  const Shape xs{t.n, t.h, t.w, t.c}, zs{t.n, p, q, t.k}, ys{t.n, Hp, Wp, t.k},
      ws{t.k, t.r, t.r, t.c};
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", xs), dy = m.feature("dy", ys), w = m.weight("w", ws);
  const TensorId gamma = m.channels("gamma", t.k, Region::params_f32),
                 beta = m.channels("beta", t.k, Region::params_f32);
  const TensorId rm_u = m.channels("rm_u", t.k, Region::bn_running),
                 rv_u = m.channels("rv_u", t.k, Region::bn_running);
  const TensorId rm_f = m.channels("rm_f", t.k, Region::bn_running),
                 rv_f = m.channels("rv_f", t.k, Region::bn_running);
  const TensorId saved_u = h.tensor("saved_u", {2, t.k}, Region::bn_saved);
  const TensorId saved_f = h.tensor("saved_f", {2, t.k}, Region::bn_saved);
  const TensorId z_u = m.feature("z_u", zs), b_u = m.feature("b_u", zs), r_u = m.feature("r_u", zs),
                 y_u = m.feature("y_u", ys), dr_u = m.feature("dr_u", zs),
                 g_u = m.feature("g_u", zs), dz_u = m.feature("dz_u", zs),
                 dx_u = m.feature("dx_u", xs);
  const TensorId arg = h.tensor("argmax", ys, Region::aux, DType::I32, Layout::NHWC);
  const TensorId z_f = m.feature("z_f", zs), y_f = m.feature("y_f", ys),
                 dz_f = m.feature("dz_f", zs), dx_f = m.feature("dx_f", xs);
  const TensorId mask =
      h.tensor("mask", {tiles ? (zs.numel() + 7) / 8 : ys.numel()}, Region::aux, DType::U8);
  ASSERT_TRUE(!picks || tiles) << "zp and mp are for windows that tile z";
  const TensorId zp = picks ? m.feature("zp", ys) : kNoTensor;
  const TensorId mp =
      picks ? h.tensor("mp", {(ys.numel() + 7) / 8}, Region::aux, DType::U8) : kNoTensor;
  const TensorId dw_u = m.weight_grad("dw_u", ws), dw_f = m.weight_grad("dw_f", ws);
  const TensorId dg_u = m.channels("dg_u", t.k, Region::grads_f32),
                 db_u = m.channels("db_u", t.k, Region::grads_f32);
  const TensorId dg_f = m.channels("dg_f", t.k, Region::grads_f32),
                 db_f = m.channels("db_f", t.k, Region::grads_f32);
  Attrs a = conv_bn_attrs(t.r, t.st, t.pad);
  a.first_layer = t.first_layer;
  Attrs pa;
  pa.kh = pa.kw = pool.k;
  pa.sh = pa.sw = pool.s;
  pa.ph = pa.pw = pool.p;
  h.node(OpKind::conv_fwd, {x, w}, {z_u}, a);
  h.node(OpKind::bn_fwd_train, {z_u, gamma, beta, rm_u, rv_u}, {b_u, saved_u}, a);
  h.node(OpKind::relu_fwd, {b_u}, {r_u}, a);
  h.node(OpKind::maxpool_fwd, {r_u}, {y_u, arg}, pa);
  h.node(OpKind::maxpool_bwd, {dy, arg}, {dr_u}, pa);
  h.node(OpKind::relu_bwd, {r_u, dr_u}, {g_u}, a);
  h.node(OpKind::bn_bwd, {z_u, g_u, gamma, saved_u}, {dz_u, dg_u, db_u}, a);
  h.node(OpKind::conv_bwd_weight, {x, dz_u}, {dw_u}, a);
  if (!t.first_layer) h.node(OpKind::conv_bwd_data, {dz_u, w}, {dx_u}, a);
  Attrs fa = a;
  fa.pool = pool.k;
  fa.pool_stride = tiles ? 0 : pool.s;
  fa.pool_pad = tiles ? 0 : pool.p;
  std::vector<TensorId> fwd_out{z_f, y_f, saved_f, mask};
  std::vector<TensorId> bwd_in{x, w, z_f, dy, mask, gamma, saved_f};
  if (picks) {
    fwd_out.insert(fwd_out.end(), {zp, mp});
    bwd_in.insert(bwd_in.end(), {zp, mp});
  }
  h.node(OpKind::cbr_pool_fwd, {x, w, gamma, beta, rm_f, rv_f}, fwd_out, fa);
  h.node(OpKind::cbr_pool_bwd, bwd_in, {t.first_layer ? kNoTensor : dx_f, dw_f, dg_f, db_f, dz_f},
         fa);
  h.compile(make_backend(backend, kilns_form(switches)));
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 41));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 42, -0.5f, 0.5f));
  h.write(dy, random_values(static_cast<size_t>(ys.numel()), 43));
  h.write(gamma, random_values(static_cast<size_t>(t.k), 44, 0.5f, 1.5f));
  h.write(beta, random_values(static_cast<size_t>(t.k), 45, -0.3f, 0.3f));
  for (TensorId id : {rm_u, rm_f}) h.write(id, random_values(static_cast<size_t>(t.k), 46));
  for (TensorId id : {rv_u, rv_f})
    h.write(id, random_values(static_cast<size_t>(t.k), 47, 0.5f, 1.5f));
  h.run();
  expect_equal(h, z_f, z_u, "z (convolution output)");
  expect_equal(h, y_f, y_u, "y (pooled)");
  const std::vector<uint8_t> bits = h.read_u8(mask);
  const std::vector<float> relu = h.read(r_u);
  const std::vector<int32_t> took = h.read_i32(arg);
  const int64_t C = t.k;
  if (!tiles) {
    // The routing mask: each pooled element's window position of the element the unfused
    // pool's argmax took, 255 where the ReLU did not pass it.
    int64_t wrong = 0, routed = 0;
    for (int64_t o = 0; o < static_cast<int64_t>(took.size()); ++o) {
      const int64_t c = o % C, pix = o / C, b = pix / (Hp * Wp), oh = (pix / Wp) % Hp,
                    ow = pix % Wp, hw = took[static_cast<size_t>(o)];
      const int64_t ih = hw / q, iw = hw % q;
      const auto i = static_cast<size_t>(((b * p + ih) * q + iw) * C + c);
      const int64_t pos = (ih - (oh * pool.s - pool.p)) * pool.k + (iw - (ow * pool.s - pool.p));
      const int want = relu[i] > 0.0f ? static_cast<int>(pos) : 255;
      wrong += bits[static_cast<size_t>(o)] != want;
      routed += want != 255;
    }
    EXPECT_EQ(wrong, 0) << "mask bytes that disagree with the unfused max-pool and ReLU";
    EXPECT_GT(routed, 0);
  }
  // Tiled: bit i set exactly where the unfused pool's argmax took element i of z and the ReLU
  // passed it.
  std::vector<bool> want(tiles ? relu.size() : 0, false);
  for (int64_t o = 0; tiles && o < static_cast<int64_t>(took.size()); ++o) {
    const int64_t c = o % C, pix = o / C, b = pix / (Hp * Wp), hw = took[static_cast<size_t>(o)];
    const auto i = static_cast<size_t>(((b * p + hw / q) * q + hw % q) * C + c);
    want[i] = relu[i] > 0.0f;
  }
  if (tiles) {
    int64_t wrong = 0, set = 0;
    for (size_t i = 0; i < relu.size(); ++i) {
      const bool bit = (bits[i / 8] >> (i % 8)) & 1u;
      wrong += bit != want[i];
      set += bit;
    }
    EXPECT_EQ(wrong, 0) << "mask bits that disagree with the unfused max-pool and ReLU";
    EXPECT_GT(set, 0);
    for (size_t i = relu.size(); i < 8 * bits.size(); ++i)
      EXPECT_FALSE((bits[i / 8] >> (i % 8)) & 1u) << "padding bit " << i;
  }
  if (picks) {
    // zp and mp: z and the ReLU's bit at the element each pooled element took.
    const std::vector<float> zv = h.read(z_u), zpv = h.read(zp);
    const std::vector<uint8_t> mpv = h.read_u8(mp);
    ASSERT_EQ(zpv.size(), took.size());
    ASSERT_EQ(mpv.size(), (took.size() + 7) / 8);
    int64_t wrong_z = 0, wrong_bit = 0, set = 0;
    for (int64_t o = 0; o < static_cast<int64_t>(took.size()); ++o) {
      const int64_t c = o % C, pix = o / C, b = pix / (Hp * Wp), hw = took[static_cast<size_t>(o)];
      const auto i = static_cast<size_t>(((b * p + hw / q) * q + hw % q) * C + c);
      const auto uo = static_cast<size_t>(o);
      wrong_z += !(zpv[uo] == zv[i]);
      const bool bit = (mpv[uo / 8] >> (uo % 8)) & 1u;
      wrong_bit += bit != (relu[i] > 0.0f);
      set += bit;
    }
    EXPECT_EQ(wrong_z, 0) << "zp values that are not z where the unfused pool took it";
    EXPECT_EQ(wrong_bit, 0) << "mp bits that disagree with the unfused ReLU where the pool took";
    EXPECT_GT(set, 0);
    for (size_t i = took.size(); i < 8 * mpv.size(); ++i)
      EXPECT_FALSE((mpv[i / 8] >> (i % 8)) & 1u) << "mp's padding bit " << i;
  }
  expect_equal(h, saved_f, saved_u, "saved statistics");
  expect_equal(h, rm_f, rm_u, "running mean");
  expect_equal(h, rv_f, rv_u, "running variance");
  expect_equal(h, dz_f, dz_u, "dz");
  expect_equal(h, dw_f, dw_u, "dw");
  expect_equal(h, dg_f, dg_u, "dgamma");
  expect_equal(h, db_f, db_u, "dbeta");
  if (!t.first_layer) expect_equal(h, dx_f, dx_u, "dx");
}

// two_grads: the output's gradient has two contributions, dy and dy2 - the unfused chain sums
// them with an add node, the fused op takes dy2 (ops.def; CompileOptions::fuse_grad_sum).
inline void bn_add_relu_equals_chain(const Shape& s, bool amp, const char* backend,
                                     bool two_grads = false,
                                     const Switches& switches = Switches::from_environment()) {
  const int64_t c = s[3];
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", s), r = m.feature("residual", s), dy = m.feature("dy", s);
  const TensorId dy2 = two_grads ? m.feature("dy2", s) : kNoTensor,
                 dsum = two_grads ? m.feature("dsum", s) : dy;
  const TensorId gamma = m.channels("gamma", c, Region::params_f32),
                 beta = m.channels("beta", c, Region::params_f32);
  const TensorId rm_u = m.channels("rm_u", c, Region::bn_running),
                 rv_u = m.channels("rv_u", c, Region::bn_running);
  const TensorId rm_f = m.channels("rm_f", c, Region::bn_running),
                 rv_f = m.channels("rv_f", c, Region::bn_running);
  const TensorId saved_u = h.tensor("saved_u", {2, c}, Region::bn_saved);
  const TensorId saved_f = h.tensor("saved_f", {2, c}, Region::bn_saved);
  const TensorId b_u = m.feature("b_u", s), s_u = m.feature("s_u", s), y_u = m.feature("y_u", s),
                 g_u = m.feature("g_u", s), dx_u = m.feature("dx_u", s);
  const TensorId y_f = m.feature("y_f", s), dx_f = m.feature("dx_f", s),
                 dres_f = m.feature("dres_f", s);
  const TensorId mask = h.tensor("mask", {(s.numel() + 7) / 8}, Region::aux, DType::U8);
  const TensorId dg_u = m.channels("dg_u", c, Region::grads_f32),
                 db_u = m.channels("db_u", c, Region::grads_f32);
  const TensorId dg_f = m.channels("dg_f", c, Region::grads_f32),
                 db_f = m.channels("db_f", c, Region::grads_f32);
  Attrs a;
  a.eps = 1e-5f;
  a.bn_momentum = 0.1f;
  h.node(OpKind::bn_fwd_train, {x, gamma, beta, rm_u, rv_u}, {b_u, saved_u}, a);
  h.node(OpKind::add, {b_u, r}, {s_u}, a);
  h.node(OpKind::relu_fwd, {s_u}, {y_u}, a);
  if (two_grads) h.node(OpKind::add, {dy, dy2}, {dsum}, a);
  h.node(OpKind::relu_bwd, {y_u, dsum}, {g_u}, a);
  h.node(OpKind::bn_bwd, {x, g_u, gamma, saved_u}, {dx_u, dg_u, db_u}, a);
  h.node(OpKind::bn_add_relu_fwd, {x, gamma, beta, rm_f, rv_f, r}, {y_f, saved_f, mask}, a);
  std::vector<TensorId> bwd_in{x, dy, mask, gamma, saved_f};
  if (two_grads) bwd_in.push_back(dy2);
  h.node(OpKind::bn_add_relu_bwd, bwd_in, {dx_f, dres_f, dg_f, db_f}, a);
  h.compile(make_backend(backend, kilns_form(switches)));
  const auto n = static_cast<size_t>(s.numel()), cn = static_cast<size_t>(c);
  h.write(x, random_values(n, 11, 1.0f, 3.0f));
  h.write(r, random_values(n, 12));
  h.write(dy, random_values(n, 13));
  if (two_grads) h.write(dy2, random_values(n, 18));
  h.write(gamma, random_values(cn, 14, 0.5f, 1.5f));
  h.write(beta, random_values(cn, 15, -0.3f, 0.3f));
  for (TensorId id : {rm_u, rm_f}) h.write(id, random_values(cn, 16));
  for (TensorId id : {rv_u, rv_f}) h.write(id, random_values(cn, 17, 0.5f, 1.5f));
  h.run();
  expect_equal(h, y_f, y_u, "y");
  expect_mask(h, mask, y_u);
  expect_equal(h, saved_f, saved_u, "saved statistics");
  expect_equal(h, rm_f, rm_u, "running mean");
  expect_equal(h, rv_f, rv_u, "running variance");
  expect_equal(h, dres_f, g_u, "dresidual (the masked gradient)");
  expect_equal(h, dx_f, dx_u, "dx");
  expect_equal(h, dg_f, dg_u, "dgamma");
  expect_equal(h, db_f, db_u, "dbeta");
}

// bn_add_relu_fwd with the residual's own BatchNorm folded in (gamma2 ...: a downsampling
// block's shortcut, ops.def) against BN(z2) and BN(x) -> add -> ReLU, and bn_add_relu_bwd with
// the shortcut's bn_bwd after it against relu_bwd and the two bn_bwd: y, the mask, both saved
// and running statistics, dresidual, both input gradients and both BatchNorms' parameter
// gradients equal. The shortcut's BatchNorm has its own eps and momentum (eps2, bn_momentum2).
inline void bn_add_relu_residual_bn_equals_chain(
    const Shape& s, bool amp, const char* backend,
    const Switches& switches = Switches::from_environment()) {
  const int64_t c = s[3];
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", s), z2 = m.feature("z2", s), dy = m.feature("dy", s);
  const TensorId gamma = m.channels("gamma", c, Region::params_f32),
                 beta = m.channels("beta", c, Region::params_f32),
                 gamma2 = m.channels("gamma2", c, Region::params_f32),
                 beta2 = m.channels("beta2", c, Region::params_f32);
  std::vector<TensorId> running;  // rm_u, rv_u, rm2_u, rv2_u, then the fused chain's
  for (const char* name : {"rm_u", "rv_u", "rm2_u", "rv2_u", "rm_f", "rv_f", "rm2_f", "rv2_f"})
    running.push_back(m.channels(name, c, Region::bn_running));
  std::vector<TensorId> saved;  // saved_u, saved2_u, saved_f, saved2_f
  for (const char* name : {"saved_u", "saved2_u", "saved_f", "saved2_f"})
    saved.push_back(h.tensor(name, {2, c}, Region::bn_saved));
  const TensorId r_u = m.feature("r_u", s), b_u = m.feature("b_u", s), s_u = m.feature("s_u", s),
                 y_u = m.feature("y_u", s), g_u = m.feature("g_u", s), dx_u = m.feature("dx_u", s),
                 dz2_u = m.feature("dz2_u", s);
  const TensorId y_f = m.feature("y_f", s), dx_f = m.feature("dx_f", s),
                 dres_f = m.feature("dres_f", s), dz2_f = m.feature("dz2_f", s);
  const TensorId mask = h.tensor("mask", {(s.numel() + 7) / 8}, Region::aux, DType::U8);
  std::vector<TensorId> pgrads;  // dg_u, db_u, dg2_u, db2_u, then the fused chain's
  for (const char* name : {"dg_u", "db_u", "dg2_u", "db2_u", "dg_f", "db_f", "dg2_f", "db2_f"})
    pgrads.push_back(m.channels(name, c, Region::grads_f32));
  Attrs a, a2;
  a2.eps = 2e-5f;
  a2.bn_momentum = 0.2f;
  h.node(OpKind::bn_fwd_train, {z2, gamma2, beta2, running[2], running[3]}, {r_u, saved[1]}, a2);
  h.node(OpKind::bn_fwd_train, {x, gamma, beta, running[0], running[1]}, {b_u, saved[0]}, a);
  h.node(OpKind::add, {b_u, r_u}, {s_u}, a);
  h.node(OpKind::relu_fwd, {s_u}, {y_u}, a);
  h.node(OpKind::relu_bwd, {y_u, dy}, {g_u}, a);
  h.node(OpKind::bn_bwd, {x, g_u, gamma, saved[0]}, {dx_u, pgrads[0], pgrads[1]}, a);
  h.node(OpKind::bn_bwd, {z2, g_u, gamma2, saved[1]}, {dz2_u, pgrads[2], pgrads[3]}, a2);
  Attrs fa = a;
  fa.eps2 = a2.eps;
  fa.bn_momentum2 = a2.bn_momentum;
  h.node(OpKind::bn_add_relu_fwd,
         {x, gamma, beta, running[4], running[5], z2, gamma2, beta2, running[6], running[7]},
         {y_f, saved[2], mask, saved[3]}, fa);
  h.node(OpKind::bn_add_relu_bwd, {x, dy, mask, gamma, saved[2]},
         {dx_f, dres_f, pgrads[4], pgrads[5]}, a);
  h.node(OpKind::bn_bwd, {z2, dres_f, gamma2, saved[3]}, {dz2_f, pgrads[6], pgrads[7]}, a2);
  h.compile(make_backend(backend, kilns_form(switches)));
  const auto n = static_cast<size_t>(s.numel()), cn = static_cast<size_t>(c);
  h.write(x, random_values(n, 21, 1.0f, 3.0f));
  h.write(z2, random_values(n, 22, -2.0f, 1.0f));
  h.write(dy, random_values(n, 23));
  h.write(gamma, random_values(cn, 24, 0.5f, 1.5f));
  h.write(beta, random_values(cn, 25, -0.3f, 0.3f));
  h.write(gamma2, random_values(cn, 26, 0.5f, 1.5f));
  h.write(beta2, random_values(cn, 27, -0.3f, 0.3f));
  for (size_t i = 0; i < running.size(); ++i) {
    h.write(running[i],
            i % 2 == 0 ? random_values(cn, 30 + i % 4) : random_values(cn, 30 + i % 4, 0.5f, 1.5f));
  }
  h.run();
  expect_equal(h, y_f, y_u, "y");
  expect_mask(h, mask, y_u);
  const char* what[] = {"saved statistics", "the residual's saved statistics"};
  for (size_t i = 0; i < 2; ++i) expect_equal(h, saved[2 + i], saved[i], what[i]);
  const char* stat[] = {"running mean", "running variance", "the residual's running mean",
                        "the residual's running variance"};
  for (size_t i = 0; i < 4; ++i) expect_equal(h, running[4 + i], running[i], stat[i]);
  expect_equal(h, dres_f, g_u, "dresidual (the masked gradient)");
  expect_equal(h, dx_f, dx_u, "dx");
  expect_equal(h, dz2_f, dz2_u, "dz2 (the shortcut's input gradient)");
  const char* grad[] = {"dgamma", "dbeta", "dgamma2", "dbeta2"};
  for (size_t i = 0; i < 4; ++i) expect_equal(h, pgrads[4 + i], pgrads[i], grad[i]);
}

// The evaluation form (bn_relu_infer) against bn_fwd_infer, [add,] relu_fwd on the same
// inputs: equal values (+0 and -0 alike), with and without the residual.
inline void bn_relu_infer_equals_chain(const Shape& s, bool amp, const char* backend, bool residual,
                                       const Switches& switches = Switches::from_environment()) {
  const int64_t c = s[3];
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", s), r = residual ? m.feature("residual", s) : kNoTensor;
  const TensorId gamma = m.channels("gamma", c, Region::params_f32),
                 beta = m.channels("beta", c, Region::params_f32);
  const TensorId rm = m.channels("rm", c, Region::bn_running),
                 rv = m.channels("rv", c, Region::bn_running);
  const TensorId b_u = m.feature("b_u", s), s_u = residual ? m.feature("s_u", s) : b_u,
                 y_u = m.feature("y_u", s), y_f = m.feature("y_f", s);
  Attrs a;
  a.eps = 1e-5f;
  h.node(OpKind::bn_fwd_infer, {x, gamma, beta, rm, rv}, {b_u}, a);
  if (residual) h.node(OpKind::add, {b_u, r}, {s_u}, a);
  h.node(OpKind::relu_fwd, {s_u}, {y_u}, a);
  std::vector<TensorId> in{x, gamma, beta, rm, rv};
  if (residual) in.push_back(r);
  h.node(OpKind::bn_relu_infer, in, {y_f}, a);
  h.compile(make_backend(backend, kilns_form(switches)));
  const auto n = static_cast<size_t>(s.numel()), cn = static_cast<size_t>(c);
  h.write(x, random_values(n, 21, -2.0f, 3.0f));
  if (residual) h.write(r, random_values(n, 22));
  h.write(gamma, random_values(cn, 23, 0.5f, 1.5f));
  h.write(beta, random_values(cn, 24, -0.3f, 0.3f));
  h.write(rm, random_values(cn, 25));
  h.write(rv, random_values(cn, 26, 0.5f, 1.5f));
  h.run();
  expect_equal(h, y_f, y_u, residual ? "relu(bn(x) + residual)" : "relu(bn(x))");
  const std::vector<float> y = h.read(y_f);
  EXPECT_TRUE(std::any_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }))
      << "some values are clipped";
  EXPECT_TRUE(std::any_of(y.begin(), y.end(), [](float v) { return v > 0.0f; }));
}

// cbr with a convolution bias (VGG's), which BatchNorm cancels (ops.def), against cbr without
// it: z, y, mask, statistics and gradients equal; the running mean moved by momentum * b (the
// host forms it in float; rm_tol allows a backend that forms it in double); db is 0.
inline void cbr_bias_moves_only_the_running_mean(
    bool amp, const char* backend, double rm_tol,
    const Switches& switches = Switches::from_environment()) {
  const int64_t n = 4, hh = 10, ww = 9, c = 16, k = 32;
  const Shape xs{n, hh, ww, c}, ys{n, hh, ww, k}, ws{k, 3, 3, c};
  OpHarness h(amp);
  const Maker m{h, amp};
  const TensorId x = m.feature("x", xs), dy = m.feature("dy", ys), w = m.weight("w", ws);
  const TensorId gamma = m.channels("gamma", k, Region::params_f32),
                 beta = m.channels("beta", k, Region::params_f32);
  const TensorId b = m.channels("b", k, Region::params_f32);
  struct Side {
    TensorId rm, rv, saved, z, y, mask, dz, dx, dw, dg, db, dbias;
  };
  Side side[2];
  for (int i = 0; i < 2; ++i) {
    const std::string t = i ? "_bias" : "_plain";
    Side& e = side[i];
    e.rm = m.channels("rm" + t, k, Region::bn_running);
    e.rv = m.channels("rv" + t, k, Region::bn_running);
    e.saved = h.tensor("saved" + t, {2, k}, Region::bn_saved);
    e.z = m.feature("z" + t, ys);
    e.y = m.feature("y" + t, ys);
    e.dz = m.feature("dz" + t, ys);
    e.dx = m.feature("dx" + t, xs);
    e.mask = h.tensor("mask" + t, {(ys.numel() + 7) / 8}, Region::aux, DType::U8);
    e.dw = m.weight_grad("dw" + t, ws);
    e.dg = m.channels("dg" + t, k, Region::grads_f32);
    e.db = m.channels("dbeta" + t, k, Region::grads_f32);
    e.dbias = i ? m.channels("dbias", k, Region::grads_f32) : kNoTensor;
  }
  const Attrs a = conv_bn_attrs(3, 1, 1);
  for (int i = 0; i < 2; ++i) {
    const Side& e = side[i];
    std::vector<TensorId> in{x, w, gamma, beta, e.rm, e.rv};
    std::vector<TensorId> out{e.dx, e.dw, e.dg, e.db, e.dz};
    if (i) {
      in.push_back(b);
      out.push_back(e.dbias);
    }
    h.node(OpKind::cbr_fwd, in, {e.z, e.y, e.saved, e.mask}, a);
    h.node(OpKind::cbr_bwd, {x, w, e.z, dy, e.mask, gamma, e.saved}, out, a);
  }
  h.compile(make_backend(backend, kilns_form(switches)));
  const auto kn = static_cast<size_t>(k);
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 31));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 32, -0.5f, 0.5f));
  h.write(dy, random_values(static_cast<size_t>(ys.numel()), 33));
  h.write(gamma, random_values(kn, 34, 0.5f, 1.5f));
  h.write(beta, random_values(kn, 35, -0.3f, 0.3f));
  const std::vector<float> bias = random_values(kn, 36, -2.0f, 2.0f), rm0 = random_values(kn, 37);
  h.write(b, bias);
  h.write(side[1].dbias, std::vector<float>(kn, 7.0f));  // must be overwritten
  for (const Side& e : side) {
    h.write(e.rm, rm0);
    h.write(e.rv, random_values(kn, 38, 0.5f, 1.5f));
  }
  h.run();
  const Side &p = side[0], &q = side[1];
  expect_equal(h, q.z, p.z, "z");
  expect_equal(h, q.y, p.y, "y");
  EXPECT_EQ(h.read_u8(q.mask), h.read_u8(p.mask)) << "mask";
  expect_equal(h, q.saved, p.saved, "saved statistics");
  expect_equal(h, q.rv, p.rv, "running variance");
  expect_equal(h, q.dz, p.dz, "dz");
  expect_equal(h, q.dx, p.dx, "dx");
  expect_equal(h, q.dw, p.dw, "dw");
  expect_equal(h, q.dg, p.dg, "dgamma");
  expect_equal(h, q.db, p.db, "dbeta");
  const std::vector<float> rm_plain = h.read(p.rm), rm_bias = h.read(q.rm);
  for (size_t j = 0; j < kn; ++j) {
    const float want = rm_plain[j] + a.bn_momentum * bias[j];
    EXPECT_NEAR(rm_bias[j], want, rm_tol * (std::fabs(want) + 1.0))
        << "running mean, channel " << j;
  }
  for (float v : h.read(q.dbias)) EXPECT_EQ(v, 0.0f) << "the cancelled bias's gradient";
}

}  // namespace kiln::test::fused
