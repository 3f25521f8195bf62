// The nodes a fused node's parts are built from, for both backends' fused kernels
// (cpu/fused.cpp, cuda/fused.cpp): each unfused part's kernel gets a node of its own
// (fused_part), and a CBR node's tensors are unpacked by role.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "backend/node_checks.h"
#include "kiln/graph/program.h"

namespace kiln {

// One unfused part of a fused node: the fused node's attributes (the convolution's geometry,
// BatchNorm's eps and momentum), never accumulating, and its label with the part named.
inline Node fused_part(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out,
                       const Node& fused, const char* what) {
  Node n;
  n.op = op;
  n.in = std::move(in);
  n.out = std::move(out);
  n.attrs = fused.attrs;
  n.attrs.accumulate = false;
  n.label = fused.label + " (" + what + ")";
  return n;
}

// The tensors of cbr_fwd and cbr_pool_fwd (ops.def: "x, w, gamma, beta, running_mean,
// running_var, [b] -> z, y, saved, mask"; y pooled and the mask over z for cbr_pool_fwd, which
// may also write zp and mp), unpacked with need_in / need_out (which name the missing role).
struct CbrFwdTensors {
  TensorId x, w, gamma, beta, rm, rv, b, z, y, saved, mask, zp, mp;
};
inline CbrFwdTensors cbr_fwd_tensors(const Node& n) {
  KILN_CHECK(n.op != OpKind::cbr_fwd || n.out.size() <= 4, Internal, "cbr_fwd node '", n.label,
             "' has outputs past its mask (zp and mp are cbr_pool_fwd's)");
  return {need_in(n, 0, "x"),
          need_in(n, 1, "w"),
          need_in(n, 2, "gamma"),
          need_in(n, 3, "beta"),
          need_in(n, 4, "running_mean"),
          need_in(n, 5, "running_var"),
          n.in.size() > 6 ? n.in[6] : kNoTensor,
          need_out(n, 0, "z"),
          need_out(n, 1, "y"),
          need_out(n, 2, "saved"),
          need_out(n, 3, "mask"),
          out_at(n, 4),
          out_at(n, 5)};
}

// The tensors of cbr_bwd and cbr_pool_bwd ("x, w, z, dy, mask, gamma, saved -> [dx], dw,
// dgamma, dbeta, dz, [db]"; dy pooled and the mask over z for cbr_pool_bwd, which may also
// read the forward's zp and mp).
struct CbrBwdTensors {
  TensorId x, w, z, dy, mask, gamma, saved, zp, mp, dx, dw, dgamma, dbeta, dz, db;
};
inline CbrBwdTensors cbr_bwd_tensors(const Node& n) {
  return {need_in(n, 0, "x"),
          need_in(n, 1, "w"),
          need_in(n, 2, "z"),
          need_in(n, 3, "dy"),
          need_in(n, 4, "mask"),
          need_in(n, 5, "gamma"),
          need_in(n, 6, "saved"),
          in_at(n, 7),
          in_at(n, 8),
          n.out.size() > 0 ? n.out[0] : kNoTensor,
          need_out(n, 1, "dw"),
          need_out(n, 2, "dgamma"),
          need_out(n, 3, "dbeta"),
          need_out(n, 4, "dz"),
          n.out.size() > 5 ? n.out[5] : kNoTensor};
}

// cbr_pool_*'s zp and mp (ops.def), where given: both or neither, over windows that tile z
// (`tiles`), zp of the pooled map y's shape and dtype, mp a bit a pooled element.
inline void expect_pooled_pick(const ProgramView& v, const Node& n, bool tiles, TensorId y,
                               TensorId zp, TensorId mp) {
  if (zp == kNoTensor && mp == kNoTensor) return;
  KILN_CHECK(zp != kNoTensor && mp != kNoTensor && tiles, Internal, op_name(n.op), " node '",
             n.label, "': zp and mp come together, for windows that tile z");
  expect_same_dtype(v, n, y, zp);
  expect_same_size(v, n, y, zp);
  expect_mask(v, n, mp, y);
}

// The tensors of bn_add_relu_fwd ("x, gamma, beta, running_mean, running_var, residual,
// [gamma2, beta2, running_mean2, running_var2] -> y, saved, mask, [saved2]"); res_bn: the
// residual's BatchNorm is given (its four inputs and saved2 all, or none).
struct BnAddReluFwdTensors {
  TensorId x, gamma, beta, rm, rv, residual, gamma2, beta2, rm2, rv2, y, saved, mask, saved2;
  bool res_bn;
};
inline BnAddReluFwdTensors bn_add_relu_fwd_tensors(const Node& n) {
  const bool res_bn = n.in.size() > 6;
  return {need_in(n, 0, "x"),
          need_in(n, 1, "gamma"),
          need_in(n, 2, "beta"),
          need_in(n, 3, "running_mean"),
          need_in(n, 4, "running_var"),
          need_in(n, 5, "residual"),
          res_bn ? need_in(n, 6, "gamma2") : kNoTensor,
          res_bn ? need_in(n, 7, "beta2") : kNoTensor,
          res_bn ? need_in(n, 8, "running_mean2") : kNoTensor,
          res_bn ? need_in(n, 9, "running_var2") : kNoTensor,
          need_out(n, 0, "y"),
          need_out(n, 1, "saved"),
          need_out(n, 2, "mask"),
          res_bn ? need_out(n, 3, "saved2") : kNoTensor,
          res_bn};
}

// The residual BatchNorm's part of such a node, as a bn_fwd_train node of its own: z2 -> out,
// saved2, with eps2 and bn_momentum2.
inline Node residual_bn_part(const Node& n, const BnAddReluFwdTensors& t, TensorId out) {
  Node p = fused_part(OpKind::bn_fwd_train, {t.residual, t.gamma2, t.beta2, t.rm2, t.rv2},
                      {out, t.saved2}, n, "residual bn");
  p.attrs.eps = n.attrs.eps2;
  p.attrs.bn_momentum = n.attrs.bn_momentum2;
  return p;
}

}  // namespace kiln
