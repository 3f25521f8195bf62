// MemoryPlan and Program invariants (SPEC S4, S5): alignment, contiguity, the 2:1 slot rule,
// AMP gating, and liveness reuse that never lets two live tensors share bytes.
#include "kiln/graph/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/graph/compiler.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

Program compiled(const std::string& model, bool amp, bool reuse = true, int64_t batch = 4,
                 bool ema = false, const std::string& opt = "sgd", bool fuse = false,
                 bool fuse_grad_sum = false, bool fuse_weight_cast = false) {
  CompileOptions o;
  o.batch = batch;
  o.fuse_grad_sum = fuse_grad_sum;
  o.fuse_weight_cast = fuse_weight_cast;
  o.amp = amp;
  o.memory_reuse = reuse;
  o.ema = ema;
  o.optimizer = opt;
  PlanOptions po;
  po.amp = amp;
  po.backend_fuses_cbr = po.backend_fuses_bn_add_relu =
      fuse;  // as a backend with fused kernels says
  Program p = lower_program(make_plan(make_model(model), po), o);
  plan_memory(p);
  validate_program(p);
  return p;
}

TEST(MemoryPlan, EveryTensorIsAlignedAndInsideItsRegion) {
  for (bool amp : {false, true}) {
    const Program p = compiled("resnet18_small", amp);
    for (const DTensor& t : p.tensors) {
      EXPECT_EQ(t.offset % kAlignment, 0) << t.name;
      EXPECT_LE(t.offset + t.bytes(), p.memory.region_bytes[static_cast<int>(t.region)]) << t.name;
    }
  }
}

TEST(MemoryPlan, ParametersAreContiguousByKindWithTwoToOneSlots) {
  const Program p = compiled("resnet50", true, true, 2, true, "adamw");
  int64_t cursor = 0;
  ParamKind last = ParamKind::ConvWeight;
  for (const ParamDesc& d : p.params) {
    EXPECT_EQ(d.slot, cursor) << d.name;
    EXPECT_EQ(d.slot_elems % 128, 0) << d.name;
    EXPECT_GE(d.slot_elems, d.shape.numel());
    EXPECT_GE(static_cast<int>(d.kind), static_cast<int>(last))
        << "kinds out of order at " << d.name;
    last = d.kind;
    cursor += d.slot_elems;
    // The same slot in every region; FP32 slot bytes exactly twice the FP16 slot's.
    const DTensor& f32 = p.tensor(d.tensor[static_cast<int>(Region::params_f32)]);
    const DTensor& f16 = p.tensor(d.tensor[static_cast<int>(Region::params_f16)]);
    EXPECT_EQ(f32.offset, 2 * f16.offset) << d.name;
    for (Region r : {Region::grads_f32, Region::moment1, Region::moment2, Region::ema_f32}) {
      EXPECT_EQ(p.tensor(d.tensor[static_cast<int>(r)]).offset, f32.offset)
          << d.name << " in " << region_name(r);
    }
    EXPECT_EQ(p.tensor(d.tensor[static_cast<int>(Region::grads_f16)]).offset, f16.offset);
    EXPECT_EQ(p.tensor(d.tensor[static_cast<int>(Region::ema_f16)]).offset, f16.offset);
    EXPECT_EQ(d.decay, d.kind == ParamKind::ConvWeight || d.kind == ParamKind::FcWeight) << d.name;
  }
  EXPECT_EQ(cursor, p.param_elems);
  EXPECT_EQ(p.memory.region_bytes[static_cast<int>(Region::params_f32)],
            2 * p.memory.region_bytes[static_cast<int>(Region::params_f16)]);
}

