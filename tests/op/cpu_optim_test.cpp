// CPU fused optimizers and EMA over region ranges: SGD (momentum, Nesterov, weight decay),
// AdamW (decoupled decay, bias correction from the step scalar), LARS (one node per
// parameter), EMA; all undo the loss scale themselves and skip the step on overflow. Checked
// by hand computations and against float64 references over several steps.
#include <gtest/gtest.h>

#include <cmath>

#include "op/cpu_op_test_util.h"
#include "support/compute_copy_check.h"

namespace kiln::test {
namespace {

// The scalars every optimizer reads.
struct Scalars {
  TensorId lr, scale, overflow, step;
  explicit Scalars(OpHarness& h) {
    lr = h.tensor("lr", {1}, Region::scalars);
    scale = h.tensor("loss_scale", {1}, Region::scalars);
    overflow = h.tensor("overflow", {1}, Region::scalars, DType::I32);
    step = h.tensor("step", {1}, Region::scalars, DType::I32);
  }
  void set(OpHarness& h, float lr_v, float scale_v, bool of, int32_t step_v = 0) const {
    h.write(lr, {lr_v});
    h.write(scale, {scale_v});
    h.write_i32(overflow, {of ? 1 : 0});
    h.write_i32(step, {step_v});
  }
};

// Tolerance for optimizer state compared with a float64 reference over a few steps: each
// element takes ~5 FP32 roundings per step of values of order 1 (w, m in [-1, 1]), so after
// 3 steps the error is at most ~15 ulp(1) = 1.8e-6 and typically a few ulp; 1e-5 (SPEC Q2)
// relative above 1 and absolute below (values near zero come out of cancellations, where
// the absolute error is what the inputs' precision allows).
constexpr double kStateTol = kFp32Tol;

// Moments are not of order 1 (Adam's v ~ g^2, LARS's m ~ trust * g): compare them against
// their own scale -- the error of an element is set by the size of the terms that made it
// (m = b m + (1-b) g cancels when the signs differ), which is the state's typical magnitude,
// so elements below the largest magnitude compare absolutely against it.
double state_floor(const ref::Vec& v) {
  double mx = 0;
  for (double x : v) mx = std::max(mx, std::fabs(x));
  return mx;
}

// ---- SGD -------------------------------------------------------------------------------------

struct SgdProgram {
  OpHarness h;
  Scalars s{h};
  TensorId w, g, m;
  SgdProgram(int64_t n, float momentum, float wd, bool nesterov) {
    w = h.tensor("w", {n}, Region::params_f32);
    g = h.tensor("g", {n}, Region::grads_f32);
    m = h.tensor("m", {n}, Region::moment1);
    Attrs a;
    a.momentum = momentum;
    a.weight_decay = wd;
    a.nesterov = nesterov;
    h.node(OpKind::sgd, {w, g, m, s.lr, s.scale, s.overflow}, {w, m}, a);
    compile_cpu(h);
  }
};

// By hand, PyTorch's torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01) on w = 2 with
// an unscaled gradient of 0.5 (stored scaled by 1024):
//   step 1: g' = 0.5 + 0.01*2 = 0.52; m = 0.52; w = 2 - 0.1*0.52 = 1.948
//   step 2: g' = 0.5 + 0.01*1.948 = 0.51948; m = 0.9*0.52 + 0.51948 = 0.98748; w = 1.948 - 0.098748
//   = 1.849252
// Nesterov: update = g' + 0.9 m:
//   step 1: u = 0.52 + 0.468 = 0.988; w = 1.9012
//   step 2: g' = 0.5 + 0.019012 = 0.519012; m = 0.468 + 0.519012 = 0.987012; u = 0.519012 +
//   0.8883108 = 1.4073228;
//           w = 1.9012 - 0.14073228 = 1.76046772
// A handful of FP32 operations on values ~1: agreement to 1e-6 relative (~8 ulp).
TEST(CpuOpSgd, MatchesAHandComputation) {
  for (bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "classical");
    SgdProgram p(1, 0.9f, 0.01f, nesterov);
    p.h.write(p.w, {2.0f});
    p.h.write(p.g, {0.5f * 1024.0f});
    p.s.set(p.h, 0.1f, 1024.0f, false);
    p.h.run();
    EXPECT_NEAR(p.h.read(p.w)[0], nesterov ? 1.9012 : 1.948, 2e-6);
    EXPECT_NEAR(p.h.read(p.m)[0], 0.52, 1e-6);
    p.h.run();
    EXPECT_NEAR(p.h.read(p.w)[0], nesterov ? 1.76046772 : 1.849252, 2e-6);
    EXPECT_NEAR(p.h.read(p.m)[0], nesterov ? 0.987012 : 0.98748, 1e-6);
  }
}

// Random state over three steps with a changing learning rate (read at run time from the
// scalar), for each combination of momentum, Nesterov and weight decay, against the
// float64 reference; then an overflowed step changes nothing at all.
TEST(CpuOpSgd, MatchesReferenceOverStepsAndSkipsOnOverflow) {
  struct Cfg {
    float momentum, wd;
    bool nesterov;
  };
  for (const Cfg& c : {Cfg{0.0f, 0.0f, false}, Cfg{0.9f, 0.0f, false}, Cfg{0.9f, 1e-2f, false},
                       Cfg{0.9f, 1e-2f, true}, Cfg{0.5f, 5e-4f, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "momentum " << c.momentum << " wd " << c.wd << " nesterov " << c.nesterov);
    const int64_t n = 777;
    const float scale = 4096.0f;
    SgdProgram p(n, c.momentum, c.wd, c.nesterov);
    const auto w0 = rand_vec(n, 141);
    p.h.write(p.w, w0);
    ref::Vec W = ref::to_double(w0), M(n, 0.0);
    const float lrs[3] = {0.1f, 0.05f, 0.2f};
    for (int step = 0; step < 3; ++step) {
      const auto g =
          rand_vec(n, 142 + step, -scale, scale);  // scaled gradients, unscaled in [-1, 1]
      p.h.write(p.g, g);
      p.s.set(p.h, lrs[step], scale, false);
      p.h.run();
      ref::sgd(W, ref::to_double(g), M, lrs[step], scale, c.momentum, c.wd, c.nesterov);
    }
    KILN_EXPECT_REL(p.h.read(p.w), W, 1.0, kStateTol, "sgd w");
    KILN_EXPECT_REL(p.h.read(p.m), M, 1.0, kStateTol, "sgd m");
    const auto w_before = p.h.read(p.w), m_before = p.h.read(p.m);
    p.h.write(p.g, rand_vec(n, 149, -scale, scale));
    p.s.set(p.h, 0.1f, scale, true);
    p.h.run();
    EXPECT_EQ(p.h.read(p.w), w_before) << "an overflowed step must not change the weights";
    EXPECT_EQ(p.h.read(p.m), m_before) << "an overflowed step must not change the momentum";
  }
}

// ---- AdamW -----------------------------------------------------------------------------------

struct AdamProgram {
  OpHarness h;
  Scalars s{h};
  TensorId w, g, m, v;
  AdamProgram(int64_t n, float wd) {
    w = h.tensor("w", {n}, Region::params_f32);
    g = h.tensor("g", {n}, Region::grads_f32);
    m = h.tensor("m", {n}, Region::moment1);
    v = h.tensor("v", {n}, Region::moment2);
    Attrs a;
    a.weight_decay = wd;
    h.node(OpKind::adamw, {w, g, m, v, s.lr, s.scale, s.overflow, s.step}, {w, m, v}, a);
    compile_cpu(h);
  }
};

// First step from zero moments, no decay: bias correction makes m^/sqrt(v^) = g/|g|, so
// every weight moves by lr * g / (|g| + eps) -- by lr against the gradient's sign.
// Decoupled decay multiplies w by 1 - lr * wd before that (not added to the gradient).
// A few FP32 operations on w ~ 1: 1e-6 absolute.
TEST(CpuOpAdamw, FirstStepMovesEachWeightByLrAndDecayIsDecoupled) {
  const int64_t n = 100;
  for (float wd : {0.0f, 0.1f}) {
    AdamProgram p(n, wd);
    const auto w0 = rand_vec(n, 151), g = rand_vec(n, 152, -100.0f, 100.0f);
    p.h.write(p.w, w0);
    p.h.write(p.g, g);
    p.s.set(p.h, 1e-2f, 64.0f, false, 0);
    p.h.run();
    const auto w1 = p.h.read(p.w);
    for (int64_t i = 0; i < n; ++i) {
      const double gu = g[i] / 64.0;
      const double want = w0[i] * (1 - 1e-2 * wd) - 1e-2 * gu / (std::fabs(gu) + 1e-8);
      ASSERT_NEAR(w1[i], want, 1e-6) << i;
    }
  }
}

// Several steps against the float64 reference, starting at step scalar 5 (t = 6 in the
// bias corrections: the scalar counts the updates applied before this one); then an
// overflowed step changes nothing. m and v compare as state_floor says; w as kStateTol
// explains.
TEST(CpuOpAdamw, MatchesReferenceOverStepsAndSkipsOnOverflow) {
  const int64_t n = 513;
  const float scale = 256.0f, wd = 0.05f;
  AdamProgram p(n, wd);
  const auto w0 = rand_vec(n, 153), m0 = rand_vec(n, 154, -0.1f, 0.1f),
             v0 = rand_vec(n, 155, 0.0f, 0.01f);
  p.h.write(p.w, w0);
  p.h.write(p.m, m0);
  p.h.write(p.v, v0);
  ref::Vec W = ref::to_double(w0), M = ref::to_double(m0), V = ref::to_double(v0);
  for (int k = 0; k < 3; ++k) {
    const auto g = rand_vec(n, 156 + k, -scale, scale);
    p.h.write(p.g, g);
    p.s.set(p.h, 1e-3f, scale, false, 5 + k);
    p.h.run();
    ref::adamw(W, ref::to_double(g), M, V, 1e-3f, scale, 6 + k, 0.9f, 0.999f, 1e-8f, wd);
  }
  KILN_EXPECT_REL(p.h.read(p.w), W, 1.0, kStateTol, "adamw w");
  KILN_EXPECT_REL(p.h.read(p.m), M, state_floor(M), kStateTol, "adamw m");
  KILN_EXPECT_REL(p.h.read(p.v), V, state_floor(V), kStateTol, "adamw v");
  // The bias correction really uses step + 1: with t = 6 vs t = 5 the first-moment correction
  // differs by (1 - 0.9^6)/(1 - 0.9^5) - 1 ~ 13%, far beyond the tolerance.
  const auto w_before = p.h.read(p.w), m_before = p.h.read(p.m), v_before = p.h.read(p.v);
  p.s.set(p.h, 1e-3f, scale, true, 8);
  p.h.run();
  EXPECT_EQ(p.h.read(p.w), w_before);
  EXPECT_EQ(p.h.read(p.m), m_before);
  EXPECT_EQ(p.h.read(p.v), v_before);
}

// ---- step_count and grad_norm -----------------------------------------------------------------

// The counter AdamW's bias correction reads: a skipped step leaves it alone (PyTorch's
// GradScaler skips optimizer.step(), so state['step'] stays), an applied one adds 1.
TEST(CpuOpStepCount, CountsOnlyStepsThatWereNotSkipped) {
  OpHarness h;
  const TensorId overflow = h.tensor("overflow", {1}, Region::scalars, DType::I32);
  const TensorId count = h.tensor("optimizer_steps", {1}, Region::scalars, DType::I32);
  h.node(OpKind::step_count, {overflow, count}, {count});
  compile_cpu(h);
  h.write_i32(count, {7});
  const bool skipped[] = {false, true, true, false, true, false};
  int32_t want = 7;
  for (bool of : skipped) {
    h.write_i32(overflow, {of ? 1 : 0});
    h.run();
    want += of ? 0 : 1;
    EXPECT_EQ(h.read_i32(count)[0], want);
  }
}

// float64 form of torch.nn.utils.clip_grad_norm_(max_norm) on the unscaled gradient.
double clip_coef_ref(const std::vector<float>& g, double scale, double max_norm) {
  double ss = 0;
  for (float x : g) ss += (x / scale) * (x / scale);
  return std::min(1.0, max_norm / (std::sqrt(ss) + 1e-6));
}

struct ClipSgdProgram {
  OpHarness h;
  Scalars s{h};
  TensorId w, g, coef;
  ClipSgdProgram(int64_t n, float max_norm) {
    w = h.tensor("w", {n}, Region::params_f32);
    g = h.tensor("g", {n}, Region::grads_f32);
    coef = h.tensor("clip_coef", {1}, Region::scalars);
    Attrs c;
    c.max_norm = max_norm;
    h.node(OpKind::grad_norm, {g, s.scale}, {coef}, c);
    Attrs a;
    a.momentum = 0.0f;
    h.node(OpKind::sgd, {w, g, kNoTensor, s.lr, s.scale, s.overflow, coef}, {w, kNoTensor}, a);
    compile_cpu(h);
  }
};

// grad_norm over a region of scaled gradients, then plain SGD taking its factor: the factor
// against the float64 reference (1e-6 relative: a double sum rounded once to FP32), and the
// step w -= lr * coef * g / scale against it (kStateTol). With max_norm above the norm the
// factor is exactly 1 and the step is the unclipped one, bit for bit.
TEST(CpuOpGradNorm, ScalesTheStepToTheNormCapAsTorchClipGradNorm) {
  const int64_t n = 1000;
  const float scale = 512.0f, lr = 0.1f;
  const auto g = rand_vec(n, 171, -scale, scale);  // unscaled in [-1, 1]: norm ~ sqrt(n / 3) ~ 18
  const auto w0 = rand_vec(n, 172);
  for (float max_norm : {0.5f, 5.0f, 1e4f}) {
    SCOPED_TRACE(::testing::Message() << "max_norm " << max_norm);
    ClipSgdProgram p(n, max_norm);
    p.h.write(p.w, w0);
    p.h.write(p.g, g);
    p.s.set(p.h, lr, scale, false);
    p.h.run();
    const double k = clip_coef_ref(g, scale, max_norm);
    if (max_norm < 100) EXPECT_LT(k, 0.5) << "the cases below the norm must clip";
    KILN_EXPECT_REL(p.h.read(p.coef), ref::Vec{k}, 1e-6, 1e-6, "clip_coef");
    ref::Vec W = ref::to_double(w0), M(n, 0.0);
    ref::Vec G = ref::to_double(g);
    for (double& x : G) x *= k;
    ref::sgd(W, G, M, lr, scale, 0.0, 0.0, false);
    const auto w1 = p.h.read(p.w);
    KILN_EXPECT_REL(w1, W, 1.0, kStateTol, "clipped sgd w");
    double moved = 0;
    for (int64_t i = 0; i < n; ++i) moved += (w1[i] - w0[i]) * static_cast<double>(w1[i] - w0[i]);
    if (k < 1)
      EXPECT_NEAR(std::sqrt(moved), lr * max_norm, 1e-4 * lr * max_norm)
          << "the step's norm is lr * max";
    if (max_norm > 100) {
      EXPECT_EQ(p.h.read(p.coef)[0], 1.0f);
      SgdProgram plain(n, 0.0f, 0.0f, false);
      plain.h.write(plain.w, w0);
      plain.h.write(plain.g, g);
      plain.s.set(plain.h, lr, scale, false);
      plain.h.run();
      EXPECT_EQ(w1, plain.h.read(plain.w)) << "a factor of 1 must leave the step unchanged";
    }
  }
}

// ---- LARS ------------------------------------------------------------------------------------

struct LarsProgram {
  OpHarness h;
  Scalars s{h};
  std::vector<TensorId> w, g, m;
  // One lars node per parameter: the trust ratio is per parameter (see cpu/optim.cpp).
  LarsProgram(const std::vector<int64_t>& sizes, const Attrs& a) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      w.push_back(h.tensor("w" + std::to_string(i), {sizes[i]}, Region::params_f32));
      g.push_back(h.tensor("g" + std::to_string(i), {sizes[i]}, Region::grads_f32));
      m.push_back(h.tensor("m" + std::to_string(i), {sizes[i]}, Region::moment1));
      h.node(OpKind::lars, {w[i], g[i], m[i], s.lr, s.scale, s.overflow}, {w[i], m[i]}, a);
    }
    compile_cpu(h);
  }
};

