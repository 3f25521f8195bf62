// The CUDA kernel factories the fused ops (fused.cpp) build on besides the unfused ops' own:
// BatchNorm+ReLU passes, defined in bn.cu beside the unfused BatchNorm kernels whose passes
// they share, and the conv+genstats graph (conv.cpp).
#pragma once
#include <functional>

#include "backend/cuda/cuda_kernel.h"
#include "backend/fused_nodes.h"

namespace kiln::cuda {

// Training BatchNorm then ReLU, with the ReLU's bit mask (ops.def's layout):
// y = relu(bn(x) [+ residual]), saved = [mean; invstd], running statistics updated.
// residual may be kNoTensor; so may conv_bias, cbr_fwd's b, which moves only the running mean
// (ops.def). n names the fused node in errors and supplies eps and momentum. conv_sums, when
// given, holds x's per-channel sum and sum of squares (make_conv_fwd_genstats wrote them),
// which replace the statistics pass over x.
// res_bn (bn_add_relu_fwd with gamma2 ...): the residual is the shortcut's convolution output,
// whose own BatchNorm (statistics pass, saved2, running statistics) is applied on the fly.
KernelPtr make_bn_relu_mask_fwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId gamma,
                                TensorId beta, TensorId rm, TensorId rv, TensorId residual,
                                TensorId conv_bias, TensorId y, TensorId saved, TensorId mask,
                                const float* conv_sums = nullptr,
                                const BnAddReluFwdTensors* res_bn = nullptr,
                                const float* res_sums = nullptr);

// The MLPerf-style CBR convolution (KILN_CBR_FORM=genstats): z = conv(x, w) with z's
// per-channel sum in sums[0, K) and sum of squares in sums[K, 2K) (FP32), one cuDNN graph.
// nullptr (with one log line) when cuDNN has no engine for it here.
KernelPtr make_conv_fwd_genstats(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                 TensorId z, float* sums);

// cbr_fwd's convolution on kiln's SM90 CUTLASS GEMM (KILN_CUTLASS; cutlass_conv.cpp): z as
// make_conv_fwd_genstats, with sums[0, K) and sums[K, 2K) zeroed and filled by the same launch
// sequence on the node's stream. nullptr (with one log line saying why) where the layer is not
// eligible (sm90_conv_rule.h), the kernels are not built, or CUTLASS refuses the problem.
KernelPtr make_conv_fwd_cutlass(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                TensorId z, float* sums);

// A conv_fwd node whose output a later bn_add_relu_fwd of the training schedule normalises (a
// bottleneck's conv3), on the SM90 GEMM with z's sums (KILN_CUTLASS), which that node's
// factory then reads from ctx.bn_add_relu_sums instead of taking its statistics pass. nullptr
// where the switch is off, the pattern does not hold or the GEMM cannot take the layer (then
// make_conv_fwd builds its cuDNN form). Where KILN_CUTLASS_TIMED leaves the choice to timing,
// `cudnn_form` builds the convolution's cuDNN kernel, timed with bn_add_relu_fwd's statistics
// pass against the GEMM; when it wins, that kernel is returned. A downsampling shortcut's
// convolution whose output a later bn_add_relu_fwd takes as its residual with the residual's
// BatchNorm folded in (KILN_FUSE_RESIDUAL_BN) likewise: its sums replace that statistics pass.
KernelPtr make_conv_fwd_summed_for_bn(const Node& n, Context& ctx, int stream,
                                      const std::function<KernelPtr()>& cudnn_form);

// bn_add_relu_fwd node n's kernel, from the sums a kernel before it took (nullptr: with its own
// statistics pass); res_sums likewise for a folded residual BatchNorm's input.
KernelPtr make_bn_add_relu_fwd_part(const Node& n, Context& ctx, int stream, const float* sums,
                                    const float* res_sums = nullptr);

