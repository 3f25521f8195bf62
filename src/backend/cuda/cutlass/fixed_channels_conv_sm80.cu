// fixed_channels_conv.h's unit: CUTLASS 2.x's implicit-GEMM forward convolution with the
// fixed-channels iterators (IteratorAlgorithm::kFixedChannels: C equals one access, so each
// filter tap of a pixel is one 8- or 16-byte cp.async), SM80 tensor cores (mma.sync 16x8x16,
// which Hopper runs), 128x64 tiles (the layers have 64 output channels) of 4 warps, 4 stages.
// Compiled for sm_90a like the SM90 units, and only where they are.
// clang-format off
#include <cutlass/cutlass.h>
#include <cutlass/conv/conv2d_problem_size.h>
#include <cutlass/conv/device/implicit_gemm_convolution.h>
#include <cutlass/conv/kernel/default_conv2d_fprop.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>
// clang-format on

#include <cstdint>
#include <string>

#include "backend/cuda/cutlass/fixed_channels_conv.h"

namespace kiln::sm90 {
namespace {

using Half = cutlass::half_t;
using Nhwc = cutlass::layout::TensorNHWC;

template <int C>
using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
    Half, Nhwc, Half, Nhwc, Half, Nhwc, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<128, 64, 32>, cutlass::gemm::GemmShape<64, 32, 32>,
    cutlass::gemm::GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<Half, 8, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<4>, 4, cutlass::arch::OpMultiplyAdd,
    cutlass::conv::IteratorAlgorithm::kFixedChannels, cutlass::conv::StrideSupport::kStrided, C,
    C>::Kernel;
template <int C>
using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel<C>>;

template <int C>
typename Conv<C>::Arguments arguments(const FixedChannelsConv& p) {
  const cutlass::conv::Conv2dProblemSize size(
      {p.n, p.h, p.w_, p.c}, {p.k, p.r, p.s, p.c}, {p.pad_h, p.pad_h, p.pad_w, p.pad_w},
      {p.stride_h, p.stride_w}, {1, 1}, {p.n, p.p, p.q, p.k},
      cutlass::conv::Mode::kCrossCorrelation, 1);
  auto* x = static_cast<Half*>(const_cast<void*>(p.x));
  auto* w = static_cast<Half*>(const_cast<void*>(p.w));
  auto* y = static_cast<Half*>(p.y);
  const auto xl = Nhwc::packed({p.n, p.h, p.w_, p.c});
  const auto wl = Nhwc::packed({p.k, p.r, p.s, p.c});
  const auto yl = Nhwc::packed({p.n, p.p, p.q, p.k});
  // beta = 0: y is only written (C is read only where beta is not zero).
  return typename Conv<C>::Arguments(size, {x, xl}, {w, wl}, {y, yl}, {y, yl}, {1.0f, 0.0f});
}

std::string status_text(const char* what, cutlass::Status s) {
  return std::string(what) + ": " + cutlass::cutlassGetStatusString(s);
}

std::string shape_refusal(const FixedChannelsConv& p) {
  if (p.c != 4 && p.c != 8) return "takes 4 or 8 input channels, not " + std::to_string(p.c);
  if (p.k % 8 != 0) return "takes output channels in multiples of 8, not " + std::to_string(p.k);
  if (!p.x || !p.w || !p.y) return "needs x, w and y";
  const auto misaligned = [](const void* a) { return reinterpret_cast<uintptr_t>(a) % 16 != 0; };
  if (misaligned(p.x) || misaligned(p.w) || misaligned(p.y))
    return "needs x, w and y 16-byte aligned";
  return "";
}

template <int C>
std::string check_as(const FixedChannelsConv& p) {
  const cutlass::Status s = Conv<C>::can_implement(arguments<C>(p));
  return s == cutlass::Status::kSuccess ? "" : status_text("CUTLASS refuses it", s);
}

template <int C>
std::string run_as(const FixedChannelsConv& p, void* workspace, cudaStream_t stream) {
  Conv<C> op;
  const auto args = arguments<C>(p);
  if (cutlass::Status s = op.initialize(args, workspace, stream); s != cutlass::Status::kSuccess)
    return status_text("CUTLASS initialize", s);
  if (cutlass::Status s = op(stream); s != cutlass::Status::kSuccess)
    return status_text("CUTLASS run", s);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("launch: ") + cudaGetErrorString(e);
  return "";
}

}  // namespace

std::string fixed_channels_conv_check(const FixedChannelsConv& p) {
  if (std::string why = shape_refusal(p); !why.empty()) return why;
  return p.c == 4 ? check_as<4>(p) : check_as<8>(p);
}

size_t fixed_channels_conv_workspace(const FixedChannelsConv& p) {
  if (!shape_refusal(p).empty()) return 0;
  return p.c == 4 ? Conv<4>::get_workspace_size(arguments<4>(p))
                  : Conv<8>::get_workspace_size(arguments<8>(p));
}

std::string fixed_channels_conv_run(const FixedChannelsConv& p, void* workspace,
                                    cudaStream_t stream) {
  if (std::string why = shape_refusal(p); !why.empty()) return why;
  return p.c == 4 ? run_as<4>(p, workspace, stream) : run_as<8>(p, workspace, stream);
}

}  // namespace kiln::sm90
