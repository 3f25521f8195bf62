// The data-parallel compiler pass (kiln/graph/data_parallel.h) on compiled Programs, in one
// process: world 1 changes nothing; world > 1 adds the two gradient buckets where their
// gradients are finished, the overflow reduction, the averaging factor, and SyncBN's split.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/graph/compiler.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

CompileOptions options(int world, bool amp = false) {
  CompileOptions o;
  o.batch = 4;
  o.amp = amp;
  o.world = world;
  o.weight_decay = 5e-4f;
  return o;
}

Program compiled(const std::string& model, const CompileOptions& o) {
  PlanOptions po;
  po.amp = o.amp;
  Program p = lower_program(make_plan(make_model(model), po), o);
  plan_memory(p);
  validate_program(p);
  return p;
}

bool is_dist_op(OpKind op) {
  return op == OpKind::allreduce || op == OpKind::allgather || op == OpKind::bn_stats ||
         op == OpKind::bn_fwd_sync || op == OpKind::bn_bwd_reduce || op == OpKind::bn_bwd_sync;
}

std::vector<std::string> phase_names(const Program& p) {
  std::vector<std::string> v;
  for (const Phase& ph : p.train) v.push_back(ph.name);
  return v;
}

size_t index_of(const std::vector<std::string>& v, const std::string& name) {
  return static_cast<size_t>(std::find(v.begin(), v.end(), name) - v.begin());
}

int count_op(const Program& p, OpKind op) {
  int n = 0;
  for (const auto* list : {&p.train, &p.eval, &p.eval_ema, &p.init}) {
    for (const Phase& ph : *list) {
      for (const Node& node : ph.nodes) n += node.op == op;
    }
  }
  return n;
}

// World 1 is the program as it was before data parallelism existed: no op, tensor or phase
// more, whatever sync_bn says, and every attribute at its neutral value.
TEST(DataParallelPass, WorldOneChangesNothing) {
  for (const std::string model : {"cnn", "resnet18_small"}) {
    for (bool amp : {false, true}) {
      CompileOptions a = options(1, amp), b = a;
      b.sync_bn = false;
      a.clip_grad = b.clip_grad = 1.0f;
      const Program pa = compiled(model, a), pb = compiled(model, b);
      EXPECT_EQ(describe_program(pa, true), describe_program(pb, true)) << model;
      for (const auto* list : {&pa.train, &pa.eval, &pa.init}) {
        for (const Phase& ph : *list) {
          EXPECT_NE(ph.kind, PhaseKind::communicate) << model << " " << ph.name;
          for (const Node& n : ph.nodes) {
            EXPECT_FALSE(is_dist_op(n.op)) << model << " " << n.label;
            EXPECT_EQ(n.attrs.grad_average, 1.0f) << n.label;
            EXPECT_EQ(n.attrs.world, 1) << n.label;
            if (n.op == OpKind::check_clip) EXPECT_EQ(n.attrs.clip, 1.0f);
          }
        }
      }
    }
  }
}