// A forward convolution over x and w already padded to 4 or 8 channels (g: the padded
// geometry) on CUTLASS's fixed-channels implicit GEMM (KILN_FIXED_CHANNELS_CONV;
// cutlass_conv.cpp): what queues it on a stream, or an empty function with *why saying why not
// (the switch off, the unit not built, another GPU or dtype, CUTLASS refusing the problem).
std::function<void(cudaStream_t)> fixed_channels_fwd(const Context& ctx, const ConvGeom& g,
                                                     DType dt, const void* x, const void* w,
                                                     void* y, std::string* why);

// A convolution's geometry as the first layer's kernels take it (first_layer_conv.h).
struct FirstLayerShape;
FirstLayerShape first_layer_shape(const ConvGeom& g);

// A CBR forward's convolution of at most 4 channels into 64, FP16, on the first layer's direct
// kernel (KILN_FIRST_LAYER_CONV; first_layer_fwd.cpp): z and sums[0, 64) and [64, 128) as
// make_conv_fwd_cutlass's. nullptr (with a debug line saying why) where it cannot take the layer.
// *x_copy receives the 4-channel copy of x it fills each run, where x has fewer channels (for the
// weight gradient to read, as a padded forward's: KILN_PAD_INPUT_ONCE).
KernelPtr make_first_layer_conv_fwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                    TensorId z, float* sums, std::shared_ptr<DeviceBuffer>* x_copy);

// A weight gradient of at most 4 channels into 64, FP16 x and dz, on the first layer's direct
// kernel (KILN_FIRST_LAYER_WGRAD; first_layer_bwd.cpp), reading x_filled (x's 4-channel copy,
// which its forward fills each step) where given. nullptr (with a debug line saying why) where
// it cannot take the layer.
// With `fold` (KILN_FIRST_LAYER_BN_FOLD), dz holds BatchNorm's gradient g, and the kernel forms
// dz from it, z, the ReLU mask (or none) and the coefficients that BatchNorm's backward
// finalize wrote (its fold_coef) as that backward's dx pass would.
struct FirstLayerFold {
  TensorId z = kNoTensor, mask = kNoTensor;
  const float4* coef = nullptr;  // [64]
};
KernelPtr make_first_layer_wgrad(const Node& n, Context& ctx, int stream, TensorId x, TensorId dz,
                                 TensorId dw, const std::shared_ptr<DeviceBuffer>& x_filled,
                                 const FirstLayerFold* fold = nullptr);
// x's 4-channel copy that a forward registered (KILN_PAD_INPUT_ONCE), or null.
std::shared_ptr<DeviceBuffer> padded_copy_of(const Context& ctx, TensorId x);

// Whether this libkiln holds the SM90 CUTLASS kernels (CMake's KILN_CUTLASS_KERNELS): what
// KILN_CUTLASS=auto asks before trying them (sm90_conv_gemm_tried).
bool cutlass_kernels_built();

// BatchNorm's backward with the ReLU's backward taken from the mask: g = mask ? dy [+ dy2] : 0
// (also written to dres unless that is kNoTensor), dx, dgamma, dbeta from g. dy2 (optional)
// is bn_add_relu_bwd's second gradient contribution, summed as the add op would.
// fold_coef, in these BatchNorm backwards: no dx pass; the finalize's per-channel coefficients
// (float4[C]) go there for a first layer's weight gradient to form dx itself (first_layer_bwd.cpp).
// Where the overlapping pool's sums pass gathers g, it still writes g into dx.
KernelPtr make_bn_relu_mask_bwd(const Node& n, Context& ctx, int stream, TensorId x, TensorId dy,
                                TensorId dy2, TensorId mask, TensorId gamma, TensorId saved,
                                TensorId dx, TensorId dres, TensorId dgamma, TensorId dbeta,
                                const Node* shortcut = nullptr, float4* fold_coef = nullptr);

