// Fused ops on the GPU: CBR and BN+add+ReLU as kiln's own kernels around
// cuDNN's convolutions. What fusion saves here, against the unfused chain:
//  - forward: the ReLU pass (a read and a write of the map) becomes part of BatchNorm's
//    apply pass, which also writes the one-bit mask (1/16 of an FP16 map);
//  - backward: the ReLU backward pass (two reads and a write) disappears: BatchNorm's two
//    passes read dy and the mask instead of a masked copy of dy;
//  - BN+add+ReLU: the add's pass too (the residual is read in the apply pass), and in the
//    backward the residual's gradient is written by BatchNorm's dx pass.
// The arithmetic is the unfused chain's, rounding for rounding, so fused and unfused programs
// give the same bits (tests/gpu/gpu_fused_test.cpp). The parts run in order on the node's
// stream. KILN_CBR_FORM=genstats takes the MLPerf-style forward instead (conv+genstats in
// one cuDNN graph), and KILN_CUTLASS kiln's SM90 GEMM with the sums in its epilogue for the
// 1x1 layers (cutlass_conv.cpp); KILN_CUTLASS_DGRAD likewise the 1x1 data gradients that feed a
// BatchNorm backward, whose epilogue takes that backward's sums (cutlass_dgrad.cpp); the genstats
// form's backward forms (dgrad+drelu+dbn) and the MLPerf prologue form are not built
// (bench/RESULTS.md: cuDNN has no dgrad+drelu+dbn_weight engine at batch 256, and the prologue
// convolutions cost about what they save). cbr_pool_* also fold a max-pool that tiles z into
// BatchNorm's apply pass: the full-resolution ReLU output is neither written nor read back, and
// the backward reads the pooled gradient and the mask of the elements the pool took.
#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/side_stream.h"
#include "backend/cuda/sm90_layer.h"
#include "backend/cuda/timed_form.h"
#include "backend/dgrad_bn_rule.h"
#include "backend/fused_nodes.h"

namespace kiln::cuda {

namespace {

// Runs its parts in order on one stream; owns what they share beyond the regions.
class Sequence final : public Kernel {
 public:
  Sequence(int stream, std::vector<KernelPtr> parts, std::unique_ptr<DeviceBuffer> shared = nullptr)
      : Kernel(stream), parts_(std::move(parts)), shared_(std::move(shared)) {}
  void run(Context& ctx) override {
    for (auto& k : parts_) k->run(ctx);
  }

