// The schedule's and memory plan's rule for the SM90 data gradient with BatchNorm-backward's sums
// (src/backend/dgrad_bn_rule.h, KILN_CUTLASS_DGRAD) on whole programs as the CUDA backend gets
// them (fused CBR and BN+add+ReLU, the gradient-sum fusion, AMP), and the switch: all without
// a GPU.
#include "backend/dgrad_bn_rule.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "backend/sm90_conv_rule.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/switches.h"
#include "kiln/graph/compiler.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

// The program the CUDA backend compiles under AMP (task/engine.cpp's fusion_options with its
// caps: every fused form, the gradient-sum fusion).
Program cuda_program(const std::string& model, bool reuse, int64_t batch = 4,
                     bool dresidual_from_dgrad = true, bool pool_pooled_sums = false) {
  CompileOptions o;
  o.batch = batch;
  o.amp = true;
  o.memory_reuse = reuse;
  o.dresidual_from_dgrad = dresidual_from_dgrad;
  o.fuse_grad_sum = true;
  o.pool_pooled_sums = pool_pooled_sums;
  PlanOptions po;
  po.amp = true;
  po.backend_fuses_cbr = po.backend_fuses_cbr_pool = po.backend_fuses_bn_add_relu =
      po.backend_fuses_fp32 = true;
  Program p = lower_program(make_plan(make_model(model), po), o);
  plan_memory(p);
  return p;
}

// The data gradients of the training step: conv_bwd_data nodes, and cbr_bwd / cbr_pool_bwd
// with a dx (as the CUDA factories ask the rule).
struct Tally {
  int to_cbr = 0, to_bn_add_relu = 0;  // uses the schedule and the plan allow, by consumer
  int to_cbr_pool = 0;                 // ... a pooled CBR's, from its forward's pooled picks
  int into_dresidual = 0, copied = 0;  // of to_bn_add_relu: where g goes
  int refused = 0;                     // uses they do not
  int one_by_one = 0;  // of the allowed: the producer's convolution is 1x1 stride 1 (eligible)
  int keeps_size = 0;  // of the others: stride 1, padding keeping the size (the implicit GEMM's)
  std::vector<std::pair<std::string, std::string>> refusals;  // producer's label, why
  std::string listed() const {
    std::string out;
    for (const auto& [label, why] : refusals) out += label + ": " + why + "\n";
    return out;
  }
};
Tally tally(const Program& p) {
  Tally t;
  for (const Phase& ph : p.train) {
    for (const Node& n : ph.nodes) {
      TensorId dx = kNoTensor;
      if (n.op == OpKind::conv_bwd_data) dx = n.out.at(0);
      if (n.op == OpKind::cbr_bwd || n.op == OpKind::cbr_pool_bwd) dx = n.out.at(0);
      if (dx == kNoTensor) continue;
      const DgradBnUse u = dgrad_bn_use(p, n, dx);
      if (u.consumer == nullptr) continue;
      if (!u.refusal.empty()) {
        ++t.refused;
        t.refusals.emplace_back(n.label, u.refusal);
        continue;
      }
      (u.consumer->op == OpKind::cbr_bwd        ? t.to_cbr
       : u.consumer->op == OpKind::cbr_pool_bwd ? t.to_cbr_pool
                                                : t.to_bn_add_relu) += 1;
      if (u.consumer->op == OpKind::cbr_pool_bwd) {
        EXPECT_EQ(u.z, u.consumer->in.at(7)) << n.label << ": z is the forward's zp";
        EXPECT_EQ(u.mask, u.consumer->in.at(8)) << n.label << ": the mask is the forward's mp";
      }
      EXPECT_EQ(u.g, u.copy_to == kNoTensor && u.consumer->op == OpKind::bn_add_relu_bwd
                         ? u.consumer->out.at(1)
                         : dx)
          << n.label << ": g goes to dresidual, or to dx where it is copied or read as dy";
      if (u.consumer->op == OpKind::bn_add_relu_bwd) {
        (u.copy_to == kNoTensor ? t.into_dresidual : t.copied) += 1;
      }
      const Attrs& a = n.attrs;
      const bool one = a.kh == 1 && a.kw == 1 && a.sh == 1 && a.sw == 1;
      t.one_by_one += one;
      t.keeps_size +=
          !one && a.sh == 1 && a.sw == 1 && 2 * a.ph == a.kh - 1 && 2 * a.pw == a.kw - 1;
    }
  }
  return t;
}