// By hand: w = (3, 4), ||w|| = 5; unscaled g = (0, 1), ||g|| = 1; eta 0.001, wd 0.1:
// trust = 0.001 * 5 / (1 + 0.1 * 5) = 1/300; d = trust * (g + 0.1 w) = (0.3, 1.4) / 300 =
// (0.001, 0.004666...); m = d; w -= 0.5 * d -> (2.9995, 3.99766667). A zero weight or gradient
// norm gives trust 1 (plain SGD with decay). 1e-6 absolute (a few FP32 operations on ~4).
TEST(CpuOpLars, MatchesAHandComputation) {
  Attrs a;
  a.lars_eta = 0.001f;
  a.weight_decay = 0.1f;
  a.momentum = 0.9f;
  LarsProgram p({2, 2}, a);
  p.h.write(p.w[0], {3.0f, 4.0f});
  p.h.write(p.g[0], {0.0f, 8.0f});  // scale 8
  p.h.write(p.w[1], {0.0f, 0.0f});  // ||w|| = 0: trust 1
  p.h.write(p.g[1], {8.0f, -16.0f});
  p.s.set(p.h, 0.5f, 8.0f, false);
  p.h.run();
  const auto w0 = p.h.read(p.w[0]), m0 = p.h.read(p.m[0]), w1 = p.h.read(p.w[1]);
  EXPECT_NEAR(m0[0], 0.001, 1e-8);
  EXPECT_NEAR(m0[1], 1.4 / 300, 1e-8);
  EXPECT_NEAR(w0[0], 2.9995, 1e-6);
  EXPECT_NEAR(w0[1], 4.0 - 0.5 * 1.4 / 300, 1e-6);
  EXPECT_NEAR(w1[0], -0.5, 1e-6);
  EXPECT_NEAR(w1[1], 1.0, 1e-6);
}

