// Which convolutions the CUDA backend's SM90 CUTLASS GEMM (cuda/cutlass_conv.cpp) can run, as a
// rule in plain C++ so that the CPU-only tests check it: a 1x1 stride-1 unpadded convolution is
// the GEMM z = x w^T over [N*H*W, C] x [K, C], which the kernel takes in FP16 with C and K in
// multiples of 8 (TMA moves 16-byte rows), on a compute capability 9.0 GPU (sm_90a code).
#pragma once
#include <string>

#include "backend/node_checks.h"
#include "kiln/core/dtype.h"
#include "kiln/core/switches.h"

namespace kiln {

struct Sm90ConvQuery {
  ConvGeom g;
  DType x = DType::F32, w = DType::F32, z = DType::F32;
  int cc_major = 0, cc_minor = 0;  // the GPU's compute capability
  bool built = false;  // libkiln holds the CUTLASS kernels (CMake's KILN_CUTLASS_KERNELS)
};

// "" when the GEMM can run the convolution, else why not, in words for a log line.
std::string sm90_conv_refusal(const Sm90ConvQuery& q);

// Whether a program's layers try the GEMM at all (KILN_CUTLASS): 1 always (each layer then says
// why it falls back), 0 never, auto where it can pay: the kernels built, a compute capability
// 9.0 GPU and FP16 features (AMP). `features` is the program's feature dtype.
bool sm90_conv_gemm_tried(Auto sw, bool built, int cc_major, int cc_minor, DType features);

// What KILN_CUTLASS_DGRAD=auto does, in one place: true follows KILN_CUTLASS (the data gradients
// that feed a BatchNorm backward take the SM90 kernel wherever the forward's GEMM is tried),
// false leaves it off unless asked for (KILN_CUTLASS_DGRAD=1). On: with 36a0a34's leaner
// epilogue ResNet-50's step gains ~3% on the H200 (bench/RESULTS.md, seventeenth session).
inline constexpr bool kCutlassDgradByDefault = true;

// What KILN_CUTLASS_CONV=auto does without KILN_CUTLASS_TIMED (which times each layer instead):
// off. On the persistent kernel the implicit-GEMM convolution with the statistics
// (cutlass/conv_stats.h) wins most layers on the H200 (ResNet-50's 3x3 1.19x, VGG16-BN's 0.92x
// with its first layer at 0.45x: bench/RESULTS.md, nineteenth session), but the fixed default
// also serves KILN_DETERMINISTIC, whose per-CTA partials form is 1.5-3x slower.
inline constexpr bool kCutlassConvByDefault = false;

// Whether a program's other CBR forwards try the SM90 implicit-GEMM convolution
// (cuda/cutlass_conv.cpp): 1 where the forward's GEMM is tried (`cutlass`), 0 never, auto as
// kCutlassConvByDefault says.
bool sm90_implicit_conv_tried(Auto sw, bool cutlass);

// "" when the SM90 implicit-GEMM convolution can run the layer, else why not: any filter,
// stride and padding within TMA's im2col limits, FP16 with channels in multiples of 8, on a
// compute capability 9.0 GPU with the kernels built.
std::string sm90_implicit_conv_refusal(const Sm90ConvQuery& q);

// Whether a layer is the GEMM's shape (1x1, stride 1, unpadded), which the GEMM runs.
bool sm90_gemm_shape(const ConvGeom& g);

// What KILN_CUTLASS_CONV_DGRAD=auto does without KILN_CUTLASS_TIMED: off. The implicit-GEMM data
// gradient with the BatchNorm epilogue (cutlass/dgrad_bn.h, conv_dgrad_bn) gains 1.02-1.06x on
// ResNet-50's conv2 and loses 0.88-0.96x on VGG16-BN's 3x3 layers against cuDNN's dgrad plus
// kiln's sums pass on the H200 (bench/RESULTS.md, nineteenth session).
inline constexpr bool kCutlassConvDgradByDefault = false;

// Whether a program's stride-1 data gradients of other filter sizes that feed a BatchNorm
// backward try the SM90 implicit-GEMM data gradient (cuda/cutlass_dgrad.cpp): 1 where the 1x1
// data gradient is tried (`dgrad`), 0 never, auto as kCutlassConvDgradByDefault says.
bool sm90_implicit_dgrad_tried(Auto sw, bool dgrad);

// "" when the SM90 implicit-GEMM data gradient can run the layer whose data gradient dx (q.g.x)
// comes from dy (q.g.y), else why not: stride 1 with padding that keeps the size (dx's pixels
// are dy's), filters within TMA's im2col limits, FP16 with channels in multiples of 8, on a
// compute capability 9.0 GPU with the kernels built.
std::string sm90_implicit_dgrad_refusal(const Sm90ConvQuery& q);

// Whether a program's data gradients try the SM90 data gradient with BatchNorm-backward's sums
// (cuda/cutlass_dgrad.cpp): 1 always (each layer then says why it falls back), 0 never, auto
// as kCutlassDgradByDefault says, given whether the forward's GEMM is tried (`cutlass`).
bool sm90_dgrad_tried(Auto sw, bool cutlass);

// The four switches and what decides them, for one program.
struct Sm90Switches {
  Auto gemm = Auto::automatic, dgrad = Auto::automatic, conv = Auto::automatic,
       conv_dgrad = Auto::automatic;  // KILN_CUTLASS, _DGRAD, _CONV, _CONV_DGRAD
  bool timed = false;                 // KILN_CUTLASS_TIMED
  bool deterministic = false;         // KILN_DETERMINISTIC
};

// Which families a program's layers try, and which of them choose per layer by timing. Without
// KILN_CUTLASS_TIMED (or under KILN_DETERMINISTIC, where a timed choice could differ from one
// process to the next and with it the bits), the functions above decide. With it, a switch left
// at auto tries its family wherever the family it builds on is tried (the GEMM's own rule for
// KILN_CUTLASS: built, an SM90 GPU, FP16), whatever the fixed default says, and each layer then
// keeps the faster form; a switch set to 1 or 0 is obeyed as before.
struct Sm90Forms {
  bool gemm = false, dgrad = false, conv = false, conv_dgrad = false;
  bool gemm_timed = false, dgrad_timed = false, conv_timed = false, conv_dgrad_timed = false;
};
Sm90Forms sm90_forms(const Sm90Switches& sw, bool built, int cc_major, int cc_minor,
                     DType features);

}  // namespace kiln