 private:
  std::vector<KernelPtr> parts_;
  std::unique_ptr<DeviceBuffer> shared_;
};

// cbr_forward's forms without the direct first-layer convolution: the SM90 kernel's (timed
// against today's where KILN_CUTLASS_TIMED says) or today's.
template <typename Summing, typename Today>
KernelPtr cbr_forward_usual(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                            TensorId z, const std::vector<TensorId>& keep, Summing& summing,
                            Today& today) {
  if (!ctx.cutlass) return today();
  KernelPtr k =
      summing([&](float* sp) { return make_conv_fwd_cutlass(n, ctx, stream, x, w, z, sp); });
  if (!k) {
    ++ctx.cbr_cutlass_fallbacks;
    return today();
  }
  const ConvGeom g = conv_geom(ctx, n, x, w, z);
  const bool implicit = sm90_fwd_implicit(ctx, g);
  if (implicit ? ctx.cutlass_conv_timed : ctx.cutlass_timed) {
    const int genstats = ctx.cbr_genstats, genstats_fallbacks = ctx.cbr_genstats_fallbacks;
    KernelPtr t = today();
    const std::string form = std::string(op_name(n.op)) + (implicit ? ".conv" : ".gemm");
    const Attrs& at = n.attrs;
    const std::string extra = at.pool == 0      ? ""
                              : at.pool_tiles() ? "pool" + std::to_string(at.pool)
                                                : "pool" + std::to_string(at.pool) + "s" +
                                                      std::to_string(at.pool_step()) + "p" +
                                                      std::to_string(at.pool_pad);
    const TimedChoice c =
        time_sm90_against_today(n, ctx, stream, timed_form_key(form, g, ctx.tensor(x).dtype, extra),
                                {k.get()}, {t.get()}, keep);
    if (!c.sm90) {
      ++ctx.cbr_cutlass_fallbacks;
      return t;
    }
    ctx.cbr_genstats = genstats, ctx.cbr_genstats_fallbacks = genstats_fallbacks;
  }
  ++ctx.cbr_cutlass;
  if (implicit) ++ctx.cbr_cutlass_conv;
  return k;
}

// cbr_fwd's and cbr_pool_fwd's convolution, then `epilogue(sums)`, their BatchNorm part. Where
// the convolution also sums z per channel (sums non-null), BatchNorm skips its statistics pass:
// with KILN_CUTLASS (by default under AMP on SM90) on kiln's SM90 CUTLASS GEMM where the layer
// is eligible (cutlass_conv.cpp), else with KILN_CBR_FORM=genstats in the MLPerf-style form where
// cuDNN has it (one graph, conv+genstats). Either's sums are FP32 over the FP16-rounded z,
// accumulated in another order than kiln's double pass, so those forms agree with the unfused chain
// to rounding, not bit for bit. A layer neither takes keeps kiln's form; the counters say how many
// took each. Where KILN_CUTLASS_TIMED leaves the SM90 kernel's family to timing, the layer keeps
// the faster of the two whole forms (timed_form.h), BatchNorm's running statistics (`keep`) kept.
template <typename Epilogue>
KernelPtr cbr_forward(const Node& n, Context& ctx, int stream, TensorId x, TensorId w, TensorId z,
                      const std::vector<TensorId>& keep, Epilogue epilogue) {
  // One summing form: its convolution writes z and [sum; sumsq] into a buffer the Sequence owns.
  auto summing = [&](auto make_conv) -> KernelPtr {
    const int64_t k = ctx.tensor(z).shape.dims.back();
    auto sums = std::make_unique<DeviceBuffer>(2 * static_cast<size_t>(k) * sizeof(float));
    auto* sp = static_cast<float*>(sums->get());
    KernelPtr conv = make_conv(sp);
    if (!conv) return nullptr;
    std::vector<KernelPtr> parts;
    parts.push_back(std::move(conv));
    parts.push_back(epilogue(static_cast<const float*>(sp)));
    return std::make_unique<Sequence>(stream, std::move(parts), std::move(sums));
  };
  // Today's form: conv+genstats where asked for and cuDNN has it, else the plain convolution
  // and kiln's statistics pass.
  auto today = [&]() -> KernelPtr {
    if (ctx.opts.cbr_genstats) {
      if (KernelPtr k = summing(
              [&](float* sp) { return make_conv_fwd_genstats(n, ctx, stream, x, w, z, sp); })) {
        ++ctx.cbr_genstats;
        return k;
      }
      ++ctx.cbr_genstats_fallbacks;
    }
    std::vector<KernelPtr> parts;
    parts.push_back(
        make_conv_fwd(fused_part(OpKind::conv_fwd, {x, w}, {z}, n, "conv"), ctx, stream));
    parts.push_back(epilogue(static_cast<const float*>(nullptr)));
    return std::make_unique<Sequence>(stream, std::move(parts));
  };
  // The first layer's direct convolution with the sums (KILN_FIRST_LAYER_CONV): 1 takes it
  // wherever it can; auto keeps the faster of it and the form the rest of this function builds
  // (timed per layer; that form's counters count it either way).
  // Its 4-channel copy of x is the weight gradient's too, where it is the form kept
  // (KILN_PAD_INPUT_ONCE; the usual form's padded forward would register its own).
  KernelPtr direct;
  std::shared_ptr<DeviceBuffer> x_copy;
  if (ctx.opts.first_layer_conv != Auto::off)
    direct = summing(
        [&](float* sp) { return make_first_layer_conv_fwd(n, ctx, stream, x, w, z, sp, &x_copy); });
  const auto keep_direct = [&] {
    ++ctx.first_layer_convs;
    if (x_copy && ctx.opts.pad_input_once) ctx.padded_inputs[x] = x_copy;
    return std::move(direct);
  };
  if (direct && ctx.opts.first_layer_conv == Auto::on) return keep_direct();
  KernelPtr usual = cbr_forward_usual(n, ctx, stream, x, w, z, keep, summing, today);
  if (!direct) return usual;
  const ConvGeom g = conv_geom(ctx, n, x, w, z);
  const FormChoice c = choose_faster_form(
      ctx, stream, timed_form_key(op_name(n.op), g, ctx.tensor(x).dtype, "", "firstv1"),
      {"direct", {direct.get()}}, {"usual", {usual.get()}}, keep,
      ctx.opts.autotune || !ctx.opts.tune_path.empty());
  log_debug(op_name(n.op), " node '", n.label, "': the first layer's direct convolution ",
            c.first_ms, " ms, its usual form ", c.second_ms, " ms: keeps ",
            c.found && c.first ? "the direct one" : "the usual one");
  if (!(c.found && c.first)) return usual;
  return keep_direct();
}

}  // namespace

// "x, w, gamma, beta, running_mean, running_var, [b] -> z, y, saved, mask"
KernelPtr make_cbr_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const CbrFwdTensors t = cbr_fwd_tensors(n);
  return cbr_forward(n, ctx, stream, t.x, t.w, t.z, {t.rm, t.rv}, [&](const float* sums) {
    return make_bn_relu_mask_fwd(n, ctx, stream, t.z, t.gamma, t.beta, t.rm, t.rv, kNoTensor, t.b,
                                 t.y, t.saved, t.mask, sums);
  });
}

