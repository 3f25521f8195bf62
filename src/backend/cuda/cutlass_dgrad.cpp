// A data gradient that feeds a BatchNorm backward on kiln's SM90 kernel (KILN_CUTLASS_DGRAD):
// dX = dY W for a 1x1 stride-1 FP16 convolution (or, under KILN_CUTLASS_CONV_DGRAD, the implicit
// GEMM's dX of a stride-1 filter that keeps the size: VGG's 3x3) whose dX is the gradient at the
// output of a later relu(bn(z)) (cbr_bwd: a bottleneck's conv3 feeding conv2's CBR) or relu(bn(z) +
// residual) (bn_add_relu_bwd: a bottleneck's conv1 feeding the previous block's output, the
// residual path's gradient added). The kernel (cutlass/dgrad_bn.h) writes that BatchNorm's masked
// gradient g = mask ? dX [+ dy2] : 0, rounded as kiln's BatchNorm backward rounds it, and g's
// two sums; the BatchNorm backward then runs its finalize and dx passes from them
// (make_bn_bwd_from_sums), without its sums pass or its reads of dy, dy2 and the mask. g goes
// into dX's own tensor (cbr_bwd reads it as its dy) or into bn_add_relu_bwd's dresidual, which
// is g exactly (dX is then never written); where the memory plan has dresidual's bytes in use
// until the BatchNorm backward (memory reuse), into dX, and the dx pass copies it to dresidual
// as it writes dresidual today. Where the layer (sm90_conv_rule.h), the schedule or
// the memory plan (dgrad_bn_rule.h) or CUTLASS do not allow it, the layer keeps cuDNN's data
// gradient and BatchNorm's sums pass, counted and logged as the forward's GEMM is
// (cutlass_conv.cpp, with which it shares sm90_layer.h). Like that file it is compiled with
// KILN_HAVE_CUTLASS where the kernels were built (CMakeLists.txt), to include them; whether
// they were reaches it through sm90_conv_query (cutlass_conv.cpp).
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/side_stream.h"
#include "backend/cuda/sm90_layer.h"
#include "backend/cuda/timed_form.h"
#include "backend/dgrad_bn_rule.h"
#include "backend/sm90_conv_rule.h"

#ifdef KILN_HAVE_CUTLASS
#include "backend/cuda/cutlass/dgrad_bn.h"
#endif

