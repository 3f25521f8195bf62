// CUDA layer ops against the CPU backend or the float64 reference where the sweep
// (tests/sweep/op_sweep_test.cpp, which runs every op on both backends) does not reach:
// convolutions on Winograd / FFT engines and on zero-padded channels, softmax cross-entropy with
// label smoothing and non-finite logits. FP32 (TF32 off) within 1e-5, FP16 features under AMP
// within 1e-2 (gpu_test_util.h explains the error measure); top-k hits exactly.
#include <gtest/gtest.h>

#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include "backend/channel_pad_rule.h"
#include "backend/cuda/cuda_backend.h"
#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "support/reference.h"

namespace kiln::test {
namespace {

class GpuLayer : public ::testing::TestWithParam<bool> {};  // param: AMP

// FP32 convolution plans on Winograd / FFT engines in the GPU side's last compile.
int transformed_plans(Pair& t) {
  auto* api = dynamic_cast<CudaBackendApi*>(&t.gpu().backend());
  return api ? api->fp32_transformed_plans() : 0;
}

struct ConvCase {
  int64_t n, h, w, c, k, r, s, st, pad;
  bool bias;
};

// fp32_tol > 0 (FP32 only): check against the float64 reference at that tolerance instead of
// against the CPU, printing the errors. Returns how many of the three convolution plans took
// Winograd / FFT engines; `report`, where given, receives the GPU's compile report.
int check_conv(const ConvCase& c, bool amp, double fp32_tol = 0,
               const Switches& switches = Switches::from_environment(),
               CompileReport* report = nullptr) {
  const int64_t p = (c.h + 2 * c.pad - c.r) / c.st + 1, q = (c.w + 2 * c.pad - c.s) / c.st + 1;
  Pair t(amp, switches);
  const TensorId x = t.add("x", {c.n, c.h, c.w, c.c}, Kind::Feature);
  const TensorId w = t.add("w", {c.k, c.r, c.s, c.c}, Kind::Weight);
  const TensorId b = c.bias ? t.add("b", {c.k}, Kind::F32, Region::params_f32) : kNoTensor;
  const TensorId y = t.add("y", {c.n, p, q, c.k}, Kind::Feature);
  const TensorId dy = t.add("dy", {c.n, p, q, c.k}, Kind::Feature);
  const TensorId dx = t.add("dx", {c.n, c.h, c.w, c.c}, Kind::Feature);
  const TensorId dw = t.add("dw", {c.k, c.r, c.s, c.c}, Kind::WeightGrad);
  const TensorId db = c.bias ? t.add("db", {c.k}, Kind::F32, Region::grads_f32) : kNoTensor;
  Attrs a;
  a.kh = static_cast<int>(c.r);
  a.kw = static_cast<int>(c.s);
  a.sh = a.sw = static_cast<int>(c.st);
  a.ph = a.pw = static_cast<int>(c.pad);
  t.node(OpKind::conv_fwd, c.bias ? std::vector<TensorId>{x, w, b} : std::vector<TensorId>{x, w},
         {y}, a);
  t.node(OpKind::conv_bwd_data, {dy, w}, {dx}, a);
  t.node(OpKind::conv_bwd_weight, {x, dy},
         c.bias ? std::vector<TensorId>{dw, db} : std::vector<TensorId>{dw}, a);
  t.compile();
  if (report) *report = t.gpu().backend().compile_report();
  const std::vector<float> xv = t.set_random(x, 1), wv = t.set_random(w, 2),
                           dyv = t.set_random(dy, 3);
  const std::vector<float> bv = c.bias ? t.set_random(b, 4) : std::vector<float>{};
  t.run();
  if (!amp && fp32_tol > 0) {
    // Against the float64 reference, each element's error scaled by the sum of |terms| it
    // adds (ref::max_scaled_error): the measure FP32 rounding is bounded by, whatever order an
    // engine sums in. GPU against CPU relative to max |want| measures the two engines'
    // rounding together, and at 6,272 products per weight gradient element two direct FP32
    // engines already differed by 1.09e-5 there (H200, 5f30cc3).
    ref::ConvShape s;
    s.n = c.n, s.h = c.h, s.w = c.w, s.c = c.c, s.k = c.k, s.r = c.r, s.s = c.s;
    s.sh = s.sw = c.st, s.ph = s.pw = c.pad;
    const ref::Vec X = ref::to_double(xv), W = ref::to_double(wv), DY = ref::to_double(dyv),
                   B = ref::to_double(bv);
    const ref::Vec aX = ref::abs_of(X), aW = ref::abs_of(W), aDY = ref::abs_of(DY),
                   aB = ref::abs_of(B);
    const auto check = [&](TensorId id, const char* what, const ref::Vec& want,
                           const ref::Vec& mag) {
      const double err = ref::max_scaled_error(t.gpu().read(id), want, mag);
      std::printf("  %s: error %.3g (tolerance %.3g)\n", what, err, fp32_tol);
      EXPECT_LE(err, fp32_tol) << what << " (FP32, against float64)";
    };
    check(y, "conv_fwd y", ref::conv_fwd(X, W, B, s), ref::conv_fwd(aX, aW, aB, s));
    check(dx, "conv_bwd_data dx", ref::conv_bwd_data(DY, W, s), ref::conv_bwd_data(aDY, aW, s));
    check(dw, "conv_bwd_weight dw", ref::conv_bwd_weight(X, DY, s),
          ref::conv_bwd_weight(aX, aDY, s));
    if (c.bias)
      check(db, "conv_bwd_weight db", ref::conv_bwd_bias(DY, s), ref::conv_bwd_bias(aDY, s));
    return transformed_plans(t);
  }
  KILN_EXPECT_CLOSE(t, y, kSumFloor, "conv_fwd y");
  KILN_EXPECT_CLOSE(t, dx, kSumFloor, "conv_bwd_data dx");
  KILN_EXPECT_CLOSE(t, dw, kSumFloor, "conv_bwd_weight dw");
  if (c.bias) KILN_EXPECT_CLOSE(t, db, kSumFloor, "conv_bwd_weight db");
  return transformed_plans(t);
}

// FP32 convolutions may take Winograd / FFT engines (KILN_FP32_WINOGRAD, default 1, as
// PyTorch lets cuDNN), whose sums are formed in a transformed domain and so rounded otherwise
// than a direct convolution's. "only" holds every layer to them where cuDNN has one, on 3x3
// stride-1 layers of VGG's kind; the errors against float64 are printed and held to SPEC Q2's
// FP32 1e-5, and at least one plan must have been a transformed one (else the test measured
// direct sums). "0" must take none.
TEST(GpuLayerFp32, ConvWinogradAndFft) {
  KILN_REQUIRE_GPU();
  // The float64 reference costs ~0.5 G multiply-adds per pass at n8 28x28 c64; a VGG-sized
  // layer (n16 56x56 c64: 3.7 G) would take the test past a minute for no new engine kind.
  const ConvCase cases[] = {{8, 28, 28, 64, 64, 3, 3, 1, 1, false},
                            {4, 14, 14, 128, 128, 3, 3, 1, 1, true},
                            {2, 9, 9, 8, 16, 3, 3, 1, 1, true}};
  for (const char* mode : {"only", "0"}) {
    Switches winograd = Switches::from_environment();
    winograd.fp32_winograd = mode;
    int transformed = 0;
    for (const ConvCase& c : cases) {
      SCOPED_TRACE(::testing::Message() << "KILN_FP32_WINOGRAD=" << mode << " conv 3x3 n" << c.n
                                        << " " << c.h << "x" << c.w << " c" << c.c << " k" << c.k);
      const int plans = check_conv(c, false, kGpuFp32Tol, winograd);
      std::printf(
          "  KILN_FP32_WINOGRAD=%s n%lld %lldx%lld c%lld k%lld: %d of 3 plans on Winograd / FFT "
          "engines\n",
          mode, static_cast<long long>(c.n), static_cast<long long>(c.h),
          static_cast<long long>(c.w), static_cast<long long>(c.c), static_cast<long long>(c.k),
          plans);
      transformed += plans;
    }
    if (std::string(mode) == "0") {
      EXPECT_EQ(transformed, 0) << "KILN_FP32_WINOGRAD=0 must refuse Winograd and FFT engines";
    } else {
      EXPECT_GE(transformed, 1)
          << "cuDNN took no Winograd / FFT engine: the errors above are direct sums'";
    }
  }
}

// Input channels that are neither 4 nor a multiple of 8 (a first layer's 3 or 1, or 5): under
// AMP with KILN_PAD_CHANNELS=1 the three convolutions run on zero-padded copies (conv.cpp; 4
// channels up to 4, else the next multiple of 8), which must give what the CPU computes on the
// unpadded tensors - forward, data gradient (padding dropped) and weight gradient (the padding
// weights' gradient dropped); under auto each keeps the faster form, timed while compiling.
// FP32 never pads, nor do 4 channels: the same check, unpadded.
TEST_P(GpuLayer, ConvPaddedChannels) {
  KILN_REQUIRE_GPU();
  const bool amp = GetParam();
  const ConvCase cases[] = {{2, 12, 12, 3, 16, 3, 3, 1, 1, true},
                            {2, 9, 9, 5, 8, 3, 3, 2, 1, false},
                            {2, 15, 13, 3, 16, 7, 7, 2, 3, false},
                            {2, 10, 11, 1, 8, 3, 3, 1, 1, true},
                            {2, 10, 10, 4, 16, 3, 3, 1, 1, false}};
  // KILN_PAD_INPUT_ONCE off and on: with it, the weight gradient reads the forward's padded x;
  // KILN_FIXED_CHANNELS_CONV=1: the padded forward on CUTLASS's fixed-channels unit (on an SM90
  // GPU with the units built), auto: timed against cuDNN.
  struct Mode {
    Auto pad;
    bool once;
    Auto fixed;
  };
  const Mode modes[] = {
      {Auto::on, false, Auto::off},        {Auto::on, true, Auto::off},
      {Auto::automatic, false, Auto::off}, {Auto::automatic, true, Auto::off},
      {Auto::on, true, Auto::on},          {Auto::automatic, true, Auto::automatic}};
  const bool fixed_here = kCutlassBuilt && sm90_gpu();
  for (const auto& [mode, once, fixed] : modes) {
    Switches pad = Switches::from_environment();
    pad.pad_channels = mode;
    pad.pad_input_once = once;
    pad.fixed_channels_conv = fixed;
    pad.autotune = Auto::on;  // auto's choice is timed where autotuning is on
    pad.deterministic = false;
    pad.autotune_cache = "0";
    for (const ConvCase& c : cases) {
      SCOPED_TRACE(::testing::Message()
                   << "KILN_PAD_CHANNELS=" << auto_text(mode) << " KILN_PAD_INPUT_ONCE=" << once
                   << " KILN_FIXED_CHANNELS_CONV=" << auto_text(fixed) << " conv " << c.r << "x"
                   << c.s << "/" << c.st << " c" << c.c << " k" << c.k);
      CompileReport r;
      check_conv(c, amp, 0, pad, &r);
      const int paddable = amp && padded_channel_count(c.c) != c.c ? 3 : 0;  // fwd, dgrad, wgrad
      if (mode == Auto::on) {
        EXPECT_EQ(r.convs_padded, paddable);
        EXPECT_EQ(r.pad_timed, 0);
        EXPECT_EQ(r.pad_copies_shared, once && paddable ? 1 : 0) << "the wgrad's x, once";
        if (fixed == Auto::on && fixed_here)
          EXPECT_EQ(r.fixed_channels_convs, paddable ? 1 : 0) << "the forward on CUTLASS's unit";
      } else {
        EXPECT_EQ(r.pad_timed, paddable) << "each paddable convolution timed";
        EXPECT_LE(r.convs_padded, r.pad_timed);
        EXPECT_LE(r.pad_copies_shared, once ? 1 : 0);
        EXPECT_LE(r.fixed_channels_convs, fixed == Auto::off ? 0 : 1);
      }
      std::printf(
          "  KILN_PAD_CHANNELS=%s KILN_PAD_INPUT_ONCE=%d KILN_FIXED_CHANNELS_CONV=%s c%lld %s: %d "
          "of 3 kernels padded (%d timed), %d reading the forward's copy, %d on CUTLASS\n",
          auto_text(mode), once ? 1 : 0, auto_text(fixed), static_cast<long long>(c.c),
          amp ? "AMP" : "FP32", r.convs_padded, r.pad_timed, r.pad_copies_shared,
          r.fixed_channels_convs);
    }
  }
}

// One softmax_ce node of N rows of K logits on both backends, compiled.
struct CePair {
  Pair t;
  TensorId z, lab, scale, loss, correct, dz, mix = kNoTensor;
  CePair(bool amp, int64_t N, int64_t K, float smoothing = 0.0f, bool mixed = false) : t(amp) {
    z = t.add("logits", {N, K}, Kind::Feature), lab = t.add("labels", {N}, Kind::I32);
    scale = t.add("loss_scale", {1}, Kind::F32, Region::scalars);
    loss = t.add("loss", {1}, Kind::F32, Region::scalars);
    correct = t.add("correct", {2}, Kind::I32, Region::scalars);
    dz = t.add("dlogits", {N, K}, Kind::Feature);
    Attrs a;
    a.label_smoothing = smoothing;
    std::vector<TensorId> in{z, lab, scale};
    if (mixed) {
      mix = t.add("mix", {8}, Kind::F32, Region::scalars);
      in.push_back(mix);
    }
    t.node(OpKind::softmax_ce, in, {loss, correct, dz}, a);
    t.compile();
  }
};

TEST_P(GpuLayer, SoftmaxCrossEntropy) {
  KILN_REQUIRE_GPU();
  const bool amp = GetParam();
  const int64_t dims[][2] = {{32, 10}, {7, 1000}, {256, 100}};
  for (const auto& d : dims) {
    const int64_t N = d[0], K = d[1];
    SCOPED_TRACE(::testing::Message() << "softmax_ce " << N << "x" << K);
    for (float smoothing : {0.0f, 0.1f}) {  // label smoothing: the CPU's formula (tests/op)
      SCOPED_TRACE(::testing::Message() << "label smoothing " << smoothing);
      CePair ce(amp, N, K, smoothing);
      Pair& t = ce.t;
      const TensorId z = ce.z, lab = ce.lab, scale = ce.scale, loss = ce.loss, correct = ce.correct,
                     dz = ce.dz;
      t.set_random(z, 51, -4.0f, 4.0f);
      Rng rng(52);
      std::vector<int32_t> labels(static_cast<size_t>(N));
      for (auto& l : labels) l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(K)));
      t.set_i32(lab, labels);
      t.set(scale, {amp ? 8192.0f : 1.0f});
      t.run();
      KILN_EXPECT_CLOSE(t, loss, kEltFloor, "softmax_ce loss");
      // dlogits = (p - onehot) scale / N: its largest entries are ~scale / N.
      KILN_EXPECT_CLOSE(t, dz, amp ? kSumFloor : kEltFloor, "softmax_ce dlogits");
      EXPECT_EQ(t.gpu().read_i32(correct), t.cpu().read_i32(correct))
          << "top-1/top-5 counts differ";
    }
  }
}

