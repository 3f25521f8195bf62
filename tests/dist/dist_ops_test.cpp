// The kernels of the data-parallel ops against the float64 reference, in one process: on the
// CPU here, and on CUDA (FP32 and FP16 features) where a GPU is present (skipped otherwise).
// Two "ranks" are two halves of one batch: their bn_stats, gathered by hand, give bn_fwd_sync
// the statistics of the whole batch, and their bn_bwd_reduce sums, added by hand, give
// bn_bwd_sync the whole batch's gradient — what allgather / allreduce do between processes
// (those two are covered under mpirun; here, with one process, they copy or do nothing).
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

using ref::Vec;

constexpr int64_t kN = 3, kH = 3, kW = 4, kC = 5;  // one half; the whole batch is 2 kN
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

Vec dbl(const std::vector<float>& v) {
  return Vec(v.begin(), v.end());
}
std::vector<float> part(const std::vector<float>& v, int half) {
  const size_t n = v.size() / 2;
  return std::vector<float>(v.begin() + static_cast<long>(half * n),
                            v.begin() + static_cast<long>((half + 1) * n));
}
Vec part(const Vec& v, int half) {
  const size_t n = v.size() / 2;
  return Vec(v.begin() + static_cast<long>(half * n),
             v.begin() + static_cast<long>((half + 1) * n));
}

Attrs bn_attrs(int world) {
  Attrs a;
  a.eps = kEps;
  a.bn_momentum = kMomentum;
  a.world = world;
  return a;
}

struct Device {
  std::string name;  // "cpu" or "cuda"
  bool amp = false;  // FP16 features
  DType feature() const { return amp ? DType::F16 : DType::F32; }
  // SPEC Q2: 1e-5 in FP32, 1e-2 in FP16.
  double tol() const { return amp ? 1e-2 : kFp32Tol; }
};

void compile_on(OpHarness& h, const Device& d) {
  h.compile(make_backend(d.name));
}

TensorId feature(OpHarness& h, const Device& d, const char* name) {
  return h.tensor(name, {kN, kH, kW, kC}, Region::features, d.feature(), Layout::NHWC);
}

// bn_stats of each half.
std::vector<float> half_stats(const Device& d, const std::vector<float>& x_half) {
  OpHarness h(d.amp);
  const TensorId x = feature(h, d, "x");
  const TensorId s = h.tensor("stats", {2, kC}, Region::bn_saved);
  h.node(OpKind::bn_stats, {x}, {s}, bn_attrs(1));
  compile_on(h, d);
  h.write(x, x_half);
  h.run();
  return h.read(s);
}

