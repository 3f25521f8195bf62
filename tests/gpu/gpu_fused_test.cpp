// The CUDA fused ops (src/backend/cuda/fused.cpp) against their unfused chains on the same GPU,
// bit for bit (tests/support/fused_checks.h says how), FP32 and AMP, with the 16-byte kernels
// on and off and deterministic convolution engines (KILN_DETERMINISTIC=1, so both chains'
// convolutions run the same engines); then whole AMP training steps, fused against unfused. All
// of it in kiln's own form: KILN_CUTLASS's SM90 GEMM (auto: on under AMP on an H200) sums z in
// another order, agreeing to rounding only, so these tests set it off; GpuCutlass*
// (gpu_cutlass_cbr_test.cpp) hold it to this form within its tolerances, whole steps included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/task/engine.h"
#include "support/engine_state.h"
#include "support/fused_checks.h"
#include "support/learnable_batch.h"

namespace kiln::test {
namespace {

using fused::CbrCase;

class GpuFusedCbr : public ::testing::TestWithParam<std::tuple<CbrCase, bool>> {};

TEST_P(GpuFusedCbr, EqualsConvBnReluBitForBit) {
  KILN_REQUIRE_GPU();
  const auto& [t, amp] = GetParam();
  if (amp && t.k % 8 != 0)
    GTEST_SKIP() << "FP16 convolutions want output channels in multiples of 8";
  // Input channels that are not (the first layer's 3) run on zero-padded copies.
  Switches sw = Switches::from_environment();
  sw.pad_channels = amp && t.c % 8 != 0 ? Auto::on : Auto::off;
  sw.deterministic = true;
  for (const char* vec : {"1", "0"}) {
    sw.vector_kernels = vec[0] == '1';
    SCOPED_TRACE(::testing::Message()
                 << t.name << (amp ? " AMP" : " FP32") << ", vector kernels " << vec);
    fused::cbr_equals_chain(t, amp, "cuda", sw);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuFusedCbr,
    ::testing::Combine(
        ::testing::Values(CbrCase{"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false},
                          CbrCase{"n3_8x7_c16_k8_3x3_s2", 3, 8, 7, 16, 8, 3, 2, 1, false},
                          CbrCase{"n2_6x6_c8_k24_1x1", 2, 6, 6, 8, 24, 1, 1, 0, false},
                          CbrCase{"n8_16x16_c64_k64_3x3", 8, 16, 16, 64, 64, 3, 1, 1, false},
                          CbrCase{"n1_5x5_c3_k8_first_layer", 1, 5, 5, 3, 8, 3, 1, 1, true},
                          CbrCase{"n4_3x3_c8_k5_odd_mask", 4, 3, 3, 8, 5, 1, 1, 0, false}),
        ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) +
             (std::get<1>(info.param) ? "_amp" : "_fp32");
    });

// CBR with a max-pool folded in (cbr_pool_*: VGG's blocks, ResNet's stem): the apply + ReLU +
// max-pool pass and the backward reading the pooled gradient against the unfused chain, bit for
// bit, with 16-byte kernels and without; 2x2 and 3x3 windows that tile the map, ResNet's
// overlapping 3x3 / 2 stem pool with padding 1 (pool_route.cuh) on even and odd maps and at the
// stem's shape scaled down, a 3x3 / 1 pool, a 2x2 / 1 pool (the forward's loop over any window,
// where 3x3 windows take its unrolled form; the backward's gather unrolled where at most two
// windows a side cover an element, 3x3 / 2 and 2x2 / 1, with and without its eager loads, its
// loop for 3x3 / 1); 2x2 pools with 16-byte kernels on the group-per-thread form and, where
// 256 threads do not tile the groups, the per-pixel one; the first-layer form, FP32 and AMP.
struct PoolCase {
  CbrCase cbr;
  fused::PoolSpec pool;
};

class GpuFusedCbrPool : public ::testing::TestWithParam<std::tuple<PoolCase, bool>> {};

TEST_P(GpuFusedCbrPool, EqualsConvBnReluMaxPoolBitForBit) {
  KILN_REQUIRE_GPU();
  const auto& [c, amp] = GetParam();
  Switches sw = Switches::from_environment();
  sw.pad_channels = amp && c.cbr.c % 8 != 0 ? Auto::on : Auto::off;
  sw.deterministic = true;
  // The eager gather (KILN_POOL_ROUTE_EAGER) and the group-per-thread apply
  // (KILN_POOL_GROUP_APPLY) change only 16-byte forms: each is run off and on there (form 0:
  // both on, 1: the eager gather off, 2: the group apply off). Form 3, windows that tile z:
  // with zp and mp (KILN_POOL_POOLED_SUMS), with and without 16-byte kernels.
  for (const char* vec : {"1", "0"}) {
    for (const int form : {0, 1, 2, 3}) {
      if ((form == 1 || form == 2) && vec[0] == '0') continue;
      if (form == 3 && !c.pool.tiles()) continue;
      sw.vector_kernels = vec[0] == '1';
      sw.pool_route_eager = form != 1;
      sw.pool_group_apply = form != 2;
      SCOPED_TRACE(::testing::Message()
                   << c.cbr.name << (amp ? " AMP" : " FP32") << ", vector kernels " << vec
                   << ", eager gather " << sw.pool_route_eager << ", group apply "
                   << sw.pool_group_apply << ", pooled picks " << (form == 3));
      fused::cbr_pool_equals_chain(c.cbr, c.pool, amp, "cuda", sw, form == 3);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuFusedCbrPool,
    ::testing::Combine(
        ::testing::Values(
            PoolCase{{"n2_8x8_c8_k16_3x3_pool2", 2, 8, 8, 8, 16, 3, 1, 1, false}, {2, 2, 0}},
            PoolCase{{"n3_6x4_c16_k8_1x1_pool2", 3, 6, 4, 16, 8, 1, 1, 0, false}, {2, 2, 0}},
            PoolCase{{"n1_9x9_c8_k8_3x3_pool3", 1, 9, 9, 8, 8, 3, 1, 1, false}, {3, 3, 0}},
            PoolCase{{"n8_16x16_c64_k64_3x3_pool2", 8, 16, 16, 64, 64, 3, 1, 1, false}, {2, 2, 0}},
            // 24 channels: three groups, which 256 threads do not tile (apply_relu_pool's 2x2
            // form rather than the group-per-thread one); 512 channels over 18,432 pooled
            // pixels: more than two of the group-per-thread form's grid strides on 132 SMs, so
            // its second pixel in flight and its loop run.
            PoolCase{{"n2_6x6_c8_k24_1x1_pool2", 2, 6, 6, 8, 24, 1, 1, 0, false}, {2, 2, 0}},
            PoolCase{{"n2_192x192_c8_k512_1x1_pool2", 2, 192, 192, 8, 512, 1, 1, 0, false},
                     {2, 2, 0}},
            PoolCase{{"n2_8x8_c3_k8_first_layer_pool2", 2, 8, 8, 3, 8, 3, 1, 1, true}, {2, 2, 0}},
            PoolCase{{"n4_56x56_c3_k64_stem_pool3s2p1", 4, 56, 56, 3, 64, 7, 2, 3, true},
                     {3, 2, 1}},
            PoolCase{{"n2_9x11_c8_k16_3x3_pool3s2p1", 2, 9, 11, 8, 16, 3, 1, 1, false}, {3, 2, 1}},
            PoolCase{{"n2_7x6_c16_k8_1x1_pool3s1p1", 2, 7, 6, 16, 8, 1, 1, 0, false}, {3, 1, 1}},
            PoolCase{{"n2_7x9_c8_k16_3x3_pool2s1", 2, 7, 9, 8, 16, 3, 1, 1, false}, {2, 1, 0}}),
        ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).cbr.name) +
             (std::get<1>(info.param) ? "_amp" : "_fp32");
    });

// The GPU forms the bias's share of the running mean in double: within 1e-6 of the float sum.
// The seed article's CBR forward (KILN_CBR_FORM=genstats: conv+genstats in one cuDNN graph,
// then kiln's finalize and apply from its FP32 sums) against kiln's form on the same inputs.
// The statistics come from other sums - FP32 in cuDNN's order instead of double over the
// FP16-rounded z - so the two agree to rounding, not bit for bit: z within 2e-3 of its scale
// (another engine: an FP16 ulp), the saved mean and inverse std within 2e-3 (AMP) / 1e-5
// (FP32), the running statistics likewise, y within 1e-2 / 1e-4, and mask bits that differ
// only where y sits within rounding of 0 (at most 0.5% of them). Under AMP the form must have
// been taken (a layer without an engine for the graph falls back, cbr_forms() counts it, and
// this test fails: how an H200 run learns whether its cuDNN has those engines). In FP32 a
// fallback is allowed, and then the outputs must be kiln's form's, bit for bit.
struct CbrForward : fused::CbrForwardOut {
  CudaBackendApi::CbrForms forms;
};

CbrForward run_cbr_forward(const CbrCase& t, bool amp, const char* form) {
  Switches sw = Switches::from_environment();
  sw.cbr_form = form;
  sw.cutlass = Auto::off;        // else it would take the 1x1 layers before either form
  sw.cutlass_dgrad = Auto::off;  // and their data gradients
  sw.pad_channels = amp && t.c % 8 != 0 ? Auto::on : Auto::off;
  OpHarness h(amp);
  CbrForward r{fused::run_cbr_forward(fused::Maker{h, amp}, t, 0, "cuda", sw), {}};
  if (auto* api = dynamic_cast<CudaBackendApi*>(&h.backend())) r.forms = api->cbr_forms();
  return r;
}

class GpuFusedCbrGenstats : public ::testing::TestWithParam<std::tuple<CbrCase, bool>> {};

TEST_P(GpuFusedCbrGenstats, AgreesWithKilnsFormToRounding) {
  KILN_REQUIRE_GPU();
  const auto& [t, amp] = GetParam();
  const CbrForward kiln = run_cbr_forward(t, amp, "kiln"),
                   article = run_cbr_forward(t, amp, "genstats");
  EXPECT_EQ(kiln.forms.genstats + kiln.forms.fallbacks, 0);
  EXPECT_EQ(article.forms.genstats + article.forms.fallbacks, 1);
  if (!amp && article.forms.fallbacks == 1) {
    std::printf("  FP32 conv+genstats: no cuDNN engine, fell back\n");
    EXPECT_EQ(article.y, kiln.y);
    EXPECT_EQ(article.saved, kiln.saved);
    return;
  }
  EXPECT_EQ(article.forms.genstats, 1) << "conv+genstats has no cuDNN engine here";
  const double stat_tol = amp ? 2e-3 : 1e-5;
  EXPECT_LE(rel_error(article.z, kiln.z, kSumFloor), amp ? 2e-3 : 1e-5) << "z";
  EXPECT_LE(rel_error(article.saved, kiln.saved, kSumFloor), stat_tol)
      << "saved mean / inverse std";
  EXPECT_LE(rel_error(article.rm, kiln.rm, kSumFloor), stat_tol) << "running mean";
  EXPECT_LE(rel_error(article.rv, kiln.rv, kSumFloor), stat_tol) << "running variance";
  EXPECT_LE(rel_error(article.y, kiln.y, kSumFloor), amp ? 1e-2 : 1e-4) << "y";
  size_t differ = 0;
  for (size_t i = 0; i < kiln.y.size(); ++i) {
    differ += (((article.mask[i / 8] ^ kiln.mask[i / 8]) >> (i % 8)) & 1u) != 0;
  }
  EXPECT_LE(differ, 5 * kiln.y.size() / 1000 + 2) << "mask bits that differ";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuFusedCbrGenstats,
    ::testing::Combine(
        ::testing::Values(CbrCase{"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false},
                          CbrCase{"n3_8x7_c16_k8_3x3_s2", 3, 8, 7, 16, 8, 3, 2, 1, false},
                          CbrCase{"n8_16x16_c64_k64_3x3", 8, 16, 16, 64, 64, 3, 1, 1, false},
                          CbrCase{"n4_14x14_c64_k256_1x1", 4, 14, 14, 64, 256, 1, 1, 0, false}),
        ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) +
             (std::get<1>(info.param) ? "_amp" : "_fp32");
    });

class GpuFusedCbrBias : public ::testing::TestWithParam<bool> {};

TEST_P(GpuFusedCbrBias, BiasMovesOnlyTheRunningMean) {
  KILN_REQUIRE_GPU();
  Switches sw = Switches::from_environment();
  sw.deterministic = true;
  fused::cbr_bias_moves_only_the_running_mean(GetParam(), "cuda", 1e-6, sw);
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuFusedCbrBias, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "amp" : "fp32"); });

class GpuFusedBnAddRelu : public ::testing::TestWithParam<std::tuple<Shape, bool>> {};

TEST_P(GpuFusedBnAddRelu, EqualsBnAddReluBitForBit) {
  KILN_REQUIRE_GPU();
  const auto& [s, amp] = GetParam();
  Switches sw = Switches::from_environment();
  for (const char* vec : {"1", "0"}) {
    sw.vector_kernels = vec[0] == '1';
    for (const bool two_grads : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << s.str() << (amp ? " AMP" : " FP32") << ", vector kernels " << vec
                   << (two_grads ? ", two gradients (dy2)" : ""));
      fused::bn_add_relu_equals_chain(s, amp, "cuda", two_grads, sw);
    }
  }
}