// Mixed targets (mixup / cutmix): the label pair of each row (its own, the row before's) with
// the step's lambda, read from the device, with and without label smoothing; the CPU's kernel
// is checked against torch's formula (tests/op/cpu_loss_test.cpp), CUDA against the CPU.
TEST_P(GpuLayer, SoftmaxCrossEntropyMixed) {
  KILN_REQUIRE_GPU();
  const bool amp = GetParam();
  const int64_t dims[][2] = {{32, 10}, {7, 1000}, {256, 100}};
  for (const auto& d : dims) {
    const int64_t N = d[0], K = d[1];
    for (float smoothing : {0.0f, 0.1f}) {
      for (float lambda : {0.2f, 0.5f, 0.9f}) {
        SCOPED_TRACE(::testing::Message() << "softmax_ce " << N << "x" << K << " ls " << smoothing
                                          << " lambda " << lambda);
        CePair ce(amp, N, K, smoothing, true);
        Pair& t = ce.t;
        t.set_random(ce.z, 53, -4.0f, 4.0f);
        Rng rng(54);
        std::vector<int32_t> labels(static_cast<size_t>(N));
        for (auto& l : labels) l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(K)));
        t.set_i32(ce.lab, labels);
        t.set(ce.scale, {amp ? 8192.0f : 1.0f});
        t.set(ce.mix, {1.0f, lambda, static_cast<float>(1.0 - lambda), 0, 0, 0, 0, 0});
        t.run();
        KILN_EXPECT_CLOSE(t, ce.loss, kEltFloor, "mixed softmax_ce loss");
        KILN_EXPECT_CLOSE(t, ce.dz, amp ? kSumFloor : kEltFloor, "mixed softmax_ce dlogits");
        EXPECT_EQ(t.gpu().read_i32(ce.correct), t.cpu().read_i32(ce.correct))
            << "dominant-label counts differ";
      }
    }
  }
}

