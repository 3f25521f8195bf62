// Mixup / cutmix draws (kiln/data/mixup.h): the Beta sampler, torchvision's box rule and its
// lambda, the choice between the two, reproducibility from (seed, epoch, step), and the
// refusal of bad options.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/mixup.h"

namespace kiln {
namespace {

// Beta(a, a) has mean 1/2 and variance 1 / (4 (2a + 1)); Beta(2, 5) mean 2/7. 20000 draws:
// the mean's standard error is <= 0.0036 and the variance's ~1.5% of it, so 0.015 and 10% are
// over 4 standard errors.
TEST(DataMixup, BetaHasItsMeanAndVariance) {
  struct Shape {
    double a, b;
  };
  for (const Shape s : {Shape{0.2, 0.2}, Shape{1.0, 1.0}, Shape{0.4, 0.4}, Shape{2.0, 5.0}}) {
    SCOPED_TRACE(::testing::Message() << "Beta(" << s.a << ", " << s.b << ")");
    Rng rng(7);
    const int n = 20000;
    double sum = 0, sq = 0;
    for (int i = 0; i < n; ++i) {
      const double x = rng.beta(s.a, s.b);
      ASSERT_TRUE(x >= 0 && x <= 1) << x;
      sum += x;
      sq += x * x;
    }
    const double mean = sum / n, var = sq / n - mean * mean;
    const double want_mean = s.a / (s.a + s.b);
    const double want_var = s.a * s.b / ((s.a + s.b) * (s.a + s.b) * (s.a + s.b + 1));
    EXPECT_NEAR(mean, want_mean, 0.015);
    EXPECT_NEAR(var, want_var, 0.1 * want_var);
  }
}

// Off (both alphas 0, the default): every step is unmixed, lambda 1.
TEST(DataMixup, OffDrawsNothing) {
  const MixOptions o;
  EXPECT_FALSE(o.enabled());
  for (int64_t step = 0; step < 10; ++step) {
    const MixDraw d = draw_mix(o, 3, 0, step, 28, 28);
    EXPECT_EQ(d.kind, MixKind::none);
    EXPECT_EQ(d.lambda, 1.0);
  }
}

// torchvision's RandomCutmix box: centre (r_x, r_y) uniform over the pixels, half sizes
// int(0.5 sqrt(1 - lambda) W) and of H, clipped at the borders; lambda is then 1 - the box's
// area over the image's. Every box drawn must be that rule's for some centre: inside the image,
// its kept fraction exactly the reported lambda, and never wider than the unclipped rule.
TEST(DataMixup, CutmixBoxIsClippedAndLambdaIsItsArea) {
  MixOptions o;
  o.cutmix_alpha = 1.0;
  const int64_t h = 28, w = 20;
  bool clipped = false, interior = false;
  for (int64_t step = 0; step < 500; ++step) {
    const MixDraw d = draw_mix(o, 11, 2, step, h, w);
    ASSERT_EQ(d.kind, MixKind::cutmix);
    ASSERT_TRUE(d.y0 >= 0 && d.y0 <= d.y1 && d.y1 <= h && d.x0 >= 0 && d.x0 <= d.x1 && d.x1 <= w);
    const double area = static_cast<double>((d.y1 - d.y0) * (d.x1 - d.x0));
    EXPECT_DOUBLE_EQ(d.lambda, 1.0 - area / static_cast<double>(h * w));
    clipped = clipped || d.y0 == 0 || d.x0 == 0 || d.y1 == h || d.x1 == w;
    interior = interior || (d.y0 > 0 && d.x0 > 0 && d.y1 < h && d.x1 < w && area > 0);
    // An unclipped box is 2 int(r H) by 2 int(r W): even sides.
    if (d.y0 > 0 && d.y1 < h) EXPECT_EQ((d.y1 - d.y0) % 2, 0);
    if (d.x0 > 0 && d.x1 < w) EXPECT_EQ((d.x1 - d.x0) % 2, 0);
  }
  EXPECT_TRUE(clipped) << "500 boxes and none touches a border";
  EXPECT_TRUE(interior) << "500 boxes and none lies inside";
}

// The rule by hand for one draw: replay the stream (prob 1 and one method draw no switch) and
// compute torchvision's box from it.
TEST(DataMixup, CutmixFollowsTorchvisionsRule) {
  MixOptions o;
  o.cutmix_alpha = 1.0;
  const uint64_t seed = 5;
  const int64_t h = 32, w = 24;
  for (int64_t step = 0; step < 20; ++step) {
    Rng rng = Rng::derive(seed + kMixSeedTag, 1, static_cast<uint64_t>(step));
    const double lambda = rng.beta(1.0, 1.0);
    const auto rx = static_cast<int64_t>(rng.below(w)), ry = static_cast<int64_t>(rng.below(h));
    const double r = 0.5 * std::sqrt(1.0 - lambda);
    const auto hw = static_cast<int64_t>(r * w), hh = static_cast<int64_t>(r * h);
    const MixDraw d = draw_mix(o, seed, 1, step, h, w);
    EXPECT_EQ(d.x0, std::max<int64_t>(rx - hw, 0));
    EXPECT_EQ(d.x1, std::min<int64_t>(rx + hw, w));
    EXPECT_EQ(d.y0, std::max<int64_t>(ry - hh, 0));
    EXPECT_EQ(d.y1, std::min<int64_t>(ry + hh, h));
  }
}

// Both on: cutmix with switch_prob (0.5 as torchvision's RandomChoice, 0.8 here), mixup
// otherwise; prob 0.6: 40% of the steps unmixed. 4000 steps: 3 standard errors < 0.025.
TEST(DataMixup, SwitchAndMixProbabilities) {
  MixOptions o;
  o.mixup_alpha = 0.2;
  o.cutmix_alpha = 1.0;
  o.prob = 0.6;
  o.switch_prob = 0.8;
  int none = 0, mixup = 0, cutmix = 0;
  const int n = 4000;
  for (int64_t step = 0; step < n; ++step) {
    const MixDraw d = draw_mix(o, 1, 0, step, 8, 8);
    none += d.kind == MixKind::none;
    mixup += d.kind == MixKind::mixup;
    cutmix += d.kind == MixKind::cutmix;
    if (d.kind == MixKind::mixup) EXPECT_TRUE(d.lambda >= 0 && d.lambda <= 1);
    if (d.kind == MixKind::none) EXPECT_EQ(d.lambda, 1.0);
  }
  EXPECT_NEAR(none / static_cast<double>(n), 0.4, 0.025);
  EXPECT_NEAR(cutmix / static_cast<double>(cutmix + mixup), 0.8, 0.025);
}

// The same (seed, epoch, step) gives the same draw in any order of calls (no hidden state: the
// loader's workers, ranks and a resumed run all see the same sequence); another seed, epoch or
// step gives another.
TEST(DataMixup, DrawsArePureFunctionsOfSeedEpochStep) {
  MixOptions o;
  o.mixup_alpha = 0.4;
  o.cutmix_alpha = 1.0;
  std::vector<double> forward;
  for (int64_t step = 0; step < 50; ++step)
    forward.push_back(draw_mix(o, 9, 3, step, 16, 16).lambda);
  for (int64_t step = 49; step >= 0; --step) {
    EXPECT_EQ(draw_mix(o, 9, 3, step, 16, 16).lambda, forward[static_cast<size_t>(step)]);
  }
  // Mixup's lambdas are continuous (cutmix's are box areas, which repeat by design).
  MixOptions m;
  m.mixup_alpha = 0.4;
  std::set<double> seed9;
  for (int64_t step = 0; step < 50; ++step) seed9.insert(draw_mix(m, 9, 3, step, 16, 16).lambda);
  int same = 0;
  for (int64_t step = 0; step < 50; ++step)
    same += seed9.count(draw_mix(m, 10, 3, step, 16, 16).lambda);
  EXPECT_EQ(same, 0) << "seed 10 repeats seed 9's lambdas";
  EXPECT_NE(draw_mix(m, 9, 4, 0, 16, 16).lambda, draw_mix(m, 9, 3, 0, 16, 16).lambda);
}

TEST(DataMixup, ParamsCarryTheDraw) {
  MixDraw d;
  d.kind = MixKind::cutmix;
  d.lambda = 0.75;
  d.y0 = 1, d.y1 = 5, d.x0 = 2, d.x1 = 6;
  const auto p = mix_params(d);
  EXPECT_EQ(p[kMixKind], 2.0f);
  EXPECT_EQ(p[kMixLambda], 0.75f);
  EXPECT_EQ(p[kMixRest], 0.25f);
  EXPECT_EQ(p[kMixY0], 1.0f);
  EXPECT_EQ(p[kMixY1], 5.0f);
  EXPECT_EQ(p[kMixX0], 2.0f);
  EXPECT_EQ(p[kMixX1], 6.0f);
}

TEST(DataMixup, BadOptionsAreRefusedNamingTheFlag) {
  struct Bad {
    MixOptions o;
    const char* flag;
  };
  MixOptions neg_mix, neg_cut, prob_hi, prob_lo, switch_hi, nan_alpha;
  neg_mix.mixup_alpha = -0.1;
  neg_cut.cutmix_alpha = -1;
  prob_hi.prob = 1.5;
  prob_lo.prob = -0.1;
  switch_hi.switch_prob = 2;
  nan_alpha.mixup_alpha = std::nan("");
  for (const Bad& b : {Bad{neg_mix, "--mixup-alpha"}, Bad{neg_cut, "--cutmix-alpha"},
                       Bad{prob_hi, "--mixup-prob"}, Bad{prob_lo, "--mixup-prob"},
                       Bad{switch_hi, "--mixup-switch-prob"}, Bad{nan_alpha, "--mixup-alpha"}}) {
    try {
      check_mix_options(b.o);
      ADD_FAILURE() << b.flag << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(b.flag), std::string::npos) << e.what();
    }
  }
  MixOptions ok;
  ok.mixup_alpha = 0.2;
  ok.cutmix_alpha = 1.0;
  ok.prob = 0;
  ok.switch_prob = 1;
  EXPECT_NO_THROW(check_mix_options(ok));
}

}  // namespace
}  // namespace kiln
