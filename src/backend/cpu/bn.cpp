// Batch normalisation on the CPU: oneDNN batch_normalization (use_scale | use_shift) for
// the training forward, the inference forward (use_global_stats) and the backward, plus the
// two loops oneDNN has no notion of:
//  - saved statistics in kiln's format, [mean; invstd] (2 x C), with
//    invstd = 1 / sqrt(biased_var + eps): the format the CUDA kernels (cuDNN's saved
//    inverse variance) use. oneDNN returns the biased variance, converted after the forward;
//    the backward converts invstd back: var = 1/invstd^2 - eps, in double. invstd carries
//    half an ulp of rounding, so 1/invstd^2 = var + eps to ~1 ulp, and oneDNN then forms
//    var + eps again in FP32 (one more rounding): the backward sees 1/sqrt(var + eps) within
//    ~2 ulp (2.4e-7 relative) of the forward's, far below the FP32 tests' 1e-5;
//  - the running statistics, PyTorch's convention: running = (1 - m) running + m batch,
//    with the *unbiased* batch variance n/(n-1) var (n = N H W; for n = 1 the factor is 1,
//    where PyTorch refuses to train).
#include <cmath>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"

namespace kiln::cpu {

namespace {

using namespace dnnl;

const normalization_flags kScaleShift =
    normalization_flags::use_scale | normalization_flags::use_shift;

struct BnGeom {
  Nhwc x;
  memory::desc data_md() const { return {nchw(x), dt::f32, tag::nhwc}; }
  dims c_dims() const { return {x.c}; }
};

BnGeom bn_geom(const Context& ctx, const Node& n, TensorId x,
               std::initializer_list<TensorId> same_shape,
               std::initializer_list<TensorId> per_channel) {
  BnGeom g;
  g.x = nhwc_of(ctx, n, x, "x");
  expect_dtype(ctx, n, x, DType::F32, "x");
  for (TensorId id : same_shape) {
    expect_dtype(ctx, n, id, DType::F32, "feature");
    KILN_CHECK(ctx.tensor(id).shape == ctx.tensor(x).shape, Shape, op_name(n.op), " node '",
               n.label, "': '", ctx.tensor(id).name, "' has shape ", ctx.tensor(id).shape.str(),
               ", x has ", ctx.tensor(x).shape.str());
  }
  expect_per_channel(ctx, n, per_channel, g.x.c);
  KILN_CHECK(n.attrs.eps > 0.0f, InvalidArgument, op_name(n.op), " node '", n.label,
             "': eps must be > 0, is ", n.attrs.eps);
  return g;
}

batch_normalization_forward::primitive_desc train_pd(const Context& ctx, const BnGeom& g, float eps,
                                                     const primitive_attr& attr) {
  batch_normalization_forward::desc d(prop_kind::forward_training, g.data_md(), eps, kScaleShift);
  return batch_normalization_forward::primitive_desc(d, attr, ctx.engine);
}

class BnTrainKernel final : public Kernel {
 public:
  // `var` is the buffer the primitive writes the variance to; moving a vector keeps its
  // heap buffer, so the memory bound in `call` stays valid.
  BnTrainKernel(DnnlCall call, int64_t c, int64_t count, const Attrs& a, std::vector<float> var,
                float* saved, float* running_mean, float* running_var)
      : call_(std::move(call)),
        c_(c),
        count_(count),
        eps_(a.eps),
        momentum_(a.bn_momentum),
        var_(std::move(var)),
        saved_(saved),
        running_mean_(running_mean),
        running_var_(running_var) {}

  void run(Context& ctx) override {
    call_(ctx);  // y, saved mean (written in place into saved[0:C]) and the biased variance
    const float* mean = saved_;
    float* invstd = saved_ + c_;
    const double unbias = formula::bn_unbias(static_cast<double>(count_));
    const double m = momentum_;
    for (int64_t i = 0; i < c_; ++i) {
      const float var = var_[static_cast<size_t>(i)];
      invstd[i] = formula::bn_invstd(var, eps_);
      running_mean_[i] = formula::running_mean_update(running_mean_[i], m, mean[i]);
      running_var_[i] = formula::running_var_update(running_var_[i], m, unbias, var);
    }
  }

 private:
  DnnlCall call_;
  int64_t c_, count_;
  float eps_, momentum_;
  std::vector<float> var_;  // biased batch variance, oneDNN's output
  float* saved_;
  float* running_mean_;
  float* running_var_;
};

class BnBwdKernel final : public Kernel {
 public:
  BnBwdKernel(DnnlCall call, int64_t c, float eps, const float* invstd, std::vector<float> var,
              std::vector<float> shift)
      : call_(std::move(call)),
        c_(c),
        eps_(eps),
        invstd_(invstd),
        var_(std::move(var)),
        shift_(std::move(shift)) {}
  void run(Context& ctx) override {
    for (int64_t i = 0; i < c_; ++i) {
      const double s = invstd_[i];
      var_[static_cast<size_t>(i)] = static_cast<float>(1.0 / (s * s) - static_cast<double>(eps_));
    }
    call_(ctx);
  }

