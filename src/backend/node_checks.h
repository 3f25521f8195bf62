// Checks of a node's tensors against the Program, shared by the CPU and CUDA kernel factories:
// every failure names the op, the node and the tensor (and the backend where the limit is its
// own), so a compiler bug shows up where the node is built, not as a wrong result.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kiln/graph/program.h"

namespace kiln {

// What the factories check a node against: the Program's tensors, and the backend's name for
// messages about what it supports. Each backend's execution Context derives from it.
struct ProgramView {
  explicit ProgramView(const char* backend_name) : backend(backend_name) {}
  const Program* program = nullptr;
  const char* backend;  // "CPU", "CUDA"
  const DTensor& tensor(TensorId id) const { return program->tensor(id); }
};

// The i-th input / output of a node, or kNoTensor when the node has fewer or marks it absent.
inline TensorId in_at(const Node& n, size_t i) {
  return i < n.in.size() ? n.in[i] : kNoTensor;
}
inline TensorId out_at(const Node& n, size_t i) {
  return i < n.out.size() ? n.out[i] : kNoTensor;
}
// Output i, or `fallback` (the input it updates in place) when the node leaves it absent.
inline TensorId out_or(const Node& n, size_t i, TensorId fallback) {
  const TensorId id = out_at(n, i);
  return id != kNoTensor ? id : fallback;
}

// Throws InvalidArgument naming the node and ops.def's signature unless the tensor is present.
TensorId need_in(const Node& n, size_t i, const char* role);
TensorId need_out(const Node& n, size_t i, const char* role);

// Throws unless the tensor has this dtype / rank / element count.
void expect_dtype(const ProgramView& v, const Node& n, TensorId id, DType dtype, const char* role);
void expect_rank(const ProgramView& v, const Node& n, TensorId id, int rank, const char* role);
void expect_numel(const ProgramView& v, const Node& n, TensorId id, int64_t numel,
                  const char* role);
// f32 / f16 / bf16 (a feature tensor); returns its dtype.
DType expect_float(const ProgramView& v, const Node& n, TensorId id, const char* role);
void expect_same_dtype(const ProgramView& v, const Node& n, TensorId a, TensorId b);
// An optimizer's [w16] output (ops.def): f16 or bf16, of the weights' `count`; its dtype.
DType expect_compute_copy(const ProgramView& v, const Node& n, TensorId id, int64_t count);
// Two tensors of the same element count (elementwise ops read them as flat arrays).
void expect_same_size(const ProgramView& v, const Node& n, TensorId a, TensorId b);
// Only `add` and `check_clip` accumulate; any other op with attrs.accumulate is a compiler
// bug, not a no-op.
void reject_accumulate(const ProgramView& v, const Node& n);

// Per-channel f32 tensors of c elements (BatchNorm's gamma, beta, running statistics).
void expect_per_channel(const ProgramView& v, const Node& n, std::initializer_list<TensorId> ids,
                        int64_t c);
// max-pool's argmax: i32, of the pooled map y's shape.
void expect_argmax(const ProgramView& v, const Node& n, TensorId idx, TensorId y);
// A ReLU bit mask (ops.def's layout): u8, one bit per element of `of`.
void expect_mask(const ProgramView& v, const Node& n, TensorId mask, TensorId of);
// A collective node runs in a process group of the size it was compiled for.
void expect_world(const Node& n);

// An NHWC feature tensor of rank 4 (or [N, C] read as N x C x 1 x 1), not empty.
struct Nhwc {
  int64_t n = 0, h = 1, w = 1, c = 0;
  int64_t numel() const { return n * h * w * c; }
};
Nhwc nhwc_of(const ProgramView& v, const Node& n, TensorId id, const char* role);

// A convolution node's geometry (features NHWC, weights KRSC, symmetric padding, the floor
// rule for output sizes), checked against its input x, weight w and output y.
struct ConvGeom {
  Nhwc x, y;                    // input and output feature maps
  int64_t k = 0, r = 0, s = 0;  // weights [K, R, S, C]
  int64_t sh = 1, sw = 1, ph = 0, pw = 0;
  int64_t x_rows() const { return x.n * x.h * x.w; }  // rows of C channels in the input (and dx)
  int64_t w_rows() const { return k * r * s; }        // rows of C channels in the weight (KRSC)
  ConvGeom with_channels(int64_t c) const {
    ConvGeom g = *this;
    g.x.c = c;
    return g;
  }
};
ConvGeom conv_geom(const ProgramView& v, const Node& n, TensorId x, TensorId w, TensorId y);

// A fully connected node's geometry: x [N, K] (a flattened NHWC map reads as [N, H*W*C]),
// weights [O, K], y [N, O].
struct FcGeom {
  int64_t n = 0, k = 0, o = 0;
};
FcGeom fc_geom(const ProgramView& v, const Node& n, TensorId x, TensorId w, TensorId y);

// A mix_batch node (ops.def): "x (f32 NHWC, a staged batch), mix (f32[8]) -> y (NHWC,
// f32/f16/bf16)", x's shape and y's dtype.
struct MixNode {
  TensorId x = kNoTensor, mix = kNoTensor, y = kNoTensor;
  Nhwc g;
  DType to = DType::F32;
};
MixNode check_mix_batch(const ProgramView& v, const Node& n);

}  // namespace kiln
