// CPU softmax cross-entropy: top-1/top-5 ties and non-finite logits, bad labels, padding, label
// smoothing, mixed targets (mixup / cutmix), finite differences. The plain loss, dlogits and counts
// against the float64 reference are the sweep's rows (tests/sweep/op_sweep_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

struct CeProgram {
  OpHarness h;
  int64_t n, k;
  TensorId z, labels, scale, loss, correct, dz = kNoTensor, mix = kNoTensor;
  CeProgram(int64_t n_, int64_t k_, bool with_grad = true, float smoothing = 0.0f,
            bool mixed = false)
      : n(n_), k(k_) {
    z = h.tensor("logits", {n, k});
    labels = h.tensor("labels", {n}, Region::input_a, DType::I32);
    scale = h.tensor("loss_scale", {1}, Region::scalars);
    loss = h.tensor("loss", {1}, Region::scalars);
    correct = h.tensor("correct", {2}, Region::scalars, DType::I32);
    std::vector<TensorId> out{loss, correct};
    if (with_grad) {
      dz = h.tensor("dlogits", {n, k});
      out.push_back(dz);
    }
    Attrs a;
    a.label_smoothing = smoothing;
    std::vector<TensorId> in{z, labels, scale};
    if (mixed) {
      mix = h.tensor("mix", {8}, Region::scalars);
      in.push_back(mix);
    }
    h.node(OpKind::softmax_ce, in, out, a);
    compile_cpu(h);
  }
  void run(const std::vector<float>& zv, const std::vector<int32_t>& lv, float s) {
    h.write(z, zv);
    h.write_i32(labels, lv);
    h.write(scale, {s});
    h.run();
  }
  // A mixed step: kind 1 (mixup) or 2 (cutmix) with lambda; kind 0 is an unmixed step.
  void run_mixed(const std::vector<float>& zv, const std::vector<int32_t>& lv, float s,
                 float lambda, int kind = 1) {
    h.write(mix,
            {static_cast<float>(kind), lambda, static_cast<float>(1.0 - lambda), 0, 0, 0, 0, 0});
    run(zv, lv, s);
  }
};

struct CeCase {
  const char* name;
  int64_t n, k;
  float spread, offset, scale;
};

const CeCase kCases[] = {
    {"n1_k1", 1, 1, 1.0f, 0.0f, 1.0f},
    {"n4_k10", 4, 10, 3.0f, 0.0f, 1.0f},
    {"n7_k1000_scaled8192", 7, 1000, 5.0f, 0.0f, 8192.0f},
    {"n3_k17_large_logits", 3, 17, 50.0f, 1000.0f, 128.0f},  // exp would overflow without the max
    {"n32_k100", 32, 100, 10.0f, -20.0f, 65536.0f},
};

// Ties: the label's rank counts larger logits plus equal logits at smaller indices (a stable
// descending sort; argmax's first maximum). Rows (label in brackets):
//  0: [5] ties class 2 (earlier): rank 1 -> top-1 miss, top-5 hit
//  1: [2] ties class 5 (later):   rank 0 -> top-1 hit
//  2: label has 4 larger logits:  rank 4 -> top-5 hit
//  3: 4 larger + 1 equal earlier: rank 5 -> top-5 miss
//  4: all logits equal, label 0:  rank 0 -> hit; label 7 would be rank 7 (row 5) -> miss
TEST(CpuOpSoftmaxCeTopK, TiesFollowTheStableOrder) {
  const int64_t k = 8;
  std::vector<std::vector<float>> rows = {{0, 0, 3, 0, 0, 3, 0, 0}, {0, 0, 3, 0, 0, 3, 0, 0},
                                          {9, 8, 7, 6, 1, 0, 0, 0}, {9, 8, 7, 6, 1, 1, 0, 0},
                                          {2, 2, 2, 2, 2, 2, 2, 2}, {2, 2, 2, 2, 2, 2, 2, 2}};
  const std::vector<int32_t> labels = {5, 2, 4, 5, 0, 7};
  std::vector<float> z;
  for (const auto& r : rows) z.insert(z.end(), r.begin(), r.end());
  const int64_t n = static_cast<int64_t>(rows.size());
  CeProgram p(n, k, false);  // the evaluation form: no dlogits
  p.run(z, labels, 1.0f);
  const auto counts = p.h.read_i32(p.correct);
  EXPECT_EQ(counts[0], 2);  // rows 1, 4
  EXPECT_EQ(counts[1], 4);  // rows 0, 1, 2, 4
  const ref::SoftmaxCe r = ref::softmax_ce(ref::to_double(z), labels, n, k, 1.0);
  EXPECT_EQ(r.top1, 2);
  EXPECT_EQ(r.top5, 4);
}

