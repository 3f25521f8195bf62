// The CPU and CUDA fused kernels (cpu_fused.cpp, cuda/fused.cpp) are built in part from their
// unfused chains' kernels; each such kernel gets a node of its own.
#pragma once
#include <string>
#include <utility>
#include <vector>

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

}  // namespace kiln