// A row with a NaN or infinite logit is a miss at top-1 and top-5 (a diverged model must not
// count as accurate), as on the CPU (tests/op/cpu_loss_test.cpp, the same rows).
TEST_P(GpuLayer, SoftmaxCrossEntropyNonFiniteLogitsAreMisses) {
  KILN_REQUIRE_GPU();
  const bool amp = GetParam();
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> rows = {{nan, nan, nan, nan, nan, nan},
                                                {1, nan, 0, 0, 0, 0},
                                                {0, 0, inf, 0, 0, 0},
                                                {5, 0, 0, -inf, 0, 0},
                                                {5, 0, 0, 0, 0, 0}};
  const int64_t N = static_cast<int64_t>(rows.size()), K = 6;
  CePair ce(amp, N, K);
  Pair& t = ce.t;
  const TensorId z = ce.z, lab = ce.lab, scale = ce.scale, correct = ce.correct;
  std::vector<float> zv;
  for (const auto& r : rows) zv.insert(zv.end(), r.begin(), r.end());
  t.set(z, zv);
  t.set_i32(lab, {0, 1, 2, 0, 0});
  t.set(scale, {1.0f});
  t.run();
  const std::vector<int32_t> gpu = t.gpu().read_i32(correct);
  EXPECT_EQ(gpu[0], 1) << "top-1: only the finite row 4 is a hit";
  EXPECT_EQ(gpu[1], 1) << "top-5: only the finite row 4 is a hit";
  EXPECT_EQ(gpu, t.cpu().read_i32(correct));
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuLayer, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "amp" : "fp32";
                         });

}  // namespace
}  // namespace kiln::test