// ResNet-50: every bottleneck's conv3 data gradient feeds its conv2 CBR's BatchNorm (16), and
// every conv1's (a 1x1 CBR) feeds the previous block's BN+add+ReLU as its second gradient (dy2:
// the backward makes the residual path's contribution first) except layer1.0's, whose input is
// the stem's (an add node sums its two contributions): 15. The 3x3 conv2s feed their conv1 CBR
// (16): the schedule allows those too, the SM90 rule refuses them (3x3). The stride-2
// downsamples of layer2-4 feed the previous block's BN+add+ReLU as its dy, before conv1 has made
// dy2: the schedule refuses those (3; the SM90 rule would too). g goes straight to dresidual,
// with memory reuse too: the plan keeps dresidual live from the producer's step
// (memory_plan.cpp's extend_dresidual), where it used to give dresidual the bytes of a tensor
// the producer reads last (conv2's data gradient, conv1's z), so that g went to dx and the
// BatchNorm backward copied it to dresidual.
TEST(DgradBnRule, Resnet50HasThirtyOneEligibleDataGradients) {
  for (const char* model : {"resnet50", "resnet50_small"}) {
    for (const bool reuse : {true, false}) {
      for (const int64_t batch : {4, 256}) {
        if (batch == 256 && std::string(model) == "resnet50_small") continue;
        SCOPED_TRACE(std::string(model) + (reuse ? ", memory reuse" : ", no reuse") + ", batch " +
                     std::to_string(batch));
        const Tally t = tally(cuda_program(model, reuse, batch));
        EXPECT_EQ(t.to_cbr, 32) << "16 conv3 (1x1) and 16 conv2 (3x3) data gradients";
        EXPECT_EQ(t.to_bn_add_relu, 15) << "the conv1 data gradients of layer1.1 to layer4.2";
        EXPECT_EQ(t.one_by_one, 31) << "16 conv3 + 15 conv1";
        EXPECT_EQ(t.keeps_size, 13) << "the unstrided conv2 (KILN_CUTLASS_CONV_DGRAD)";
        EXPECT_EQ(t.refused, 3) << t.listed();
        EXPECT_EQ(t.into_dresidual, 15) << "dresidual shares no bytes with the producer's step";
        EXPECT_EQ(t.copied, 0);
        std::printf("%s, reuse %d, batch %lld: g into dresidual %d, into dx and copied %d\n", model,
                    reuse, static_cast<long long>(batch), t.into_dresidual, t.copied);
        // The downsamples' data gradients, refused for dy2's order.
        size_t schedule = 0;
        for (const auto& [label, why] : t.refusals) {
          schedule += label.find(".downsample.") != std::string::npos &&
                      why.find("over its other gradient contribution") != std::string::npos;
        }
        EXPECT_EQ(schedule, 3u) << t.listed();
      }
    }
  }
}

// KILN_DRESIDUAL_FROM_DGRAD=0 (CompileOptions::dresidual_from_dgrad): dresidual placed from its
// own step shares the bytes of a tensor conv1's step reads last, so under memory reuse every
// conv1's g goes to dx and is copied; the same eligible uses either way.
TEST(DgradBnRule, DresidualPlacedLateIsCopied) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "memory reuse" : "no reuse");
    const Tally t = tally(cuda_program("resnet50", reuse, 256, false));
    EXPECT_EQ(t.to_bn_add_relu, 15);
    EXPECT_EQ(t.refused, 3) << t.listed();
    EXPECT_EQ(t.copied, reuse ? 15 : 0);
    EXPECT_EQ(t.into_dresidual, reuse ? 0 : 15);
  }
}

// dresidual live from conv1's step costs no activation memory at ResNet-50's peak.
TEST(DgradBnRule, DresidualFromTheDataGradientKeepsThePeak) {
  for (const int64_t batch : {4, 256}) {
    const Program early = cuda_program("resnet50", true, batch, true);
    const Program late = cuda_program("resnet50", true, batch, false);
    EXPECT_EQ(early.memory.region_bytes[static_cast<int>(Region::features)],
              late.memory.region_bytes[static_cast<int>(Region::features)])
        << "batch " << batch;
  }
}

// VGG16-BN: a 3x3 layer's data gradient feeds the CBR before it within a block (the second
// layer of each of the 5 blocks, the third of blocks 3 to 5: 8); the first layer of blocks 2 to
// 5 feeds a max-pool's backward (folded into the CBR before it, cbr_pool_bwd), which is no
// BatchNorm's, and the network's first layer has no dx. All 8 keep their size
// (KILN_CUTLASS_CONV_DGRAD's layers, gpu_cutlass_dgrad_step_test.cpp counts them on the H200).
TEST(DgradBnRule, Vgg16BnHasEightStrideOneDataGradientsIntoACbr) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "memory reuse" : "no reuse");
    const Tally t = tally(cuda_program("vgg16_bn", reuse));
    EXPECT_EQ(t.to_cbr, 8) << t.listed();
    EXPECT_EQ(t.to_bn_add_relu, 0);
    EXPECT_EQ(t.refused, 0) << t.listed();
    EXPECT_EQ(t.one_by_one, 0);
    EXPECT_EQ(t.keeps_size, 8);
  }
}