// A diverged model's logits (NaN, or +/-inf) are a miss at top-1 and top-5: NaN compares
// false, so ranking alone would count every such row as a hit and report 100%.
//  0: all NaN                  -> miss (was a hit)
//  1: label's logit NaN        -> miss (was a hit)
//  2: label's logit +inf       -> miss (a finite rank, but no trustworthy score)
//  3: another logit -inf       -> miss
//  4: finite, label the max    -> hit
TEST(CpuOpSoftmaxCeTopK, NonFiniteLogitsAreMisses) {
  const int64_t k = 6;
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {{nan, nan, nan, nan, nan, nan},
                                                {1, nan, 0, 0, 0, 0},
                                                {0, 0, inf, 0, 0, 0},
                                                {5, 0, 0, -inf, 0, 0},
                                                {5, 0, 0, 0, 0, 0}};
  const std::vector<int32_t> labels = {0, 1, 2, 0, 0};
  std::vector<float> z;
  for (const auto& r : rows) z.insert(z.end(), r.begin(), r.end());
  CeProgram p(static_cast<int64_t>(rows.size()), k, false);
  p.run(z, labels, 1.0f);
  const auto counts = p.h.read_i32(p.correct);
  EXPECT_EQ(counts[0], 1);  // row 4 only
  EXPECT_EQ(counts[1], 1);
  EXPECT_FALSE(std::isfinite(p.h.read(p.loss)[0])) << "the loss still shows the NaN";
}

// A label outside [0, classes) is a data error naming the sample, not a wild read.
TEST(CpuOpSoftmaxCeErrors, LabelOutOfRangeIsADataError) {
  CeProgram p(2, 5);
  try {
    p.run(rand_vec(10, 113), {1, 5}, 1.0f);
    FAIL() << "expected kiln::Error(Data)";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Data);
    EXPECT_NE(std::string(e.what()).find("sample 1"), std::string::npos) << e.what();
  }
}

// Padding (label < 0, the last partial batch of an evaluation): the padded rows count in
// neither loss, hits nor gradient; the result equals running the valid rows alone.
TEST(CpuOpSoftmaxCePadding, PaddedRowsAreIgnored) {
  const int64_t k = 7;
  const auto z = rand_vec(5 * k, 116, -2.0f, 2.0f);
  CeProgram padded(5, k);
  padded.run(z, {3, 1, -1, 6, -1}, 256.0f);
  CeProgram alone(3, k);
  std::vector<float> zv;
  for (int64_t row : {0, 1, 3}) zv.insert(zv.end(), z.begin() + row * k, z.begin() + (row + 1) * k);
  alone.run(zv, {3, 1, 6}, 256.0f);
  // Same rows, same double sums in the same order: equal to the last bit.
  EXPECT_EQ(padded.h.read(padded.loss), alone.h.read(alone.loss));
  EXPECT_EQ(padded.h.read_i32(padded.correct), alone.h.read_i32(alone.correct));
  const auto dp = padded.h.read(padded.dz), da = alone.h.read(alone.dz);
  for (int64_t j = 0; j < k; ++j) {
    EXPECT_EQ(dp[static_cast<size_t>(j)], da[static_cast<size_t>(j)]);
    EXPECT_EQ(dp[static_cast<size_t>(2 * k + j)], 0.0f) << "padded row 2";
    EXPECT_EQ(dp[static_cast<size_t>(3 * k + j)], da[static_cast<size_t>(2 * k + j)]);
    EXPECT_EQ(dp[static_cast<size_t>(4 * k + j)], 0.0f) << "padded row 4";
  }
}