// Several parameters of different sizes and scales over three steps against the float64
// reference (each with its own trust ratio), Nesterov on; then an overflowed step changes
// nothing. The norms are summed in double; kStateTol as for SGD.
TEST(CpuOpLars, MatchesReferencePerParameterAndSkipsOnOverflow) {
  Attrs a;
  a.lars_eta = 0.02f;
  a.weight_decay = 5e-4f;
  a.momentum = 0.9f;
  a.nesterov = true;
  const std::vector<int64_t> sizes = {300, 17, 1000};
  LarsProgram p(sizes, a);
  const float scale = 2048.0f;
  std::vector<ref::Vec> W, M;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto w0 = rand_vec(sizes[i], 161 + i, -0.5f * (i + 1), 0.5f * (i + 1));
    p.h.write(p.w[i], w0);
    W.push_back(ref::to_double(w0));
    M.emplace_back(sizes[i], 0.0);
  }
  for (int k = 0; k < 3; ++k) {
    p.s.set(p.h, 0.5f, scale, false);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto g = rand_vec(sizes[i], 170 + 10 * k + i, -scale * 0.01f, scale * 0.01f);
      p.h.write(p.g[i], g);
      ref::lars(W[i], ref::to_double(g), M[i], 0.5, scale, 0.9, 5e-4f, 0.02f, true);
    }
    p.h.run();
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    KILN_EXPECT_REL(p.h.read(p.w[i]), W[i], 1.0, kStateTol, "lars w" + std::to_string(i));
    KILN_EXPECT_REL(p.h.read(p.m[i]), M[i], state_floor(M[i]), kStateTol,
                    "lars m" + std::to_string(i));
  }
  const auto before = p.h.read(p.w[2]);
  p.s.set(p.h, 0.5f, scale, true);
  p.h.run();
  EXPECT_EQ(p.h.read(p.w[2]), before);
}