TEST(MemoryPlan, AmpRegionsExistOnlyWithAmp) {
  const Program fp32 = compiled("resnet18_small", false, true, 4, true);
  for (Region r : {Region::params_f16, Region::grads_f16, Region::ema_f16}) {
    EXPECT_EQ(fp32.memory.region_bytes[static_cast<int>(r)], 0) << region_name(r);
  }
  const Program amp = compiled("resnet18_small", true, true, 4, true);
  for (Region r : {Region::params_f16, Region::grads_f16, Region::ema_f16}) {
    EXPECT_GT(amp.memory.region_bytes[static_cast<int>(r)], 0) << region_name(r);
  }
  for (const DTensor& t : amp.tensors) {
    if (t.region == Region::features) EXPECT_EQ(t.dtype, DType::F16) << t.name;
  }
}

TEST(MemoryPlan, AnFp16FeatureWithAmpOffIsAnError) {
  Program p = compiled("cnn", false);
  Program bad = p;
  // Turn the step's input (and its views) FP16.
  for (DTensor& t : bad.tensors) {
    if (t.id == bad.io.input || t.view_of == bad.io.input) t.dtype = DType::F16;
  }
  EXPECT_THROW(validate_program(bad), Error);
  try {
    validate_program(bad);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Memory);
    EXPECT_NE(std::string(e.what()).find("AMP"), std::string::npos) << e.what();
  }
  // And the reverse: an FP32 feature under AMP.
  Program amp = compiled("cnn", true);
  for (DTensor& t : amp.tensors) {
    if (t.id == amp.io.input || t.view_of == amp.io.input) t.dtype = DType::F32;
  }
  EXPECT_THROW(validate_program(amp), Error);
}

TEST(MemoryPlan, MisalignedTensorIsAnError) {
  Program p = compiled("cnn", false);
  for (DTensor& t : p.tensors) {
    if (t.region == Region::bn_running) {
      t.offset += 4;
      break;
    }
  }
  EXPECT_THROW(validate_program(p), Error);
}

// Reference liveness, computed here independently of the planner.
std::map<TensorId, std::pair<int64_t, int64_t>> lifetimes(const Program& p) {
  std::map<TensorId, std::pair<int64_t, int64_t>> live;
  int64_t t = 0;
  for (const auto* list : {&p.train, &p.eval, &p.eval_ema, &p.init}) {
    for (const Phase& ph : *list) {
      for (const Node& n : ph.nodes) {
        for (const auto* ids : {&n.in, &n.out}) {
          for (TensorId id : *ids) {
            if (id == kNoTensor) continue;
            TensorId root = id;
            while (p.tensor(root).view_of != kNoTensor) root = p.tensor(root).view_of;
            auto it = live.find(root);
            if (it == live.end())
              live[root] = {t, t};
            else
              it->second = {std::min(it->second.first, t), std::max(it->second.second, t)};
          }
        }
        ++t;
      }
    }
  }
  return live;
}

TEST(MemoryPlan, ReuseNeverAliasesTwoLiveTensors) {
  for (const std::string model : {"resnet18_small", "vgg11_bn_small", "lenet",
                                  "resnet18_small+fused", "vgg11_bn_small+fused"}) {
    const bool fused = model.find("+fused") != std::string::npos;
    const Program p =
        fused ? compiled(model.substr(0, model.find('+')), true, true, 4, false, "sgd", true)
              : compiled(model, false);
    const auto live = lifetimes(p);
    std::vector<TensorId> feats;
    for (const auto& [id, iv] : live) {
      const Region r = p.tensor(id).region;
      if (r == Region::features || r == Region::aux) feats.push_back(id);
    }
    int shared = 0;
    for (size_t i = 0; i < feats.size(); ++i) {
      for (size_t j = i + 1; j < feats.size(); ++j) {
        const DTensor& a = p.tensor(feats[i]);
        const DTensor& b = p.tensor(feats[j]);
        if (a.region != b.region) continue;
        const bool bytes_overlap =
            a.offset < b.offset + b.bytes() && b.offset < a.offset + a.bytes();
        if (!bytes_overlap) continue;
        ++shared;
        const auto& ia = live.at(feats[i]);
        const auto& ib = live.at(feats[j]);
        EXPECT_TRUE(ia.second < ib.first || ib.second < ia.first)
            << model << ": " << a.name << " and " << b.name << " share bytes while both live";
      }
    }
    EXPECT_GT(shared, 0) << model << ": reuse should share some bytes";
  }
}