namespace kiln::cuda {

namespace {

// The consumer's tensors as the kernel reads them: z, g and the other gradient maps of dX's
// dtype and size, the mask's bits over them, saved [mean; invstd] in FP32. "" when they are.
std::string layout_refusal(const Context& ctx, TensorId dx, const DgradBnUse& u, int64_t channels) {
  const DTensor& d = ctx.tensor(dx);
  auto same_map = [&](TensorId id) {
    return ctx.tensor(id).dtype == d.dtype && ctx.tensor(id).numel() == d.numel();
  };
  if (!same_map(u.z) || !same_map(u.g) || (u.other != kNoTensor && !same_map(u.other)))
    return "needs the BatchNorm's z, g and second gradient in dx's dtype and size";
  const DTensor& mask = ctx.tensor(u.mask);
  if (mask.dtype != DType::U8 || mask.numel() < (d.numel() + 7) / 8)
    return "needs the BatchNorm's ReLU mask as one bit per element of dx";
  const DTensor& saved = ctx.tensor(u.saved);
  if (saved.dtype != DType::F32 || saved.numel() != 2 * channels)
    return "needs the BatchNorm's saved statistics as FP32 [mean; invstd]";
  return "";
}

}  // namespace

KernelPtr make_dgrad_for_bn(const Node& n, Context& ctx, int stream, TensorId dy, TensorId w,
                            TensorId dx, const std::function<KernelPtr()>& cudnn_form) {
  if (!ctx.cutlass_dgrad || ctx.program == nullptr || dx == kNoTensor) return nullptr;
  const DgradBnUse u = dgrad_bn_use(*ctx.program, n, dx);
  if (u.consumer == nullptr) return nullptr;  // no BatchNorm backward reads dx: not tried
  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  const Sm90ConvQuery q = sm90_conv_query(n, ctx, dx, w, dy);
  // A 1x1 stride-1 layer is the GEMM's; other stride-1 ones the implicit-GEMM data gradient's
  // where KILN_CUTLASS_CONV_DGRAD has them try it.
  const bool implicit = ctx.cutlass_conv_dgrad && !sm90_gemm_shape(q.g);
  std::string why = implicit ? sm90_implicit_dgrad_refusal(q) : sm90_conv_refusal(q);
  // A layer of another shape or precision, or a schedule or plan that does not fit, is routine;
  // the kernels missing or another GPU under KILN_CUTLASS_DGRAD=1, or CUTLASS refusing an
  // eligible layer, is worth a line at the default level (as cutlass_conv.cpp).
  if (why.empty()) why = u.refusal;
  if (why.empty()) why = layout_refusal(ctx, dx, u, q.g.x.c);
  const bool routine = !why.empty() && sm90_kernels_here(q);
  if (why.empty() &&
      !all_tma_aligned({ctx.ptr(dy), ctx.ptr(w), ctx.ptr(u.z), ctx.ptr(u.g), ctx.ptr(u.other)})) {
    why = "needs dy, w, z, g and dy2 at 16-byte aligned addresses (TMA, half2 loads)";
  }
#ifdef KILN_HAVE_CUTLASS
  const int64_t channels = q.g.x.c;
  std::shared_ptr<DeviceBuffer> sums;
  if (why.empty())
    sums = std::make_shared<DeviceBuffer>(2 * static_cast<size_t>(channels) * sizeof(float));
  sm90::DgradBn d;
  d.dy = ctx.ptr(dy), d.w = ctx.ptr(w), d.z = ctx.ptr(u.z);
  d.mask = ctx.ptr<uint8_t>(u.mask);
  d.dy2 = ctx.ptr(u.other);
  d.mean = ctx.ptr<float>(u.saved);  // saved = [mean; invstd]
  d.g = ctx.ptr(u.g);
  d.sums = sums ? static_cast<float*>(sums->get()) : nullptr;
  d.m = q.g.x_rows(), d.n = channels, d.k = q.g.k;
  d.sm_count = ctx.sm_count;
  d.clear_by_kernel = ctx.opts.sums_clear_kernel;
  CUDA_CHECK(cudaGetDevice(&d.device_id));
  if (implicit) {
    d.h = static_cast<int>(q.g.x.h), d.w_ = static_cast<int>(q.g.x.w);
    d.r = static_cast<int>(q.g.r), d.s = static_cast<int>(q.g.s);
    d.pad_h = static_cast<int>(q.g.ph), d.pad_w = static_cast<int>(q.g.pw);
  }
  // The partials form adds the CTAs' sums in a fixed order: a deterministic run's bits repeat.
  // A CBR's g has no second gradient: its unit keeps no shared memory for one (KILN_DGRAD_NO_DY2
  // off keeps the one unit for both).
  const bool dy2 = d.dy2 != nullptr || !ctx.opts.dgrad_no_dy2;
  const sm90::DgradBnKernel kern =
      implicit ? sm90::conv_dgrad_bn_kernel_for(d.n, ctx.opts.deterministic, dy2,
                                                ctx.opts.conv_dgrad_wide_tile,
                                                ctx.opts.conv_dgrad_pingpong)
               : sm90::dgrad_bn_kernel_for(d.n, ctx.opts.deterministic, dy2);
  if (why.empty()) {
    if (std::string err = kern.check(d); !err.empty()) why = "refuses it: CUTLASS " + err;
  }
#endif
  if (!why.empty()) {
    ++ctx.dgrad_cutlass_fallbacks;
    log_sm90_fallback(routine,
                      what + ": the data gradient keeps cuDNN (and '" + u.consumer->label +
                          "' its sums pass); kiln's SM90 data gradient ",
                      why);
    return nullptr;
  }
#ifdef KILN_HAVE_CUTLASS
  KernelPtr sm90 = make_sm90_unit_run(
      ctx, stream, kern, d, what + ": the SM90 data gradient (" + kern.name + ") failed: ", sums);
  if (implicit ? ctx.cutlass_conv_dgrad_timed : ctx.cutlass_dgrad_timed) {
    // The two forms of this data gradient and the consumer's BatchNorm backward: the SM90 kernel
    // with the consumer's passes from its sums, against cuDNN's with the consumer's sums pass.
    KernelPtr today = cudnn_form();
    const Context::DgradBnSums summed{d.sums, u.g};
    const KernelPtr bn_sm90 = make_bn_bwd_part(*u.consumer, ctx, stream, &summed);
    const KernelPtr bn_today = make_bn_bwd_part(*u.consumer, ctx, stream, nullptr);
    // The unit without room for dy2 is timed under a key of its own (tables hold the other's).
    const std::string extra =
        std::string(op_name(u.consumer->op)) + (u.other != kNoTensor ? ",dy2" : "") +
        (u.g != dx ? ",g" : "") + (dy2 || ctx.opts.deterministic ? "" : ",nody2") +
        (kern.tile_m == 256 ? ",wide" : "") + (sm90::is_pingpong_unit(kern) ? ",pingpong" : "");
    const TimedChoice c = time_sm90_against_today(
        n, ctx, stream,
        timed_form_key(implicit ? "dgrad.conv" : "dgrad.gemm", q.g, ctx.tensor(dy).dtype, extra),
        {sm90.get(), bn_sm90.get()}, {today.get(), bn_today.get()}, {});
    if (!c.sm90) {
      ++ctx.dgrad_cutlass_fallbacks;
      return today;
    }
  }
  // The consumer reads g and these sums on the schedule's order (the same stream, or joined
  // behind this phase's event); the sums live as long as the kernel that writes them.
  ctx.dgrad_bn_sums[u.consumer] = {d.sums, u.g};
  ++ctx.dgrad_cutlass;
  if (implicit) ++ctx.dgrad_cutlass_conv;
  if (kern.tile_m == 256) ++ctx.dgrad_cutlass_wide;
  if (sm90::is_pingpong_unit(kern)) ++ctx.dgrad_cutlass_pingpong;
  // What this node now reads and writes beyond its own tensors, for the side stream's joins.
  Context::ExtraBytes& extra = ctx.extra_bytes[&n];
  extra.reads = byte_ranges(ctx, {u.z, u.mask, u.saved, u.other});
  if (u.g != dx) extra.writes = byte_ranges(ctx, {u.g});
  log_debug(what, ": the data gradient runs on ", kern.name, ", writing '", ctx.tensor(u.g).name,
            "' and the sums for '", u.consumer->label, "'");
  return sm90;
#else
  return nullptr;
#endif
}

}  // namespace kiln::cuda
