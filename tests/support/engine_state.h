// What a trained Engine holds, by name, for comparing two runs whose programs differ (fusion
// reorders declarations): every parameter (its FP32 master) and every FP32 buffer (BatchNorm's
// running statistics).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "kiln/task/engine.h"

namespace kiln::test {

inline std::map<std::string, std::vector<float>> params_and_buffers(Engine& e) {
  std::map<std::string, std::vector<float>> r;
  for (const ParamDesc& d : e.program().params) r[d.name] = e.read_param(d.name);
  for (const BufferDesc& buf : e.program().buffers) {
    const DTensor& t = e.program().tensor(buf.tensor);
    if (t.dtype != DType::F32) continue;
    std::vector<float> v(static_cast<size_t>(t.numel()));
    e.backend().read(t, v.data());
    r[buf.name] = std::move(v);
  }
  return r;
}

// The training nodes for which pred(phase, node) holds: what the counts below share.
template <class Pred>
int train_node_count(const Engine& e, Pred pred) {
  int n = 0;
  for (const Phase& ph : e.program().train) {
    for (const Node& node : ph.nodes) n += pred(ph, node) ? 1 : 0;
  }
  return n;
}

// The number of fused nodes (CBR, BN+add+ReLU) in the training phases.
inline int fused_node_count(const Engine& e) {
  return train_node_count(
      e, [](const Phase&, const Node& n) { return op_category(n.op) == OpCategory::Fused; });
}

// The CBR nodes with a max-pool folded in (cbr_pool_fwd and cbr_pool_bwd; KILN_FUSE_POOL).
inline int pooled_cbr_count(const Engine& e) {
  return train_node_count(e, [](const Phase&, const Node& n) {
    return n.op == OpKind::cbr_pool_fwd || n.op == OpKind::cbr_pool_bwd;
  });
}

// The pooled CBR nodes that write or read the pooled picks (ops.def's zp and mp on cbr_pool_fwd
// and cbr_pool_bwd; KILN_POOL_POOLED_SUMS).
inline int pooled_picks_count(const Engine& e) {
  return train_node_count(e, [](const Phase&, const Node& n) {
    return (n.op == OpKind::cbr_pool_fwd && n.out.size() > 4 && n.out[4] != kNoTensor) ||
           (n.op == OpKind::cbr_pool_bwd && n.in.size() > 7 && n.in[7] != kNoTensor);
  });
}

// The BN+add+ReLU backwards that take a second gradient (ops.def's dy2): the gradient sums
// folded into them (CompileOptions::fuse_grad_sum).
inline int folded_grad_sum_count(const Engine& e) {
  return train_node_count(e, [](const Phase&, const Node& n) {
    return n.op == OpKind::bn_add_relu_bwd && n.in.size() > 5 && n.in[5] != kNoTensor;
  });
}

// The BN+add+ReLU forwards that also apply the shortcut's BatchNorm (KILN_FUSE_RESIDUAL_BN).
inline int residual_bn_folded_count(const Engine& e) {
  return train_node_count(e, [](const Phase&, const Node& n) {
    return n.op == OpKind::bn_add_relu_fwd && n.in.size() > 6;
  });
}

// The optimizer nodes' outputs in the FP16/BF16 weight region: the compute copies they write
// (KILN_FUSE_WEIGHT_CAST).
inline int optimizer_compute_copy_count(const Engine& e) {
  int n = 0;
  for (const Phase& ph : e.program().train) {
    if (ph.kind != PhaseKind::optimizer) continue;
    for (const Node& node : ph.nodes) {
      for (TensorId id : node.out)
        n += id != kNoTensor && e.program().tensor(id).region == Region::params_f16;
    }
  }
  return n;
}

}  // namespace kiln::test