// ---- The compute copy ([w16], KILN_FUSE_WEIGHT_CAST) ------------------------------------------

// SGD, AdamW and LARS with their FP16 and BF16 compute copies (support/compute_copy_check.h;
// the GPU test runs the same check on CUDA).
TEST(CpuOpComputeCopy, EveryOptimizerWritesTheCastOfItsNewWeights) {
  expect_optimizers_write_compute_copy("cpu");
}

// ---- EMA -------------------------------------------------------------------------------------

// ema = d ema + (1 - d) w over several steps against float64 (two roundings per step on
// values ~1: kStateTol); an overflowed step leaves the average alone.
TEST(CpuOpEma, MatchesReferenceAndSkipsOnOverflow) {
  const int64_t n = 1000;
  OpHarness h;
  const TensorId w = h.tensor("w", {n}, Region::params_f32),
                 e = h.tensor("ema", {n}, Region::ema_f32);
  const TensorId of = h.tensor("overflow", {1}, Region::scalars, DType::I32);
  Attrs a;
  a.ema_decay = 0.99f;
  h.node(OpKind::ema, {w, of}, {e}, a);
  compile_cpu(h);
  const auto e0 = rand_vec(n, 181);
  h.write(e, e0);
  ref::Vec E = ref::to_double(e0);
  for (int k = 0; k < 4; ++k) {
    const auto wv = rand_vec(n, 182 + k);
    h.write(w, wv);
    h.write_i32(of, {0});
    h.run();
    ref::ema(E, ref::to_double(wv), static_cast<double>(0.99f));
  }
  KILN_EXPECT_REL(h.read(e), E, 1.0, kStateTol, "ema");
  const auto before = h.read(e);
  h.write(w, rand_vec(n, 190));
  h.write_i32(of, {1});
  h.run();
  EXPECT_EQ(h.read(e), before);
}

}  // namespace
}  // namespace kiln::test