// With the residual's own BatchNorm folded in (a downsampling shortcut's, KILN_FUSE_RESIDUAL_BN:
// its statistics pass, then the apply pass applies it on the fly), against BN(z2), BN(x), add,
// ReLU and their backwards; 16-byte kernels on and off.
TEST_P(GpuFusedBnAddRelu, WithTheResidualsBatchNormEqualsChainBitForBit) {
  KILN_REQUIRE_GPU();
  const auto& [s, amp] = GetParam();
  Switches sw = Switches::from_environment();
  for (const char* vec : {"1", "0"}) {
    sw.vector_kernels = vec[0] == '1';
    SCOPED_TRACE(::testing::Message()
                 << s.str() << (amp ? " AMP" : " FP32") << ", vector kernels " << vec);
    fused::bn_add_relu_residual_bn_equals_chain(s, amp, "cuda", sw);
  }
}

// The evaluation form (bn_relu_infer) against bn_fwd_infer, [add,] relu_fwd, same roundings.
TEST_P(GpuFusedBnAddRelu, InferenceEqualsChainBitForBit) {
  KILN_REQUIRE_GPU();
  const auto& [s, amp] = GetParam();
  for (const bool residual : {false, true}) {
    SCOPED_TRACE(::testing::Message()
                 << s.str() << (amp ? " AMP" : " FP32") << (residual ? ", residual" : ""));
    fused::bn_relu_infer_equals_chain(s, amp, "cuda", residual);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuFusedBnAddRelu,
                         ::testing::Combine(::testing::Values(Shape{2, 7, 7, 16}, Shape{1, 3, 5, 8},
                                                              Shape{16, 14, 14, 256},
                                                              Shape{4, 2, 2, 3}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Shape& s = std::get<0>(info.param);
                           return "n" + std::to_string(s[0]) + "_" + std::to_string(s[1]) + "x" +
                                  std::to_string(s[2]) + "_c" + std::to_string(s[3]) +
                                  (std::get<1>(info.param) ? "_amp" : "_fp32");
                         });

// Whole training steps, fusion on (the default on CUDA) against KILN_FUSION off,
// with deterministic convolution engines: the fused kernels give the unfused chain's bits op
// by op, so the losses, every weight, momentum-updated parameter and BN running statistic must
// be equal bit for bit (measured on the H200: 0 of 103 / 268 tensors differ after three steps
// of resnet18_small / resnet50). VGG's CBR folds its convolution biases away (ops.def), so
// its unfused chain trains those zero-initialised biases on rounding noise; from the second
// step on the two programs then differ at rounding level, which this model's 2x2 maps
// (16 values per channel at batch 4) amplify through ReLU decisions (measured: BN biases
// 2-14% apart after three steps). So VGG is compared after its first step, where everything
// but those biases must be equal bit for bit, and the biases are 0 fused, noise unfused -
// vgg11_bn_small and the full vgg16_bn (224x224, batch 4) alike.
// The fused program is compiled twice: with the residual blocks' gradient sums left to add
// passes (KILN_FUSE_GRAD_SUM=0), and as it is by default, with them folded into the
// BN+add+ReLU backward; both must give the same bits.
// FP32 takes the same path where fusion is asked for in FP32 (Switches::fuse_fp32,
// KILN_FUSE_FP32=1): the same kernels in float, the same bits demanded.
void fused_steps_equal_unfused(bool amp, const std::vector<std::string>& models) {
  for (const std::string& model : models) {
    SCOPED_TRACE(model + (amp ? " AMP" : " FP32"));
    const bool vgg = model.rfind("vgg", 0) == 0;
    const int steps = vgg ? 1 : 3;
    const BluePrint bp = make_model(model);
    const LearnableBatch b = learnable_batch(bp, 4, 9);
    // By name (fusion reorders declarations): unfused, fused with add passes, fused (default).
    std::vector<std::map<std::string, std::vector<float>>> results(3);
    std::map<std::string, ParamKind> kinds;
    std::vector<int> fused_nodes, folded;
    for (const int config : {0, 1, 2}) {
      const bool fusion = config > 0;
      EngineOptions o;
      o.device = "cuda";
      o.compile.batch = 4;
      o.compile.amp = amp;
      o.compile.momentum = 0.9f;
      o.switches.deterministic = true;
      o.switches.cutlass = Auto::off;  // kiln's form (see the top of the file)
      o.switches.cutlass_dgrad = Auto::off;
      o.switches.fuse_grad_sum = config == 2;
      o.switches.fusion = fusion;
      if (!amp) o.switches.fuse_fp32 = Auto::on;
      Engine e(bp, o);
      e.lock_memory();
      e.compile(5);
      fused_nodes.push_back(fused_node_count(e));
      folded.push_back(folded_grad_sum_count(e));
      std::vector<float> losses;
      for (int i = 0; i < steps; ++i)
        losses.push_back(e.train_step(b.images.data(), b.labels.data(), 0.05f).loss);
      auto& r = results[static_cast<size_t>(config)];
      r = params_and_buffers(e);
      r["loss"] = losses;
      for (const ParamDesc& d : e.program().params) kinds[d.name] = d.kind;
    }
    EXPECT_EQ(fused_nodes[0], 0);
    EXPECT_GT(fused_nodes[1], 0) << "CUDA fuses under AMP, and in FP32 where asked";
    EXPECT_EQ(fused_nodes[2], fused_nodes[1]);
    EXPECT_EQ(folded[1], 0) << "KILN_FUSE_GRAD_SUM=0";
    if (model.rfind("resnet", 0) == 0)
      EXPECT_GT(folded[2], 0) << "residual blocks fold their gradient sums";
    for (const size_t fused : {size_t{1}, size_t{2}}) {
      SCOPED_TRACE(fused == 2 ? "default fusion: gradient sums folded"
                              : "fusion with KILN_FUSE_GRAD_SUM=0");
      ASSERT_EQ(results[0].size(), results[fused].size());
      size_t differing = 0, cancelled = 0;
      for (const auto& [name, want] : results[0]) {
        ASSERT_TRUE(results[fused].count(name)) << name;
        const std::vector<float>& got = results[fused].at(name);
        ASSERT_EQ(got.size(), want.size()) << name;
        const auto kind = kinds.count(name) ? kinds.at(name) : ParamKind::ConvWeight;
        if (kind == ParamKind::Bias &&
            std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; })) {
          // A convolution bias the fused CBR cancels: gradient exactly 0 there (it keeps its zero
          // initialisation); the unfused chain's is rounding noise.
          ++cancelled;
          for (float v : want)
            EXPECT_LE(std::fabs(v), 1e-4f) << name << " (a bias BN cancels, unfused)";
          continue;
        }
        size_t n = 0;
        for (size_t i = 0; i < got.size(); ++i) n += bits_of(got[i]) != bits_of(want[i]);
        EXPECT_EQ(n, 0u) << name << ": " << n << " of " << got.size() << " values differ (error "
                         << rel_error(got, want, kSumFloor) << " of its scale)";
        differing += n > 0;
      }
      if (vgg) EXPECT_GT(cancelled, 0u) << "VGG's convolution biases are folded";
      std::printf(
          "  %s%s: %d fused nodes, %d step(s); %zu of %zu tensors differ; %zu cancelled biases\n",
          model.c_str(), fused == 2 ? " (gradient sums folded)" : "", fused_nodes[1], steps,
          differing, results[0].size(), cancelled);
    }
  }
}