namespace {

// The cancelled bias's gradient: the sum of dz per channel, exactly 0 (ops.def).
KernelPtr zero_bias_grad(const Node& n, Context& ctx, int stream, TensorId db) {
  expect_dtype(ctx, n, db, DType::F32, "db");
  void* dbp = ctx.ptr(db);
  const auto bytes = static_cast<size_t>(ctx.tensor(db).bytes());
  return make_fn(
      stream, [=](Context&, cudaStream_t st) { CUDA_CHECK(cudaMemsetAsync(dbp, 0, bytes, st)); });
}

// The convolution gradients of cbr_bwd and cbr_pool_bwd after their BatchNorm part (which
// wrote dz): the weight gradient on the side stream beside the data gradient (side_stream.h)
// unless dx or db shares bytes with what it reads or writes; the first layer's form has no dx.
KernelPtr cbr_conv_backward(const Node& n, Context& ctx, int stream, KernelPtr bn, TensorId x,
                            TensorId w, TensorId dz, TensorId dx, TensorId dw, TensorId db) {
  std::vector<KernelPtr> parts;
  parts.push_back(std::move(bn));
  auto wgrad = [&](int s) {
    return make_conv_bwd_weight(fused_part(OpKind::conv_bwd_weight, {x, dz}, {dw}, n, "wgrad"), ctx,
                                s);
  };
  const bool apart = !any_overlap(byte_ranges(ctx, {dx, db}), byte_ranges(ctx, {x, dz, dw}));
  parts.push_back(apart ? maybe_on_side_stream(ctx, stream, {x, dz}, {dw}, wgrad) : wgrad(stream));
  if (dx != kNoTensor) {
    // A bottleneck's conv1: with KILN_CUTLASS_DGRAD, the SM90 data gradient that also takes the
    // previous block's BN+add+ReLU backward's sums (cutlass_dgrad.cpp).
    auto cudnn = [&] {
      return make_conv_bwd_data(fused_part(OpKind::conv_bwd_data, {dz, w}, {dx}, n, "dgrad"), ctx,
                                stream);
    };
    KernelPtr dgrad = make_dgrad_for_bn(n, ctx, stream, dz, w, dx, cudnn);
    parts.push_back(dgrad ? std::move(dgrad) : cudnn());
  }
  if (db != kNoTensor) parts.push_back(zero_bias_grad(n, ctx, stream, db));
  return std::make_unique<Sequence>(stream, std::move(parts));
}

// A first layer's CBR backward (no dx) with BatchNorm's dx pass folded into the direct weight
// gradient (KILN_FIRST_LAYER_BN_FOLD, with KILN_FIRST_LAYER_WGRAD): bn_part(coef) is BatchNorm's
// backward without its dx pass, leaving its coefficients in coef, and the weight gradient forms
// dz from g (BatchNorm's gradient: dy, or where a pass wrote it), z and the mask as it loads
// them: dz is never written (only the overlapping pool's sums pass writes g there). 1 takes it
// wherever it can; auto keeps the faster of it and `usual` (the unfolded pair), timed per
// layer. nullptr where it is not taken.
KernelPtr first_layer_folded(const Node& n, Context& ctx, int stream, const CbrBwdTensors& t,
                             TensorId g, TensorId mask,
                             const std::function<KernelPtr(float4*)>& bn_part,
                             const std::function<KernelPtr()>& usual) {
  if (ctx.opts.first_layer_bn_fold == Auto::off || ctx.opts.first_layer_wgrad == Auto::off ||
      t.dx != kNoTensor)
    return nullptr;
  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  if (const std::string why = ctx.program ? unread_output_refusal(*ctx.program, n, t.dz)
                                          : "no program to check dz's readers in";
      !why.empty()) {
    log_debug(what, ": BatchNorm's backward stays unfolded: ", why);
    return nullptr;
  }
  const ConvGeom geom = conv_geom(ctx, n, t.x, t.w, t.z);
  auto coef = std::make_unique<DeviceBuffer>(kFirstLayerOutputs * sizeof(float4));
  const FirstLayerFold fold{t.z, mask, static_cast<const float4*>(coef->get())};
  const std::shared_ptr<DeviceBuffer> x_filled = padded_copy_of(ctx, t.x);
  KernelPtr wgrad =
      make_first_layer_wgrad(fused_part(OpKind::conv_bwd_weight, {t.x, g}, {t.dw}, n, "wgrad"), ctx,
                             stream, t.x, g, t.dw, x_filled, &fold);
  if (!wgrad) return nullptr;
  std::vector<KernelPtr> parts;
  parts.push_back(bn_part(static_cast<float4*>(coef->get())));
  parts.push_back(std::move(wgrad));
  if (t.db != kNoTensor) parts.push_back(zero_bias_grad(n, ctx, stream, t.db));
  KernelPtr folded = std::make_unique<Sequence>(stream, std::move(parts), std::move(coef));
  const auto keep_folded = [&] {
    ++ctx.first_layer_wgrads, ++ctx.first_layer_bn_folds;
    if (x_filled && geom.x.c != kFirstLayerChannels) ++ctx.pad_copies_shared;
    return std::move(folded);
  };
  if (ctx.opts.first_layer_bn_fold == Auto::on) return keep_folded();
  // The unfolded pair's own choices (cuDNN's weight gradient or the direct one) count only where
  // it is the form kept.
  const int wgrads = ctx.first_layer_wgrads, shared = ctx.pad_copies_shared;
  KernelPtr unfolded = usual();
  const FormChoice c =
      choose_faster_form(ctx, stream, timed_form_key(op_name(n.op), geom, DType::F16, "", "flbnv2"),
                         {"folded", {folded.get()}}, {"usual", {unfolded.get()}}, {},
                         ctx.opts.autotune || !ctx.opts.tune_path.empty());
  log_debug(what, ": BatchNorm's backward folded into the direct weight gradient ", c.first_ms,
            " ms, unfolded ", c.second_ms, " ms: keeps ",
            c.found && c.first ? "the folded form" : "the unfolded one");
  if (!(c.found && c.first)) return unfolded;
  ctx.first_layer_wgrads = wgrads, ctx.pad_copies_shared = shared;
  return keep_folded();
}

}  // namespace

