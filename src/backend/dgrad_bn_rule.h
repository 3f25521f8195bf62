// Where a convolution's data gradient dx can run as the SM90 data gradient with BatchNorm-
// backward's sums (cuda/cutlass_dgrad.cpp, KILN_CUTLASS_DGRAD): dx is the gradient at the output
// of a later relu(bn(z)) (cbr_bwd's dy; cbr_pool_bwd's pooled dy where its forward wrote zp and
// mp) or relu(bn(z) + residual) (bn_add_relu_bwd's dy or dy2), so the kernel can write that
// BatchNorm's masked gradient g and its two sums at dx's step, and
// the BatchNorm backward then skips its sums pass. This file is the schedule's and the memory
// plan's side of that, in plain C++ so that the CPU tests check it on whole programs; the shape
// and precision rule is the forward's (sm90_conv_rule.h).
#pragma once
#include <string>

#include "kiln/graph/program.h"

namespace kiln {

// How a data gradient's output is used by a BatchNorm backward.
struct DgradBnUse {
  // cbr_bwd, cbr_pool_bwd (with zp and mp) or bn_add_relu_bwd; null: no such use (not tried)
  const Node* consumer = nullptr;
  // The consumer's BatchNorm input, ReLU mask and saved [mean; invstd] (cbr_pool_bwd's zp and
  // mp: the input and the ReLU's bit where its pool took, over the pooled map).
  TensorId z = kNoTensor, mask = kNoTensor, saved = kNoTensor;
  // bn_add_relu_bwd's other gradient contribution (the kernel's dy2: the residual path's, or
  // the block's main path's when dx is the residual's), or none.
  TensorId other = kNoTensor;
  // Where the kernel writes g: dx itself (cbr_bwd reads it as its dy), or bn_add_relu_bwd's
  // dresidual, which is exactly g (then dx is never written, and its only reader reads g).
  TensorId g = kNoTensor;
  // bn_add_relu_bwd's dresidual where the memory plan has its bytes in use between the two
  // steps: g then goes to dx, and the consumer's dx pass copies it here (as it writes it today).
  TensorId copy_to = kNoTensor;
  // "" when the schedule and the memory plan let the fused form run, else why not.
  std::string refusal;
};

// `producer` (a conv_bwd_data node, or a cbr_bwd / cbr_pool_bwd whose data gradient writes dx)
// as a node of p.train. The consumer is dx's only reader, later in the schedule. The fused form
// moves the consumer's reads of z, mask, saved and `other` to the producer's step: nothing
// between may write those, and `other` must be complete before it. g goes to dresidual only
// where its bytes are free from the producer's step on (the memory plan gave them to it from the
// consumer's step: nothing touched between may share them), else to dx (copy_to).
DgradBnUse dgrad_bn_use(const Program& p, const Node& producer, TensorId dx);

// "" where no node of p.train but n reads t (any view of its storage), so that n may leave its
// output t unwritten (a first layer's dz, which its own weight gradient forms as it loads it:
// cuda/first_layer_bwd.cpp), else why not, naming the reader.
std::string unread_output_refusal(const Program& p, const Node& n, TensorId t);

}  // namespace kiln