TEST(GpuFusedStep, FusedStepsEqualUnfusedBitForBitAmp) {
  KILN_REQUIRE_GPU();
  fused_steps_equal_unfused(true, {"resnet18_small", "resnet50", "vgg11_bn_small", "vgg16_bn"});
}

TEST(GpuFusedStep, FusedStepsEqualUnfusedBitForBitFp32) {
  KILN_REQUIRE_GPU();
  fused_steps_equal_unfused(false, {"cnn", "resnet18_small", "vgg11_bn_small"});
}

// A fold (a max-pool into CBR, a shortcut's BatchNorm into BN+add+ReLU) off and on, fusion on,
// with deterministic convolution engines: both programs fold VGG's biases alike, so three steps
// give the same losses, weights and running statistics bit for bit (the folded pass does the
// arithmetic of what it folds), and the folded program has `folded_nodes` nodes by `count`.
// `fold_switch` sets the switch under test (and may set others, after kiln's form is chosen);
// `amps`: AMP, FP32 or both.
template <typename Fold, typename Count>
void folding_bit_for_bit(const std::string& model, int folded_nodes, Fold fold_switch, Count count,
                         std::initializer_list<bool> amps = {true, false}) {
  for (const bool amp : amps) {
    SCOPED_TRACE(model + (amp ? " AMP" : " FP32"));
    const BluePrint bp = make_model(model);
    const LearnableBatch b = learnable_batch(bp, 4, 9);
    std::vector<std::map<std::string, std::vector<float>>> results(2);
    std::vector<int> pooled;
    for (const bool fold : {false, true}) {
      EngineOptions o;
      o.device = "cuda";
      o.compile.batch = 4;
      o.compile.amp = amp;
      o.compile.momentum = 0.9f;
      o.switches.deterministic = true;
      o.switches.cutlass = Auto::off;  // kiln's form (see the top of the file)
      o.switches.cutlass_dgrad = Auto::off;
      fold_switch(o.switches, fold);
      if (!amp) o.switches.fuse_fp32 = Auto::on;
      Engine e(bp, o);
      e.lock_memory();
      e.compile(5);
      pooled.push_back(count(e));
      std::vector<float> losses;
      for (int i = 0; i < 3; ++i)
        losses.push_back(e.train_step(b.images.data(), b.labels.data(), 0.05f).loss);
      results[fold ? 1 : 0] = params_and_buffers(e);
      results[fold ? 1 : 0]["loss"] = losses;
    }
    EXPECT_EQ(pooled[0], 0);
    EXPECT_EQ(pooled[1], folded_nodes) << "the folded nodes";
    ASSERT_EQ(results[0].size(), results[1].size());
    size_t differing = 0;
    for (const auto& [name, want] : results[0]) {
      const std::vector<float>& got = results[1].at(name);
      ASSERT_EQ(got.size(), want.size()) << name;
      size_t n = 0;
      for (size_t i = 0; i < got.size(); ++i) n += bits_of(got[i]) != bits_of(want[i]);
      EXPECT_EQ(n, 0u) << name << ": " << n << " of " << got.size() << " values differ";
      differing += n > 0;
    }
    std::printf("  %s %s: folding off / on, %zu of %zu tensors differ after 3 steps\n",
                model.c_str(), amp ? "AMP" : "FP32", differing, results[0].size());
  }
}

