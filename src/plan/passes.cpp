// The ArchPlan's rewrite passes, in the order make_plan runs them.
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {

namespace {

PlanNode& node(ArchPlan& p, int id) {
  return p.nodes[static_cast<size_t>(id)];
}

// Points every consumer of `from` at `to`.
void rewire(ArchPlan& p, int from, int to) {
  for (PlanNode& n : p.nodes) {
    if (n.removed) continue;
    for (int& i : n.inputs) {
      if (i == from) i = to;
    }
  }
}

void drop_identities(ArchPlan& p, const PlanOptions&) {
  int dropped = 0;
  for (PlanNode& n : p.nodes) {
    if (n.removed || n.op == PlanOp::Input) continue;
    const bool identity = n.op == PlanOp::Identity || (n.op == PlanOp::Dropout && n.p == 0.0f) ||
                          (n.op == PlanOp::Flatten && node(p, n.inputs[0]).shape.rank() == 1);
    if (!identity) continue;
    n.removed = true;
    rewire(p, n.id, n.inputs[0]);
    ++dropped;
  }
  p.notes.push_back("drop_identities: removed " + std::to_string(dropped) + " layer(s)");
}

void append_loss_head(ArchPlan& p, const PlanOptions&) {
  int last = -1;
  for (const PlanNode& n : p.nodes) {
    if (!n.removed) last = n.id;
  }
  const PlanNode& out = node(p, last);
  KILN_CHECK(out.shape.rank() == 1 && out.shape[0] == p.num_classes, Shape, "model '", p.model,
             "' ends in layer '", out.name, "' with output ", out.shape.str(),
             " but the loss needs [", p.num_classes,
             "] (one logit per class); end the model with fc(", p.num_classes, ")");
  PlanNode head;
  head.id = static_cast<int>(p.nodes.size());
  head.op = PlanOp::SoftmaxCE;
  head.name = "loss";
  head.inputs = {last};
  head.shape = Shape{1};
  p.nodes.push_back(head);
  p.notes.push_back("append_loss_head: softmax cross-entropy with top-1/top-5 after '" + out.name +
                    "'");
}

void mark_first_layer(ArchPlan& p, const PlanOptions&) {
  std::string first;
  for (PlanNode& n : p.nodes) {
    if (n.removed) continue;
    if (n.op == PlanOp::Input) {
      n.requires_grad = false;
      continue;
    }
    bool upstream = false;
    for (int i : n.inputs) upstream = upstream || node(p, i).requires_grad;
    n.requires_grad = upstream || plan_op_has_params(n.op);
    n.first_layer = plan_op_has_params(n.op) && !upstream;
    if (n.first_layer && first.empty()) first = n.name;
  }
  p.notes.push_back("mark_first_layer: '" + first + "' computes no input gradient");
}

// Why a Conv→BN→ReLU chain cannot take the fused path, or "" when it can. The fused CBR runs
// its convolution as the unfused chain does, so any input channel count and kernel fuse - the
// first layer's 3 channels, ResNet's 7x7 stem (a backend form that cannot take a layer, such
// as CUDA's conv+genstats graph, falls back per layer itself, with a log line). Output
// channels that are not a multiple of 8 stay unfused: FP16 convolutions and the fused
// BatchNorm's 16-byte passes want them.
std::string cbr_refusal(const PlanNode& conv) {
  if (conv.out % 8 != 0)
    return std::to_string(conv.out) + " output channels are not a multiple of 8";
  return "";
}

void merge_cbr(ArchPlan& p, const PlanOptions& o) {
  if (!o.fusion || (!o.amp && !o.backend_fuses_fp32) || !o.backend_fuses_cbr) {
    p.notes.push_back(std::string("merge_cbr: off (") +
                      (!o.fusion                         ? "fusion disabled"
                       : !o.amp && !o.backend_fuses_fp32 ? "the backend fuses only under AMP"
                                                         : "backend has no fused CBR") +
                      ")");
    return;
  }
  int merged = 0;
  for (PlanNode& conv : p.nodes) {
    if (conv.removed || conv.op != PlanOp::Conv) continue;
    const auto c1 = p.consumers(conv.id);
    if (c1.size() != 1 || node(p, c1[0]).op != PlanOp::BatchNorm) continue;
    PlanNode& bn = node(p, c1[0]);
    const auto c2 = p.consumers(bn.id);
    if (c2.size() != 1 || node(p, c2[0]).op != PlanOp::ReLU) continue;
    PlanNode& relu = node(p, c2[0]);
    const std::string why = cbr_refusal(conv);
    if (!why.empty()) {
      log_info("layer '", conv.name, "' keeps Conv, BN, ReLU unfused: ", why);
      p.notes.push_back("merge_cbr: '" + conv.name + "' unfused: " + why);
      continue;
    }
    conv.op = PlanOp::CBR;
    conv.bn_name = bn.name;
    conv.eps = bn.eps;
    conv.momentum = bn.momentum;
    bn.removed = relu.removed = true;
    rewire(p, relu.id, conv.id);
    ++merged;
  }
  p.notes.push_back("merge_cbr: " + std::to_string(merged) + " Conv+BN+ReLU chain(s) fused");
}

// A max-pool whose windows tile a CBR's output (window = stride, no padding, the map's height
// and width multiples of it: VGG's 2x2 / 2 after each block's last CBR) folds into the CBR's
// BatchNorm apply pass (ops.def's cbr_pool_fwd): the full-resolution ReLU output is never
// written, and the backward reads the pooled gradient. A pool whose windows overlap or are
// padded (ResNet's 3x3 / 2, padding 1, after the stem) folds in where the backend has that form
// (backend_fuses_overlapping_pool), its window at most 15 (the mask's byte holds its position)
// and its padding below the window (every window holds an element).
void merge_cbr_pool(ArchPlan& p, const PlanOptions& o) {
  if (!o.fusion || (!o.amp && !o.backend_fuses_fp32) || !o.backend_fuses_cbr ||
      !o.backend_fuses_cbr_pool) {
    p.notes.push_back(std::string("merge_cbr_pool: off (") +
                      (!o.fusion                         ? "fusion disabled"
                       : !o.amp && !o.backend_fuses_fp32 ? "the backend fuses only under AMP"
                       : !o.backend_fuses_cbr_pool
                           ? "backend has no fused CBR+pool, or KILN_FUSE_POOL=0"
                           : "backend has no fused CBR") +
                      ")");
    return;
  }
  int merged = 0;
  for (PlanNode& cbr : p.nodes) {
    if (cbr.removed || cbr.op != PlanOp::CBR || cbr.pool) continue;
    const auto c = p.consumers(cbr.id);
    if (c.size() != 1 || node(p, c[0]).op != PlanOp::MaxPool) continue;
    PlanNode& pool = node(p, c[0]);
    const bool tiles = pool.k == pool.stride && pool.pad == 0 && pool.k >= 2 &&
                       cbr.shape[0] % pool.k == 0 && cbr.shape[1] % pool.k == 0;
    // (A window = stride pool without padding whose map does not divide stays apart: the ops
    // read such attributes as the tiled form.)
    const bool overlaps = !tiles && o.backend_fuses_overlapping_pool && pool.k >= 2 &&
                          pool.k <= 15 && pool.stride >= 1 && pool.pad < pool.k &&
                          (pool.stride != pool.k || pool.pad != 0);
    if (!tiles && !overlaps) {
      p.notes.push_back(
          "merge_cbr_pool: '" + pool.name + "' stays apart: its windows do not tile '" + cbr.name +
          "''s output (k" + std::to_string(pool.k) + " s" + std::to_string(pool.stride) + " p" +
          std::to_string(pool.pad) + ")" +
          (o.backend_fuses_overlapping_pool ? ""
                                            : " and the backend folds no overlapping pool, or "
                                              "KILN_FUSE_OVERLAPPING_POOL=0"));
      continue;
    }
    cbr.pool = pool.k;
    cbr.pool_stride = pool.stride;
    cbr.pool_pad = pool.pad;
    cbr.pool_name = pool.name;
    cbr.pool_in = cbr.shape;
    cbr.shape = pool.shape;
    pool.removed = true;
    rewire(p, pool.id, cbr.id);
    ++merged;
  }
  p.notes.push_back("merge_cbr_pool: " + std::to_string(merged) + " max-pool(s) folded into CBR");
}

void merge_bn_add_relu(ArchPlan& p, const PlanOptions& o) {
  if (!o.fusion || (!o.amp && !o.backend_fuses_fp32) || !o.backend_fuses_bn_add_relu) {
    p.notes.push_back(std::string("merge_bn_add_relu: off (") +
                      (!o.fusion                         ? "fusion disabled"
                       : !o.amp && !o.backend_fuses_fp32 ? "the backend fuses only under AMP"
                                                         : "backend has no fused BN+add+ReLU") +
                      ")");
    return;
  }
  int merged = 0, folded = 0;
  for (PlanNode& add : p.nodes) {
    if (add.removed || add.op != PlanOp::Add) continue;
    const auto out = p.consumers(add.id);
    if (out.size() != 1 || node(p, out[0]).op != PlanOp::ReLU) continue;
    // The main branch ends in a BatchNorm that feeds only this add.
    int bn_slot = -1;
    for (int s = 0; s < 2; ++s) {
      const PlanNode& in = node(p, add.inputs[static_cast<size_t>(s)]);
      if (in.op == PlanOp::BatchNorm && p.consumers(in.id).size() == 1) {
        bn_slot = s;
        break;
      }
    }
    if (bn_slot < 0) continue;
    PlanNode& bn = node(p, add.inputs[static_cast<size_t>(bn_slot)]);
    if (bn.shape[2] % 8 != 0) {
      p.notes.push_back("merge_bn_add_relu: '" + bn.name +
                        "' unfused: channels not a multiple of 8");
      continue;
    }
    int residual = add.inputs[static_cast<size_t>(1 - bn_slot)];
    PlanNode& relu = node(p, out[0]);
    // A downsampling shortcut's BatchNorm, feeding this add alone, folds in too where the backend
    // applies it on the fly: its output is never written.
    PlanNode& res = node(p, residual);
    if (o.backend_fuses_residual_bn && res.op == PlanOp::BatchNorm &&
        p.consumers(res.id).size() == 1 && res.shape == bn.shape) {
      add.res_bn_name = res.name;
      add.res_eps = res.eps;
      add.res_momentum = res.momentum;
      residual = res.inputs[0];
      res.removed = true;
      ++folded;
    }
    add.op = PlanOp::BnAddReLU;
    add.bn_name = bn.name;
    add.inputs = {bn.inputs[0], residual};
    add.eps = bn.eps;
    add.momentum = bn.momentum;
    bn.removed = relu.removed = true;
    rewire(p, relu.id, add.id);
    ++merged;
  }
  p.notes.push_back("merge_bn_add_relu: " + std::to_string(merged) +
                    " BN+add+ReLU tail(s) fused, " + std::to_string(folded) +
                    " with their shortcut's BatchNorm");
}

}  // namespace

std::vector<PlanPass> default_passes() {
  return {{"drop_identities", drop_identities},   {"append_loss_head", append_loss_head},
          {"mark_first_layer", mark_first_layer}, {"merge_cbr", merge_cbr},
          {"merge_cbr_pool", merge_cbr_pool},     {"merge_bn_add_relu", merge_bn_add_relu}};
}

}  // namespace kiln