// Fused CBR (issue 5): each cbr_bwd reads the convolution output (z), the bit mask and the
// saved statistics that its cbr_fwd wrote - BatchNorm's backward needs the normalised input at
// every element, not only where ReLU passed it - and the first layer computes no input
// gradient. BN+add+ReLU's backward reads the mask and statistics of its forward.
TEST(Program, FusedBackwardsReadWhatTheirForwardsWrote) {
  const Program p = compiled("resnet50", true, true, 2, false, "sgd", true);
  std::map<std::string, const Node*> fwd;
  int cbr = 0, bar = 0;
  for (const Phase& ph : p.train) {
    for (const Node& n : ph.nodes) {
      if (n.op == OpKind::cbr_fwd || n.op == OpKind::bn_add_relu_fwd) {
        fwd[n.label.substr(0, n.label.find(' '))] = &n;
        if (n.op == OpKind::cbr_fwd) {
          ASSERT_EQ(n.out.size(), 4u) << n.label;
          EXPECT_EQ(p.tensor(n.out[0]).shape, p.tensor(n.out[1]).shape) << n.label << ": z and y";
          EXPECT_EQ(p.tensor(n.out[3]).numel(), (p.tensor(n.out[1]).numel() + 7) / 8)
              << n.label << ": one bit each";
        }
      }
      if (n.op == OpKind::cbr_bwd) {
        ++cbr;
        const Node* f = fwd.at(n.label.substr(0, n.label.find(' ')));
        ASSERT_EQ(f->op, OpKind::cbr_fwd);
        EXPECT_EQ(n.in[0], f->in[0]) << n.label << ": x";
        EXPECT_EQ(n.in[2], f->out[0]) << n.label << ": z, the convolution's output";
        EXPECT_EQ(n.in[4], f->out[3]) << n.label << ": mask";
        EXPECT_EQ(n.in[6], f->out[2]) << n.label << ": saved statistics";
        EXPECT_EQ(n.out[0] == kNoTensor, n.label.rfind("conv1 ", 0) == 0)
            << n.label << ": only the stem (the first layer) skips dx";
      }
      if (n.op == OpKind::bn_add_relu_bwd) {
        ++bar;
        const Node* f = fwd.at(n.label.substr(0, n.label.find(' ')));
        ASSERT_EQ(f->op, OpKind::bn_add_relu_fwd);
        EXPECT_EQ(n.in[0], f->in[0]) << n.label;
        EXPECT_EQ(n.in[2], f->out[2]) << n.label << ": mask";
        EXPECT_EQ(n.in[4], f->out[1]) << n.label << ": saved statistics";
      }
    }
  }
  EXPECT_EQ(cbr, 33);
  EXPECT_EQ(bar, 16);
}

// The gradient-sum fusion (CompileOptions::fuse_grad_sum): a residual block's output feeds
// the next block twice, so its gradient has two contributions. Folded, the BN+add+ReLU
// backward takes the second as dy2 - written earlier in the backward by the next block - and
// the add node that summed them is gone: 15 of ResNet-50's 16 blocks (the last feeds only the
// pooling). Off, no backward takes a dy2.
TEST(Program, GradientSumsFoldIntoTheBnAddReluBackward) {
  auto count = [](const Program& p, int* folded, int* sums) {
    std::set<TensorId> written;
    *folded = *sums = 0;
    for (const Phase& ph : p.train) {
      for (const Node& n : ph.nodes) {
        if (n.op == OpKind::add && n.label.find("grad sum") != std::string::npos) ++*sums;
        if (n.op == OpKind::bn_add_relu_bwd && n.in.size() > 5 && n.in[5] != kNoTensor) {
          ++*folded;
          EXPECT_TRUE(written.count(n.in[5])) << n.label << ": dy2 is written before it is read";
          EXPECT_EQ(p.tensor(n.in[5]).shape, p.tensor(n.in[1]).shape) << n.label;
          EXPECT_NE(n.in[5], n.in[1]) << n.label;
        }
        for (TensorId t : n.out) written.insert(t);
      }
    }
  };
  int folded_on = 0, sums_on = 0, folded_off = 0, sums_off = 0;
  count(compiled("resnet50", true, true, 2, false, "sgd", true, true), &folded_on, &sums_on);
  count(compiled("resnet50", true, true, 2, false, "sgd", true, false), &folded_off, &sums_off);
  EXPECT_EQ(folded_on, 15);
  EXPECT_EQ(folded_off, 0);
  EXPECT_EQ(sums_off - sums_on, 15);
}