// VGG11-BN (small): its five 2x2 / 2 pools (KILN_FUSE_POOL).
TEST(GpuFusedStep, PoolFoldingOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  folding_bit_for_bit(
      "vgg11_bn_small", 10, [](Switches& sw, bool fold) { sw.fuse_pool = fold; }, pooled_cbr_count);
}

// ResNet-18 at 224x224: its stem's 3x3 / 2 pool with padding 1, whose windows overlap
// (KILN_FUSE_OVERLAPPING_POOL: the apply pass pools, the backward's sums pass gathers the
// gradient, pool_route.cuh).
TEST(GpuFusedStep, OverlappingPoolFoldingOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  folding_bit_for_bit(
      "resnet18", 2, [](Switches& sw, bool fold) { sw.fuse_overlapping_pool = fold; },
      pooled_cbr_count);
}

// ResNet-50 at 224x224: its four downsampling shortcuts' BatchNorms folded into their blocks'
// BN+add+ReLU forwards (KILN_FUSE_RESIDUAL_BN).
TEST(GpuFusedStep, ResidualBnFoldingOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  folding_bit_for_bit(
      "resnet50", 4, [](Switches& sw, bool fold) { sw.fuse_residual_bn = fold; },
      residual_bn_folded_count);
}

// BatchNorm's 16-byte apply and dx passes with four rows in flight a thread against two
// (KILN_BN_DEEP_LOADS): the same arithmetic per element, so ResNet-50 (apply + ReLU + mask, the
// residual's add and its BatchNorm, the dx pass with dy2) and VGG11-BN (plain CBR apply passes
// beside the pooled ones) train three steps to the same bits. At batch 4 each thread takes one
// trip of four rows, the last ones past the map where the rows do not fill it.
TEST(GpuFusedStep, BnDeepLoadsOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  for (const char* model : {"resnet50", "vgg11_bn_small"}) {
    folding_bit_for_bit(
        model, 0, [](Switches& sw, bool deep) { sw.bn_deep_loads = deep; },
        [](const Engine&) { return 0; });
  }
}