// Reference: dlogits / (scale) is the gradient of the mean loss (central differences in
// double, h = 1e-5: truncation ~h^2 ~ 1e-10, rounding ~1e-16 / h ~ 1e-11, against
// gradients ~0.01..0.5): 1e-6 relative (floor 1e-3).
TEST(CpuOpSoftmaxCeGrad, ReferenceGradientIsTheDerivativeOfTheLoss) {
  const int64_t n = 3, k = 6;
  const ref::Vec z = ref::to_double(rand_vec(n * k, 114, -3.0f, 3.0f));
  const auto lv = rand_labels(n, k, 115);
  const double scale = 1024;
  auto loss = [&](const ref::Vec& v) { return ref::softmax_ce(v, lv, n, k, scale).loss; };
  ref::Vec g = ref::softmax_ce(z, lv, n, k, scale).dlogits;
  for (double& v : g) v /= scale;
  KILN_EXPECT_REL(ref::numeric_grad(loss, z), g, 1e-3, 1e-6, "fd dlogits");
}

// Kernel: its dlogits / scale against central differences of its own FP32 loss. h = 1e-2:
// truncation h^2 |f'''| / 6 ~ 2e-5; the FP32 loss (~1.5) carries ~1e-7 of rounding, / 2h ->
// 1e-5. Gradients are <= 0.5 in magnitude: 2e-4 absolute.
TEST(CpuOpSoftmaxCeGrad, KernelGradientMatchesFiniteDifferencesOfKernelLoss) {
  const int64_t n = 2, k = 5;
  const float scale = 4096.0f;
  CeProgram p(n, k);
  auto z = rand_vec(n * k, 116, -2.0f, 2.0f);
  const auto lv = rand_labels(n, k, 117);
  p.run(z, lv, scale);
  ref::Vec g = ref::to_double(p.h.read(p.dz));
  for (double& v : g) v /= scale;
  ref::Vec fd(z.size());
  const float h = 1e-2f;
  for (size_t i = 0; i < z.size(); ++i) {
    const float z0 = z[i];
    z[i] = z0 + h;
    p.run(z, lv, scale);
    const double lp = p.h.read(p.loss)[0];
    z[i] = z0 - h;
    p.run(z, lv, scale);
    const double lm = p.h.read(p.loss)[0];
    z[i] = z0;
    fd[i] = (lp - lm) / (static_cast<double>(z0 + h) - static_cast<double>(z0 - h));
  }
  KILN_EXPECT_REL(g, fd, 1.0, 2e-4, "kernel dlogits vs fd");
}

// ---- label smoothing ---------------------------------------------------------------------------

// torch.nn.CrossEntropyLoss(label_smoothing=e) in float64, in its own form: log-softmax, then
// loss_n = -(1 - e) logp[y] - (e / K) sum_j logp[j], the mean over the rows; its gradient
// (softmax - (1 - e) onehot - e / K) / N, here times the loss scale as kiln's dlogits.
struct SmoothRef {
  double loss = 0;
  ref::Vec dlogits;
};
SmoothRef smoothed_ce(const ref::Vec& z, const std::vector<int32_t>& y, int64_t n, int64_t k,
                      double e, double scale) {
  SmoothRef r;
  r.dlogits.resize(z.size());
  for (int64_t b = 0; b < n; ++b) {
    const double* row = z.data() + b * k;
    double mx = row[0], sum = 0;
    for (int64_t j = 1; j < k; ++j) mx = std::max(mx, row[j]);
    for (int64_t j = 0; j < k; ++j) sum += std::exp(row[j] - mx);
    for (int64_t j = 0; j < k; ++j) {
      const double logp = row[j] - mx - std::log(sum);
      const double target = (j == y[b] ? 1 - e : 0.0) + e / static_cast<double>(k);
      r.loss -= target * logp / static_cast<double>(n);
      r.dlogits[static_cast<size_t>(b * k + j)] =
          (std::exp(logp) - target) * scale / static_cast<double>(n);
    }
  }
  return r;
}

