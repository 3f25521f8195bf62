// A CBR forward's convolution on the first layer's direct kernel (first_layer_conv.h) under
// KILN_FIRST_LAYER_CONV: x's 1-3 channels (and the filter's) copied with zero channels up to 4
// before each run, into buffers the kernel owns, then z and BatchNorm's sums in one launch (the
// sums in a fixed order: the same bits every run).
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/fused_kernels.h"

namespace kiln::cuda {

FirstLayerShape first_layer_shape(const ConvGeom& g) {
  FirstLayerShape s;
  s.n = static_cast<int>(g.x.n), s.h = static_cast<int>(g.x.h), s.w_ = static_cast<int>(g.x.w);
  s.r = static_cast<int>(g.r), s.s = static_cast<int>(g.s);
  s.stride_h = static_cast<int>(g.sh), s.stride_w = static_cast<int>(g.sw);
  s.pad_h = static_cast<int>(g.ph), s.pad_w = static_cast<int>(g.pw);
  return s;
}

KernelPtr make_first_layer_conv_fwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                    TensorId z, float* sums,
                                    std::shared_ptr<DeviceBuffer>* x_copy) {
  const ConvGeom g = conv_geom(ctx, n, x, w, z);
  const auto refuse = [&](const std::string& why) -> KernelPtr {
    log_debug(op_name(n.op), " node '", n.label, "': the first layer's direct convolution ", why);
    return nullptr;
  };
  for (TensorId id : {x, w, z})
    if (ctx.tensor(id).dtype != DType::F16) return refuse("takes FP16 (AMP)");
  if (g.x.c > kFirstLayerChannels) return refuse("takes at most 4 input channels");
  if (g.k != kFirstLayerOutputs) return refuse("takes 64 output channels");
  if (ctx.cc_major != 9) return refuse("is built for SM90 (kiln's CUDA architectures)");
  // The padded copies of x and w: 4 channels a pixel and a filter tap.
  const int64_t c = g.x.c, x_rows = g.x_rows(), w_rows = g.w_rows();
  std::shared_ptr<DeviceBuffer> xp, wp;
  if (c != kFirstLayerChannels) {
    xp = std::make_shared<DeviceBuffer>(static_cast<size_t>(x_rows * kFirstLayerChannels) * 2);
    wp = std::make_shared<DeviceBuffer>(static_cast<size_t>(w_rows * kFirstLayerChannels) * 2);
  }
  FirstLayerConv p;
  p.x = static_cast<const __half*>(xp ? xp->get() : ctx.ptr(x));
  p.w = static_cast<const __half*>(wp ? wp->get() : ctx.ptr(w));
  p.z = static_cast<__half*>(ctx.ptr(z));
  p.sums = sums;
  static_cast<FirstLayerShape&>(p) = first_layer_shape(g);
  if (p.p() != g.y.h || p.q() != g.y.w) return refuse("disagrees with z's shape");
  if (std::string why = first_layer_conv_refusal(p); !why.empty()) return refuse(why);
  unsigned grid = 0;
  if (cudaError_t e = prepare_first_layer_conv(p, ctx.sm_count, &grid); e != cudaSuccess)
    return refuse(std::string("could not be set up: ") + cudaGetErrorString(e));
  // The CTAs' shares of the sums and the counter that finds the last CTA: zeros once, here;
  // each launch leaves them so.
  std::shared_ptr<DeviceBuffer> partials;
  if (sums) {
    const size_t bytes = first_layer_conv_workspace(grid);
    partials = std::make_shared<DeviceBuffer>(bytes);
    CUDA_CHECK(cudaMemset(partials->get(), 0, bytes));
    p.partials = static_cast<float*>(partials->get());
  }
  const void* x_src = ctx.ptr(x);
  const void* w_src = ctx.ptr(w);
  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  *x_copy = xp;
  return make_fn(stream, [=](Context& cx, cudaStream_t s) {
    static_cast<void>(partials);  // owned as long as the kernel
    if (xp) {
      launch_pad_channels(x_src, xp->get(), DType::F16, x_rows, c, kFirstLayerChannels, cx.sm_count,
                          s);
      launch_pad_channels(w_src, wp->get(), DType::F16, w_rows, c, kFirstLayerChannels, cx.sm_count,
                          s);
    }
    if (cudaError_t e = launch_first_layer_conv(p, grid, s); e != cudaSuccess)
      KILN_FAIL(Backend, what,
                ": the first layer's direct convolution failed to launch: ", cudaGetErrorString(e));
  });
}

}  // namespace kiln::cuda