void sync_bn_of_two_halves(const Device& d) {
  const double tol = d.tol();
  const int64_t half = kN * kH * kW * kC;
  const std::vector<float> x = rand_vec(2 * half, 1, -2.0f, 3.0f), dy = rand_vec(2 * half, 2);
  const std::vector<float> gamma = rand_vec(kC, 3, 0.5f, 1.5f), beta = rand_vec(kC, 4);
  const std::vector<float> rm0 = rand_vec(kC, 5), rv0 = rand_vec(kC, 6, 0.5f, 2.0f);
  const ref::BnForward want = ref::bn_fwd_train(dbl(x), dbl(gamma), dbl(beta), kC, kEps);
  const ref::BnBackward want_b =
      ref::bn_bwd(dbl(x), dbl(dy), dbl(gamma), want.mean, want.invstd, kC);
  Vec want_rm = dbl(rm0), want_rv = dbl(rv0);
  ref::bn_running_update(want_rm, want_rv, want.mean, want.var, 2 * kN * kH * kW, kMomentum);

  // stats_all = [stats of half 0, stats of half 1], as allgather makes it.
  std::vector<float> all = half_stats(d, part(x, 0));
  const std::vector<float> s1 = half_stats(d, part(x, 1));
  all.insert(all.end(), s1.begin(), s1.end());

  for (int r = 0; r < 2; ++r) {
    const std::string who = d.name + (d.amp ? " f16" : " f32") + " half " + std::to_string(r);
    // Forward on this half with both halves' statistics.
    OpHarness f(d.amp);
    const TensorId xt = feature(f, d, "x"), yt = feature(f, d, "y");
    const TensorId g = f.tensor("gamma", {kC}, Region::params_f32),
                   b = f.tensor("beta", {kC}, Region::params_f32);
    const TensorId rm = f.tensor("rm", {kC}, Region::bn_running),
                   rv = f.tensor("rv", {kC}, Region::bn_running);
    const TensorId at = f.tensor("stats_all", {2, 2, kC}, Region::bn_saved);
    const TensorId saved = f.tensor("saved", {2, kC}, Region::bn_saved);
    f.node(OpKind::bn_fwd_sync, {xt, g, b, rm, rv, at}, {yt, saved}, bn_attrs(2));
    compile_on(f, d);
    f.write(xt, part(x, r));
    f.write(g, gamma);
    f.write(b, beta);
    f.write(rm, rm0);
    f.write(rv, rv0);
    f.write(at, all);
    f.run();
    KILN_EXPECT_REL(f.read(yt), part(want.y, r), 1.0, tol, who + " y");
    const std::vector<float> sv = f.read(saved);
    KILN_EXPECT_REL(std::vector<float>(sv.begin(), sv.begin() + kC), want.mean, 1.0, tol,
                    who + " mean");
    KILN_EXPECT_REL(std::vector<float>(sv.begin() + kC, sv.end()), want.invstd, 1.0, tol,
                    who + " invstd");
    KILN_EXPECT_REL(f.read(rm), want_rm, 1.0, tol, who + " running mean");
    KILN_EXPECT_REL(f.read(rv), want_rv, 1.0, tol,
                    who + " running var (unbiased over both halves)");

    // Backward: this half's sums; the other half's from a second kernel; dx with both.
    std::vector<float> sums_total(2 * kC, 0.0f), dgamma(kC, 0.0f), dbeta(kC, 0.0f);
    for (int q = 0; q < 2; ++q) {
      OpHarness br(d.amp);
      const TensorId bx = feature(br, d, "x"), bdy = feature(br, d, "dy");
      const TensorId bs = br.tensor("saved", {2, kC}, Region::bn_saved);
      const TensorId dg = br.tensor("dgamma", {kC}, Region::grads_f32),
                     db = br.tensor("dbeta", {kC}, Region::grads_f32);
      const TensorId sums = br.tensor("sums", {2, kC}, Region::bn_saved);
      br.node(OpKind::bn_bwd_reduce, {bx, bdy, bs}, {dg, db, sums}, bn_attrs(2));
      compile_on(br, d);
      br.write(bx, part(x, q));
      br.write(bdy, part(dy, q));
      br.write(bs, sv);
      br.run();
      const std::vector<float> s = br.read(sums), g_q = br.read(dg), b_q = br.read(db);
      for (int64_t c = 0; c < kC; ++c) {
        EXPECT_EQ(s[static_cast<size_t>(c)], b_q[static_cast<size_t>(c)]) << "sums[0] is dbeta";
        EXPECT_EQ(s[static_cast<size_t>(kC + c)], g_q[static_cast<size_t>(c)])
            << "sums[1] is dgamma";
      }
      for (size_t i = 0; i < s.size(); ++i) sums_total[i] += s[i];
      for (int64_t c = 0; c < kC; ++c) {
        dgamma[static_cast<size_t>(c)] += g_q[static_cast<size_t>(c)];
        dbeta[static_cast<size_t>(c)] += b_q[static_cast<size_t>(c)];
      }
    }
    // The ranks' dgamma and dbeta add up (in the gradient all-reduce) to the batch's.
    KILN_EXPECT_REL(dgamma, want_b.dgamma, 1.0, tol, who + " dgamma");
    KILN_EXPECT_REL(dbeta, want_b.dbeta, 1.0, tol, who + " dbeta");
    OpHarness bs(d.amp);
    const TensorId bx = feature(bs, d, "x"), bdy = feature(bs, d, "dy"), bdx = feature(bs, d, "dx");
    const TensorId bg = bs.tensor("gamma", {kC}, Region::params_f32);
    const TensorId bsv = bs.tensor("saved", {2, kC}, Region::bn_saved);
    const TensorId bsum = bs.tensor("sums", {2, kC}, Region::bn_saved);
    bs.node(OpKind::bn_bwd_sync, {bx, bdy, bg, bsv, bsum}, {bdx}, bn_attrs(2));
    compile_on(bs, d);
    bs.write(bx, part(x, r));
    bs.write(bdy, part(dy, r));
    bs.write(bg, gamma);
    bs.write(bsv, sv);
    bs.write(bsum, sums_total);
    bs.run();
    KILN_EXPECT_REL(bs.read(bdx), part(want_b.dx, r), 1.0, tol, who + " dx");
  }
}