// The same when the data gradient before it (make_dgrad_for_bn) wrote g, the gradient at
// BatchNorm's output with the mask applied and dy2 added, and g's FP32 sums [sum g; sum
// g (x - mean)]: the finalize and dx passes alone (dx, dgamma, dbeta from g and x; g copied to
// dres unless that is kNoTensor).
KernelPtr make_bn_bwd_from_sums(const Node& n, Context& ctx, int stream, TensorId x, TensorId g,
                                TensorId gamma, TensorId saved, TensorId dx, TensorId dres,
                                TensorId dgamma, TensorId dbeta, const float* sums,
                                const Node* shortcut = nullptr, float4* fold_coef = nullptr);

// A data gradient dx = conv_bwd_data(dy, w) of `n` (a conv_bwd_data node, or cbr_bwd /
// cbr_pool_bwd's part) whose dx a later cbr_bwd or bn_add_relu_bwd reads as the gradient at its
// ReLU's output (dgrad_bn_rule.h), on kiln's SM90 kernel (KILN_CUTLASS_DGRAD): it writes that
// BatchNorm's g (into dx, or into bn_add_relu_bwd's dresidual) and g's sums, which the consumer
// then reads from ctx.dgrad_bn_sums (make_bn_bwd_from_sums). nullptr where the switch is off, no
// such consumer exists, or the layer, the schedule, the memory plan or CUTLASS does not allow it
// (counted and logged); the caller then builds the cuDNN data gradient.
// Where KILN_CUTLASS_TIMED leaves the choice to timing, `cudnn_form` builds the cuDNN data
// gradient, timed with the consumer's sums pass against the SM90 kernel with the consumer's
// passes from its sums; when it wins, that kernel is returned.
KernelPtr make_dgrad_for_bn(const Node& n, Context& ctx, int stream, TensorId dy, TensorId w,
                            TensorId dx, const std::function<KernelPtr()>& cudnn_form);

// The BatchNorm backward of n (cbr_bwd's part, or bn_add_relu_bwd), from the g and sums a data
// gradient before it left (`summed`), or with its own sums pass (nullptr). `shortcut`: the
// shortcut BatchNorm's backward whose sums bn_add_relu_bwd's dx pass may take
// (KILN_RESIDUAL_BN_SUMS_IN_DX); given only for the node's own kernel, never a timed copy.
KernelPtr make_bn_bwd_part(const Node& n, Context& ctx, int stream,
                           const Context::DgradBnSums* summed, const Node* shortcut = nullptr,
                           float4* fold_coef = nullptr);

// cbr_pool_fwd's epilogue (ops.def): saved and running statistics as make_bn_relu_mask_fwd,
// then y = the max-pool of relu(bn(z)) by n.attrs.pool windows, and the mask of the elements
// the pool took where the ReLU passed them (over z for windows that tile it, else a byte per
// pooled element: pool_route.cuh); zp and mp too where given (tiled windows).
KernelPtr make_bn_relu_pool_fwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId gamma,
                                TensorId beta, TensorId rm, TensorId rv, TensorId conv_bias,
                                TensorId y, TensorId saved, TensorId mask,
                                const float* conv_sums = nullptr, TensorId zp = kNoTensor,
                                TensorId mp = kNoTensor);

// cbr_pool_bwd's BatchNorm backward: the gradient at BatchNorm's output is the pooled dy of the
// element's window where the mask is set, 0 elsewhere (overlapping windows: the sum over those
// that took it); dz, dgamma, dbeta from it. Given the forward's zp and mp, its sums pass reads
// them and dy (pooled maps) instead of z; given `sums` (FP32 [sum g; sum g (z - mean)]), which a
// data gradient before it took from zp and mp while writing g = mp ? dy : 0 into dy, none.
KernelPtr make_bn_relu_pool_bwd(const Node& n, Context& ctx, int stream, TensorId z, TensorId dy,
                                TensorId mask, TensorId gamma, TensorId saved, TensorId dz,
                                TensorId dgamma, TensorId dbeta, float4* fold_coef = nullptr,
                                TensorId zp = kNoTensor, TensorId mp = kNoTensor,
                                const float* sums = nullptr);

}  // namespace kiln::cuda