// VGG11-BN (small): its five 2x2 pools' CBRs writing zp and mp and their backwards' sums passes
// reading those rather than z (KILN_POOL_POOLED_SUMS): the same nonzero terms in double in
// another order, whose float roundings agree (fused_checks.h's cbr_pool_equals_chain), so three
// steps agree bit for bit; with the group-per-thread apply pass (the form that writes them on
// 16-byte maps where it applies) off and on.
TEST(GpuFusedStep, PoolPooledSumsOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  for (const bool group : {false, true}) {
    SCOPED_TRACE(group ? "group apply on" : "group apply off");
    folding_bit_for_bit(
        "vgg11_bn_small", 10,
        [group](Switches& sw, bool picks) {
          sw.pool_group_apply = group;
          sw.pool_pooled_sums = picks;
        },
        pooled_picks_count);
  }
}

// The optimizer writing the FP16 compute copy of the weights it updates (KILN_FUSE_WEIGHT_CAST)
// in place of the weight_cast phase: the same rounding of the same weights, so VGG11-BN (its
// conv and fc weights, one SGD node over them) trains three AMP steps to the same bits.
TEST(GpuFusedStep, WeightCastInTheOptimizerOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  folding_bit_for_bit("vgg11_bn_small", 1, [](Switches& sw, bool on) { sw.fuse_weight_cast = on; },
                      optimizer_compute_copy_count, {true});
}

// ResNet-50 in AMP: its four downsampling shortcuts' BatchNorm backwards summed in their
// BN+add+ReLU backwards' dx passes (KILN_RESIDUAL_BN_SUMS_IN_DX) against their own sums passes,
// in kiln's form (the dx pass forms g from dy, dy2 and the mask) and with the SM90 kernels on
// (whose data gradient may leave g and its sums to that backward: make_bn_bwd_from_sums): the
// dx pass takes each thread's rows in the sums pass's order, so three steps agree bit for bit.
TEST(GpuFusedStep, ShortcutBnSumsInDxPassOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  for (const bool sm90 : {false, true}) {
    SCOPED_TRACE(sm90 ? "SM90 kernels on" : "kiln's form");
    folding_bit_for_bit(
        "resnet50", 4,
        [sm90](Switches& sw, bool fold) {
          sw.fuse_residual_bn = true;
          sw.residual_bn_sums_in_dx = fold;
          if (sm90) sw.cutlass = sw.cutlass_dgrad = Auto::on;
        },
        [](Engine& e) { return e.backend().compile_report().residual_bn_sums_in_dx; }, {true});
  }
}

}  // namespace
}  // namespace kiln::test