// Evaluation of a fused program: every CBR and BN+add+ReLU of ResNet-50 (33 + 16) runs its
// BatchNorm, add and ReLU as one bn_relu_infer after its convolution; no relu_fwd is left,
// and only the 4 downsample BatchNorms (which feed an add, not a ReLU) stay bn_fwd_infer.
TEST(Program, FusedEvaluationUsesTheInferenceForm) {
  const Program p = compiled("resnet50", true, true, 2, false, "sgd", true);
  int fused = 0, relu = 0, bn = 0;
  for (const Phase& ph : p.eval) {
    for (const Node& n : ph.nodes) {
      fused += n.op == OpKind::bn_relu_infer;
      relu += n.op == OpKind::relu_fwd;
      bn += n.op == OpKind::bn_fwd_infer;
      if (n.op == OpKind::bn_relu_infer)
        EXPECT_TRUE(n.in.size() == 5 || n.in.size() == 6) << n.label;
    }
  }
  EXPECT_EQ(fused, 49);
  EXPECT_EQ(relu, 0);
  EXPECT_EQ(bn, 4);
}

TEST(MemoryPlan, ReuseShrinksActivationsAndCanBeSwitchedOff) {
  const Program on = compiled("resnet50", true, true, 32);
  const Program off = compiled("resnet50", true, false, 32);
  const auto feat = [](const Program& p) {
    return p.memory.region_bytes[static_cast<int>(Region::features)];
  };
  EXPECT_LT(feat(on), feat(off) / 2)
      << "liveness reuse should more than halve ResNet-50's activations";
  EXPECT_EQ(feat(off), off.memory.features_without_reuse);
  EXPECT_EQ(on.memory.features_without_reuse, off.memory.features_without_reuse);
  EXPECT_NE(describe_memory(on).find("with reuse"), std::string::npos);
}

TEST(MemoryPlan, LockingTwiceIsALifecycleError) {
  Program p = compiled("cnn", false);
  try {
    plan_memory(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::State);
  }
}

TEST(Program, PhasesComeInScheduleOrder) {
  const Program p = compiled("resnet18_small", true, true, 4, true);
  std::vector<PhaseKind> kinds;
  for (const Phase& ph : p.train) kinds.push_back(ph.kind);
  const std::vector<PhaseKind> expected{
      PhaseKind::transfer,         PhaseKind::transfer,       PhaseKind::forward_first,
      PhaseKind::forward_backward, PhaseKind::backward_first, PhaseKind::grad_cast,
      PhaseKind::check_scale,      PhaseKind::optimizer,      PhaseKind::ema,
      PhaseKind::weight_cast};
  EXPECT_EQ(kinds, expected);
  // The loss scale changes after the optimizer has unscaled with the step's own scale.
  const Phase& opt = p.train[7];
  ASSERT_EQ(opt.kind, PhaseKind::optimizer);
  EXPECT_EQ(opt.nodes.back().op, OpKind::loss_scale_update);
  for (const Phase& ph : p.train) {
    for (size_t i = 0; i < ph.nodes.size(); ++i) {
      if (ph.nodes[i].op == OpKind::loss_scale_update) EXPECT_EQ(&ph, &opt);
    }
  }
  // The first layer's backward has no data gradient.
  for (const Node& n : p.train[4].nodes) EXPECT_NE(n.op, OpKind::conv_bwd_data) << n.label;
  // FP32 has no casts, no loss-scale phase.
  const Program fp32 = compiled("resnet18_small", false);
  for (const Phase& ph : fp32.train) {
    EXPECT_NE(ph.kind, PhaseKind::grad_cast);
    EXPECT_NE(ph.kind, PhaseKind::check_scale);
    EXPECT_NE(ph.kind, PhaseKind::weight_cast);
  }
  EXPECT_FALSE(p.eval.empty());
  EXPECT_FALSE(p.eval_ema.empty());
  EXPECT_NE(describe_program(p, true).find("phase optimizer"), std::string::npos);
}