// By hand: logits (ln 3, 0), label 0, e = 0.2, K = 2: p = (0.75, 0.25), target (0.9, 0.1),
// loss = -(0.9 ln 0.75 + 0.1 ln 0.25) = 0.3975433, gradient p - target = (-0.15, 0.15).
// The reference first (so that it is the formula above), then the kernel: 1e-6 (a few ulp).
TEST(CpuOpSoftmaxCeSmoothing, MatchesAHandComputation) {
  const std::vector<float> z = {std::log(3.0f), 0.0f};
  const SmoothRef r = smoothed_ce(ref::to_double(z), {0}, 1, 2, 0.2, 1.0);
  EXPECT_NEAR(r.loss, -(0.9 * std::log(0.75) + 0.1 * std::log(0.25)), 1e-7);
  EXPECT_NEAR(r.dlogits[0], -0.15, 1e-7);
  CeProgram p(1, 2, true, 0.2f);
  p.run(z, {0}, 1.0f);
  EXPECT_NEAR(p.h.read(p.loss)[0], 0.3975433, 1e-6);
  EXPECT_NEAR(p.h.read(p.dz)[0], -0.15, 1e-6);
  EXPECT_NEAR(p.h.read(p.dz)[1], 0.15, 1e-6);
}

// Fixed logits (several shapes, large and scaled cases) against the float64 reference, for
// e in {0.05, 0.1, 0.3}: the loss to 1e-6 relative (double sums rounded once), dlogits to
// kFp32Tol of the magnitude of its terms (p + target) * scale / N, as the plain case above.
// The counts do not depend on e. e = 0 gives the unsmoothed kernel's bits.
TEST(CpuOpSoftmaxCeSmoothing, LossAndGradientMatchTorchsFormula) {
  for (const CeCase& c : kCases) {
    for (float e : {0.05f, 0.1f, 0.3f}) {
      SCOPED_TRACE(::testing::Message() << c.name << " e " << e);
      CeProgram p(c.n, c.k, true, e);
      const auto zv = rand_vec(c.n * c.k, 121, c.offset - c.spread, c.offset + c.spread);
      const auto lv = rand_labels(c.n, c.k, 122);
      p.run(zv, lv, c.scale);
      const SmoothRef r =
          smoothed_ce(ref::to_double(zv), lv, c.n, c.k, static_cast<double>(e), c.scale);
      KILN_EXPECT_REL(p.h.read(p.loss), ref::Vec{r.loss}, 1e-6, 1e-6, "smoothed loss");
      ref::Vec mag(r.dlogits.size());
      for (size_t i = 0; i < mag.size(); ++i) {
        const double target =
            (static_cast<int64_t>(i) % c.k == lv[i / static_cast<size_t>(c.k)] ? 1.0 - e : 0.0) +
            e / static_cast<double>(c.k);
        mag[i] = (std::fabs(r.dlogits[i] / c.scale * c.n) + 2 * target) * c.scale / c.n;
      }
      KILN_EXPECT_SCALED(p.h.read(p.dz), r.dlogits, mag, kFp32Tol, "smoothed dlogits");
      const ref::SoftmaxCe plain = ref::softmax_ce(ref::to_double(zv), lv, c.n, c.k, c.scale);
      const auto counts = p.h.read_i32(p.correct);
      EXPECT_EQ(counts[0], plain.top1);
      EXPECT_EQ(counts[1], plain.top5);
    }
    CeProgram off(c.n, c.k, true, 0.0f), plain(c.n, c.k);
    const auto zv = rand_vec(c.n * c.k, 121, c.offset - c.spread, c.offset + c.spread);
    const auto lv = rand_labels(c.n, c.k, 122);
    off.run(zv, lv, c.scale);
    plain.run(zv, lv, c.scale);
    EXPECT_EQ(off.h.read(off.loss), plain.h.read(plain.loss));
    EXPECT_EQ(off.h.read(off.dz), plain.h.read(plain.dz));
  }
}