KernelPtr make_bn_bwd_part(const Node& n, Context& ctx, int stream,
                           const Context::DgradBnSums* summed, const Node* shortcut,
                           float4* fold_coef) {
  if (n.op == OpKind::cbr_bwd) {
    const CbrBwdTensors t = cbr_bwd_tensors(n);
    return summed != nullptr ? make_bn_bwd_from_sums(n, ctx, stream, t.z, summed->g, t.gamma,
                                                     t.saved, t.dz, kNoTensor, t.dgamma, t.dbeta,
                                                     summed->sums, nullptr, fold_coef)
                             : make_bn_relu_mask_bwd(n, ctx, stream, t.z, t.dy, kNoTensor, t.mask,
                                                     t.gamma, t.saved, t.dz, kNoTensor, t.dgamma,
                                                     t.dbeta, nullptr, fold_coef);
  }
  if (n.op == OpKind::cbr_pool_bwd) {
    // The data gradient before it wrote g = mp ? dy : 0 into dy itself (dgrad_bn_rule.h), which
    // the dx pass routes through the pool's mask as it would dy.
    const CbrBwdTensors t = cbr_bwd_tensors(n);
    return make_bn_relu_pool_bwd(n, ctx, stream, t.z, t.dy, t.mask, t.gamma, t.saved, t.dz,
                                 t.dgamma, t.dbeta, fold_coef, t.zp, t.mp,
                                 summed != nullptr ? summed->sums : nullptr);
  }
  KILN_CHECK(fold_coef == nullptr, Internal, "make_bn_bwd_part: ", op_name(n.op), " node '",
             n.label, "': only a CBR's BatchNorm backward leaves its dx to a fold");
  KILN_CHECK(n.op == OpKind::bn_add_relu_bwd, Internal, "make_bn_bwd_part: ", op_name(n.op),
             " node '", n.label, "' has no BatchNorm backward part");
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), mask = need_in(n, 2, "mask"),
                 gamma = need_in(n, 3, "gamma"), saved = need_in(n, 4, "saved"), dy2 = in_at(n, 5);
  const TensorId dx = need_out(n, 0, "dx"), dres = need_out(n, 1, "dresidual"),
                 dgamma = need_out(n, 2, "dgamma"), dbeta = need_out(n, 3, "dbeta");
  // The next block's conv1 data gradient on the SM90 kernel (KILN_CUTLASS_DGRAD) wrote g, the
  // masked sum of dy and dy2, and left g's sums: g in dresidual (which is g), or where the memory
  // plan did not allow that in the data gradient's own output (this node's dy2, or dy), which it
  // then copies to dresidual.
  if (summed != nullptr) {
    return make_bn_bwd_from_sums(n, ctx, stream, x, summed->g, gamma, saved, dx,
                                 summed->g == dres ? kNoTensor : dres, dgamma, dbeta, summed->sums,
                                 shortcut);
  }
  return make_bn_relu_mask_bwd(n, ctx, stream, x, dy, dy2, mask, gamma, saved, dx, dres, dgamma,
                               dbeta, shortcut);
}