// FP32: the deep bucket right after the deep backward (before the first layer's backward),
// the first layer's after its backward; together they cover every parameter slot once.
TEST(DataParallelPass, TwoBucketsWhereTheirGradientsAreFinished) {
  const Program p = compiled("cnn", options(2));
  const auto names = phase_names(p);
  const size_t fb = index_of(names, "forward_backward"), deep = index_of(names, "communicate_deep"),
               bf = index_of(names, "backward_first"), first = index_of(names, "communicate_first"),
               opt = index_of(names, "optimizer");
  ASSERT_LT(opt, names.size());
  EXPECT_EQ(deep, fb + 1);
  EXPECT_EQ(bf, deep + 1);
  EXPECT_EQ(first, bf + 1);
  EXPECT_LT(first, opt);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Phase& ph : p.train) {
    if (ph.kind != PhaseKind::communicate) continue;
    EXPECT_EQ(ph.stream, 1) << ph.name;
    for (const Node& n : ph.nodes) {
      ASSERT_EQ(n.op, OpKind::allreduce);
      const DTensor& t = p.tensor(n.in[0]);
      EXPECT_EQ(t.region, Region::grads_f32);
      EXPECT_EQ(n.out[0], n.in[0]);
      EXPECT_FALSE(n.attrs.reduce_max);
      EXPECT_EQ(n.attrs.world, 2);
      ranges.push_back({t.offset / 4, t.offset / 4 + t.numel()});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t cursor = 0;
  for (const auto& [b, e] : ranges) {
    EXPECT_EQ(b, cursor) << "buckets must tile the parameter slots";
    cursor = e;
  }
  EXPECT_EQ(cursor, p.param_elems);
  // The first layer's bucket is exactly the first convolution's weight slot.
  const ParamDesc* w = p.find_param("block1.conv.weight");
  ASSERT_NE(w, nullptr);
  const Phase& fp = p.train[first];
  ASSERT_EQ(fp.nodes.size(), 1u);
  EXPECT_EQ(p.tensor(fp.nodes[0].in[0]).offset / 4, w->slot);
  EXPECT_EQ(p.tensor(fp.nodes[0].in[0]).numel(), w->slot_elems);
}

// The optimizers average (1/world in their unscale multiply); no other node scales.
TEST(DataParallelPass, AveragingIsFoldedIntoTheOptimizers) {
  for (const std::string opt : {"sgd", "adamw", "lars"}) {
    CompileOptions o = options(4);
    o.optimizer = opt;
    const Program p = compiled("cnn", o);
    int updates = 0;
    for (const Phase& ph : p.train) {
      for (const Node& n : ph.nodes) {
        if (n.op == OpKind::sgd || n.op == OpKind::adamw || n.op == OpKind::lars) {
          EXPECT_EQ(n.attrs.grad_average, 0.25f) << opt << " " << n.label;
          ++updates;
        }
      }
    }
    EXPECT_GT(updates, 0) << opt;
  }
}

// AMP: both buckets after grad_cast (the FP16 gradients are reduced in FP32), deep first; the
// overflow flag reduced with max between the check and the loss-scale update; the clip bound
// scaled to the sum.
TEST(DataParallelPass, AmpReducesAfterTheCastAndReducesTheOverflowFlag) {
  CompileOptions o = options(2, /*amp=*/true);
  o.clip_grad = 0.5f;
  const Program p = compiled("resnet18_small", o);
  const auto names = phase_names(p);
  const size_t cast = index_of(names, "grad_cast"), deep = index_of(names, "communicate_deep"),
               first = index_of(names, "communicate_first"), check = index_of(names, "check_scale");
  ASSERT_LT(check, names.size());
  EXPECT_EQ(deep, cast + 1);
  EXPECT_EQ(first, cast + 2);
  EXPECT_EQ(check, first + 1);
  const Phase& cs = p.train[check];
  ASSERT_EQ(cs.nodes.size(), 2u);
  EXPECT_EQ(cs.nodes[0].op, OpKind::check_clip);
  EXPECT_EQ(cs.nodes[0].attrs.clip, 1.0f) << "clip 0.5 on the average is 1.0 on the sum of 2";
  EXPECT_EQ(cs.nodes[1].op, OpKind::allreduce);
  EXPECT_TRUE(cs.nodes[1].attrs.reduce_max);
  EXPECT_EQ(cs.nodes[1].in[0], p.io.overflow);
  // The loss scale is updated after the optimizer, from the reduced flag.
  const Phase& opt = p.train[index_of(names, "optimizer")];
  EXPECT_EQ(opt.nodes.back().op, OpKind::loss_scale_update);
}

// SyncBN: every training BatchNorm becomes stats → allgather → normalise, and its backward
// local sums → allreduce → dx; evaluation keeps the running statistics. Without SyncBN the
// BatchNorms stay as they are.
TEST(DataParallelPass, SyncBnSplitsEveryTrainingBatchNorm) {
  const Program one = compiled("resnet18_small", options(1));
  const int bns = count_op(one, OpKind::bn_fwd_train);
  ASSERT_GT(bns, 0);
  const Program p = compiled("resnet18_small", options(2));
  EXPECT_EQ(count_op(p, OpKind::bn_fwd_train), 0);
  EXPECT_EQ(count_op(p, OpKind::bn_bwd), 0);
  EXPECT_EQ(count_op(p, OpKind::bn_stats), bns);
  EXPECT_EQ(count_op(p, OpKind::bn_fwd_sync), bns);
  EXPECT_EQ(count_op(p, OpKind::allgather), bns);
  EXPECT_EQ(count_op(p, OpKind::bn_bwd_reduce), count_op(one, OpKind::bn_bwd));
  EXPECT_EQ(count_op(p, OpKind::bn_fwd_infer), count_op(one, OpKind::bn_fwd_infer));
  for (const Phase& ph : p.train) {
    for (size_t i = 0; i < ph.nodes.size(); ++i) {
      const Node& n = ph.nodes[i];
      if (n.op == OpKind::bn_fwd_sync) {
        ASSERT_GE(i, 2u);
        EXPECT_EQ(ph.nodes[i - 2].op, OpKind::bn_stats);
        EXPECT_EQ(ph.nodes[i - 1].op, OpKind::allgather);
        EXPECT_EQ(n.in.at(5), ph.nodes[i - 1].out[0]);
        EXPECT_EQ(p.tensor(n.in[5]).numel(), 2 * 2 * p.tensor(n.in[1]).numel());
      }
      if (n.op == OpKind::bn_bwd_sync) {
        EXPECT_EQ(ph.nodes[i - 1].op, OpKind::allreduce);
        EXPECT_EQ(ph.nodes[i - 2].op, OpKind::bn_bwd_reduce);
        EXPECT_EQ(n.in.at(4), ph.nodes[i - 1].out[0]);
      }
    }
  }
  CompileOptions o = options(2);
  o.sync_bn = false;
  const Program q = compiled("resnet18_small", o);
  EXPECT_EQ(count_op(q, OpKind::bn_fwd_train), bns);
  EXPECT_EQ(count_op(q, OpKind::bn_stats), 0);
  EXPECT_EQ(count_op(q, OpKind::allgather), 0);
}

TEST(DataParallelPass, BadWorldIsAClearError) {
  try {
    compiled("cnn", options(0));
    FAIL() << "world 0 compiled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world size"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