// KILN_FUSE_WEIGHT_CAST: under AMP each optimizer writes the compute copy of the weights it
// updates (ops.def's [w16]) over exactly the bytes the weight_cast phase's cast wrote, and that
// phase is gone; SGD and AdamW as one range node, LARS per weight; validate_program passes.
TEST(Program, WeightCastFusedIntoTheOptimizerCoversTheCastsRange) {
  for (const std::string opt : {"sgd", "adamw", "lars"}) {
    SCOPED_TRACE(opt);
    auto build = [&](bool fused) {
      return compiled("resnet18_small", true, true, 4, true, opt, false, false, fused);
    };
    // [begin, end) bytes of params_f16 written by the phases of `kind`.
    auto f16_written = [](const Program& p, PhaseKind kind) {
      std::vector<std::pair<int64_t, int64_t>> spans;
      for (const Phase& ph : p.train) {
        if (ph.kind != kind) continue;
        for (const Node& n : ph.nodes) {
          for (TensorId id : n.out) {
            if (id == kNoTensor || p.tensor(id).region != Region::params_f16) continue;
            spans.push_back({p.tensor(id).offset, p.tensor(id).offset + p.tensor(id).bytes()});
          }
        }
      }
      std::sort(spans.begin(), spans.end());
      return spans;
    };
    const Program plain = build(false), fused = build(true);
    const auto cast = f16_written(plain, PhaseKind::weight_cast);
    ASSERT_EQ(cast.size(), 1u) << "one cast over the decayed range";
    EXPECT_TRUE(f16_written(plain, PhaseKind::optimizer).empty());
    const auto by_update = f16_written(fused, PhaseKind::optimizer);
    ASSERT_FALSE(by_update.empty());
    for (const Phase& ph : fused.train) EXPECT_NE(ph.kind, PhaseKind::weight_cast);
    // LARS writes a piece a weight: the slots' padding between them keeps init's zeros, which
    // is all the range cast would write there.
    EXPECT_EQ(by_update.front().first, cast[0].first);
    int64_t covered = 0;
    for (const auto& [b, e] : by_update) covered += e - b;
    if (opt == "lars") {
      EXPECT_GT(by_update.size(), 1u);
      EXPECT_LE(by_update.back().second, cast[0].second);
      EXPECT_LE(covered, cast[0].second - cast[0].first);
    } else {
      ASSERT_EQ(by_update.size(), 1u);
      EXPECT_EQ(by_update[0], cast[0]);
    }
  }
}

TEST(Program, OptimizerSkipsDecayForBatchNormAndBiases) {
  CompileOptions o;
  o.batch = 2;
  o.weight_decay = 1e-4f;
  Program p = lower_program(make_plan(make_model("vgg11_bn_small")), o);
  int decayed = 0, plain = 0;
  for (const Phase& ph : p.train) {
    if (ph.kind != PhaseKind::optimizer) continue;
    for (const Node& n : ph.nodes) {
      ASSERT_EQ(n.op, OpKind::sgd);
      (n.attrs.weight_decay > 0 ? decayed : plain)++;
    }
  }
  EXPECT_EQ(decayed, 1);
  EXPECT_EQ(plain, 1);
}

}  // namespace
}  // namespace kiln
