// Region kernels on CUDA against the CPU ones, on the same inputs: bit for bit (casts,
// fills, copies, the check and clamp, the loss-scale update, SGD, EMA), or within 1 ulp
// where the GPU's double-precision pow / summation order may move the last bit (AdamW's bias
// corrections, LARS's trust ratio).
#include <gtest/gtest.h>

#include <limits>

#include "gpu/gpu_test_util.h"
#include "support/compute_copy_check.h"

namespace kiln::test {
namespace {

// Region kernels never run on f16 features; the pair is built without AMP unless a test
// needs f16 parameter regions.
constexpr int64_t kLen = 100003;  // odd: exercises every tail

TEST(GpuRegion, FillCopyCast) {
  KILN_REQUIRE_GPU();
  Pair t(/*amp=*/true);
  const TensorId w32 = t.add("w32", {kLen}, Kind::F32, Region::params_f32);
  const TensorId w16 = t.add("w16", {kLen}, Kind::Weight);  // f16 on the GPU
  const TensorId g16 = t.add("g16", {kLen}, Kind::WeightGrad);
  const TensorId g32 = t.add("g32", {kLen}, Kind::F32, Region::grads_f32);
  const TensorId m = t.add("m", {kLen}, Kind::F32, Region::moment1);
  const TensorId fill = t.add("fill", {kLen}, Kind::F32, Region::moment2);
  const TensorId ifill = t.add("ifill", {3}, Kind::I32, Region::scalars);
  t.node(OpKind::copy, {w32}, {m});
  Attrs f;
  f.value = -2.75f;
  t.node(OpKind::fill, {}, {fill}, f);
  t.node(OpKind::fill, {}, {ifill}, f);
  t.compile();
  // The CPU cannot run f16 casts into an f32-typed twin, so compare the GPU's casts with
  // kiln's host conversions (bit-exact with __float2half_rn by design).
  auto v = rand_floats(kLen, 61, -70000.0f, 70000.0f);  // includes values that overflow f16
  v[0] = 1e-8f;                                         // an f16 subnormal
  v[1] = std::numeric_limits<float>::quiet_NaN();
  t.set(w32, v);
  t.run();
  EXPECT_EQ(max_ulp(t.gpu().read(m), t.cpu().read(m)), 0) << "copy";
  EXPECT_EQ(t.gpu().read(fill), t.cpu().read(fill)) << "fill f32";
  EXPECT_EQ(t.gpu().read_i32(ifill), t.cpu().read_i32(ifill)) << "fill i32";

  // cast f32 -> f16 -> f32 on the GPU alone, against kiln's host conversions.
  OpHarness h(/*amp=*/true);
  const TensorId a = h.tensor("a", {kLen}, Region::params_f32, DType::F32);
  const TensorId b = h.tensor("b", {kLen}, Region::params_f16, DType::F16);
  const TensorId c = h.tensor("c", {kLen}, Region::grads_f32, DType::F32);
  h.node(OpKind::cast, {a}, {b});
  h.node(OpKind::cast, {b}, {c});
  // an odd-length range: the scalar (not 4-wide) path
  const TensorId a2 = h.tensor("a2", {kLen - 1}, Region::moment1, DType::F32);
  const TensorId b2 = h.tensor("b2", {kLen - 1}, Region::ema_f16, DType::F16);
  h.node(OpKind::cast, {a2}, {b2});
  h.compile(make_backend("cuda"));
  h.write(a, v);
  std::vector<float> v2(v.begin() + 1, v.end());
  h.write(a2, v2);
  h.run();
  std::vector<uint16_t> half(kLen), half2(kLen - 1);
  h.backend().read(h.program().tensor(b), half.data());
  h.backend().read(h.program().tensor(b2), half2.data());
  const auto back = h.read(c);
  int64_t bad = 0, bad_back = 0;
  for (int64_t i = 0; i < kLen; ++i) {
    const uint16_t want = float_to_half(v[static_cast<size_t>(i)]);
    const bool nan = std::isnan(v[static_cast<size_t>(i)]);
    bad += nan ? !((half[static_cast<size_t>(i)] & 0x7c00) == 0x7c00 &&
                   (half[static_cast<size_t>(i)] & 0x3ff))
               : half[static_cast<size_t>(i)] != want;
    if (i > 0) bad += half2[static_cast<size_t>(i - 1)] != want && !nan;
    bad_back += !nan && bits_of(back[static_cast<size_t>(i)]) != bits_of(half_to_float(want));
  }
  EXPECT_EQ(bad, 0) << "f32 -> f16 casts that differ from float_to_half";
  EXPECT_EQ(bad_back, 0) << "f16 -> f32 casts that differ from half_to_float";
}

TEST(GpuRegion, CheckClipAndLossScale) {
  KILN_REQUIRE_GPU();
  for (float clip : {0.0f, 0.5f}) {
    for (bool inject : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "clip " << clip << (inject ? " with Inf" : ""));
      Pair t(false);
      const TensorId g = t.add("g", {kLen}, Kind::F32, Region::grads_f32);
      const TensorId scale = t.add("loss_scale", {1}, Kind::F32, Region::scalars);
      const TensorId ov = t.add("overflow", {1}, Kind::I32, Region::scalars);
      const TensorId good = t.add("good_steps", {1}, Kind::I32, Region::scalars);
      Attrs a;
      a.clip = clip;
      t.node(OpKind::check_clip, {g, scale}, {ov, g}, a);
      Attrs s;
      s.growth_interval = 3;
      t.node(OpKind::loss_scale_update, {ov, scale, good}, {scale, good}, s);
      t.compile();
      auto v = rand_floats(kLen, 71, -8192.0f, 8192.0f);
      if (inject) v[kLen / 2] = std::numeric_limits<float>::infinity();
      t.set(g, v);
      t.set(scale, {1024.0f});
      t.set_i32(good, {2});
      t.run();
      EXPECT_EQ(t.gpu().read_i32(ov), t.cpu().read_i32(ov));
      EXPECT_EQ(t.gpu().read_i32(ov)[0], inject ? 1 : 0);
      EXPECT_EQ(max_ulp(t.gpu().read(g), t.cpu().read(g)), 0) << "clamped gradients";
      EXPECT_EQ(t.gpu().read(scale), t.cpu().read(scale));
      EXPECT_EQ(t.gpu().read(scale)[0],
                inject ? 512.0f : 2048.0f);  // halved, or grown after 3 clean steps
      EXPECT_EQ(t.gpu().read_i32(good), t.cpu().read_i32(good));
    }
  }
}

// grad_norm's factor (double sums in another order: the FP32 factor within 1 ulp), the SGD
// step that takes it, and step_count over applied and skipped steps, as on the CPU.
TEST(GpuRegion, GradNormAndStepCount) {
  KILN_REQUIRE_GPU();
  Pair t(false);
  const TensorId w = t.add("w", {kLen}, Kind::F32, Region::params_f32);
  const TensorId g = t.add("g", {kLen}, Kind::F32, Region::grads_f32);
  const TensorId lr = t.add("lr", {1}, Kind::F32, Region::scalars);
  const TensorId scale = t.add("loss_scale", {1}, Kind::F32, Region::scalars);
  const TensorId ov = t.add("overflow", {1}, Kind::I32, Region::scalars);
  const TensorId coef = t.add("clip_coef", {1}, Kind::F32, Region::scalars);
  const TensorId count = t.add("optimizer_steps", {1}, Kind::I32, Region::scalars);
  Attrs c;
  c.max_norm = 1.0f;
  t.node(OpKind::grad_norm, {g, scale}, {coef}, c);
  Attrs a;
  t.node(OpKind::sgd, {w, g, kNoTensor, lr, scale, ov, coef}, {w, kNoTensor}, a);
  t.node(OpKind::step_count, {ov, count}, {count});
  t.compile();
  t.set_random(w, 83);
  t.set(lr, {0.05f});
  t.set(scale, {256.0f});
  t.set_i32(count, {0});
  const bool skipped[] = {false, true, false};
  for (int it = 0; it < 3; ++it) {
    t.set_random(g, 95 + static_cast<uint64_t>(it), -256.0f, 256.0f);
    t.set_i32(ov, {skipped[it] ? 1 : 0});
    t.run();
    EXPECT_LE(max_ulp(t.gpu().read(coef), t.cpu().read(coef)), 1) << "clip factor, step " << it;
  }
  EXPECT_LT(t.cpu().read(coef)[0], 1.0f) << "the cap is below the norm: the factor clips";
  EXPECT_LE(max_ulp(t.gpu().read(w), t.cpu().read(w)), 2) << "weights";
  EXPECT_EQ(t.gpu().read_i32(count), (std::vector<int32_t>{2}));
  EXPECT_EQ(t.cpu().read_i32(count), (std::vector<int32_t>{2}));
}

// The optimizers' FP16 / BF16 compute copy written by the update (KILN_FUSE_WEIGHT_CAST): the
// cast op's bits of the new weights, the weights unchanged by it (as on the CPU, op tests).
TEST(GpuRegion, OptimizersWriteTheCastOfTheirNewWeights) {
  KILN_REQUIRE_GPU();
  expect_optimizers_write_compute_copy("cuda");
}

struct OptCase {
  const char* name;
  OpKind op;
  float momentum, wd;
  bool nesterov;
  int64_t max_ulp;
};

class GpuOptimizer : public ::testing::TestWithParam<OptCase> {};

TEST_P(GpuOptimizer, MatchesCpuOverSteps) {
  KILN_REQUIRE_GPU();
  const OptCase& c = GetParam();
  Pair t(false);
  const TensorId w = t.add("w", {kLen}, Kind::F32, Region::params_f32);
  const TensorId g = t.add("g", {kLen}, Kind::F32, Region::grads_f32);
  const TensorId m = t.add("m", {kLen}, Kind::F32, Region::moment1);
  const TensorId v = t.add("v", {kLen}, Kind::F32, Region::moment2);
  const TensorId e = t.add("ema", {kLen}, Kind::F32, Region::ema_f32);
  const TensorId lr = t.add("lr", {1}, Kind::F32, Region::scalars);
  const TensorId scale = t.add("loss_scale", {1}, Kind::F32, Region::scalars);
  const TensorId ov = t.add("overflow", {1}, Kind::I32, Region::scalars);
  const TensorId step = t.add("step", {1}, Kind::I32, Region::scalars);
  Attrs a;
  a.momentum = c.momentum;
  a.weight_decay = c.wd;
  a.nesterov = c.nesterov;
  a.ema_decay = 0.99f;
  if (c.op == OpKind::adamw) {
    t.node(c.op, {w, g, m, v, lr, scale, ov, step}, {w, m, v}, a);
  } else {
    t.node(c.op, {w, g, m, lr, scale, ov}, {w, m}, a);
  }
  t.node(OpKind::ema, {w, ov}, {e}, a);
  t.compile();
  t.set_random(w, 81);
  t.set_random(e, 82);
  t.set(lr, {0.05f});
  t.set(scale, {256.0f});
  for (int it = 0; it < 3; ++it) {
    t.set_random(g, 90 + static_cast<uint64_t>(it), -256.0f, 256.0f);
    t.set_i32(step, {it});
    t.run();
  }
  EXPECT_LE(max_ulp(t.gpu().read(w), t.cpu().read(w)), c.max_ulp) << c.name << " weights";
  EXPECT_LE(max_ulp(t.gpu().read(m), t.cpu().read(m)), c.max_ulp) << c.name << " first moment";
  if (c.op == OpKind::adamw)
    EXPECT_LE(max_ulp(t.gpu().read(v), t.cpu().read(v)), c.max_ulp) << "second moment";
  EXPECT_LE(max_ulp(t.gpu().read(e), t.cpu().read(e)), c.max_ulp) << "ema";
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuOptimizer,
    ::testing::Values(OptCase{"sgd", OpKind::sgd, 0.9f, 1e-4f, false, 0},
                      OptCase{"sgd_nesterov", OpKind::sgd, 0.9f, 5e-4f, true, 0},
                      OptCase{"sgd_plain", OpKind::sgd, 0.0f, 0.0f, false, 0},
                      OptCase{"adamw", OpKind::adamw, 0.0f, 0.01f, false, 1},
                      OptCase{"lars", OpKind::lars, 0.9f, 1e-4f, false, 1}),
    [](const ::testing::TestParamInfo<OptCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace kiln::test