 private:
  DnnlCall call_;
  int64_t c_;
  float eps_;
  const float* invstd_;
  std::vector<float> var_;    // the variance oneDNN reads, rebuilt from invstd
  std::vector<float> shift_;  // oneDNN 2.6 wants a SHIFT argument in the backward (unread)
};

// bn_fwd_train, its output y written to dst when that is given (a buffer of x's size; node
// output 0 is then not read).
KernelPtr bn_fwd_train(const Node& n, Context& ctx, float* dst) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var");
  const TensorId y = dst ? kNoTensor : need_out(n, 0, "y"), saved = need_out(n, 1, "saved");
  const BnGeom g = dst ? bn_geom(ctx, n, x, {}, {gamma, beta, rm, rv})
                       : bn_geom(ctx, n, x, {y}, {gamma, beta, rm, rv});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * g.x.c, "saved (2 x C)");
  std::vector<float> var(static_cast<size_t>(g.x.c));
  try {
    auto pd = train_pd(ctx, g, n.attrs.eps, user_scratchpad_attr());
    float* saved_p = ctx.ptr<float>(saved);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_DST, dst ? make_memory(ctx, dst, nchw(g.x), tag::nhwc)
                           : make_memory(ctx, y, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_SCALE, make_memory(ctx, gamma, g.c_dims(), tag::x)},
        {DNNL_ARG_SHIFT, make_memory(ctx, beta, g.c_dims(), tag::x)},
        {DNNL_ARG_MEAN, make_memory(ctx, saved_p, g.c_dims(), tag::x)},
        {DNNL_ARG_VARIANCE, make_memory(ctx, var.data(), g.c_dims(), tag::x)}};
    return std::make_unique<BnTrainKernel>(
        DnnlCall(n, ctx, batch_normalization_forward(pd), pd, std::move(args)), g.x.c,
        g.x.n * g.x.h * g.x.w, n.attrs, std::move(var), saved_p, ctx.ptr<float>(rm),
        ctx.ptr<float>(rv));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

}  // namespace

// "x, gamma, beta, running_mean, running_var -> y, saved (2xC: mean, invstd)"
KernelPtr make_bn_fwd_train(const Node& n, Context& ctx) {
  return bn_fwd_train(n, ctx, nullptr);
}

KernelPtr make_bn_fwd_train_into(const Node& n, Context& ctx, float* dst) {
  return bn_fwd_train(n, ctx, dst);
}

// "x, gamma, beta, running_mean, running_var -> y"
KernelPtr make_bn_fwd_infer(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var");
  const TensorId y = need_out(n, 0, "y");
  const BnGeom g = bn_geom(ctx, n, x, {y}, {gamma, beta, rm, rv});
  try {
    batch_normalization_forward::desc d(prop_kind::forward_inference, g.data_md(), n.attrs.eps,
                                        kScaleShift | normalization_flags::use_global_stats);
    batch_normalization_forward::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_DST, make_memory(ctx, y, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_SCALE, make_memory(ctx, gamma, g.c_dims(), tag::x)},
        {DNNL_ARG_SHIFT, make_memory(ctx, beta, g.c_dims(), tag::x)},
        {DNNL_ARG_MEAN, make_memory(ctx, rm, g.c_dims(), tag::x)},
        {DNNL_ARG_VARIANCE, make_memory(ctx, rv, g.c_dims(), tag::x)}};
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, batch_normalization_forward(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "x, dy, gamma, saved -> dx, dgamma, dbeta"
KernelPtr make_bn_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), gamma = need_in(n, 2, "gamma"),
                 saved = need_in(n, 3, "saved");
  const TensorId dx = need_out(n, 0, "dx"), dgamma = need_out(n, 1, "dgamma"),
                 dbeta = need_out(n, 2, "dbeta");
  const BnGeom g = bn_geom(ctx, n, x, {dy, dx}, {gamma, dgamma, dbeta});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * g.x.c, "saved (2 x C)");
  std::vector<float> var(static_cast<size_t>(g.x.c)), shift(static_cast<size_t>(g.x.c), 0.0f);
  try {
    auto hint = train_pd(ctx, g, n.attrs.eps, primitive_attr());
    batch_normalization_backward::desc d(prop_kind::backward, g.data_md(), g.data_md(), n.attrs.eps,
                                         kScaleShift);
    batch_normalization_backward::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    float* saved_p = ctx.ptr<float>(saved);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_SCALE, make_memory(ctx, gamma, g.c_dims(), tag::x)},
        {DNNL_ARG_SHIFT, make_memory(ctx, shift.data(), g.c_dims(), tag::x)},
        {DNNL_ARG_MEAN, make_memory(ctx, saved_p, g.c_dims(), tag::x)},
        {DNNL_ARG_VARIANCE, make_memory(ctx, var.data(), g.c_dims(), tag::x)},
        {DNNL_ARG_DIFF_SRC, make_memory(ctx, dx, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_DIFF_SCALE, make_memory(ctx, dgamma, g.c_dims(), tag::x)},
        {DNNL_ARG_DIFF_SHIFT, make_memory(ctx, dbeta, g.c_dims(), tag::x)}};
    return std::make_unique<BnBwdKernel>(
        DnnlCall(n, ctx, batch_normalization_backward(pd), pd, std::move(args)), g.x.c, n.attrs.eps,
        saved_p + g.x.c, std::move(var), std::move(shift));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

}  // namespace kiln::cpu