namespace {

const Context::DgradBnSums* dgrad_sums_for(const Context& ctx, const Node& n) {
  const auto it = ctx.dgrad_bn_sums.find(&n);
  return it == ctx.dgrad_bn_sums.end() ? nullptr : &it->second;
}

// KILN_RESIDUAL_BN_SUMS_IN_DX: the shortcut BatchNorm's backward that reads bn_add_relu_bwd n's
// dresidual as its dy (the lowering of a folded shortcut BatchNorm), or nullptr.
const Node* shortcut_bn_bwd(const Context& ctx, const Node& n) {
  const TensorId dres = out_at(n, 1);
  if (!ctx.opts.residual_bn_sums_in_dx || ctx.program == nullptr || dres == kNoTensor)
    return nullptr;
  for (const Phase& ph : ctx.program->train) {
    for (const Node& m : ph.nodes) {
      if (m.op == OpKind::bn_bwd && in_at(m, 1) == dres) return &m;
    }
  }
  return nullptr;
}

}  // namespace

// "x, w, z, dy, mask, gamma, saved -> [dx], dw, dgamma, dbeta, dz, [db]"
KernelPtr make_cbr_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const CbrBwdTensors t = cbr_bwd_tensors(n);
  // A bottleneck's conv2: its dy is conv3's data gradient, which on the SM90 kernel
  // (KILN_CUTLASS_DGRAD) wrote g there and left g's sums.
  const Context::DgradBnSums* summed = dgrad_sums_for(ctx, n);
  const auto bn = [&](float4* fold_coef) {
    return make_bn_bwd_part(n, ctx, stream, summed, nullptr, fold_coef);
  };
  const auto usual = [&] {
    return cbr_conv_backward(n, ctx, stream, bn(nullptr), t.x, t.w, t.dz, t.dx, t.dw, t.db);
  };
  // g: masked already where the data gradient wrote it, else dy under the mask.
  if (KernelPtr k = first_layer_folded(n, ctx, stream, t, summed ? summed->g : t.dy,
                                       summed ? kNoTensor : t.mask, bn, usual))
    return k;
  return usual();
}

