// A first layer's weight gradient on the direct kernel (first_layer_wgrad.h) under
// KILN_FIRST_LAYER_WGRAD: dz (the conv_bwd_weight node's dy) and x, whose 1-3 channels are
// read from the 4-channel copy its forward fills each step where there is one
// (KILN_PAD_INPUT_ONCE), else copied to 4 channels before each run into a buffer the kernel owns.
// With a fold (KILN_FIRST_LAYER_BN_FOLD; fused.cpp chooses it) the same kernel forms dz itself
// from the CBR's BatchNorm backward, which then skips its dx pass.
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/first_layer_wgrad.h"
#include "backend/cuda/fused_kernels.h"

namespace kiln::cuda {

KernelPtr make_first_layer_wgrad(const Node& n, Context& ctx, int stream, TensorId x, TensorId dz,
                                 TensorId dw, const std::shared_ptr<DeviceBuffer>& x_filled,
                                 const FirstLayerFold* fold) {
  const ConvGeom g = conv_geom(ctx, n, x, dw, dz);
  const auto refuse = [&](const std::string& why) -> KernelPtr {
    log_debug(op_name(n.op), " node '", n.label, "': the first layer's direct weight gradient ",
              fold ? "with BatchNorm's backward " : "", why);
    return nullptr;
  };
  if (ctx.tensor(x).dtype != DType::F16 || ctx.tensor(dz).dtype != DType::F16)
    return refuse("takes FP16 x and dz (AMP)");
  const DType wdt = ctx.tensor(dw).dtype;
  if (wdt != DType::F16 && wdt != DType::F32) return refuse("writes an FP16 or FP32 dw");
  if (g.x.c > kFirstLayerChannels) return refuse("takes at most 4 input channels");
  if (g.k != kFirstLayerOutputs) return refuse("takes 64 output channels");
  if (ctx.cc_major != 9) return refuse("is built for SM90 (kiln's CUDA architectures)");
  const int64_t c = g.x.c, x_rows = g.x_rows();
  std::shared_ptr<DeviceBuffer> xp = c == kFirstLayerChannels ? nullptr : x_filled;
  const bool fill = c != kFirstLayerChannels && !xp;
  if (fill)
    xp = std::make_shared<DeviceBuffer>(static_cast<size_t>(x_rows * kFirstLayerChannels) * 2);
  FirstLayerWgrad p;
  p.x = static_cast<const __half*>(xp ? xp->get() : ctx.ptr(x));
  p.dz = static_cast<const __half*>(ctx.ptr(dz));
  p.dw = ctx.ptr(dw), p.dw_f32 = wdt == DType::F32, p.dw_channels = static_cast<int>(c);
  static_cast<FirstLayerShape&>(p) = first_layer_shape(g);
  if (p.p() != g.y.h || p.q() != g.y.w) return refuse("disagrees with dz's shape");
  if (fold) {
    const DTensor& z = ctx.tensor(fold->z);
    if (z.dtype != DType::F16 || z.numel() != ctx.tensor(dz).numel())
      return refuse("takes an FP16 z of dz's size");
    if (fold->mask != kNoTensor && (ctx.tensor(fold->mask).dtype != DType::U8 ||
                                    ctx.tensor(fold->mask).numel() * 8 < z.numel()))
      return refuse("takes a mask of one bit per element of z");
    p.bn.z = static_cast<const __half*>(ctx.ptr(fold->z));
    p.bn.mask = fold->mask == kNoTensor ? nullptr : ctx.ptr<uint8_t>(fold->mask);
    p.bn.coef = fold->coef;
  }
  if (std::string why = first_layer_wgrad_refusal(p); !why.empty()) return refuse(why);
  unsigned grid = 0;
  if (cudaError_t e = prepare_first_layer_wgrad(p, ctx.sm_count, &grid); e != cudaSuccess)
    return refuse(std::string("could not be set up: ") + cudaGetErrorString(e));
  auto partials = std::make_shared<DeviceBuffer>(first_layer_wgrad_workspace(p, grid));
  p.partials = static_cast<float*>(partials->get());
  const void* x_src = ctx.ptr(x);
  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  return make_fn(stream, [=](Context& cx, cudaStream_t s) {
    (void)partials;  // owned by the kernel
    if (fill)
      launch_pad_channels(x_src, xp->get(), DType::F16, x_rows, c, kFirstLayerChannels, cx.sm_count,
                          s);
    if (cudaError_t e = launch_first_layer_wgrad(p, grid, s); e != cudaSuccess)
      KILN_FAIL(Backend, what, ": the first layer's direct weight gradient failed to launch: ",
                cudaGetErrorString(e));
  });
}

std::shared_ptr<DeviceBuffer> padded_copy_of(const Context& ctx, TensorId x) {
  if (!ctx.opts.pad_input_once) return nullptr;
  const auto at = ctx.padded_inputs.find(x);
  return at == ctx.padded_inputs.end() ? nullptr : at->second.lock();
}

}  // namespace kiln::cuda