// Outside [0, 1) the kernel refuses the node (the trainer names the flag first).
TEST(CpuOpSoftmaxCeSmoothing, OutOfRangeIsRefused) {
  for (float e : {-0.1f, 1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_THROW(CeProgram(2, 3, true, e), Error) << e;
  }
}

// ---- mixed targets (mixup / cutmix) ------------------------------------------------------------

// By hand: two rows of K = 2, logits (ln 3, 0) and (0, 0), labels (0, 1), lambda 0.25: row 0's
// partner is row 1 (label 1), row 1's is row 0 (label 0). Row 0: p = (0.75, 0.25), target
// (0.25, 0.75), loss -(0.25 ln 0.75 + 0.75 ln 0.25); row 1: p = (0.5, 0.5), target
// (0.75, 0.25), loss ln 2. The loss is the mean of the two; dlogits (p - target) / 2. Top-1
// against the dominant label (lambda < 0.5: the partner's): row 0's is 1 (a miss), row 1's is
// 0 (a tie with class 1, broken by index: a hit).
TEST(CpuOpSoftmaxCeMixed, MatchesAHandComputation) {
  const std::vector<float> z = {std::log(3.0f), 0.0f, 0.0f, 0.0f};
  const ref::SoftmaxCe r = ref::softmax_ce_mixed(ref::to_double(z), {0, 1}, 2, 2, 1.0, 0.25, 0.0);
  const double want = (-(0.25 * std::log(0.75) + 0.75 * std::log(0.25)) + std::log(2.0)) / 2;
  EXPECT_NEAR(r.loss, want, 1e-7);
  CeProgram p(2, 2, true, 0.0f, true);
  p.run_mixed(z, {0, 1}, 1.0f, 0.25f);
  EXPECT_NEAR(p.h.read(p.loss)[0], want, 1e-6);
  const auto d = p.h.read(p.dz);
  EXPECT_NEAR(d[0], (0.75 - 0.25) / 2, 1e-6);
  EXPECT_NEAR(d[1], (0.25 - 0.75) / 2, 1e-6);
  EXPECT_NEAR(d[2], (0.5 - 0.75) / 2, 1e-6);
  EXPECT_NEAR(d[3], (0.5 - 0.25) / 2, 1e-6);
  const auto counts = p.h.read_i32(p.correct);
  EXPECT_EQ(counts[0], 1);
  EXPECT_EQ(r.top1, 1);
}

// Fixed logits (the plain cases' shapes) against torch's CrossEntropyLoss(label_smoothing=e) on
// the mixed one-hot target (ref::softmax_ce_mixed), lambda in {0.1, 0.5, 0.7}, e in {0, 0.1}:
// the loss to 1e-6 relative (double sums rounded once), dlogits to kFp32Tol of its terms'
// magnitude (p + target) * scale / N, the counts exactly.
TEST(CpuOpSoftmaxCeMixed, LossAndGradientMatchTorchsFormula) {
  for (const CeCase& c : kCases) {
    for (float lambda : {0.1f, 0.5f, 0.7f}) {
      for (float e : {0.0f, 0.1f}) {
        SCOPED_TRACE(::testing::Message() << c.name << " lambda " << lambda << " e " << e);
        CeProgram p(c.n, c.k, true, e, true);
        const auto zv = rand_vec(c.n * c.k, 123, c.offset - c.spread, c.offset + c.spread);
        const auto lv = rand_labels(c.n, c.k, 124);
        p.run_mixed(zv, lv, c.scale, lambda);
        const ref::SoftmaxCe r =
            ref::softmax_ce_mixed(ref::to_double(zv), lv, c.n, c.k, c.scale, lambda, e);
        KILN_EXPECT_REL(p.h.read(p.loss), ref::Vec{r.loss}, 1e-6, 1e-6, "mixed loss");
        ref::Vec mag(r.dlogits.size());
        for (size_t i = 0; i < mag.size(); ++i) {
          const int64_t b = static_cast<int64_t>(i) / c.k, j = static_cast<int64_t>(i) % c.k;
          const double w = (j == lv[static_cast<size_t>(b)] ? lambda : 0.0) +
                           (j == lv[static_cast<size_t>((b + c.n - 1) % c.n)] ? 1.0 - lambda : 0.0);
          const double target = (1.0 - e) * w + e / static_cast<double>(c.k);
          mag[i] = (std::fabs(r.dlogits[i] / c.scale * c.n) + 2 * target) * c.scale / c.n;
        }
        KILN_EXPECT_SCALED(p.h.read(p.dz), r.dlogits, mag, kFp32Tol, "mixed dlogits");
        const auto counts = p.h.read_i32(p.correct);
        EXPECT_EQ(counts[0], r.top1);
        EXPECT_EQ(counts[1], r.top5);
      }
    }
  }
}

// The mixed loss is lambda CE_e(y_a) + (1 - lambda) CE_e(y_b): the reference's two forms agree
// (1e-12: double sums of ~1), so its target form is the formula the issue states.
TEST(CpuOpSoftmaxCeMixed, ReferenceIsTheLambdaWeightedSumOfTwoLosses) {
  const int64_t n = 6, k = 9;
  const ref::Vec z = ref::to_double(rand_vec(n * k, 125, -3.0f, 3.0f));
  const auto lv = rand_labels(n, k, 126);
  std::vector<int32_t> rolled(lv.size());
  for (int64_t b = 0; b < n; ++b)
    rolled[static_cast<size_t>(b)] = lv[static_cast<size_t>((b + n - 1) % n)];
  for (double e : {0.0, 0.2}) {
    const double lambda = 0.35;
    const double mixed = ref::softmax_ce_mixed(z, lv, n, k, 1.0, lambda, e).loss;
    auto ce = [&](const std::vector<int32_t>& y) {
      return ref::softmax_ce_mixed(z, y, n, k, 1.0, 1.0, e).loss;
    };
    EXPECT_NEAR(mixed, lambda * ce(lv) + (1 - lambda) * ce(rolled), 1e-12);
  }
}

// An unmixed step (kind 0) and lambda 1 give the plain kernel's bits; the mix input changes
// nothing else.
TEST(CpuOpSoftmaxCeMixed, UnmixedStepIsThePlainLossBitForBit) {
  const int64_t n = 7, k = 11;
  const auto zv = rand_vec(n * k, 127, -4.0f, 4.0f);
  const auto lv = rand_labels(n, k, 128);
  for (float e : {0.0f, 0.1f}) {
    CeProgram plain(n, k, true, e), mixed(n, k, true, e, true);
    plain.run(zv, lv, 512.0f);
    for (int kind : {0, 1}) {
      mixed.run_mixed(zv, lv, 512.0f, kind == 0 ? 0.3f : 1.0f, kind);
      SCOPED_TRACE(::testing::Message() << "kind " << kind << " e " << e);
      EXPECT_EQ(mixed.h.read(mixed.loss), plain.h.read(plain.loss));
      EXPECT_EQ(mixed.h.read(mixed.dz), plain.h.read(plain.dz));
      EXPECT_EQ(mixed.h.read_i32(mixed.correct), plain.h.read_i32(plain.correct));
    }
  }
}

// Kernel: its mixed dlogits / scale against central differences of its own FP32 loss (the
// bounds of KernelGradientMatchesFiniteDifferencesOfKernelLoss above), with smoothing 0.1.
TEST(CpuOpSoftmaxCeMixed, KernelGradientMatchesFiniteDifferencesOfKernelLoss) {
  const int64_t n = 3, k = 5;
  const float scale = 2048.0f, lambda = 0.3f;
  CeProgram p(n, k, true, 0.1f, true);
  auto z = rand_vec(n * k, 129, -2.0f, 2.0f);
  const auto lv = rand_labels(n, k, 130);
  p.run_mixed(z, lv, scale, lambda);
  ref::Vec g = ref::to_double(p.h.read(p.dz));
  for (double& v : g) v /= scale;
  ref::Vec fd(z.size());
  const float h = 1e-2f;
  for (size_t i = 0; i < z.size(); ++i) {
    const float z0 = z[i];
    z[i] = z0 + h;
    p.run_mixed(z, lv, scale, lambda);
    const double lp = p.h.read(p.loss)[0];
    z[i] = z0 - h;
    p.run_mixed(z, lv, scale, lambda);
    const double lm = p.h.read(p.loss)[0];
    z[i] = z0;
    fd[i] = (lp - lm) / (static_cast<double>(z0 + h) - static_cast<double>(z0 - h));
  }
  KILN_EXPECT_REL(g, fd, 1.0, 2e-4, "kernel mixed dlogits vs fd");
}

// A lambda outside [0, 1] is refused (the host never writes one; a corrupt step must not train).
TEST(CpuOpSoftmaxCeMixed, LambdaOutsideZeroOneIsRefused) {
  CeProgram p(2, 3, true, 0.0f, true);
  EXPECT_THROW(p.run_mixed(rand_vec(6, 131), {0, 1}, 1.0f, 1.5f), Error);
}

}  // namespace
}  // namespace kiln::test