// "x, w, gamma, beta, running_mean, running_var, [b] -> z, y (pooled), saved, mask (over z)":
// cbr_fwd with the max-pool in BatchNorm's apply pass (make_bn_relu_pool_fwd), so the
// full-resolution ReLU output is never written.
KernelPtr make_cbr_pool_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const CbrFwdTensors t = cbr_fwd_tensors(n);
  return cbr_forward(n, ctx, stream, t.x, t.w, t.z, {t.rm, t.rv}, [&](const float* sums) {
    return make_bn_relu_pool_fwd(n, ctx, stream, t.z, t.gamma, t.beta, t.rm, t.rv, t.b, t.y,
                                 t.saved, t.mask, sums, t.zp, t.mp);
  });
}

// "x, w, z, dy (pooled), mask (over z), gamma, saved -> [dx], dw, dgamma, dbeta, dz, [db]"
KernelPtr make_cbr_pool_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const CbrBwdTensors t = cbr_bwd_tensors(n);
  // With the forward's pooled picks, the next layer's data gradient on the SM90 kernel may have
  // written g into dy and left its sums (KILN_POOL_POOLED_SUMS, KILN_CUTLASS_CONV_DGRAD).
  const Context::DgradBnSums* summed = dgrad_sums_for(ctx, n);
  KILN_CHECK(summed == nullptr || summed->g == t.dy, Internal, "cbr_pool_bwd node '", n.label,
             "': a data gradient left its g elsewhere than dy");
  const auto bn = [&](float4* fold_coef) {
    return make_bn_bwd_part(n, ctx, stream, summed, nullptr, fold_coef);
  };
  const auto usual = [&] {
    return cbr_conv_backward(n, ctx, stream, bn(nullptr), t.x, t.w, t.dz, t.dx, t.dw, t.db);
  };
  // Overlapping windows: the sums pass gathers g into dz, where the fold reads it. Windows that
  // tile z leave g to be read through the pool's map, which the fold does not do.
  if (!n.attrs.pool_tiles()) {
    if (KernelPtr k = first_layer_folded(n, ctx, stream, t, t.dz, kNoTensor, bn, usual)) return k;
  }
  return usual();
}

KernelPtr make_bn_add_relu_fwd_part(const Node& n, Context& ctx, int stream, const float* sums,
                                    const float* res_sums) {
  const BnAddReluFwdTensors t = bn_add_relu_fwd_tensors(n);
  return make_bn_relu_mask_fwd(n, ctx, stream, t.x, t.gamma, t.beta, t.rm, t.rv, t.residual,
                               kNoTensor, t.y, t.saved, t.mask, sums, &t, res_sums);
}

// "x, gamma, beta, running_mean, running_var, residual, [gamma2, beta2, running_mean2,
// running_var2] -> y, saved, mask, [saved2]"
KernelPtr make_bn_add_relu_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  // A bottleneck's conv3 on the SM90 GEMM (make_conv_fwd_summed_for_bn) left x's sums; a
  // downsampling shortcut's convolution there, the residual's.
  const auto summed = ctx.bn_add_relu_sums.find(&n);
  const auto res_summed = ctx.bn_add_relu_residual_sums.find(&n);
  return make_bn_add_relu_fwd_part(
      n, ctx, stream, summed == ctx.bn_add_relu_sums.end() ? nullptr : summed->second,
      res_summed == ctx.bn_add_relu_residual_sums.end() ? nullptr : res_summed->second);
}

// "x, dy, mask, gamma, saved, [dy2] -> dx, dresidual, dgamma, dbeta": the add passes the
// masked gradient (of dy + dy2 when dy2 is given: the gradient-sum add folded in) to both
// branches; BatchNorm's dx pass writes the residual's copy.
KernelPtr make_bn_add_relu_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const Node* shortcut = shortcut_bn_bwd(ctx, n);
  KernelPtr k = make_bn_bwd_part(n, ctx, stream, dgrad_sums_for(ctx, n), shortcut);
  if (shortcut != nullptr && ctx.residual_bn_partials.count(shortcut) > 0) {
    // Read beyond its own tensors: the shortcut BatchNorm's input and saved statistics.
    Context::ExtraBytes& extra = ctx.extra_bytes[&n];
    for (const ByteRange& r : byte_ranges(ctx, {in_at(*shortcut, 0), in_at(*shortcut, 3)}))
      extra.reads.push_back(r);
  }
  return k;
}

}  // namespace kiln::cuda