TEST(DistOps, SyncBnOfTwoHalvesIsTheWholeBatchCpu) {
  sync_bn_of_two_halves({"cpu", false});
}

TEST(DistOps, SyncBnOfTwoHalvesIsTheWholeBatchCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  sync_bn_of_two_halves({"cuda", false});
}

TEST(DistOps, SyncBnOfTwoHalvesIsTheWholeBatchCudaFp16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU";
  sync_bn_of_two_halves({"cuda", true});
}

// With one process the split equals the plain BatchNorm kernels (allgather copies, the
// allreduce does nothing): the same numbers as bn_fwd_train / bn_bwd up to FP32 rounding.
TEST(DistOps, OneProcessSplitEqualsPlainBatchNormCpu) {
  const int64_t n = 2 * kN * kH * kW * kC;
  OpHarness h;
  auto feat = [&](const char* name) {
    return h.tensor(name, {2 * kN, kH, kW, kC}, Region::features, DType::F32, Layout::NHWC);
  };
  const TensorId x = feat("x"), dy = feat("dy"), y1 = feat("y1"), y2 = feat("y2"),
                 dx1 = feat("dx1"), dx2 = feat("dx2");
  const TensorId g = h.tensor("gamma", {kC}, Region::params_f32),
                 b = h.tensor("beta", {kC}, Region::params_f32);
  const TensorId rm1 = h.tensor("rm1", {kC}, Region::bn_running),
                 rv1 = h.tensor("rv1", {kC}, Region::bn_running);
  const TensorId rm2 = h.tensor("rm2", {kC}, Region::bn_running),
                 rv2 = h.tensor("rv2", {kC}, Region::bn_running);
  const TensorId s1 = h.tensor("saved1", {2, kC}, Region::bn_saved),
                 s2 = h.tensor("saved2", {2, kC}, Region::bn_saved);
  const TensorId st = h.tensor("stats", {2, kC}, Region::bn_saved),
                 all = h.tensor("all", {1, 2, kC}, Region::bn_saved);
  const TensorId sums = h.tensor("sums", {2, kC}, Region::bn_saved);
  const TensorId dg1 = h.tensor("dg1", {kC}, Region::grads_f32),
                 db1 = h.tensor("db1", {kC}, Region::grads_f32);
  const TensorId dg2 = h.tensor("dg2", {kC}, Region::grads_f32),
                 db2 = h.tensor("db2", {kC}, Region::grads_f32);
  const Attrs a = bn_attrs(1);
  h.node(OpKind::bn_fwd_train, {x, g, b, rm1, rv1}, {y1, s1}, a);
  h.node(OpKind::bn_bwd, {x, dy, g, s1}, {dx1, dg1, db1}, a);
  h.node(OpKind::bn_stats, {x}, {st}, a);
  h.node(OpKind::allgather, {st}, {all}, a);
  h.node(OpKind::bn_fwd_sync, {x, g, b, rm2, rv2, all}, {y2, s2}, a);
  h.node(OpKind::bn_bwd_reduce, {x, dy, s2}, {dg2, db2, sums}, a);
  h.node(OpKind::allreduce, {sums}, {sums}, a);
  h.node(OpKind::bn_bwd_sync, {x, dy, g, s2, sums}, {dx2}, a);
  compile_cpu(h);
  h.write(x, rand_vec(n, 11, -1.0f, 2.0f));
  h.write(dy, rand_vec(n, 12));
  h.write(g, rand_vec(kC, 13, 0.5f, 1.5f));
  h.write(b, rand_vec(kC, 14));
  h.run();
  for (auto [p, q, what] : {std::tuple{y1, y2, "y"},
                            {s1, s2, "saved"},
                            {rm1, rm2, "running mean"},
                            {rv1, rv2, "running var"},
                            {dx1, dx2, "dx"},
                            {dg1, dg2, "dgamma"},
                            {db1, db2, "dbeta"}}) {
    KILN_EXPECT_REL(h.read(q), dbl(h.read(p)), 1.0, kFp32Tol, what);
  }
}

}  // namespace
}  // namespace kiln::test
