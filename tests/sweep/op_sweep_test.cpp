// The op x backend sweep: every OpKind of ops.def has rows here (a few shapes, the attributes,
// a tolerance and its reason), and every row runs on every backend - the CPU against the
// float64 reference (tests/support/reference.h), CUDA against the CPU on the same inputs in
// FP32 and under AMP (ctest label `gpu`, skipped without a GPU). The fused ops are checked
// against their unfused chain on each backend (tests/support/fused_checks.h). A row may
// instead name the test that covers its op (the collectives, which need several ranks).
//
// Adding an op: write KILN_SWEEP(name) below with its rows; an op without one does not compile
// (sweep_cases' static_assert, instantiated for every op of the X-macro at the bottom).
// KILN_OP_TEST_ERRORS=1 prints every measured error next to its bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "support/fused_checks.h"
#include "support/op_harness.h"
#include "support/reference.h"

namespace kiln::test {
namespace {

using ref::Vec;
using Values = std::map<std::string, Vec>;

// ---- what a row is ------------------------------------------------------------------------

// A tensor of a row. kind says its dtype and region on each side (gpu_test_util.h's Kind:
// features and convolution weights are FP16 on CUDA under AMP); dtype overrides F32 for the
// casts. Float inputs start as U(lo, hi); integer ones as 0 unless the row's prepare sets them.
struct Spec {
  std::string name;
  Shape shape;
  Kind kind = Kind::Feature;
  Region region = Region::features;
  float lo = -1.0f, hi = 1.0f;
  DType dtype = DType::F32;
  bool flat = false;  // a rank-4 tensor in Flat layout (fc's flattened input)
};

// How CUDA's value compares with the CPU's (rel_error, gpu_test_util.h): relative to each
// element, or to the tensor's largest magnitude for sums of products, which the two backends
// add in different orders. Integer tensors compare exactly.
enum class Floor { elt, sum, sum_under_amp };

// One checked tensor: the float64 value it must have and the magnitude its rounding error
// scales with (ref::max_scaled_error); no magnitude means exact (NaN equals NaN, -0 equals +0).
struct Check {
  std::string tensor;
  Vec want, mag;
  double tol = 0;
  const char* why = "";
  Floor floor = Floor::elt;
};

struct Case {
  OpKind op;
  std::string label;  // shape and attributes; unique within the op
  std::vector<Spec> t;
  std::vector<std::string> in, out;  // tensor names; "" = kNoTensor
  Attrs a;
  std::function<void(Values&)> prepare;                     // inputs that must be consistent
  std::function<std::vector<Check>(const Values&)> expect;  // from the inputs' values
  bool fp32 = true, amp = true;                             // the CUDA runs
  bool validate = true;          // false: tensors no whole program holds (FP16 casts on the CPU)
  bool vector_variants = false;  // CUDA runs with kiln's 16-byte kernels on, then off
  // Fused ops: the check of the op against its unfused chain on a backend.
  std::function<void(const char* backend, bool amp, Switches)> chain;
  std::string covered_by;  // instead of a run: the test that covers the op
};

// ---- tolerances and their reasons -------------------------------------------------------------

// SPEC Q2's FP32 bar, of the error over the magnitude it scales with (cpu_op_test_util.h).
constexpr double kTol = 1e-5;
constexpr const char* kSumWhy = "FP32 sums of products: 1e-5 of the sum of |terms|";
constexpr const char* kExactWhy = "selects, moves or rounds once: exact";
constexpr const char* kBnWhy =
    "a few FP32 operations on sums over N*H*W: 1e-5 of the cancelling terms";
constexpr const char* kStateWhy = "~5 FP32 roundings of values ~1: 1e-5, absolute below 1";

Vec fl(const Vec& v) {  // each value rounded to FP32, as a kernel that computes in FP32 stores it
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = static_cast<float>(v[i]);
  return r;
}
double fl(double x) {
  return static_cast<float>(x);
}
Vec rel_mag(const Vec& want, double floor) {  // relative error, absolute below floor
  Vec m(want.size());
  for (size_t i = 0; i < want.size(); ++i) m[i] = std::max(std::fabs(want[i]), floor);
  return m;
}
Vec cat(Vec a, const Vec& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
Vec rand_values_d(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return ref::to_double(random_values(static_cast<size_t>(n), seed, lo, hi));
}
std::vector<int32_t> ints(const Vec& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

Spec feat(std::string n, Shape s, float lo = -1.0f, float hi = 1.0f) {
  return {std::move(n), std::move(s), Kind::Feature, Region::features, lo, hi};
}
Spec weight(std::string n, Shape s) {
  return {std::move(n), std::move(s), Kind::Weight, Region::params_f32};
}
Spec weight_grad(std::string n, Shape s) {
  return {std::move(n), std::move(s), Kind::WeightGrad, Region::grads_f32};
}
Spec f32(std::string n, Shape s, Region r, float lo = -1.0f, float hi = 1.0f) {
  return {std::move(n), std::move(s), Kind::F32, r, lo, hi};
}
Spec i32(std::string n, Shape s, Region r = Region::scalars) {
  return {std::move(n), std::move(s), Kind::I32, r};
}
Spec u8(std::string n, Shape s) {
  return {std::move(n), std::move(s), Kind::U8, Region::aux};
}

// The primary template fails for an op without rows; KILN_SWEEP(op) specialises it.
template <OpKind>
constexpr bool kNoRows = false;
template <OpKind op>
std::vector<Case> sweep_cases() {
  static_assert(kNoRows<op>,
                "an OpKind has no sweep rows: add KILN_SWEEP(<op>) to op_sweep_test.cpp");
  return {};
}
#define KILN_SWEEP(name) \
  template <>            \
  std::vector<Case> sweep_cases<OpKind::name>()

// ---- convolution --------------------------------------------------------------------------

struct ConvRow {
  const char* name;
  ref::ConvShape s;  // {n, h, w, c, k, r, s, sh, sw, ph, pw}
  bool bias;
  bool amp;  // FP16 tensor-core convolutions want channel counts in multiples of 8
};
const ConvRow kConv[] = {
    {"3x3_s1_p1_c3_k8", {2, 7, 9, 3, 8, 3, 3, 1, 1, 1, 1}, true, false},
    {"1x1_c1_k17_batch1", {1, 8, 8, 1, 17, 1, 1, 1, 1, 0, 0}, false, false},
    {"3x3_s2_p1_c17_k8_odd", {3, 11, 10, 17, 8, 3, 3, 2, 2, 1, 1}, true, false},
    {"7x7_s2_p3_c3_k8_stem", {2, 15, 13, 3, 8, 7, 7, 2, 2, 3, 3}, false, false},
    {"1x1_s2_c8_k3_shortcut", {1, 5, 5, 8, 3, 1, 1, 2, 2, 0, 0}, true, false},
    {"3x3_s1_p0_c8_k1", {2, 6, 7, 8, 1, 3, 3, 1, 1, 0, 0}, true, false},
    {"3x2_s2x1_p1x0_rect", {2, 9, 6, 3, 17, 3, 2, 2, 1, 1, 0}, true, false},
    {"3x3_s1_p1_c8_k16", {2, 9, 9, 8, 16, 3, 3, 1, 1, 1, 1}, true, true},
    {"3x3_s2_p1_c16_k32", {4, 16, 16, 16, 32, 3, 3, 2, 2, 1, 1}, false, true},
    {"1x1_c32_k8", {2, 8, 8, 32, 8, 1, 1, 1, 1, 0, 0}, false, true},
    {"7x7_s2_p3_c8_k16_stem", {2, 15, 13, 8, 16, 7, 7, 2, 2, 3, 3}, false, true},
    {"1x1_s2_c64_k64", {3, 7, 7, 64, 64, 1, 1, 2, 2, 0, 0}, true, true},
};

Attrs conv_attrs(const ref::ConvShape& s) {
  Attrs a;
  a.kh = static_cast<int>(s.r), a.kw = static_cast<int>(s.s);
  a.sh = static_cast<int>(s.sh), a.sw = static_cast<int>(s.sw);
  a.ph = static_cast<int>(s.ph), a.pw = static_cast<int>(s.pw);
  return a;
}
Case conv_case(OpKind op, const ConvRow& r) {
  const ref::ConvShape s = r.s;
  Case c{op, r.name};
  c.a = conv_attrs(s);
  c.amp = r.amp;
  const Shape xs{s.n, s.h, s.w, s.c}, ws{s.k, s.r, s.s, s.c}, ys{s.n, s.p(), s.q(), s.k};
  c.t = {feat("x", xs),  weight("w", ws), feat("y", ys),
         feat("dy", ys), feat("dx", xs),  weight_grad("dw", ws)};
  return c;
}

KILN_SWEEP(conv_fwd) {
  std::vector<Case> rows;
  for (const ConvRow& r : kConv) {
    Case c = conv_case(OpKind::conv_fwd, r);
    if (r.bias) c.t.push_back(f32("b", {r.s.k}, Region::params_f32));
    c.in = {"x", "w"};
    if (r.bias) c.in.push_back("b");
    c.out = {"y"};
    c.expect = [s = r.s, bias = r.bias](const Values& v) {
      const Vec b = bias ? v.at("b") : Vec{};
      return std::vector<Check>{
          {"y", ref::conv_fwd(v.at("x"), v.at("w"), b, s),
           ref::conv_fwd(ref::abs_of(v.at("x")), ref::abs_of(v.at("w")), ref::abs_of(b), s), kTol,
           kSumWhy, Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(conv_bwd_data) {
  std::vector<Case> rows;
  for (const ConvRow& r : kConv) {
    Case c = conv_case(OpKind::conv_bwd_data, r);
    c.in = {"dy", "w"};
    c.out = {"dx"};
    c.expect = [s = r.s](const Values& v) {
      return std::vector<Check>{
          {"dx", ref::conv_bwd_data(v.at("dy"), v.at("w"), s),
           ref::conv_bwd_data(ref::abs_of(v.at("dy")), ref::abs_of(v.at("w")), s), kTol, kSumWhy,
           Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(conv_bwd_weight) {
  std::vector<Case> rows;
  for (const ConvRow& r : kConv) {
    Case c = conv_case(OpKind::conv_bwd_weight, r);
    if (r.bias) c.t.push_back(f32("db", {r.s.k}, Region::grads_f32));
    c.in = {"x", "dy"};
    c.out = {"dw"};
    if (r.bias) c.out.push_back("db");
    c.expect = [s = r.s, bias = r.bias](const Values& v) {
      const Vec ax = ref::abs_of(v.at("x")), ady = ref::abs_of(v.at("dy"));
      std::vector<Check> k{{"dw", ref::conv_bwd_weight(v.at("x"), v.at("dy"), s),
                            ref::conv_bwd_weight(ax, ady, s), kTol, kSumWhy, Floor::sum}};
      if (bias)
        k.push_back({"db", ref::conv_bwd_bias(v.at("dy"), s), ref::conv_bwd_bias(ady, s), kTol,
                     kSumWhy, Floor::sum});
      return k;
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- batch normalisation --------------------------------------------------------------------

struct BnRow {
  const char* name;
  Shape shape;  // [N, H, W, C] or [N, C]
  float momentum;
  float lo = 1.0f, hi = 5.0f;  // x ~ U(lo, hi): a mean far from 0, as in real layers
};
const BnRow kBn[] = {
    {"n2_5x3_c3", {2, 5, 3, 3}, 0.1f},
    {"batch1_7x7_c17", {1, 7, 7, 17}, 0.1f},
    {"n4_2x2_c8", {4, 2, 2, 8}, 0.3f},
    {"n8_1x1_c1", {8, 1, 1, 1}, 0.1f},
    {"rank2_n6_c17", {6, 17}, 0.1f},
    {"count1_c3", {1, 1, 1, 3}, 0.1f},
    // variance ~ eps: the invstd -> variance conversion of the backward matters most, and the
    // centring cancels ~7 of FP32's 24 bits
    {"variance_near_eps_c8", {2, 4, 4, 8}, 0.1f, 0.99f, 1.01f},
    {"n8_14x14_c64", {8, 14, 14, 64}, 0.1f},
    // CUDA's plain kernels (C = 3, 40) and 16-byte ones (C = 16, 64)
    {"n4_7x5_c16", {4, 7, 5, 16}, 0.1f, 0.5f, 2.5f},
    {"n2_3x3_c3", {2, 3, 3, 3}, 0.1f, 0.5f, 2.5f},
    {"n2_1x1_c40", {2, 1, 1, 40}, 0.1f, 0.5f, 2.5f},
};

// The batch statistics of x and the magnitudes BN's FP32 errors scale with: x - mean cancels,
// so its error scales with |x| + |mean|, not |x - mean|.
struct BnRef {
  int64_t c = 0, count = 0;
  Vec mean, var, invstd;
  Vec mag_mean, mag_var, xa, mag_y, mag_dx, sum_abs_dy, sum_abs_dy_x;
};
// mean / invstd: the statistics the op is given (saved); empty: x's own.
BnRef bn_ref(const Values& v, int64_t c, const Vec& mean = {}, const Vec& invstd = {}) {
  const Vec& x = v.at("x");
  BnRef r;
  r.c = c;
  r.count = static_cast<int64_t>(x.size()) / c;
  const ref::BnForward f = ref::bn_fwd_train(x, Vec(c, 1.0), Vec(c, 0.0), c, 1e-5);
  r.mean = mean.empty() ? f.mean : mean;
  r.invstd = invstd.empty() ? f.invstd : invstd;
  r.var = f.var;
  r.mag_mean.assign(c, 0.0);
  r.mag_var.assign(c, 0.0);
  r.sum_abs_dy.assign(c, 0.0);
  r.sum_abs_dy_x.assign(c, 0.0);
  r.xa.resize(x.size());
  const Vec* dy = v.count("dy") ? &v.at("dy") : nullptr;
  for (size_t k = 0; k < x.size(); ++k) {
    const size_t j = k % c;
    r.mag_mean[j] += std::fabs(x[k]) / r.count;
    r.mag_var[j] += (std::fabs(x[k]) + std::fabs(r.mean[j])) *
                    (std::fabs(x[k]) + std::fabs(r.mean[j])) / r.count;
    r.xa[k] = (std::fabs(x[k]) + std::fabs(r.mean[j])) * r.invstd[j];
    if (dy) {
      r.sum_abs_dy[j] += std::fabs((*dy)[k]);
      r.sum_abs_dy_x[j] += std::fabs((*dy)[k]) * r.xa[k];
    }
  }
  if (v.count("gamma")) {
    const Vec& g = v.at("gamma");
    r.mag_y.resize(x.size());
    r.mag_dx.resize(x.size());
    for (size_t k = 0; k < x.size(); ++k) {
      const size_t j = k % c;
      r.mag_y[k] = std::fabs(g[j]) * r.xa[k] + (v.count("beta") ? std::fabs(v.at("beta")[j]) : 0.0);
      if (dy)
        r.mag_dx[k] =
            std::fabs(g[j]) * r.invstd[j] / r.count *
            (r.count * std::fabs((*dy)[k]) + r.sum_abs_dy[j] + r.xa[k] * r.sum_abs_dy_x[j]);
    }
  }
  return r;
}

Case bn_case(OpKind op, const BnRow& r) {
  const int64_t c = r.shape[r.shape.rank() - 1];
  Case k{op, r.name};
  k.a.eps = 1e-5f;
  k.a.bn_momentum = r.momentum;
  k.t = {feat("x", r.shape, r.lo, r.hi),
         feat("y", r.shape),
         feat("dy", r.shape),
         feat("dx", r.shape),
         f32("gamma", {c}, Region::params_f32, 0.5f, 1.5f),
         f32("beta", {c}, Region::params_f32),
         f32("rm", {c}, Region::bn_running),
         f32("rv", {c}, Region::bn_running, 0.5f, 1.5f),
         f32("saved", {2, c}, Region::bn_saved),
         f32("dgamma", {c}, Region::grads_f32),
         f32("dbeta", {c}, Region::grads_f32)};
  return k;
}
// saved = x's batch mean and invstd, rounded to FP32 as the forward stores them.
void prepare_saved(Values& v, int64_t c) {
  const ref::BnForward f = ref::bn_fwd_train(v.at("x"), Vec(c, 1.0), Vec(c, 0.0), c, 1e-5);
  v["saved"] = fl(cat(f.mean, f.invstd));
}
// PyTorch's running statistics from the batch's mean and (biased) variance over count.
std::vector<Check> running_checks(const Values& v, const BnRef& b, double m) {
  Vec rm = v.at("rm"), rv = v.at("rv");
  ref::bn_running_update(rm, rv, b.mean, b.var, b.count, m);
  Vec mag_rm(b.c);
  for (int64_t j = 0; j < b.c; ++j)
    mag_rm[j] = (1 - m) * std::fabs(v.at("rm")[j]) + m * b.mag_mean[j];
  return {{"rm", rm, mag_rm, kTol, kBnWhy}, {"rv", rv, rel_mag(rv, 1e-30), kTol, kBnWhy}};
}

KILN_SWEEP(bn_fwd_train) {
  std::vector<Case> rows;
  for (const BnRow& r : kBn) {
    Case c = bn_case(OpKind::bn_fwd_train, r);
    const int64_t ch = r.shape[r.shape.rank() - 1];
    c.in = {"x", "gamma", "beta", "rm", "rv"};
    c.out = {"y", "saved"};
    c.expect = [ch, m = static_cast<double>(r.momentum)](const Values& v) {
      const BnRef b = bn_ref(v, ch);
      const ref::BnForward f = ref::bn_fwd_train(v.at("x"), v.at("gamma"), v.at("beta"), ch, 1e-5);
      // invstd: the two-pass variance carries a few ulp whatever |mean| / std is: relative.
      std::vector<Check> k{{"y", f.y, b.mag_y, kTol, kBnWhy, Floor::sum},
                           {"saved", cat(f.mean, f.invstd),
                            cat(b.mag_mean, rel_mag(f.invstd, 1e-30)), kTol, kBnWhy}};
      for (Check& rc : running_checks(v, b, m)) k.push_back(rc);
      return k;
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(bn_fwd_infer) {
  std::vector<Case> rows;
  for (const BnRow& r : kBn) {
    Case c = bn_case(OpKind::bn_fwd_infer, r);
    const int64_t ch = r.shape[r.shape.rank() - 1];
    c.in = {"x", "gamma", "beta", "rm", "rv"};
    c.out = {"y"};
    c.expect = [ch](const Values& v) {
      const Vec &x = v.at("x"), &g = v.at("gamma"), &rm = v.at("rm"), &rv = v.at("rv");
      Vec mag(x.size());
      for (size_t k = 0; k < x.size(); ++k) {
        const size_t j = k % ch;
        mag[k] = std::fabs(g[j]) * (std::fabs(x[k]) + std::fabs(rm[j])) / std::sqrt(rv[j] + 1e-5) +
                 std::fabs(v.at("beta")[j]);
      }
      return std::vector<Check>{{"y", ref::bn_fwd_infer(x, g, v.at("beta"), rm, rv, ch, 1e-5), mag,
                                 kTol, kBnWhy, Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(bn_bwd) {
  std::vector<Case> rows;
  for (const BnRow& r : kBn) {
    Case c = bn_case(OpKind::bn_bwd, r);
    const int64_t ch = r.shape[r.shape.rank() - 1];
    c.in = {"x", "dy", "gamma", "saved"};
    c.out = {"dx", "dgamma", "dbeta"};
    c.prepare = [ch](Values& v) { prepare_saved(v, ch); };
    c.expect = [ch](const Values& v) {
      const Vec& s = v.at("saved");
      const Vec mean(s.begin(), s.begin() + ch), invstd(s.begin() + ch, s.end());
      const BnRef b = bn_ref(v, ch, mean, invstd);
      const ref::BnBackward bw =
          ref::bn_bwd(v.at("x"), v.at("dy"), v.at("gamma"), mean, invstd, ch);
      return std::vector<Check>{{"dx", bw.dx, b.mag_dx, kTol, kBnWhy, Floor::sum},
                                {"dgamma", bw.dgamma, b.sum_abs_dy_x, kTol, kBnWhy, Floor::sum},
                                {"dbeta", bw.dbeta, b.sum_abs_dy, kTol, kBnWhy, Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- SyncBN with world = 1 (one rank: its statistics are the global ones) --------------------
// Two ranks: DistOps.SyncBnOfTwoHalvesIsTheWholeBatch* (tests/dist/dist_ops_test.cpp).

std::vector<Case> sync_bn_rows(OpKind op) {
  std::vector<Case> rows;
  for (const BnRow& r : {kBn[0], kBn[6], kBn[7]}) {
    Case c = bn_case(op, r);
    c.a.world = 1;
    const int64_t ch = r.shape[r.shape.rank() - 1];
    c.t.push_back(f32("stats", {2, ch}, Region::bn_saved));
    c.t.push_back(f32("stats_all", {1, 2, ch}, Region::bn_saved));
    c.t.push_back(f32("sums", {2, ch}, Region::bn_saved));
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(bn_stats) {
  std::vector<Case> rows = sync_bn_rows(OpKind::bn_stats);
  for (Case& c : rows) {
    const int64_t ch = c.t[0].shape[c.t[0].shape.rank() - 1];
    c.in = {"x"};
    c.out = {"stats"};
    // A variance's FP32 error scales with (|x| + |mean|)^2, the square before it cancels.
    c.expect = [ch](const Values& v) {
      const BnRef b = bn_ref(v, ch);
      return std::vector<Check>{
          {"stats", cat(b.mean, b.var), cat(b.mag_mean, b.mag_var), kTol, kBnWhy}};
    };
  }
  return rows;
}

KILN_SWEEP(bn_fwd_sync) {
  std::vector<Case> rows = sync_bn_rows(OpKind::bn_fwd_sync);
  for (Case& c : rows) {
    const int64_t ch = c.t[0].shape[c.t[0].shape.rank() - 1];
    const double m = c.a.bn_momentum;
    c.in = {"x", "gamma", "beta", "rm", "rv", "stats_all"};
    c.out = {"y", "saved"};
    c.prepare = [ch](Values& v) {
      const BnRef b = bn_ref(v, ch);
      v["stats_all"] = fl(cat(b.mean, b.var));
    };
    c.expect = [ch, m](const Values& v) {
      const Vec& s = v.at("stats_all");
      BnRef b = bn_ref(v, ch);
      b.mean.assign(s.begin(), s.begin() + ch);
      b.var.assign(s.begin() + ch, s.end());
      Vec y(v.at("x").size());
      for (int64_t j = 0; j < ch; ++j) b.invstd[j] = 1.0 / std::sqrt(b.var[j] + 1e-5);
      for (size_t k = 0; k < y.size(); ++k) {
        const size_t j = k % ch;
        y[k] = v.at("gamma")[j] * (v.at("x")[k] - b.mean[j]) * b.invstd[j] + v.at("beta")[j];
      }
      std::vector<Check> k{{"y", y, b.mag_y, kTol, kBnWhy, Floor::sum},
                           {"saved", cat(b.mean, b.invstd),
                            cat(b.mag_mean, rel_mag(b.invstd, 1e-30)), kTol, kBnWhy}};
      for (Check& rc : running_checks(v, b, m)) k.push_back(rc);
      return k;
    };
  }
  return rows;
}

KILN_SWEEP(bn_bwd_reduce) {
  std::vector<Case> rows = sync_bn_rows(OpKind::bn_bwd_reduce);
  for (Case& c : rows) {
    const int64_t ch = c.t[0].shape[c.t[0].shape.rank() - 1];
    c.in = {"x", "dy", "saved"};
    c.out = {"dgamma", "dbeta", "sums"};
    c.prepare = [ch](Values& v) { prepare_saved(v, ch); };
    c.expect = [ch](const Values& v) {
      const Vec& s = v.at("saved");
      const Vec mean(s.begin(), s.begin() + ch), invstd(s.begin() + ch, s.end());
      const BnRef b = bn_ref(v, ch, mean, invstd);
      const ref::BnBackward bw = ref::bn_bwd(v.at("x"), v.at("dy"), Vec(ch, 1.0), mean, invstd, ch);
      return std::vector<Check>{{"dgamma", bw.dgamma, b.sum_abs_dy_x, kTol, kBnWhy, Floor::sum},
                                {"dbeta", bw.dbeta, b.sum_abs_dy, kTol, kBnWhy, Floor::sum},
                                {"sums", cat(bw.dbeta, bw.dgamma),
                                 cat(b.sum_abs_dy, b.sum_abs_dy_x), kTol, kBnWhy, Floor::sum}};
    };
  }
  return rows;
}

KILN_SWEEP(bn_bwd_sync) {
  std::vector<Case> rows = sync_bn_rows(OpKind::bn_bwd_sync);
  for (Case& c : rows) {
    const int64_t ch = c.t[0].shape[c.t[0].shape.rank() - 1];
    c.in = {"x", "dy", "gamma", "saved", "sums"};
    c.out = {"dx"};
    c.prepare = [ch](Values& v) {
      prepare_saved(v, ch);
      const Vec& s = v.at("saved");
      const ref::BnBackward bw =
          ref::bn_bwd(v.at("x"), v.at("dy"), Vec(ch, 1.0), Vec(s.begin(), s.begin() + ch),
                      Vec(s.begin() + ch, s.end()), ch);
      v["sums"] = fl(cat(bw.dbeta, bw.dgamma));
    };
    c.expect = [ch](const Values& v) {
      const Vec &s = v.at("saved"), &sums = v.at("sums"), &x = v.at("x"), &dy = v.at("dy");
      const Vec mean(s.begin(), s.begin() + ch), invstd(s.begin() + ch, s.end());
      const BnRef b = bn_ref(v, ch, mean, invstd);
      Vec dx(x.size());
      const double n = static_cast<double>(b.count);
      for (size_t k = 0; k < x.size(); ++k) {
        const size_t j = k % ch;
        const double xhat = (x[k] - mean[j]) * invstd[j];
        dx[k] = v.at("gamma")[j] * invstd[j] * (dy[k] - sums[j] / n - xhat * sums[ch + j] / n);
      }
      return std::vector<Check>{{"dx", dx, b.mag_dx, kTol, kBnWhy, Floor::sum}};
    };
  }
  return rows;
}

// ---- elementwise ---------------------------------------------------------------------------

const Shape kEltShapes[] = {{2, 3, 5, 17}, {1, 1}, {7, 3}, {3, 5, 7, 24}};

KILN_SWEEP(relu_fwd) {
  std::vector<Case> rows;
  for (const Shape& s : kEltShapes) {
    Case c{OpKind::relu_fwd, s.str()};
    c.t = {feat("x", s), feat("y", s)};
    c.in = {"x"};
    c.out = {"y"};
    // +0 and -0 give 0; a NaN stays NaN (PyTorch's clamp_min; oneDNN's relu would give 0).
    c.prepare = [](Values& v) {
      Vec& x = v.at("x");
      x[0] = 0.0;
      if (x.size() > 1) x[1] = -0.0;
      if (x.size() > 2) x.back() = std::numeric_limits<double>::quiet_NaN();
    };
    c.expect = [](const Values& v) {
      return std::vector<Check>{{"y", ref::relu_fwd(v.at("x")), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  for (const Shape& s : {Shape{1, 1}}) {  // a lone NaN
    Case c{OpKind::relu_fwd, s.str() + "_nan"};
    c.t = {feat("x", s), feat("y", s)};
    c.in = {"x"};
    c.out = {"y"};
    c.prepare = [](Values& v) { v.at("x").back() = std::numeric_limits<double>::quiet_NaN(); };
    c.expect = [](const Values& v) {
      return std::vector<Check>{{"y", ref::relu_fwd(v.at("x")), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(relu_bwd) {
  std::vector<Case> rows;
  for (const Shape& s : kEltShapes) {
    Case c{OpKind::relu_bwd, s.str()};
    c.t = {feat("y", s), feat("dy", s), feat("dx", s)};
    c.in = {"y", "dy"};
    c.out = {"dx"};
    c.prepare = [](Values& v) {  // an output of ReLU, with its zeros
      v.at("y")[0] = -0.0;
      v["y"] = ref::relu_fwd(v.at("y"));
    };
    c.expect = [](const Values& v) {
      return std::vector<Check>{{"dx", ref::relu_bwd(v.at("y"), v.at("dy")), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

// SiLU and hardswish against float64 formulas (PyTorch's definitions): the error bound scales
// with the sum of the magnitudes of the terms, so that the zeros of 1 + x(1 - s) and
// x/3 + 1/2 (where the gradient cancels) do not demand a relative accuracy FP32 cannot give.
double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
constexpr const char* kActWhy = "exp, add, mul, div in FP32: 1e-5 of the terms' magnitude";

template <typename Fwd, typename Mag>
std::vector<Case> act_fwd_rows(OpKind op, float range, Fwd f, Mag mag,
                               std::vector<double> special) {
  std::vector<Case> rows;
  for (const Shape& s : kEltShapes) {
    Case c{op, s.str()};
    c.t = {feat("x", s, -range, range), feat("y", s)};
    c.in = {"x"};
    c.out = {"y"};
    c.prepare = [special](Values& v) {
      Vec& x = v.at("x");
      for (size_t i = 0; i < special.size() && i < x.size(); ++i) x[i] = special[i];
    };
    c.expect = [f, mag](const Values& v) {
      const Vec& x = v.at("x");
      Vec want(x.size()), m(x.size());
      for (size_t i = 0; i < x.size(); ++i) want[i] = f(x[i]), m[i] = std::max(mag(x[i]), 1e-30);
      return std::vector<Check>{{"y", want, m, kTol, kActWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

template <typename Bwd, typename Mag>
std::vector<Case> act_bwd_rows(OpKind op, float range, Bwd g, Mag mag,
                               std::vector<double> special) {
  std::vector<Case> rows;
  for (const Shape& s : kEltShapes) {
    Case c{op, s.str()};
    c.t = {feat("x", s, -range, range), feat("dy", s), feat("dx", s)};
    c.in = {"x", "dy"};
    c.out = {"dx"};
    c.prepare = [special](Values& v) {
      Vec& x = v.at("x");
      for (size_t i = 0; i < special.size() && i < x.size(); ++i) x[i] = special[i];
    };
    c.expect = [g, mag](const Values& v) {
      const Vec &x = v.at("x"), &dy = v.at("dy");
      Vec want(x.size()), m(x.size());
      for (size_t i = 0; i < x.size(); ++i)
        want[i] = g(x[i], dy[i]), m[i] = std::max(std::fabs(dy[i]) * mag(x[i]), 1e-30);
      return std::vector<Check>{{"dx", want, m, kTol, kActWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(silu_fwd) {
  return act_fwd_rows(
      OpKind::silu_fwd, 8.0f, [](double x) { return x * sigmoid_d(x); },
      [](double x) { return std::fabs(x) * sigmoid_d(x); }, {0.0, -0.0, -20.0, 20.0});
}

KILN_SWEEP(silu_bwd) {
  return act_bwd_rows(
      OpKind::silu_bwd, 8.0f,
      [](double x, double dy) {
        const double sg = sigmoid_d(x);
        return dy * sg * (1.0 + x * (1.0 - sg));
      },
      [](double x) {
        const double sg = sigmoid_d(x);
        return sg * (1.0 + std::fabs(x) * (1.0 - sg));
      },
      {0.0, -1.2785, -20.0, 20.0});
}

// The kinks at -3 and 3 as PyTorch's hardswish_backward: 0 below -3, x/3 + 1/2 on [-3, 3].
KILN_SWEEP(hardswish_fwd) {
  return act_fwd_rows(
      OpKind::hardswish_fwd, 5.0f,
      [](double x) { return x * std::min(std::max(x + 3.0, 0.0), 6.0) / 6.0; },
      [](double x) { return std::fabs(x) * (std::fabs(x) + 3.0) / 6.0; }, {-3.0, 3.0, 0.0, -1.5});
}

KILN_SWEEP(hardswish_bwd) {
  return act_bwd_rows(
      OpKind::hardswish_bwd, 5.0f,
      [](double x, double dy) { return x < -3.0   ? 0.0
                                       : x <= 3.0 ? dy * (x / 3.0 + 0.5)
                                                  : dy; },
      [](double x) { return std::fabs(x) / 3.0 + 0.5; }, {-3.0, 3.0, 0.0, -1.5});
}

// dropout_fwd: the mask is the shared counter-based hash (ref::dropout_keep) bit for bit, so
// both backends draw the same mask; y and dx are x and dy times the FP32 scale 1/(1-p), exactly.
struct DropoutRow {
  const char* name;
  Shape s;
  float p;
  uint64_t seed;
  int32_t step;
};
const DropoutRow kDropout[] = {{"n4099_p0.3", {4099}, 0.3f, 1234, 7},
                               {"3x5x7x24_p0.3", {3, 5, 7, 24}, 0.3f, 1234, 7},
                               {"n1000_p0.5", {1000}, 0.5f, 99, 3}};

Vec dropout_mask(const DropoutRow& r, int64_t n) {
  Vec m(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    m[i] = ref::dropout_keep(r.seed, r.step, static_cast<uint64_t>(i), r.p);
  return m;
}
Vec dropout_apply(const Vec& x, const Vec& mask, float p) {
  const float scale = 1.0f / (1.0f - p);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = mask[i] != 0 ? fl(x[i] * scale) : 0.0;
  return y;
}

KILN_SWEEP(dropout_fwd) {
  std::vector<Case> rows;
  for (const DropoutRow& r : kDropout) {
    Case c{OpKind::dropout_fwd, r.name};
    c.t = {feat("x", r.s), i32("step", {1}), feat("y", r.s), u8("mask", r.s)};
    c.a.p = r.p;
    c.a.seed = r.seed;
    c.in = {"x", "step"};
    c.out = {"y", "mask"};
    c.prepare = [step = r.step](Values& v) { v["step"] = {static_cast<double>(step)}; };
    c.expect = [r](const Values& v) {
      const Vec mask = dropout_mask(r, static_cast<int64_t>(v.at("x").size()));
      return std::vector<Check>{{"mask", mask, {}, 0, "the shared hash: exact"},
                                {"y", dropout_apply(v.at("x"), mask, r.p), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(dropout_bwd) {
  std::vector<Case> rows;
  for (const DropoutRow& r : kDropout) {
    Case c{OpKind::dropout_bwd, r.name};
    c.t = {feat("dy", r.s), u8("mask", r.s), feat("dx", r.s)};
    c.a.p = r.p;
    c.a.seed = r.seed;
    c.in = {"dy", "mask"};
    c.out = {"dx"};
    c.prepare = [r](Values& v) { v["mask"] = dropout_mask(r, r.s.numel()); };
    c.expect = [p = r.p](const Values& v) {
      return std::vector<Check>{
          {"dx", dropout_apply(v.at("dy"), v.at("mask"), p), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

// FP32 addition is correctly rounded: the kernel equals the same FP32 expression bit for bit,
// y = a + b, y += a + b (evaluated as y + (a + b)), y = a, y += a, and a sum over its input.
KILN_SWEEP(add) {
  std::vector<Case> rows;
  for (const Shape& s : {Shape{3, 4, 5, 2}, Shape{3, 5, 7, 24}}) {
    struct Form {
      const char* name;
      std::vector<std::string> in, out;
      bool accumulate;
      std::function<double(double y0, double a, double b)> f;
    };
    const Form forms[] = {
        {"", {"a", "b"}, {"y"}, false, [](double, double a, double b) { return fl(a + b); }},
        {"_accumulate",
         {"a", "b"},
         {"y"},
         true,
         [](double y0, double a, double b) { return fl(y0 + fl(a + b)); }},
        {"_one_input", {"a"}, {"y"}, false, [](double, double a, double) { return a; }},
        {"_accumulate_one_input",
         {"a", ""},
         {"y"},
         true,
         [](double y0, double a, double) { return fl(y0 + a); }},
        {"_in_place",
         {"y", "b"},
         {"y"},
         false,
         [](double y0, double, double b) { return fl(y0 + b); }},
    };
    for (const Form& form : forms) {
      Case c{OpKind::add, s.str() + form.name};
      c.t = {feat("a", s), feat("b", s), feat("y", s)};
      c.in = form.in;
      c.out = form.out;
      c.a.accumulate = form.accumulate;
      c.expect = [f = form.f](const Values& v) {
        Vec y(v.at("y").size());
        for (size_t i = 0; i < y.size(); ++i) y[i] = f(v.at("y")[i], v.at("a")[i], v.at("b")[i]);
        return std::vector<Check>{
            {"y", y, {}, 0, "one correctly rounded FP32 addition per term: exact"}};
      };
      rows.push_back(c);
    }
  }
  return rows;
}

// ---- pooling ------------------------------------------------------------------------------

struct PoolRow {
  const char* name;
  ref::PoolShape s;  // {n, h, w, c, kh, kw, sh, sw, ph, pw}
};
const PoolRow kPool[] = {
    {"2x2_s2_8x8_c3", {2, 8, 8, 3, 2, 2, 2, 2, 0, 0}},
    {"2x2_s2_odd_7x9_c1", {1, 7, 9, 1, 2, 2, 2, 2, 0, 0}},
    {"3x3_s2_p1_resnet_9x11_c17", {2, 9, 11, 17, 3, 3, 2, 2, 1, 1}},
    {"3x3_s2_p1_resnet_8x8_c8", {3, 8, 8, 8, 3, 3, 2, 2, 1, 1}},
    {"3x3_s1_p1_5x6_c3", {1, 5, 6, 3, 3, 3, 1, 1, 1, 1}},
    {"3x2_s1x2_p1x0_rect_c8", {2, 6, 7, 8, 3, 2, 1, 2, 1, 0}},
    // 2x2 windows that tile the input: CUDA's tiled max-pool backward
    {"3x3_s2_p1_11x10_c16", {2, 11, 10, 16, 3, 3, 2, 2, 1, 1}},
    {"2x2_s2_11x10_c16", {2, 11, 10, 16, 2, 2, 2, 2, 0, 0}},
    {"3x3_s1_p1_11x10_c16", {2, 11, 10, 16, 3, 3, 1, 1, 1, 1}},
    {"2x2_s2_tiled_10x10_c16", {2, 10, 10, 16, 2, 2, 2, 2, 0, 0}},
};

Case pool_case(OpKind op, const PoolRow& r, bool include_pad, const std::string& suffix) {
  const ref::PoolShape& s = r.s;
  Case c{op, r.name + suffix};
  c.a.kh = static_cast<int>(s.kh), c.a.kw = static_cast<int>(s.kw);
  c.a.sh = static_cast<int>(s.sh), c.a.sw = static_cast<int>(s.sw);
  c.a.ph = static_cast<int>(s.ph), c.a.pw = static_cast<int>(s.pw);
  c.a.count_include_pad = include_pad;
  const Shape xs{s.n, s.h, s.w, s.c}, ys{s.n, s.p(), s.q(), s.c};
  c.t = {feat("x", xs), feat("y", ys), feat("dy", ys), feat("dx", xs),
         i32("argmax", ys, Region::aux)};
  return c;
}
// Ties: every 7th input equal; the first in window order wins (rows, then columns).
void pool_ties(Vec& x) {
  for (size_t i = 0; i < x.size(); i += 7) x[i] = 0.25;
}

KILN_SWEEP(maxpool_fwd) {
  std::vector<Case> rows;
  for (const PoolRow& r : kPool) {
    for (bool argmax : {true, false}) {  // without: the evaluation form
      Case c = pool_case(OpKind::maxpool_fwd, r, true, argmax ? "" : "_no_argmax");
      c.in = {"x"};
      c.out = {"y"};
      if (argmax) c.out.push_back("argmax");
      c.prepare = [](Values& v) { pool_ties(v.at("x")); };
      c.expect = [s = r.s, argmax](const Values& v) {
        std::vector<int32_t> am;
        std::vector<Check> k{{"y", ref::maxpool_fwd(v.at("x"), s, &am), {}, 0, kExactWhy}};
        if (argmax) k.push_back({"argmax", Vec(am.begin(), am.end()), {}, 0, kExactWhy});
        return k;
      };
      rows.push_back(c);
    }
  }
  return rows;
}

KILN_SWEEP(maxpool_bwd) {
  std::vector<Case> rows;
  for (const PoolRow& r : kPool) {
    Case c = pool_case(OpKind::maxpool_bwd, r, true, "");
    c.in = {"dy", "argmax"};
    c.out = {"dx"};
    c.prepare = [s = r.s](Values& v) {  // the forward's choice on random inputs with ties
      Vec x = rand_values_d(s.x_size(), 71);
      pool_ties(x);
      std::vector<int32_t> am;
      ref::maxpool_fwd(x, s, &am);
      v["argmax"] = Vec(am.begin(), am.end());
    };
    // Sums of at most ceil(k/s)^2 gradients per input element: 1e-6 of their |sum| (a few ulp).
    c.expect = [s = r.s](const Values& v) {
      const std::vector<int32_t> am = ints(v.at("argmax"));
      return std::vector<Check>{{"dx", ref::maxpool_bwd(v.at("dy"), am, s),
                                 ref::maxpool_bwd(ref::abs_of(v.at("dy")), am, s), 1e-6,
                                 "sums of <= 9 gradients: a few ulp"}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(avgpool_fwd) {
  std::vector<Case> rows;
  for (const PoolRow& r : kPool) {
    for (bool pad : {true, false}) {
      Case c = pool_case(OpKind::avgpool_fwd, r, pad, pad ? "_count_pad" : "_exclude_pad");
      c.in = {"x"};
      c.out = {"y"};
      c.expect = [s = r.s, pad](const Values& v) {
        return std::vector<Check>{{"y", ref::avgpool_fwd(v.at("x"), s, pad),
                                   ref::avgpool_fwd(ref::abs_of(v.at("x")), s, pad), kTol, kSumWhy,
                                   Floor::sum}};
      };
      rows.push_back(c);
    }
  }
  return rows;
}

KILN_SWEEP(avgpool_bwd) {
  std::vector<Case> rows;
  for (const PoolRow& r : kPool) {
    for (bool pad : {true, false}) {
      Case c = pool_case(OpKind::avgpool_bwd, r, pad, pad ? "_count_pad" : "_exclude_pad");
      c.in = {"dy"};
      c.out = {"dx"};
      c.expect = [s = r.s, pad](const Values& v) {
        return std::vector<Check>{{"dx", ref::avgpool_bwd(v.at("dy"), s, pad),
                                   ref::avgpool_bwd(ref::abs_of(v.at("dy")), s, pad), kTol, kSumWhy,
                                   Floor::sum}};
      };
      rows.push_back(c);
    }
  }
  return rows;
}

const Shape kGapShapes[] = {
    {2, 7, 7, 17}, {1, 1, 1, 3}, {3, 5, 3, 8}, {2, 11, 10, 16}, {2, 10, 10, 16}};

KILN_SWEEP(gap_fwd) {
  std::vector<Case> rows;
  for (const Shape& s : kGapShapes) {
    Case c{OpKind::gap_fwd, s.str()};
    c.t = {feat("x", s), feat("y", {s[0], s[3]})};
    c.in = {"x"};
    c.out = {"y"};
    c.expect = [s](const Values& v) {
      const int64_t n = s[0], hw = s[1] * s[2], ch = s[3];
      return std::vector<Check>{{"y", ref::gap_fwd(v.at("x"), n, hw, ch),
                                 ref::gap_fwd(ref::abs_of(v.at("x")), n, hw, ch), kTol,
                                 "a mean over H*W: 1e-5 of the mean of |x|", Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(gap_bwd) {
  std::vector<Case> rows;
  for (const Shape& s : kGapShapes) {
    Case c{OpKind::gap_bwd, s.str()};
    c.t = {feat("dy", {s[0], s[3]}), feat("dx", s)};
    c.in = {"dy"};
    c.out = {"dx"};
    c.expect = [s](const Values& v) {
      const int64_t n = s[0], hw = s[1] * s[2], ch = s[3];
      return std::vector<Check>{{"dx", ref::gap_bwd(v.at("dy"), n, hw, ch),
                                 ref::gap_bwd(ref::abs_of(v.at("dy")), n, hw, ch), kTol,
                                 "one division per element: 1e-5 relative"}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- fully connected ----------------------------------------------------------------------

struct FcRow {
  const char* name;
  Shape x;  // [N, K] or a flattened map [N, H, W, C]
  int64_t o;
  bool bias;
};
const FcRow kFc[] = {
    {"n1_k1_o1", {1, 1}, 1, true},
    {"n2_k17_o3", {2, 17}, 3, true},
    {"n5_k64_o10_nobias", {5, 64}, 10, false},
    {"n3_k37_o17", {3, 37}, 17, true},
    {"flattened_n2_2x2x3_o8", {2, 2, 2, 3}, 8, true},
    {"n8_k512_o100", {8, 512}, 100, true},
    {"n16_k64_o10", {16, 64}, 10, true},
    {"n5_k37_o13", {5, 37}, 13, true},
    {"n128_k512_o1000", {128, 512}, 1000, true},
};

Case fc_case(OpKind op, const FcRow& r) {
  const int64_t n = r.x[0], k = r.x.numel() / n;
  Case c{op, r.name};
  Spec x = feat("x", r.x), dx = feat("dx", r.x);
  x.flat = dx.flat = true;
  // dw and db are FP32 even under AMP (S10).
  c.t = {x,
         dx,
         weight("w", {r.o, k}),
         f32("dw", {r.o, k}, Region::grads_f32),
         feat("y", {n, r.o}),
         feat("dy", {n, r.o}),
         f32("b", {r.o}, Region::params_f32),
         f32("db", {r.o}, Region::grads_f32)};
  return c;
}

KILN_SWEEP(fc_fwd) {
  std::vector<Case> rows;
  for (const FcRow& r : kFc) {
    Case c = fc_case(OpKind::fc_fwd, r);
    c.in = {"x", "w"};
    if (r.bias) c.in.push_back("b");
    c.out = {"y"};
    c.expect = [r](const Values& v) {
      const int64_t n = r.x[0], k = r.x.numel() / n;
      const Vec b = r.bias ? v.at("b") : Vec{};
      return std::vector<Check>{
          {"y", ref::fc_fwd(v.at("x"), v.at("w"), b, n, k, r.o),
           ref::fc_fwd(ref::abs_of(v.at("x")), ref::abs_of(v.at("w")), ref::abs_of(b), n, k, r.o),
           kTol, kSumWhy, Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(fc_bwd_data) {
  std::vector<Case> rows;
  for (const FcRow& r : kFc) {
    Case c = fc_case(OpKind::fc_bwd_data, r);
    c.in = {"dy", "w"};
    c.out = {"dx"};
    c.expect = [r](const Values& v) {
      const int64_t n = r.x[0], k = r.x.numel() / n;
      return std::vector<Check>{
          {"dx", ref::fc_bwd_data(v.at("dy"), v.at("w"), n, k, r.o),
           ref::fc_bwd_data(ref::abs_of(v.at("dy")), ref::abs_of(v.at("w")), n, k, r.o), kTol,
           kSumWhy, Floor::sum}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(fc_bwd_weight) {
  std::vector<Case> rows;
  for (const FcRow& r : kFc) {
    Case c = fc_case(OpKind::fc_bwd_weight, r);
    c.in = {"x", "dy"};
    c.out = {"dw"};
    if (r.bias) c.out.push_back("db");
    c.expect = [r](const Values& v) {
      const int64_t n = r.x[0], k = r.x.numel() / n;
      const Vec ax = ref::abs_of(v.at("x")), ady = ref::abs_of(v.at("dy"));
      std::vector<Check> ks{{"dw", ref::fc_bwd_weight(v.at("x"), v.at("dy"), n, k, r.o),
                             ref::fc_bwd_weight(ax, ady, n, k, r.o), kTol, kSumWhy, Floor::sum}};
      if (r.bias)
        ks.push_back({"db", ref::fc_bwd_bias(v.at("dy"), n, r.o), ref::fc_bwd_bias(ady, n, r.o),
                      kTol, kSumWhy, Floor::sum});
      return ks;
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- loss ---------------------------------------------------------------------------------

struct CeRow {
  const char* name;
  int64_t n, k;
  float spread, offset, scale;
};
const CeRow kCe[] = {
    {"n1_k1", 1, 1, 1.0f, 0.0f, 1.0f},
    {"n4_k10", 4, 10, 3.0f, 0.0f, 1.0f},
    {"n7_k1000_scaled8192", 7, 1000, 5.0f, 0.0f, 8192.0f},
    {"n3_k17_large_logits", 3, 17, 50.0f, 1000.0f, 128.0f},  // exp would overflow without the max
    {"n32_k100", 32, 100, 10.0f, -20.0f, 65536.0f},
};

// The loss is summed in double from FP32 logits and rounded once: 1e-6 relative. dlogits =
// (p - onehot) scale / N in double, rounded once: 1e-5 of (p + onehot) scale / N. Counts exact.
std::vector<Case> softmax_ce_mixed_rows();  // below: the rows with a mix input

KILN_SWEEP(softmax_ce) {
  std::vector<Case> rows;
  for (const CeRow& r : kCe) {
    Case c{OpKind::softmax_ce, r.name};
    c.t = {feat("logits", {r.n, r.k}, r.offset - r.spread, r.offset + r.spread),
           i32("labels", {r.n}, Region::input_a),
           f32("loss_scale", {1}, Region::scalars),
           f32("loss", {1}, Region::scalars),
           i32("correct", {2}),
           feat("dlogits", {r.n, r.k})};
    c.in = {"logits", "labels", "loss_scale"};
    c.out = {"loss", "correct", "dlogits"};
    c.prepare = [r](Values& v) {
      Rng rng(112);
      for (double& l : v.at("labels"))
        l = static_cast<double>(rng.below(static_cast<uint64_t>(r.k)));
      v["loss_scale"] = {r.scale};
    };
    c.expect = [r](const Values& v) {
      const std::vector<int32_t> lv = ints(v.at("labels"));
      const ref::SoftmaxCe s = ref::softmax_ce(v.at("logits"), lv, r.n, r.k, r.scale);
      Vec mag(s.dlogits.size());
      for (int64_t b = 0; b < r.n; ++b)
        for (int64_t j = 0; j < r.k; ++j) {
          const size_t i = static_cast<size_t>(b * r.k + j);
          const double onehot = j == lv[b] ? 1.0 : 0.0;
          mag[i] = (std::fabs(s.dlogits[i] / r.scale * r.n + onehot) + onehot) * r.scale / r.n;
        }
      return std::vector<Check>{
          {"loss", {s.loss}, rel_mag({s.loss}, 1e-6), 1e-6, "a double sum rounded once"},
          {"dlogits", s.dlogits, mag, kTol, "a double value rounded once", Floor::sum_under_amp},
          {"correct",
           {static_cast<double>(s.top1), static_cast<double>(s.top5)},
           {},
           0,
           "counts: exact"}};
    };
    rows.push_back(c);
  }
  for (Case& c : softmax_ce_mixed_rows()) rows.push_back(std::move(c));
  return rows;
}

// Mixed targets (mixup / cutmix): the mix input's lambda mixes each row's label with the row
// before's (ref::softmax_ce_mixed, torch's CrossEntropyLoss on the mixed one-hot target), with
// and without label smoothing. Tolerances as the plain rows: the same double sums, rounded once.
struct CeMixRow {
  const char* name;
  int64_t n, k;
  float spread, scale, lambda, eps;
  int kind = 1;  // 0: an unmixed step (lambda ignored), the plain rows' values
};
const CeMixRow kCeMix[] = {
    {"mix_n4_k10_lam0.3", 4, 10, 3.0f, 1.0f, 0.3f, 0.0f},
    {"mix_n7_k1000_lam0.8_ls0.1", 7, 1000, 5.0f, 8192.0f, 0.8f, 0.1f},
    {"mix_n32_k100_lam0.5_ls0.2", 32, 100, 10.0f, 65536.0f, 0.5f, 0.2f},
    {"mix_n1_k5_lam0.6_self", 1, 5, 2.0f, 1.0f, 0.6f, 0.0f},  // its own partner: the plain loss
    {"cutmix_n9_k17_lam0.12_ls0.1", 9, 17, 4.0f, 128.0f, 0.12f, 0.1f},
    {"unmixed_n5_k10_ls0.1", 5, 10, 3.0f, 1024.0f, 0.3f, 0.1f, 0},
};
std::vector<Case> softmax_ce_mixed_rows() {
  std::vector<Case> rows;
  for (const CeMixRow& r : kCeMix) {
    Case c{OpKind::softmax_ce, r.name};
    c.t = {feat("logits", {r.n, r.k}, -r.spread, r.spread),
           i32("labels", {r.n}, Region::input_a),
           f32("loss_scale", {1}, Region::scalars),
           f32("mix", {8}, Region::scalars),
           f32("loss", {1}, Region::scalars),
           i32("correct", {2}),
           feat("dlogits", {r.n, r.k})};
    c.in = {"logits", "labels", "loss_scale", "mix"};
    c.out = {"loss", "correct", "dlogits"};
    c.a.label_smoothing = r.eps;
    c.prepare = [r](Values& v) {
      Rng rng(118);
      for (double& l : v.at("labels"))
        l = static_cast<double>(rng.below(static_cast<uint64_t>(r.k)));
      v["loss_scale"] = {r.scale};
      v["mix"] = {static_cast<double>(r.kind), r.lambda, fl(1.0 - r.lambda), 0, 0, 0, 0, 0};
    };
    c.expect = [r](const Values& v) {
      const std::vector<int32_t> lv = ints(v.at("labels"));
      const double lambda = r.kind == 0 ? 1.0 : static_cast<double>(r.lambda);
      const ref::SoftmaxCe s =
          ref::softmax_ce_mixed(v.at("logits"), lv, r.n, r.k, r.scale, lambda, r.eps);
      Vec mag(s.dlogits.size());
      for (int64_t b = 0; b < r.n; ++b)
        for (int64_t j = 0; j < r.k; ++j) {
          const size_t i = static_cast<size_t>(b * r.k + j);
          const double w = (j == lv[static_cast<size_t>(b)] ? lambda : 0.0) +
                           (j == lv[static_cast<size_t>((b + r.n - 1) % r.n)] ? 1.0 - lambda : 0.0);
          const double target = (1.0 - r.eps) * w + r.eps / static_cast<double>(r.k);
          mag[i] = (std::fabs(s.dlogits[i] / r.scale * r.n) + 2 * target) * r.scale / r.n;
        }
      return std::vector<Check>{
          {"loss", {s.loss}, rel_mag({s.loss}, 1e-6), 1e-6, "a double sum rounded once"},
          {"dlogits", s.dlogits, mag, kTol, "a double value rounded once", Floor::sum_under_amp},
          {"correct",
           {static_cast<double>(s.top1), static_cast<double>(s.top5)},
           {},
           0,
           "counts: exact"}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- mix_batch ------------------------------------------------------------------------------

struct MixRow {
  const char* name;
  Shape x;  // [N, H, W, C]
  ref::MixBox m;
};
const MixRow kMix[] = {
    {"mixup_n4_5x6_c3_lam0.3", {4, 5, 6, 3}, {1, 0.3}},
    {"mixup_n1_4x4_c1_self", {1, 4, 4, 1}, {1, 0.7}},  // its own partner: x again, rounded
    {"mixup_n8_16x16_c8_lam0.95", {8, 16, 16, 8}, {1, 0.95}},
    {"cutmix_n3_7x5_c2_box", {3, 7, 5, 2}, {2, 1 - 12.0 / 35, 1, 5, 2, 5}},
    {"cutmix_n2_6x6_c3_whole", {2, 6, 6, 3}, {2, 0.0, 0, 6, 0, 6}},
    {"cutmix_n2_6x6_c3_corner", {2, 6, 6, 3}, {2, 1 - 4.0 / 36, 0, 2, 4, 6}},
    {"cutmix_n2_5x5_c1_empty", {2, 5, 5, 1}, {2, 1.0, 3, 3, 1, 4}},
    {"unmixed_n3_4x5_c3", {3, 4, 5, 3}, {0, 1.0}},
};

// Mixup: two FP32 products and a sum, each rounded (and 1 - lambda rounded to FP32 once):
// 1e-6 of lambda |x| + (1 - lambda) |x_partner|. Cutmix and unmixed rows move values: exact.
KILN_SWEEP(mix_batch) {
  std::vector<Case> rows;
  for (const MixRow& r : kMix) {
    Case c{OpKind::mix_batch, r.name};
    c.t = {f32("x", r.x, Region::input_a, -2.0f, 2.0f), f32("mix", {8}, Region::scalars),
           feat("y", r.x)};
    c.in = {"x", "mix"};
    c.out = {"y"};
    c.prepare = [r](Values& v) {
      const ref::MixBox& m = r.m;
      v["mix"] = {static_cast<double>(m.kind), fl(m.lambda),
                  fl(1.0 - m.lambda),          static_cast<double>(m.y0),
                  static_cast<double>(m.y1),   static_cast<double>(m.x0),
                  static_cast<double>(m.x1),   0};
    };
    c.expect = [r](const Values& v) {
      ref::MixBox m = r.m;
      m.lambda = fl(m.lambda);
      const Vec want = ref::mix_batch(v.at("x"), r.x[0], r.x[1], r.x[2], r.x[3], m);
      if (m.kind != 1) return std::vector<Check>{{"y", want, {}, 0, kExactWhy}};
      return std::vector<Check>{
          {"y", want, ref::mix_batch(ref::abs_of(v.at("x")), r.x[0], r.x[1], r.x[2], r.x[3], m),
           1e-6, "two FP32 products and a sum: 1e-6 of the terms"}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- region ops -----------------------------------------------------------------------------

KILN_SWEEP(fill) {
  struct Form {
    const char* name;
    Spec t;
    float value;
  };
  std::vector<Case> rows;
  for (const Form& f : {Form{"f32_300", f32("y", {300}, Region::grads_f32), -2.5f},
                        Form{"i32_3", i32("y", {3}), 7.0f}, Form{"u8_17", u8("y", {17}), 1.0f}}) {
    Case c{OpKind::fill, f.name};
    c.t = {f.t};
    c.out = {"y"};
    c.a.value = f.value;
    c.amp = false;
    c.expect = [value = f.value](const Values& v) {
      return std::vector<Check>{{"y", Vec(v.at("y").size(), value), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(copy) {
  std::vector<Case> rows;
  for (int64_t n : {1000, 100003}) {
    Case c{OpKind::copy, "n" + std::to_string(n)};
    c.t = {f32("x", {n}, Region::params_f32), f32("y", {n}, Region::ema_f32)};
    c.in = {"x"};
    c.out = {"y"};
    c.amp = false;
    c.expect = [](const Values& v) {
      return std::vector<Check>{{"y", v.at("x"), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

// Round to nearest even by value (ref::round_binary), overflow to Inf, subnormals, NaN; the
// exhaustive bit patterns are CpuOpCast's (tests/op/cpu_region_test.cpp).
KILN_SWEEP(cast) {
  struct Form {
    const char* name;
    DType from, to;
    double (*round)(double);
  };
  std::vector<Case> rows;
  for (const Form& f : {Form{"f32_to_f16", DType::F32, DType::F16, ref::round_to_half},
                        Form{"f32_to_bf16", DType::F32, DType::BF16, ref::round_to_bf16},
                        Form{"f16_to_f32", DType::F16, DType::F32, nullptr}}) {
    for (int64_t n : {1001, 100003}) {
      Case c{OpKind::cast, std::string(f.name) + "_n" + std::to_string(n)};
      Spec x = f32("x", {n}, f.from == DType::F32 ? Region::params_f32 : Region::params_f16,
                   -70000.0f, 70000.0f);
      Spec y = f32("y", {n}, f.to == DType::F32 ? Region::grads_f32 : Region::grads_f16);
      x.dtype = f.from;
      y.dtype = f.to;
      c.t = {x, y};
      c.in = {"x"};
      c.out = {"y"};
      c.validate = false;  // FP16 tensors on the CPU backend, which no FP32 program holds
      c.fp32 = false;      // CUDA's FP16 regions exist under AMP
      c.prepare = [f](Values& v) {
        Vec& x = v.at("x");
        x[0] = 1e-8, x[1] = std::numeric_limits<double>::quiet_NaN(), x[2] = 65520.0, x[3] = -0.0;
        if (f.from == DType::F16)
          for (double& e : x) e = ref::round_to_half(e);
      };
      c.expect = [f](const Values& v) {
        Vec y = v.at("x");
        if (f.round)
          for (double& e : y) e = f.round(e);
        return std::vector<Check>{{"y", y, {}, 0, "round to nearest even by value: exact"}};
      };
      rows.push_back(c);
    }
  }
  return rows;
}

// g holds scaled gradients: clip = 0.5 at loss scale 1024 clamps each to +-512, the unscaled
// gradient to +-0.5 (S9). One Inf sets the flag; a stale flag is overwritten.
KILN_SWEEP(check_clip) {
  std::vector<Case> rows;
  for (const bool inf : {false, true}) {
    const int64_t n = inf ? 1001 : 2000;
    Case c{OpKind::check_clip, inf ? "n1001_inf_no_clip" : "n2000_clip0.5_scale1024"};
    c.t = {f32("g", {n}, Region::grads_f32, -2000.0f, 2000.0f),
           f32("loss_scale", {1}, Region::scalars), i32("overflow", {1})};
    c.a.clip = inf ? 0.0f : 0.5f;
    c.in = {"g", "loss_scale"};
    c.out = {"overflow", "g"};
    c.amp = false;
    c.prepare = [inf, n](Values& v) {
      v["loss_scale"] = {1024.0};
      v["overflow"] = {inf ? 0.0 : 1.0};
      if (inf) v.at("g")[n / 2] = std::numeric_limits<double>::infinity();
    };
    c.expect = [inf](const Values& v) {
      Vec g = v.at("g");
      if (!inf)
        for (double& e : g) e = std::clamp(e, -512.0, 512.0);
      return std::vector<Check>{{"overflow", {inf ? 1.0 : 0.0}, {}, 0, kExactWhy},
                                {"g", g, {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(loss_scale_update) {
  struct Form {
    const char* name;
    bool overflow;
    double scale;
    int good;
    int64_t interval;
  };
  std::vector<Case> rows;
  for (const Form& f :
       {Form{"overflow_halves", true, 8192, 5, 2000}, Form{"overflow_floor_1", true, 1, 0, 0},
        Form{"grows_after_interval", false, 8192, 2, 3},
        Form{"counts_clean_step", false, 4, 7, 0}}) {
    Case c{OpKind::loss_scale_update, f.name};
    c.t = {i32("overflow", {1}), f32("loss_scale", {1}, Region::scalars), i32("good_steps", {1})};
    c.a.growth_interval = f.interval;
    c.in = {"overflow", "loss_scale", "good_steps"};
    c.out = {"loss_scale", "good_steps"};
    c.amp = false;
    c.prepare = [f](Values& v) {
      v["overflow"] = {f.overflow ? 1.0 : 0.0};
      v["loss_scale"] = {f.scale};
      v["good_steps"] = {static_cast<double>(f.good)};
    };
    c.expect = [f](const Values&) {
      ref::LossScaleState s{f.scale, f.good};
      ref::loss_scale_update(s, f.overflow, f.interval);
      return std::vector<Check>{
          {"loss_scale", {s.scale}, {}, 0, kExactWhy},
          {"good_steps", {static_cast<double>(s.good_steps)}, {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

// torch.nn.utils.clip_grad_norm_ on the unscaled gradient, in double, rounded once: 1e-6.
KILN_SWEEP(grad_norm) {
  std::vector<Case> rows;
  for (float max_norm : {5.0f, 1e4f}) {
    Case c{OpKind::grad_norm, "n1000_max_norm" + std::to_string(static_cast<int>(max_norm))};
    c.t = {f32("g", {1000}, Region::grads_f32, -512.0f, 512.0f),
           f32("loss_scale", {1}, Region::scalars), f32("clip_coef", {1}, Region::scalars)};
    c.a.max_norm = max_norm;
    c.in = {"g", "loss_scale"};
    c.out = {"clip_coef"};
    c.amp = false;
    c.prepare = [](Values& v) { v["loss_scale"] = {512.0}; };
    c.expect = [max_norm](const Values& v) {
      double ss = 0;
      for (double x : v.at("g")) ss += (x / 512.0) * (x / 512.0);
      const double k = std::min(1.0, max_norm / (std::sqrt(ss) + 1e-6));
      return std::vector<Check>{
          {"clip_coef", {k}, rel_mag({k}, 1e-6), 1e-6, "a double sum rounded once"}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(step_count) {
  std::vector<Case> rows;
  for (bool overflow : {false, true}) {
    Case c{OpKind::step_count, overflow ? "skipped_step" : "applied_step"};
    c.t = {i32("overflow", {1}), i32("count", {1})};
    c.in = {"overflow", "count"};
    c.out = {"count"};
    c.amp = false;
    c.prepare = [overflow](Values& v) {
      v["overflow"] = {overflow ? 1.0 : 0.0};
      v["count"] = {7.0};
    };
    c.expect = [overflow](const Values&) {
      return std::vector<Check>{{"count", {overflow ? 7.0 : 8.0}, {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- optimizers: one step from random state against PyTorch's formulas in float64; an
// overflowed step changes nothing. Multi-step runs are tests/op/cpu_optim_test.cpp's.

// The scalars every optimizer reads; g holds gradients scaled by 4096 (unscaled in [-1, 1]).
std::vector<Spec> optimizer_specs(int64_t n) {
  return {f32("w", {n}, Region::params_f32),
          f32("g", {n}, Region::grads_f32, -4096.0f, 4096.0f),
          f32("m", {n}, Region::moment1, -0.1f, 0.1f),
          f32("v", {n}, Region::moment2, 0.0f, 0.01f),
          f32("lr", {1}, Region::scalars),
          f32("loss_scale", {1}, Region::scalars),
          i32("overflow", {1}),
          i32("step", {1}),
          f32("clip_coef", {1}, Region::scalars),
          f32("ema", {n}, Region::ema_f32)};
}
std::function<void(Values&)> optimizer_scalars(bool overflow, double clip_coef = 1.0) {
  return [=](Values& v) {
    v["lr"] = {fl(0.05)};
    v["loss_scale"] = {4096.0};
    v["overflow"] = {overflow ? 1.0 : 0.0};
    v["step"] = {5.0};
    v["clip_coef"] = {fl(clip_coef)};
  };
}
double state_floor(const Vec& v) {  // a moment's own scale: below it, absolute
  double mx = 0;
  for (double x : v) mx = std::max(mx, std::fabs(x));
  return mx;
}
Vec scaled_by(Vec g, double k) {
  for (double& x : g) x *= k;
  return g;
}

KILN_SWEEP(sgd) {
  struct Form {
    const char* name;
    int64_t n;
    float momentum, wd;
    bool nesterov, overflow;
    double clip;
  };
  std::vector<Case> rows;
  for (const Form& f : {Form{"n777_momentum0.9_wd0.01", 777, 0.9f, 1e-2f, false, false, 1.0},
                        Form{"n777_nesterov_wd5e-4_clip0.7", 777, 0.5f, 5e-4f, true, false, 0.7},
                        Form{"n100003_plain", 100003, 0.0f, 0.0f, false, false, 1.0},
                        Form{"n777_overflow_skips", 777, 0.9f, 1e-2f, false, true, 1.0}}) {
    Case c{OpKind::sgd, f.name};
    c.t = optimizer_specs(f.n);
    c.a.momentum = f.momentum, c.a.weight_decay = f.wd, c.a.nesterov = f.nesterov;
    const bool moment = f.momentum != 0;  // plain SGD keeps no momentum buffer
    c.in = {"w", "g", moment ? "m" : "", "lr", "loss_scale", "overflow"};
    if (f.clip != 1.0) c.in.push_back("clip_coef");
    c.out = {"w", moment ? "m" : ""};
    c.amp = false;
    c.prepare = optimizer_scalars(f.overflow, f.clip);
    c.expect = [f, moment](const Values& v) {
      Vec w = v.at("w"), m = v.at("m");
      if (f.overflow)
        return std::vector<Check>{{"w", w, {}, 0, "skipped: unchanged"},
                                  {"m", m, {}, 0, "skipped: unchanged"}};
      ref::sgd(w, scaled_by(v.at("g"), v.at("clip_coef")[0]), m, v.at("lr")[0], 4096.0, f.momentum,
               f.wd, f.nesterov);
      std::vector<Check> k{{"w", w, rel_mag(w, 1.0), kTol, kStateWhy}};
      if (moment) k.push_back({"m", m, rel_mag(m, 1.0), kTol, kStateWhy});
      return k;
    };
    rows.push_back(c);
  }
  return rows;
}

// The step scalar counts the updates before this one: the bias corrections use t = step + 1.
KILN_SWEEP(adamw) {
  std::vector<Case> rows;
  for (bool overflow : {false, true}) {
    Case c{OpKind::adamw, overflow ? "n513_overflow_skips" : "n513_wd0.05_step5"};
    c.t = optimizer_specs(513);
    c.a.weight_decay = 0.05f;
    c.in = {"w", "g", "m", "v", "lr", "loss_scale", "overflow", "step"};
    c.out = {"w", "m", "v"};
    c.amp = false;
    c.prepare = optimizer_scalars(overflow);
    c.expect = [overflow](const Values& v) {
      Vec w = v.at("w"), m = v.at("m"), s = v.at("v");
      if (overflow)
        return std::vector<Check>{{"w", w, {}, 0, "skipped: unchanged"},
                                  {"m", m, {}, 0, "skipped: unchanged"},
                                  {"v", s, {}, 0, "skipped: unchanged"}};
      ref::adamw(w, v.at("g"), m, s, v.at("lr")[0], 4096.0, 6, 0.9f, 0.999f, 1e-8f, 0.05f);
      return std::vector<Check>{
          {"w", w, rel_mag(w, 1.0), kTol, kStateWhy},
          {"m", m, rel_mag(m, state_floor(m)), kTol, "a moment, against its own scale"},
          {"v", s, rel_mag(s, state_floor(s)), kTol, "a moment, against its own scale"}};
    };
    rows.push_back(c);
  }
  return rows;
}

// One node per parameter (the trust ratio is per parameter); norms summed in double.
KILN_SWEEP(lars) {
  std::vector<Case> rows;
  for (int64_t n : {300, 17}) {
    Case c{OpKind::lars, "n" + std::to_string(n) + "_eta0.02_nesterov"};
    c.t = optimizer_specs(n);
    c.a.lars_eta = 0.02f, c.a.weight_decay = 5e-4f, c.a.momentum = 0.9f, c.a.nesterov = true;
    c.in = {"w", "g", "m", "lr", "loss_scale", "overflow"};
    c.out = {"w", "m"};
    c.amp = false;
    c.prepare = optimizer_scalars(false);
    c.expect = [](const Values& v) {
      Vec w = v.at("w"), m = v.at("m");
      ref::lars(w, v.at("g"), m, v.at("lr")[0], 4096.0, 0.9, 5e-4f, 0.02f, true);
      return std::vector<Check>{
          {"w", w, rel_mag(w, 1.0), kTol, kStateWhy},
          {"m", m, rel_mag(m, state_floor(m)), kTol, "a moment, against its own scale"}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(ema) {
  std::vector<Case> rows;
  for (bool overflow : {false, true}) {
    Case c{OpKind::ema, overflow ? "n1000_overflow_skips" : "n1000_decay0.99"};
    c.t = optimizer_specs(1000);
    c.a.ema_decay = 0.99f;
    c.in = {"w", "overflow"};
    c.out = {"ema"};
    c.amp = false;
    c.prepare = optimizer_scalars(overflow);
    c.expect = [overflow](const Values& v) {
      Vec e = v.at("ema");
      if (overflow) return std::vector<Check>{{"ema", e, {}, 0, "skipped: unchanged"}};
      ref::ema(e, v.at("w"), static_cast<double>(0.99f));
      return std::vector<Check>{
          {"ema", e, rel_mag(e, 1.0), kTol, "two FP32 roundings of values ~1"}};
    };
    rows.push_back(c);
  }
  return rows;
}

// ---- collectives (world = 1 here: the sum or gather of one rank is its own value) -------------

constexpr const char* kCollectivesCovered =
    "two ranks over MPI: dist_mpi_two_ranks (DistTrain.*, tests/dist/train_equivalence_test.cpp); "
    "NCCL on CUDA needs a communicator of several ranks";

KILN_SWEEP(allreduce) {
  std::vector<Case> rows;
  for (bool max : {false, true}) {
    Case c{OpKind::allreduce, max ? "n1001_max_world1" : "n1001_sum_world1"};
    c.t = {f32("x", {1001}, Region::grads_f32)};
    c.a.reduce_max = max;
    c.in = {"x"};
    c.out = {"x"};
    c.fp32 = c.amp = false;
    c.covered_by = kCollectivesCovered;
    c.expect = [](const Values& v) {
      return std::vector<Check>{{"x", v.at("x"), {}, 0, kExactWhy}};
    };
    rows.push_back(c);
  }
  return rows;
}

KILN_SWEEP(allgather) {
  Case c{OpKind::allgather, "2x5_world1"};
  c.t = {f32("x", {2, 5}, Region::bn_saved), f32("y", {1, 2, 5}, Region::bn_saved)};
  c.in = {"x"};
  c.out = {"y"};
  c.fp32 = c.amp = false;
  c.covered_by = kCollectivesCovered;
  c.expect = [](const Values& v) { return std::vector<Check>{{"y", v.at("x"), {}, 0, kExactWhy}}; };
  return {c};
}

// ---- fused ops: against their unfused chain on the same backend, bit for bit -----------------
// (fused_checks.h; on CUDA with deterministic engines, so both chains run the same ones).

Case chain_row(OpKind op, std::string label, bool amp,
               std::function<void(const char*, bool, Switches)> check) {
  Case c{op, std::move(label)};
  c.amp = amp;
  c.chain = std::move(check);
  return c;
}
const fused::CbrCase kCbr[] = {
    {"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false},
    {"n3_8x7_c16_k8_3x3_s2", 3, 8, 7, 16, 8, 3, 2, 1, false},
    {"n2_6x6_c8_k24_1x1", 2, 6, 6, 8, 24, 1, 1, 0, false},
    {"n1_5x5_c3_k8_first_layer", 1, 5, 5, 3, 8, 3, 1, 1, true},
    {"n4_3x3_c8_k5_odd_mask", 4, 3, 3, 8, 5, 1, 1, 0, false},
};

// cbr_equals_chain runs cbr_fwd and cbr_bwd; the backward's rows are the bias form below.
KILN_SWEEP(cbr_fwd) {
  std::vector<Case> rows;
  for (const fused::CbrCase& t : kCbr) {
    rows.push_back(
        chain_row(OpKind::cbr_fwd, t.name, t.k % 8 == 0, [t](const char* b, bool amp, Switches sw) {
          sw.pad_channels = amp && t.c % 8 != 0;  // the first layer's 3 channels, zero-padded
          fused::cbr_equals_chain(t, amp, b, sw);
        }));
  }
  return rows;
}

// The convolution bias BatchNorm cancels: only the running mean moves (by momentum * b, which
// the CPU forms in float as the check does, CUDA in double: 1e-6).
KILN_SWEEP(cbr_bwd) {
  return {chain_row(OpKind::cbr_bwd, "bias_n4_10x9_c16_k32", true,
                    [](const char* b, bool amp, Switches sw) {
                      fused::cbr_bias_moves_only_the_running_mean(
                          amp, b, std::string(b) == "cpu" ? 0.0 : 1e-6, sw);
                    })};
}

struct CbrPoolRow {
  fused::CbrCase cbr;
  int pool;
};
const CbrPoolRow kCbrPool[] = {
    {{"n2_8x8_c8_k16_3x3_pool2", 2, 8, 8, 8, 16, 3, 1, 1, false}, 2},
    {{"n3_6x4_c16_k8_1x1_pool2", 3, 6, 4, 16, 8, 1, 1, 0, false}, 2},
    {{"n1_9x9_c8_k8_3x3_pool3", 1, 9, 9, 8, 8, 3, 1, 1, false}, 3},
    {{"n2_8x8_c3_k8_first_layer_pool2", 2, 8, 8, 3, 8, 3, 1, 1, true}, 2},
    {{"n2_4x4_c8_k5_odd_mask_pool2", 2, 4, 4, 8, 5, 1, 1, 0, false}, 2},
};

KILN_SWEEP(cbr_pool_fwd) {
  std::vector<Case> rows;
  for (const CbrPoolRow& r : kCbrPool) {
    rows.push_back(chain_row(OpKind::cbr_pool_fwd, r.cbr.name, r.cbr.k % 8 == 0,
                             [r](const char* b, bool amp, Switches sw) {
                               sw.pad_channels = amp && r.cbr.c % 8 != 0;
                               fused::cbr_pool_equals_chain(r.cbr, r.pool, amp, b, sw);
                             }));
    // CUDA folds a pool into BatchNorm's pass only for output channels % 8 == 0 (the planner
    // does not merge otherwise): the odd-channel row is the CPU's alone.
    rows.back().fp32 = r.cbr.k % 8 == 0;
  }
  return rows;
}

KILN_SWEEP(cbr_pool_bwd) {
  Case c{OpKind::cbr_pool_bwd, "with_cbr_pool_fwd"};
  c.covered_by =
      "cbr_pool_fwd's rows: cbr_pool_equals_chain runs the forward and the backward together";
  return {c};
}

const Shape kBar[] = {{2, 7, 7, 16}, {1, 3, 5, 8}, {4, 2, 2, 3}};  // the last: an odd mask tail

KILN_SWEEP(bn_add_relu_fwd) {
  std::vector<Case> rows;
  for (const Shape& s : kBar)
    rows.push_back(chain_row(OpKind::bn_add_relu_fwd, s.str(), true,
                             [s](const char* b, bool amp, Switches sw) {
                               fused::bn_add_relu_equals_chain(s, amp, b, false, sw);
                             }));
  return rows;
}

// The second gradient dy2 folded in: the chain's add, ReLU and BN backward.
KILN_SWEEP(bn_add_relu_bwd) {
  std::vector<Case> rows;
  for (const Shape& s : kBar)
    rows.push_back(chain_row(OpKind::bn_add_relu_bwd, s.str() + "_two_grads", true,
                             [s](const char* b, bool amp, Switches sw) {
                               fused::bn_add_relu_equals_chain(s, amp, b, true, sw);
                             }));
  return rows;
}

KILN_SWEEP(bn_relu_infer) {
  std::vector<Case> rows;
  for (const Shape& s : kBar)
    for (bool residual : {false, true})
      rows.push_back(chain_row(OpKind::bn_relu_infer, s.str() + (residual ? "_residual" : ""), true,
                               [s, residual](const char* b, bool amp, Switches sw) {
                                 fused::bn_relu_infer_equals_chain(s, amp, b, residual, sw);
                               }));
  return rows;
}

#undef KILN_SWEEP

// ---- the table: every op of ops.def, in its order -----------------------------------------------

const std::vector<Case>& sweep() {
  static const std::vector<Case> all = [] {
    std::vector<Case> rows;
#define KILN_OP(name, category, doc) \
  for (Case c : sweep_cases<OpKind::name>()) rows.push_back(std::move(c));
#include "kiln/graph/ops.def"
#undef KILN_OP
    // kiln's CUDA kernels with 16-byte forms (channels in vectors of 8 f16 / 4 f32)
    const std::set<OpKind> vector_ops = {
        OpKind::bn_fwd_train, OpKind::bn_fwd_infer, OpKind::bn_bwd,      OpKind::relu_fwd,
        OpKind::relu_bwd,     OpKind::add,          OpKind::dropout_fwd, OpKind::dropout_bwd,
        OpKind::maxpool_fwd,  OpKind::maxpool_bwd,  OpKind::avgpool_fwd, OpKind::avgpool_bwd,
        OpKind::gap_fwd,      OpKind::gap_bwd};
    for (Case& c : rows) c.vector_variants = vector_ops.count(c.op) > 0;
    return rows;
  }();
  return all;
}

std::string test_name(const Case& c) {
  std::string s;  // gtest's names: letters, digits and single underscores
  for (const char ch : std::string(op_name(c.op)) + "_" + c.label) {
    const bool keep = std::isalnum(static_cast<unsigned char>(ch)) != 0;
    if (keep || (!s.empty() && s.back() != '_')) s += keep ? ch : '_';
  }
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}
std::string where(const Case& c) {
  return std::string(op_name(c.op)) + " " + c.label;
}

// ---- building and running a row on a backend ---------------------------------------------------

// The tensor of spec s on one side (gpu_test_util.h's Pair::add, with the dtype override).
TensorId declare(OpHarness& h, const Spec& s, bool amp) {
  DType d = s.dtype;
  Region r = s.region;
  Layout l = s.shape.rank() == 4 && !s.flat ? Layout::NHWC : Layout::Flat;
  switch (s.kind) {
    case Kind::Feature:
      d = amp ? DType::F16 : DType::F32, r = Region::features;
      break;
    case Kind::Weight:
      d = amp ? DType::F16 : DType::F32, r = amp ? Region::params_f16 : Region::params_f32;
      l = s.shape.rank() == 4 ? Layout::KRSC : Layout::OI;
      break;
    case Kind::WeightGrad:
      d = amp ? DType::F16 : DType::F32, r = amp ? Region::grads_f16 : Region::grads_f32;
      l = s.shape.rank() == 4 ? Layout::KRSC : Layout::OI;
      break;
    case Kind::F32:
      break;
    case Kind::I32:
      d = DType::I32, r = r == Region::features ? Region::aux : r;
      break;
    case Kind::U8:
      d = DType::U8, r = r == Region::features ? Region::aux : r;
      break;
  }
  return h.tensor(s.name, s.shape, r, d, l);
}

struct Built {
  OpHarness h;
  std::map<std::string, TensorId> id;
  explicit Built(bool amp) : h(amp) {}
};

void build(Built& b, const Case& c, bool amp, const char* backend, const Switches& sw) {
  for (const Spec& s : c.t) b.id[s.name] = declare(b.h, s, amp);
  auto ids = [&](const std::vector<std::string>& names) {
    std::vector<TensorId> v;
    for (const std::string& n : names) v.push_back(n.empty() ? kNoTensor : b.id.at(n));
    return v;
  };
  b.h.node(c.op, ids(c.in), ids(c.out), c.a).label = where(c);
  b.h.compile(make_backend(backend, sw), c.validate);
}

Values initial_values(const Case& c) {
  Values v;
  uint64_t seed = 1;
  for (const Spec& s : c.t) {
    const bool integer = s.kind == Kind::I32 || s.kind == Kind::U8;
    v[s.name] = integer ? Vec(static_cast<size_t>(s.shape.numel()), 0.0)
                        : rand_values_d(s.shape.numel(), seed, s.lo, s.hi);
    ++seed;
  }
  if (c.prepare) c.prepare(v);
  return v;
}

void write(Built& b, const std::string& name, const Vec& v) {
  const TensorId id = b.id.at(name);
  switch (b.h.program().tensor(id).dtype) {
    case DType::I32:
      b.h.write_i32(id, ints(v));
      break;
    case DType::U8:
      b.h.write_u8(id, std::vector<uint8_t>(v.begin(), v.end()));
      break;
    default:
      b.h.write(id, ref::to_float(v));
      break;
  }
}
Vec read(Built& b, const std::string& name) {
  const TensorId id = b.id.at(name);
  switch (b.h.program().tensor(id).dtype) {
    case DType::I32: {
      const std::vector<int32_t> i = b.h.read_i32(id);
      return Vec(i.begin(), i.end());
    }
    case DType::U8: {
      const std::vector<uint8_t> u = b.h.read_u8(id);
      return Vec(u.begin(), u.end());
    }
    default:
      return ref::to_double(b.h.read(id));
  }
}

bool same(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

// The worst element of got against want, named by op, shape, tensor and index.
void expect_check(const Case& c, const Check& k, const Vec& got) {
  ASSERT_EQ(got.size(), k.want.size()) << where(c) << ": " << k.tensor;
  double worst = 0;
  size_t at = 0, differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = 0;
    if (k.mag.empty()) {
      e = same(got[i], k.want[i]) ? 0.0 : std::numeric_limits<double>::infinity();
    } else {
      e = std::fabs(got[i] - k.want[i]) / std::max(k.mag[i], 1e-30);
      if (std::isnan(e))
        e = same(got[i], k.want[i]) ? 0.0 : std::numeric_limits<double>::infinity();
    }
    differ += e > k.tol;
    if (e > worst) worst = e, at = i;
  }
  if (print_op_errors())
    std::printf("  %-60s %-10s error %9.3g  bound %9.3g\n", where(c).c_str(), k.tensor.c_str(),
                worst, k.tol);
  EXPECT_EQ(differ, 0u) << where(c) << ": " << k.tensor << " " << differ << " of " << got.size()
                        << " elements beyond " << k.tol << " (" << k.why << "); worst element "
                        << at << ": got " << got[at] << ", want " << k.want[at] << " (error "
                        << worst << ")";
}

// CUDA's value against the CPU's: rel_error's measure (gpu_test_util.h), NaN equal to NaN,
// integers exact; the worst element named.
void expect_close(const Case& c, const Check& k, const Vec& gpu, const Vec& cpu, bool integer,
                  bool amp) {
  ASSERT_EQ(gpu.size(), cpu.size()) << where(c) << ": " << k.tensor;
  const double tol = integer ? 0.0 : amp ? kGpuAmpTol : kGpuFp32Tol;
  const bool sum = k.floor == Floor::sum || (amp && k.floor == Floor::sum_under_amp);
  double mx = 0;
  for (double w : cpu)
    if (std::isfinite(w)) mx = std::max(mx, std::fabs(w));
  const double f = std::max((sum ? kSumFloor : kEltFloor) * mx, 1e-30);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    double e =
        same(gpu[i], cpu[i]) ? 0.0 : std::fabs(gpu[i] - cpu[i]) / std::max(std::fabs(cpu[i]), f);
    if (std::isnan(e) || (integer && e > 0)) e = std::numeric_limits<double>::infinity();
    if (e > worst) worst = e, at = i;
  }
  if (print_op_errors())
    std::printf("  %-60s %-10s error %9.3g  bound %9.3g\n", where(c).c_str(), k.tensor.c_str(),
                worst, tol);
  EXPECT_LE(worst, tol) << where(c) << (amp ? " (AMP)" : " (FP32)") << ": " << k.tensor
                        << " element " << at << ": CUDA " << gpu[at] << ", CPU " << cpu[at]
                        << " (error " << worst << " > " << tol << ")";
}

// ---- the tests ----------------------------------------------------------------------------------

std::vector<size_t> rows_where(const std::function<bool(const Case&)>& keep) {
  std::vector<size_t> v;
  for (size_t i = 0; i < sweep().size(); ++i)
    if (keep(sweep()[i])) v.push_back(i);
  return v;
}

class SweepCpu : public ::testing::TestWithParam<size_t> {};

TEST_P(SweepCpu, MatchesFloat64Reference) {
  const Case& c = sweep()[GetParam()];
  if (c.chain) return c.chain("cpu", false, Switches::from_environment());
  Built b(false);
  build(b, c, false, "cpu", Switches::from_environment());
  const Values v = initial_values(c);
  for (const Spec& s : c.t) write(b, s.name, v.at(s.name));
  b.h.run();
  for (const Check& k : c.expect(v)) expect_check(c, k, read(b, k.tensor));
}

INSTANTIATE_TEST_SUITE_P(Ops, SweepCpu, ::testing::ValuesIn(rows_where([](const Case& c) {
                           return c.chain || !c.t.empty();
                         })),
                         [](const auto& info) { return test_name(sweep()[info.param]); });

// One row on CUDA and on the CPU, fed the same inputs (rounded to FP16 where CUDA's tensor is).
void cuda_against_cpu(const Case& c, bool amp, Switches sw) {
  if (c.chain) {
    sw.deterministic = true;
    return c.chain("cuda", amp, sw);
  }
  Built cpu(false), gpu(amp);
  build(cpu, c, false, "cpu", Switches::from_environment());
  build(gpu, c, amp, "cuda", sw);
  Values v = initial_values(c);
  for (const Spec& s : c.t) {
    Vec& x = v.at(s.name);
    if (gpu.h.program().tensor(gpu.id.at(s.name)).dtype == DType::F16 &&
        cpu.h.program().tensor(cpu.id.at(s.name)).dtype == DType::F32)
      for (double& e : x) e = half_to_float(float_to_half(static_cast<float>(e)));
    write(cpu, s.name, x);
    write(gpu, s.name, x);
  }
  cpu.h.run();
  gpu.h.run();
  for (const Check& k : c.expect(v)) {
    const DType d = gpu.h.program().tensor(gpu.id.at(k.tensor)).dtype;
    expect_close(c, k, read(gpu, k.tensor), read(cpu, k.tensor), d == DType::I32 || d == DType::U8,
                 amp);
  }
}

struct CudaRun {
  size_t row;
  bool amp;
};
void PrintTo(const CudaRun& r, std::ostream* os) {
  *os << where(sweep()[r.row]) << (r.amp ? " AMP" : " FP32");
}

class SweepCuda : public ::testing::TestWithParam<CudaRun> {};

TEST_P(SweepCuda, MatchesCpu) {
  KILN_REQUIRE_GPU();
  const Case& c = sweep()[GetParam().row];
  Switches sw = Switches::from_environment();
  if (!c.vector_variants) return cuda_against_cpu(c, GetParam().amp, sw);
  for (const bool vec : {true, false}) {
    SCOPED_TRACE(vec ? "16-byte kernels on" : "16-byte kernels off");
    sw.vector_kernels = vec;
    cuda_against_cpu(c, GetParam().amp, sw);
  }
}

std::vector<CudaRun> cuda_runs() {
  std::vector<CudaRun> runs;
  for (size_t i = 0; i < sweep().size(); ++i) {
    const Case& c = sweep()[i];
    if (!c.chain && c.t.empty()) continue;  // covered elsewhere
    if (c.fp32) runs.push_back({i, false});
    if (c.amp) runs.push_back({i, true});
  }
  return runs;
}

INSTANTIATE_TEST_SUITE_P(Ops, SweepCuda, ::testing::ValuesIn(cuda_runs()), [](const auto& info) {
  return test_name(sweep()[info.param.row]) + (info.param.amp ? "_amp" : "_fp32");
});

// Every op has rows of its own kind, with unique names; a row that runs nothing names its cover.
TEST(SweepTable, EveryOpHasRows) {
  std::set<std::string> names;
  std::vector<int> rows(kOpCount, 0);
  for (const Case& c : sweep()) {
    ++rows[static_cast<int>(c.op)];
    EXPECT_TRUE(names.insert(test_name(c)).second) << "two rows named " << test_name(c);
    const bool runs = c.chain || !c.t.empty();
    EXPECT_TRUE(runs || !c.covered_by.empty()) << where(c) << " runs nothing and names no cover";
    if (!c.chain && !c.t.empty()) EXPECT_TRUE(c.expect) << where(c) << " has no reference";
  }
  for (int i = 0; i < kOpCount; ++i) EXPECT_GT(rows[i], 0) << op_name(static_cast<OpKind>(i));
}

}  // namespace
}  // namespace kiln::test
