// What the two layers on kiln's SM90 kernels (cutlass_conv.cpp: the forward's GEMM;
// cutlass_dgrad.cpp: the data gradient) share: the rule's question for a layer, the TMA's
// alignment, the fallback's log line and the kernel that runs a compiled unit. Defined in
// cutlass_conv.cpp, which alone knows whether the kernels were built (KILN_HAVE_CUTLASS); the
// template below takes a unit's descriptor (cutlass/gemm_stats.h, cutlass/dgrad_bn.h), which only
// files built with the kernels include.
#pragma once
#include <initializer_list>
#include <memory>
#include <string>

#include "backend/cuda/cuda_kernel.h"
#include "backend/sm90_conv_rule.h"

namespace kiln::cuda {

// sm90_conv_refusal's question for convolution node n as a GEMM a (x, or dx) = b (z, or dy) over
// w: its geometry, the three dtypes, the GPU and whether the kernels were built.
Sm90ConvQuery sm90_conv_query(const Node& n, const Context& ctx, TensorId a, TensorId w,
                              TensorId b);

// Whether a forward of geometry g that the SM90 kernels try is the implicit-GEMM convolution's
// (KILN_CUTLASS_CONV on, not the GEMM's 1x1 stride-1 shape).
bool sm90_fwd_implicit(const Context& ctx, const ConvGeom& g);

// Whether the kernels could run here at all: built, and a compute capability 9.0 GPU. A refusal
// where they could is routine (the layer's shape, precision or schedule); one where they could
// not, under an explicit switch, is worth a line at the default level.
bool sm90_kernels_here(const Sm90ConvQuery& q);

// Every pointer at a 16-byte aligned address (TMA moves 16-byte rows); null ones pass.
bool all_tma_aligned(std::initializer_list<const void*> ptrs);

// `line` + `why`: at debug level where the refusal is routine, else at the default level.
void log_sm90_fallback(bool routine, const std::string& line, const std::string& why);

// The kernel that runs a compiled unit `kern` (its workspace reserved on `stream`) on problem p;
// an error throws, `failed` + CUTLASS's or CUDA's words. `owned` lives as long as the kernel.
template <class UnitKernel, class Problem>
KernelPtr make_sm90_unit_run(Context& ctx, int stream, const UnitKernel& kern, const Problem& p,
                             const std::string& failed, std::shared_ptr<void> owned = nullptr) {
  ctx.need_workspace(stream, kern.workspace(p));
  return make_fn(stream, [=](Context& c, cudaStream_t st) {
    // run() zeroes what it adds into, launches the GEMM (and the partials' finalize) on st and
    // checks each launch.
    const std::string err = kern.run(p, c.streams[static_cast<size_t>(stream)].workspace, st);
    KILN_CHECK(err.empty(), Backend, failed, err);
    static_cast<void>(owned);
  });
}

}  // namespace kiln::cuda