// With the pooled picks (KILN_POOL_POOLED_SUMS), the first layer of blocks 2 to 5 feeds the
// pooled CBR before it as well: 8 + 4, all keeping their size. Without them the pooled CBR's
// backward is no use (above).
TEST(DgradBnRule, Vgg16BnPooledPicksAddFourDataGradientsIntoAPooledCbr) {
  for (const bool reuse : {true, false}) {
    SCOPED_TRACE(reuse ? "memory reuse" : "no reuse");
    const Tally t = tally(cuda_program("vgg16_bn", reuse, 4, true, true));
    EXPECT_EQ(t.to_cbr, 8) << t.listed();
    EXPECT_EQ(t.to_cbr_pool, 4) << t.listed();
    EXPECT_EQ(t.to_bn_add_relu, 0);
    EXPECT_EQ(t.refused, 0) << t.listed();
    EXPECT_EQ(t.keeps_size, 12);
  }
}

// A first layer's CBR backward may leave dz unwritten (KILN_FIRST_LAYER_BN_FOLD): no other
// node reads it, in VGG16-BN (a plain CBR) or ResNet-50 (the stem's CBR with its max-pool),
// with memory reuse or without. A data gradient's dx, read by the next node, is refused by name.
TEST(DgradBnRule, FirstLayersDzIsReadByNoOtherNode) {
  for (const char* model : {"vgg16_bn", "resnet50"}) {
    for (const bool reuse : {true, false}) {
      SCOPED_TRACE(std::string(model) + (reuse ? ", memory reuse" : ", no reuse"));
      const Program p = cuda_program(model, reuse);
      int first_layers = 0, refused_dx = 0;
      for (const Phase& ph : p.train) {
        for (const Node& n : ph.nodes) {
          if (n.op != OpKind::cbr_bwd && n.op != OpKind::cbr_pool_bwd) continue;
          if (n.out.at(0) == kNoTensor) {
            ++first_layers;
            EXPECT_EQ(unread_output_refusal(p, n, n.out.at(4)), "") << n.label << "'s dz";
          } else {
            const std::string why = unread_output_refusal(p, n, n.out.at(0));
            refused_dx += why.find("is read by '") != std::string::npos;
          }
        }
      }
      EXPECT_EQ(first_layers, 1);
      EXPECT_GT(refused_dx, 0) << "every other CBR's dx is read by the layer before it";
    }
  }
  Node stray;
  stray.label = "stray";
  EXPECT_NE(unread_output_refusal(cuda_program("vgg16_bn", true), stray, 0)
                .find("'stray' is not a training node"),
            std::string::npos);
}

Switches parse(const char* value) {
  return Switches::parse(
      [&](const char* name) -> const char* {
        return std::string(name) == "KILN_CUTLASS_DGRAD" ? value : nullptr;
      },
      Switches{});
}

TEST(DgradBnRule, SwitchIsAutoUnlessAskedAndParsesAsAuto) {
  EXPECT_EQ(parse(nullptr).cutlass_dgrad, Auto::automatic);
  EXPECT_EQ(parse("auto").cutlass_dgrad, Auto::automatic);
  EXPECT_EQ(parse("1").cutlass_dgrad, Auto::on);
  EXPECT_EQ(parse("on").cutlass_dgrad, Auto::on);
  EXPECT_EQ(parse("0").cutlass_dgrad, Auto::off);
  EXPECT_EQ(parse("off").cutlass_dgrad, Auto::off);
  EXPECT_EQ(parse("1").cutlass, Auto::automatic) << "KILN_CUTLASS is a switch of its own";
  try {
    parse("maybe");
    ADD_FAILURE() << "KILN_CUTLASS_DGRAD=maybe was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_CUTLASS_DGRAD"), std::string::npos) << e.what();
  }
}

// auto follows the forward's GEMM (KILN_CUTLASS resolved for the device, the build and the
// precision) as kCutlassDgradByDefault says; 1 tries it everywhere (each layer logs why it
// falls back), 0 nowhere.
TEST(DgradBnRule, AutoFollowsTheForwardsGemm) {
  EXPECT_EQ(sm90_dgrad_tried(Auto::automatic, true), kCutlassDgradByDefault);
  EXPECT_FALSE(sm90_dgrad_tried(Auto::automatic, false)) << "never where the GEMM is not tried";
  EXPECT_TRUE(sm90_dgrad_tried(Auto::on, false));
  EXPECT_TRUE(sm90_dgrad_tried(Auto::on, true));
  EXPECT_FALSE(sm90_dgrad_tried(Auto::off, true));
  EXPECT_FALSE(sm90_dgrad_tried(Auto::off, false));
}

}  // namespace
}  // namespace kiln
