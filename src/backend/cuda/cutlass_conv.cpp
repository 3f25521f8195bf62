// cbr_fwd's convolution on kiln's SM90 CUTLASS GEMM (KILN_CUTLASS): z = x w^T for a 1x1
// stride-1 FP16 convolution, whose epilogue also sums z and z^2 per channel (FP32, of the
// FP16-rounded z), so BatchNorm skips its statistics pass; other FP16 convolutions likewise on
// the implicit-GEMM convolution with the same epilogue where KILN_CUTLASS_CONV asks. Only this file
// and cutlass_dgrad.cpp see whether the kernels were built (KILN_HAVE_CUTLASS, set by
// CMakeLists.txt on those two alone), and only this one answers it for the rest
// (cutlass_kernels_built, sm90_layer.h); where they were not, every layer reports "not built" and
// keeps its form.
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/sm90_layer.h"
#include "backend/cuda/timed_form.h"
#include "backend/sm90_conv_rule.h"

#ifdef KILN_HAVE_CUTLASS
#include "backend/cuda/cutlass/conv_stats.h"
#include "backend/cuda/cutlass/fixed_channels_conv.h"
#include "backend/cuda/cutlass/gemm_stats.h"
#endif

namespace kiln::cuda {

namespace {

#ifdef KILN_HAVE_CUTLASS
constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

bool cutlass_kernels_built() {
  return kBuilt;
}

Sm90ConvQuery sm90_conv_query(const Node& n, const Context& ctx, TensorId a, TensorId w,
                              TensorId b) {
  Sm90ConvQuery q;
  q.g = conv_geom(ctx, n, a, w, b);
  q.x = ctx.tensor(a).dtype, q.w = ctx.tensor(w).dtype, q.z = ctx.tensor(b).dtype;
  q.cc_major = ctx.cc_major, q.cc_minor = ctx.cc_minor;
  q.built = kBuilt;
  return q;
}

bool sm90_kernels_here(const Sm90ConvQuery& q) {
  return q.built && q.cc_major == 9 && q.cc_minor == 0;
}

bool all_tma_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

void log_sm90_fallback(bool routine, const std::string& line, const std::string& why) {
  if (routine) {
    log_debug(line, why);
  } else {
    log_info(line, why);
  }
}

std::function<void(cudaStream_t)> fixed_channels_fwd(const Context& ctx, const ConvGeom& g,
                                                     DType dt, const void* x, const void* w,
                                                     void* y, std::string* why) {
  const auto refuse = [&](const std::string& reason) {
    *why = reason;
    return std::function<void(cudaStream_t)>();
  };
  if (ctx.opts.fixed_channels_conv == Auto::off) return refuse("KILN_FIXED_CHANNELS_CONV is off");
  if (!kBuilt) return refuse("the CUTLASS units were not built");
  // The unit is compiled for sm_90a alone, as the SM90 units are.
  if (ctx.cc_major != 9 || ctx.cc_minor != 0) return refuse("the unit is built for SM90 alone");
  if (dt != DType::F16) return refuse("takes FP16");
#ifdef KILN_HAVE_CUTLASS
  sm90::FixedChannelsConv p;
  p.x = x, p.w = w, p.y = y;
  p.n = static_cast<int>(g.x.n), p.h = static_cast<int>(g.x.h), p.w_ = static_cast<int>(g.x.w);
  p.c = static_cast<int>(g.x.c), p.k = static_cast<int>(g.k);
  p.r = static_cast<int>(g.r), p.s = static_cast<int>(g.s);
  p.p = static_cast<int>(g.y.h), p.q = static_cast<int>(g.y.w);
  p.pad_h = static_cast<int>(g.ph), p.pad_w = static_cast<int>(g.pw);
  p.stride_h = static_cast<int>(g.sh), p.stride_w = static_cast<int>(g.sw);
  if (std::string err = sm90::fixed_channels_conv_check(p); !err.empty()) return refuse(err);
  // Serial, one slice: CUTLASS asks no workspace (the stream's is not at hand in the runner).
  if (sm90::fixed_channels_conv_workspace(p) != 0) return refuse("CUTLASS asks a workspace");
  return [p](cudaStream_t s) {
    if (std::string err = sm90::fixed_channels_conv_run(p, nullptr, s); !err.empty())
      KILN_FAIL(Backend, "the fixed-channels CUTLASS convolution failed: ", err);
  };
#else
  (void)g, (void)x, (void)w, (void)y;
  return refuse("the CUTLASS units were not built");
#endif
}

bool sm90_fwd_implicit(const Context& ctx, const ConvGeom& g) {
  return ctx.cutlass_conv && !sm90_gemm_shape(g);
}

namespace {

// A first layer's 3 channels on the SM90 kernels, which want channels in multiples of 8
// (KILN_PAD_CHANNELS not 0, FP16): x and w copied with zero channels up to 8 before each run
// (the zeros add nothing to z or its sums), into buffers the kernel owns.
struct PaddedOperands {
  std::shared_ptr<DeviceBuffer> x, w;
  const void *x_src = nullptr, *w_src = nullptr;
  DType dt = DType::F16;
  int64_t x_rows = 0, w_rows = 0, c = 0, cp = 0;
};

std::shared_ptr<PaddedOperands> padded_operands(const Context& ctx, const ConvGeom& g, DType dt,
                                                const void* x, const void* w) {
  if (ctx.opts.pad_channels == Auto::off || dt == DType::F32 || g.x.c % 8 == 0) return nullptr;
  auto p = std::make_shared<PaddedOperands>();
  p->x_src = x, p->w_src = w, p->dt = dt;
  p->x_rows = g.x_rows(), p->w_rows = g.w_rows();
  p->c = g.x.c, p->cp = (g.x.c + 7) / 8 * 8;
  const auto bytes = [&](int64_t rows) {
    return static_cast<size_t>(rows * p->cp) * dtype_size(dt);
  };
  p->x = std::make_shared<DeviceBuffer>(bytes(p->x_rows));
  p->w = std::make_shared<DeviceBuffer>(bytes(p->w_rows));
  return p;
}

// `unit` after the padding copies, on its stream.
KernelPtr after_padding(int stream, std::shared_ptr<PaddedOperands> p, KernelPtr unit) {
  std::shared_ptr<Kernel> k = std::move(unit);
  return make_fn(stream, [p, k](Context& c, cudaStream_t st) {
    launch_pad_channels(p->x_src, p->x->get(), p->dt, p->x_rows, p->c, p->cp, c.sm_count, st);
    launch_pad_channels(p->w_src, p->w->get(), p->dt, p->w_rows, p->c, p->cp, c.sm_count, st);
    k->run(c);
  });
}

}  // namespace

KernelPtr make_conv_fwd_cutlass(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                TensorId z, float* sums) {
  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  Sm90ConvQuery q = sm90_conv_query(n, ctx, x, w, z);
  void *xa = ctx.ptr(x), *wa = ctx.ptr(w);
  const std::shared_ptr<PaddedOperands> pad = padded_operands(ctx, q.g, q.x, xa, wa);
  if (pad) {
    q.g = q.g.with_channels(pad->cp);
    xa = pad->x->get(), wa = pad->w->get();
  }
  const bool implicit = sm90_fwd_implicit(ctx, q.g);
  const char* kernel_words =
      implicit ? "kiln's SM90 CUTLASS implicit-GEMM convolution " : "kiln's SM90 CUTLASS GEMM ";
  std::string why = implicit ? sm90_implicit_conv_refusal(q) : sm90_conv_refusal(q);
  // A layer of another shape or precision is routine; the kernels missing or another GPU under
  // an explicit KILN_CUTLASS=1 (auto does not try there: sm90_conv_gemm_tried), or CUTLASS
  // refusing an eligible layer, is worth a line at the default level.
  const bool routine = !why.empty() && sm90_kernels_here(q);
  if (why.empty() && !all_tma_aligned({xa, wa, ctx.ptr(z)})) {
    why = "needs x, w and z at 16-byte aligned addresses (TMA)";
  }
#ifdef KILN_HAVE_CUTLASS
  int device_id = 0;
  CUDA_CHECK(cudaGetDevice(&device_id));
  if (implicit) {
    sm90::ConvStats c;
    c.x = xa, c.w = wa, c.z = ctx.ptr(z);
    c.sum = sums, c.sumsq = sums + q.g.k;
    c.n = static_cast<int>(q.g.x.n), c.h = static_cast<int>(q.g.x.h);
    c.w_ = static_cast<int>(q.g.x.w), c.c = static_cast<int>(q.g.x.c);
    c.k = static_cast<int>(q.g.k), c.r = static_cast<int>(q.g.r), c.s = static_cast<int>(q.g.s);
    c.pad_h = static_cast<int>(q.g.ph), c.pad_w = static_cast<int>(q.g.pw);
    c.stride_h = static_cast<int>(q.g.sh), c.stride_w = static_cast<int>(q.g.sw);
    c.sm_count = ctx.sm_count;
    c.device_id = device_id;
    c.clear_by_kernel = ctx.opts.sums_clear_kernel;
    // The deterministic form adds per-CTA partials in a fixed order (as the GEMM's below).
    const sm90::ConvStatsKernel kern = sm90::conv_stats_kernel_for(q.g.k, ctx.opts.deterministic);
    if (why.empty()) {
      if (std::string err = kern.check(c); !err.empty()) why = "refuses it: CUTLASS " + err;
    }
    if (why.empty()) {
      KernelPtr unit =
          make_sm90_unit_run(ctx, stream, kern, c,
                             what + ": the SM90 CUTLASS convolution (" + kern.name + ") failed: ");
      return pad ? after_padding(stream, pad, std::move(unit)) : std::move(unit);
    }
  } else {
    sm90::GemmStats g;
    g.x = xa, g.w = wa, g.z = ctx.ptr(z);
    g.m = q.g.x.n * q.g.x.h * q.g.x.w, g.n = q.g.k, g.k = q.g.x.c;
    g.sum = sums, g.sumsq = sums + g.n;
    g.sm_count = ctx.sm_count;
    g.device_id = device_id;
    g.clear_by_kernel = ctx.opts.sums_clear_kernel;
    // FP32 atomics add the CTAs' sums in whatever order they finish; the partials form adds them
    // in a fixed order, so a deterministic run gives the same bits every time.
    const sm90::GemmStatsKernel kern = ctx.opts.deterministic
                                           ? sm90::gemm_stats_256x128_reg_partials_1x1()
                                           : sm90::gemm_stats_256x128_reg_atomic_1x1();
    if (why.empty()) {
      if (std::string err = kern.check(g); !err.empty()) why = "refuses it: CUTLASS " + err;
    }
    if (why.empty()) {
      KernelPtr unit = make_sm90_unit_run(
          ctx, stream, kern, g, what + ": the SM90 CUTLASS GEMM (" + kern.name + ") failed: ");
      return pad ? after_padding(stream, pad, std::move(unit)) : std::move(unit);
    }
  }
#endif
  log_sm90_fallback(routine, what + ": the convolution keeps cuDNN; " + kernel_words, why);
  return nullptr;
}

namespace {

// The first bn_add_relu_fwd after `conv` in the training schedule that normalises y: as its
// input x (a bottleneck's conv3), or as its residual with the residual's BatchNorm folded in (a
// downsampling shortcut's convolution, `residual` set); nullptr where none does (conv is not a
// training node: a fused part, an evaluation node).
const Node* later_bn_add_relu_reader(const Program& p, const Node& conv, TensorId y,
                                     bool* residual) {
  bool after = false;
  for (const Phase& ph : p.train) {
    for (const Node& m : ph.nodes) {
      if (&m == &conv) {
        after = true;
      } else if (after && m.op == OpKind::bn_add_relu_fwd && !m.in.empty()) {
        *residual = m.in.size() > 6 && m.in[5] == y;
        if (m.in[0] == y || *residual) return &m;
      }
    }
  }
  return nullptr;
}

const float* found_sums(const std::unordered_map<const Node*, const float*>& m, const Node* n) {
  const auto it = m.find(n);
  return it == m.end() ? nullptr : it->second;
}

}  // namespace

KernelPtr make_conv_fwd_summed_for_bn(const Node& n, Context& ctx, int stream,
                                      const std::function<KernelPtr()>& cudnn_form) {
  if (!ctx.cutlass || ctx.program == nullptr || n.out.empty()) return nullptr;
  if (in_at(n, 2) != kNoTensor) return nullptr;  // a bias: the GEMM adds none
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), y = need_out(n, 0, "y");
  bool residual = false;
  const Node* bn = later_bn_add_relu_reader(*ctx.program, n, y, &residual);
  if (bn == nullptr) return nullptr;
  const int64_t k = ctx.tensor(y).shape.dims.back();
  auto sums = std::make_shared<DeviceBuffer>(2 * static_cast<size_t>(k) * sizeof(float));
  auto* sp = static_cast<float*>(sums->get());
  std::shared_ptr<Kernel> conv = make_conv_fwd_cutlass(n, ctx, stream, x, w, y, sp);
  if (!conv) {
    ++ctx.conv_cutlass_fallbacks;
    return nullptr;
  }
  const ConvGeom g = conv_geom(ctx, n, x, w, y);
  const bool implicit = sm90_fwd_implicit(ctx, g);
  if (implicit ? ctx.cutlass_conv_timed : ctx.cutlass_timed) {
    // The two forms of the convolution and its BatchNorm's statistics: the SM90 kernel with the
    // BatchNorm's apply pass from its sums, against cuDNN's convolution with the BatchNorm's
    // whole pass (the other input's sums, where a kernel took them already, in both).
    KernelPtr today = cudnn_form();
    const float* other =
        found_sums(residual ? ctx.bn_add_relu_sums : ctx.bn_add_relu_residual_sums, bn);
    const KernelPtr bn_sm90 = residual ? make_bn_add_relu_fwd_part(*bn, ctx, stream, other, sp)
                                       : make_bn_add_relu_fwd_part(*bn, ctx, stream, sp, other);
    const KernelPtr bn_today = residual
                                   ? make_bn_add_relu_fwd_part(*bn, ctx, stream, other, nullptr)
                                   : make_bn_add_relu_fwd_part(*bn, ctx, stream, nullptr, other);
    const std::string form = std::string("conv_fwd+bn_add_relu_fwd") +
                             (residual ? ".residual" : "") + (implicit ? ".conv" : ".gemm");
    const TimedChoice c = time_sm90_against_today(
        n, ctx, stream, timed_form_key(form, g, ctx.tensor(x).dtype, ""),
        {conv.get(), bn_sm90.get()}, {today.get(), bn_today.get()},
        // The running statistics both forms update, the residual's BatchNorm's too where it is
        // folded in (ops.def's running_mean2 / running_var2).
        {need_in(*bn, 3, "running_mean"), need_in(*bn, 4, "running_var"), in_at(*bn, 8),
         in_at(*bn, 9)});
    if (!c.sm90) {
      ++ctx.conv_cutlass_fallbacks;
      return today;
    }
  }
  (residual ? ctx.bn_add_relu_residual_sums : ctx.bn_add_relu_sums)[bn] = sp;
  ++ctx.conv_cutlass;
  // The sums live as long as the kernel that writes them; the BatchNorm node after it reads them
  // on the schedule's order (the same stream, or joined behind this phase's event).
  return make_fn(stream, [conv, sums](Context& c, cudaStream_t) { conv->run(c); });
}

}  // namespace kiln::cuda
