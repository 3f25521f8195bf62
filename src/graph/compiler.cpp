// The Compiler. Reads the plan once, forward; writes the Program. Layout of the parameter
// regions: same-kind parameters contiguous, kinds in the order conv weights, fc weights,
// BatchNorm weights, BatchNorm biases, biases — so that "decayed" (conv+fc weights), "has an
// FP16 compute copy" (conv+fc weights) and "gradient written in FP16" (conv weights) are
// each one contiguous range that a single region op covers.
#include "kiln/graph/compiler.h"

#include <algorithm>
#include <map>

#include "kiln/core/error.h"
#include "kiln/graph/data_parallel.h"

namespace kiln {

namespace {

constexpr int64_t kSlotAlign = 128;  // elements: 256 bytes in FP16, 512 in FP32

struct Range {
  int64_t begin = 0, end = 0;  // elements
  bool empty() const { return end <= begin; }
};

class Compiler {
 public:
  Compiler(const ArchPlan& plan, const CompileOptions& o) : plan_(plan) {
    KILN_CHECK(o.batch > 0, InvalidArgument, "batch size must be > 0, got ", o.batch);
    KILN_CHECK(o.optimizer == "sgd" || o.optimizer == "adamw" || o.optimizer == "lars", InvalidArgument,
               "unknown optimizer '", o.optimizer, "'; use sgd, adamw or lars");
    KILN_CHECK(!o.amp || o.amp_dtype == DType::F16 || o.amp_dtype == DType::BF16, InvalidArgument,
               "AMP dtype must be f16 or bf16");
    p_.options = o;
    p_.model = plan.model;
    p_.num_classes = plan.num_classes;
    p_.feature_dtype = o.amp ? o.amp_dtype : DType::F32;
  }

  Program run() {
    make_params();
    make_scalars_and_inputs();
    build_train();
    build_eval(p_.eval, /*ema=*/false);
    if (p_.options.ema) build_eval(p_.eval_ema, /*ema=*/true);
    build_init();
    return std::move(p_);
  }

 private:
  // ---- tensors ------------------------------------------------------------------------
  TensorId tensor(const std::string& name, Region region, Shape shape, DType dtype, Layout layout,
                  int64_t offset = -1) {
    DTensor t;
    t.id = static_cast<TensorId>(p_.tensors.size());
    t.name = name;
    t.region = region;
    t.shape = std::move(shape);
    t.dtype = dtype;
    t.layout = layout;
    t.offset = offset;
    p_.tensors.push_back(t);
    return t.id;
  }
  TensorId view(TensorId of, const std::string& name, Shape shape, Layout layout) {
    const DTensor base = p_.tensor(of);
    TensorId id = tensor(name, base.region, std::move(shape), base.dtype, layout);
    p_.tensors[static_cast<size_t>(id)].view_of = of;
    return id;
  }
  // A feature map of the step: [N, H, W, C] or [N, F].
  TensorId feature(const std::string& name, const Shape& per_sample) {
    std::vector<int64_t> d{p_.options.batch};
    d.insert(d.end(), per_sample.dims.begin(), per_sample.dims.end());
    return tensor(name, Region::features, Shape(d), p_.feature_dtype,
                  per_sample.rank() == 3 ? Layout::NHWC : Layout::NC);
  }
  TensorId aux(const std::string& name, int64_t elems, DType dtype) {
    return tensor(name, Region::aux, Shape{elems}, dtype, Layout::Flat);
  }
  const Shape& in_shape(const PlanNode& n, size_t i = 0) const {
    return plan_.nodes[static_cast<size_t>(n.inputs[i])].shape;
  }

  // ---- parameters ---------------------------------------------------------------------
  struct ParamSpec {
    std::string name;
    ParamKind kind;
    Shape shape, torch_shape;
    std::array<int64_t, 3> chw{0, 0, 0};
  };

  bool has_region(Region r) const {
    const CompileOptions& o = p_.options;
    switch (r) {
      case Region::params_f32:
      case Region::grads_f32:
        return true;
      case Region::params_f16:
      case Region::grads_f16:
        return o.amp;
      case Region::moment1:
        return o.optimizer != "sgd" || o.momentum != 0.0f;
      case Region::moment2:
        return o.optimizer == "adamw";
      case Region::ema_f32:
        return o.ema;
      case Region::ema_f16:
        return o.ema && o.amp;
      default:
        return false;
    }
  }

  void make_params() {
    std::vector<ParamSpec> specs;
    // Flatten → fc: remember the map an fc reads, for torchvision's C,H,W column order.
    std::map<int, std::array<int64_t, 3>> flat_source;
    for (const PlanNode* n : plan_.live()) {
      if (n->op == PlanOp::Flatten) {
        const Shape& s = in_shape(*n);
        flat_source[n->id] = {s[2], s[0], s[1]};
      }
    }
    for (const PlanNode* n : plan_.live()) {
      switch (n->op) {
        case PlanOp::Conv:
        case PlanOp::CBR: {
          const int64_t c = in_shape(*n)[2];
          specs.push_back({n->name + ".weight", ParamKind::ConvWeight, Shape{n->out, n->k, n->k, c},
                           Shape{n->out, c, n->k, n->k}});
          if (n->bias) specs.push_back({n->name + ".bias", ParamKind::Bias, Shape{n->out}, Shape{n->out}});
          if (n->op == PlanOp::CBR) add_bn_specs(specs, n->bn_name, n->out);
          break;
        }
        case PlanOp::BatchNorm:
          add_bn_specs(specs, n->name, in_shape(*n)[2]);
          break;
        case PlanOp::BnAddReLU:
          add_bn_specs(specs, n->bn_name, in_shape(*n)[2]);
          break;
        case PlanOp::FC: {
          const int64_t k = in_shape(*n)[0];
          ParamSpec w{n->name + ".weight", ParamKind::FcWeight, Shape{n->out, k}, Shape{n->out, k}};
          auto it = flat_source.find(n->inputs[0]);
          if (it != flat_source.end() && it->second[1] * it->second[2] > 1) w.chw = it->second;
          specs.push_back(w);
          if (n->bias) specs.push_back({n->name + ".bias", ParamKind::Bias, Shape{n->out}, Shape{n->out}});
          break;
        }
        default:
          break;
      }
    }
    // Kind order, stable within a kind (model order).
    std::stable_sort(specs.begin(), specs.end(),
                     [](const ParamSpec& a, const ParamSpec& b) { return a.kind < b.kind; });
    int64_t cursor = 0;
    for (const ParamSpec& s : specs) {
      ParamDesc d;
      d.name = s.name;
      d.kind = s.kind;
      d.shape = s.shape;
      d.torch_shape = s.torch_shape;
      d.decay = s.kind == ParamKind::ConvWeight || s.kind == ParamKind::FcWeight;
      d.compute_copy = d.decay;
      d.fc_input_chw = s.chw;
      d.slot = cursor;
      d.slot_elems = align_up(s.shape.numel(), kSlotAlign);
      d.tensor.fill(kNoTensor);
      cursor += d.slot_elems;
      const Range r{d.slot, d.slot + d.slot_elems};
      auto extend = [&](Range& range) {
        if (range.empty()) range = r;
        else range.end = r.end;
      };
      if (d.kind == ParamKind::ConvWeight) extend(conv_range_);
      if (d.decay) extend(decay_range_);
      else extend(no_decay_range_);
      p_.params.push_back(d);
    }
    p_.param_elems = cursor;
    KILN_CHECK(cursor > 0, Model, "model '", plan_.model, "' has no parameters to train");
    // One tensor per parameter in each region that exists.
    for (ParamDesc& d : p_.params) {
      const Layout layout = d.kind == ParamKind::ConvWeight ? Layout::KRSC
                            : d.kind == ParamKind::FcWeight ? Layout::OI : Layout::Flat;
      for (int r = 0; r < kRegionCount; ++r) {
        const Region region = static_cast<Region>(r);
        if (!has_region(region)) continue;
        const DType dt = region_dtype(region);
        d.tensor[static_cast<size_t>(r)] =
            tensor(d.name + ":" + region_name(region), region, d.shape, dt, layout,
                   d.slot * static_cast<int64_t>(dtype_size(dt)));
      }
    }
    for (ParamDesc& d : p_.params) param_index_[d.name] = &d - p_.params.data();
  }

  void add_bn_specs(std::vector<ParamSpec>& specs, const std::string& name, int64_t c) {
    specs.push_back({name + ".weight", ParamKind::BnWeight, Shape{c}, Shape{c}});
    specs.push_back({name + ".bias", ParamKind::BnBias, Shape{c}, Shape{c}});
    running_[name] = {tensor(name + ".running_mean", Region::bn_running, Shape{c}, DType::F32, Layout::Flat),
                      tensor(name + ".running_var", Region::bn_running, Shape{c}, DType::F32, Layout::Flat)};
    p_.buffers.push_back({name + ".running_mean", running_[name].first});
    p_.buffers.push_back({name + ".running_var", running_[name].second});
  }

  DType region_dtype(Region r) const {
    return (r == Region::params_f16 || r == Region::grads_f16 || r == Region::ema_f16) ? p_.options.amp_dtype
                                                                                      : DType::F32;
  }

  const ParamDesc& param(const std::string& name) const {
    auto it = param_index_.find(name);
    KILN_CHECK(it != param_index_.end(), Internal, "no parameter named ", name);
    return p_.params[it->second];
  }
  TensorId param_in(const std::string& name, Region r) const {
    return param(name).tensor[static_cast<size_t>(r)];
  }
  // The weight a layer computes with: the FP16 copy under AMP (conv, fc), else the master.
  TensorId compute_weight(const std::string& name, Region master = Region::params_f32) const {
    const ParamDesc& d = param(name);
    if (p_.options.amp && d.compute_copy) {
      return d.tensor[static_cast<size_t>(master == Region::ema_f32 ? Region::ema_f16 : Region::params_f16)];
    }
    return d.tensor[static_cast<size_t>(master)];
  }
  // A 1-D tensor over a range of a parameter region (for the region ops).
  TensorId range_tensor(Region r, Range range, const std::string& what) {
    const DType dt = region_dtype(r);
    return tensor(std::string(region_name(r)) + "[" + what + "]", r, Shape{range.end - range.begin}, dt,
                  Layout::Flat, range.begin * static_cast<int64_t>(dtype_size(dt)));
  }

  // ---- scalars and inputs -------------------------------------------------------------
  void make_scalars_and_inputs() {
    ProgramIO& io = p_.io;
    io.loss = tensor("loss", Region::scalars, Shape{1}, DType::F32, Layout::Flat);
    io.correct = tensor("correct", Region::scalars, Shape{2}, DType::I32, Layout::Flat);
    io.loss_scale = tensor("loss_scale", Region::scalars, Shape{1}, DType::F32, Layout::Flat);
    io.overflow = tensor("overflow", Region::scalars, Shape{1}, DType::I32, Layout::Flat);
    io.good_steps = tensor("good_steps", Region::scalars, Shape{1}, DType::I32, Layout::Flat);
    io.lr = tensor("lr", Region::scalars, Shape{1}, DType::F32, Layout::Flat);
    io.step = tensor("step", Region::scalars, Shape{1}, DType::I32, Layout::Flat);
    io.optimizer_steps = tensor("optimizer_steps", Region::scalars, Shape{1}, DType::I32, Layout::Flat);
    if (p_.options.clip_grad_norm > 0) {
      io.clip_coef = tensor("clip_coef", Region::scalars, Shape{1}, DType::F32, Layout::Flat);
    }
    const Shape& in = plan_.input;
    const int64_t n = p_.options.batch;
    for (int s = 0; s < 2; ++s) {
      const Region r = s == 0 ? Region::input_a : Region::input_b;
      const std::string tag = s == 0 ? "a" : "b";
      io.staged_images[static_cast<size_t>(s)] =
          tensor("staged_images_" + tag, r, Shape{n, in[0], in[1], in[2]}, DType::F32, Layout::NHWC);
      io.staged_labels[static_cast<size_t>(s)] = tensor("staged_labels_" + tag, r, Shape{n}, DType::I32, Layout::Flat);
    }
  }

  // Copy of a staged slot into the step's input and labels (a cast under AMP).
  std::vector<Node> transfer_nodes(int slot, TensorId input, TensorId labels) {
    std::vector<Node> v;
    const TensorId img = p_.io.staged_images[static_cast<size_t>(slot)];
    const TensorId img_flat = view(img, p_.tensor(img).name + ":flat", Shape{p_.tensor(img).numel()}, Layout::Flat);
    const TensorId in_flat = view(input, p_.tensor(input).name + ":flat", Shape{p_.tensor(input).numel()}, Layout::Flat);
    v.push_back(make_node(p_.options.amp ? OpKind::cast : OpKind::copy, {img_flat}, {in_flat}, {}, "input"));
    v.push_back(make_node(OpKind::copy, {p_.io.staged_labels[static_cast<size_t>(slot)]}, {labels}, {}, "labels"));
    return v;
  }

  static Node make_node(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, const Attrs& a,
                        const std::string& label) {
    Node n;
    n.op = op;
    n.in = std::move(in);
    n.out = std::move(out);
    n.attrs = a;
    n.label = label;
    return n;
  }

  // ---- forward ------------------------------------------------------------------------
  struct Forward {
    std::map<int, TensorId> out;            // plan node → its output tensor
    std::map<int, std::vector<TensorId>> saved;  // extra tensors a backward needs (stats, masks, indices)
  };

  Attrs window_attrs(const PlanNode& n) const {
    Attrs a;
    a.kh = a.kw = n.k;
    a.sh = a.sw = n.stride;
    a.ph = a.pw = n.pad;
    return a;
  }

  // Emits the forward nodes of one plan node into `nodes`. `train` selects batch statistics
  // and dropout; `master` selects the weights (params_f32 or ema_f32).
  void forward_node(const PlanNode& n, Forward& f, std::vector<Node>& nodes, bool train, Region master,
                    const std::string& tag) {
    auto x = [&](size_t i = 0) { return f.out.at(n.inputs[i]); };
    const std::string& name = n.name;
    switch (n.op) {
      case PlanOp::Input:
        break;
      case PlanOp::Conv: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        std::vector<TensorId> in{x(), compute_weight(name + ".weight", master)};
        if (n.bias) in.push_back(param_in(name + ".bias", master));
        nodes.push_back(make_node(OpKind::conv_fwd, in, {y}, window_attrs(n), name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::BatchNorm:
      case PlanOp::CBR:
      case PlanOp::BnAddReLU: {
        const bool fused_conv = n.op == PlanOp::CBR;
        const bool fused_add = n.op == PlanOp::BnAddReLU;
        const std::string bn = (fused_conv || fused_add) ? n.bn_name : name;
        const TensorId y = feature(name + ":y" + tag, n.shape);
        Attrs a = window_attrs(n);
        a.eps = n.eps;
        a.bn_momentum = n.momentum;
        const auto& [rm, rv] = running_.at(bn);
        std::vector<TensorId> params{param_in(bn + ".weight", master), param_in(bn + ".bias", master), rm, rv};
        if (!train) {
          KILN_CHECK(!fused_conv && !fused_add, Internal, "fused nodes are compiled unfused for evaluation");
          nodes.push_back(make_node(OpKind::bn_fwd_infer, {x(), params[0], params[1], rm, rv}, {y}, a, name + " infer"));
          f.out[n.id] = y;
          break;
        }
        const TensorId saved = tensor(bn + ":saved", Region::bn_saved, Shape{2, n.shape[2]}, DType::F32, Layout::Flat);
        if (fused_conv) {
          // The convolution's output; with a merged max-pool y is the pooled map and the mask
          // covers z (ops.def's cbr_pool_fwd).
          const TensorId z = feature(name + ":z" + tag, n.conv_shape());
          const TensorId mask = aux(name + ":mask", (p_.tensor(z).numel() + 7) / 8, DType::U8);
          std::vector<TensorId> in{x(), compute_weight(name + ".weight", master), params[0], params[1], rm, rv};
          if (n.bias) in.push_back(param_in(name + ".bias", master));  // folded into the running mean (ops.def)
          a.pool = n.pool;
          nodes.push_back(make_node(n.pool ? OpKind::cbr_pool_fwd : OpKind::cbr_fwd, in, {z, y, saved, mask}, a,
                                    name + (n.pool ? " cbr+" + n.pool_name + " fwd" : " cbr fwd")));
          f.saved[n.id] = {saved, mask, z};
        } else if (fused_add) {
          const TensorId mask = aux(name + ":mask", (p_.tensor(y).numel() + 7) / 8, DType::U8);
          nodes.push_back(make_node(OpKind::bn_add_relu_fwd, {x(0), params[0], params[1], rm, rv, x(1)},
                                    {y, saved, mask}, a, bn + " bn+add+relu fwd"));
          f.saved[n.id] = {saved, mask};
        } else {
          nodes.push_back(make_node(OpKind::bn_fwd_train, {x(), params[0], params[1], rm, rv}, {y, saved}, a,
                                    name + " fwd"));
          f.saved[n.id] = {saved};
        }
        f.out[n.id] = y;
        break;
      }
      case PlanOp::ReLU: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        nodes.push_back(make_node(OpKind::relu_fwd, {x()}, {y}, {}, name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::MaxPool: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        std::vector<TensorId> outs{y};
        if (train) {
          const TensorId idx = tensor(name + ":argmax", Region::aux, p_.tensor(y).shape, DType::I32, Layout::NHWC);
          outs.push_back(idx);
          f.saved[n.id] = {idx};
        }
        nodes.push_back(make_node(OpKind::maxpool_fwd, {x()}, outs, window_attrs(n), name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::AvgPool: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        nodes.push_back(make_node(OpKind::avgpool_fwd, {x()}, {y}, window_attrs(n), name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::GlobalAvgPool: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        nodes.push_back(make_node(OpKind::gap_fwd, {x()}, {y}, {}, name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::Flatten: {
        f.out[n.id] = view(x(), name + ":y" + tag, Shape{p_.options.batch, n.shape[0]}, Layout::NC);
        break;
      }
      case PlanOp::FC: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        std::vector<TensorId> in{x(), compute_weight(name + ".weight", master)};
        if (n.bias) in.push_back(param_in(name + ".bias", master));
        nodes.push_back(make_node(OpKind::fc_fwd, in, {y}, {}, name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::Dropout: {
        if (!train) {  // evaluation: identity
          f.out[n.id] = x();
          break;
        }
        const TensorId y = feature(name + ":y" + tag, n.shape);
        const TensorId mask = tensor(name + ":mask", Region::aux, p_.tensor(y).shape, DType::U8, p_.tensor(y).layout);
        Attrs a;
        a.p = n.p;
        a.seed = p_.options.dropout_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(n.id + 1));
        nodes.push_back(make_node(OpKind::dropout_fwd, {x(), p_.io.step}, {y, mask}, a, name + " fwd"));
        f.saved[n.id] = {mask};
        f.out[n.id] = y;
        break;
      }
      case PlanOp::Add: {
        const TensorId y = feature(name + ":y" + tag, n.shape);
        nodes.push_back(make_node(OpKind::add, {x(0), x(1)}, {y}, {}, name + " fwd"));
        f.out[n.id] = y;
        break;
      }
      case PlanOp::SoftmaxCE: {
        std::vector<TensorId> outs{p_.io.loss, p_.io.correct};
        if (train) {
          const TensorId dlogits = feature("loss:dlogits", in_shape(n));
          outs.push_back(dlogits);
          f.saved[n.id] = {dlogits};
        }
        Attrs a;
        a.label_smoothing = p_.options.label_smoothing;  // evaluation too, as torchvision's criterion
        nodes.push_back(make_node(OpKind::softmax_ce, {x(), labels_, p_.io.loss_scale}, outs, a,
                                  train ? "loss fwd+bwd" : "loss eval"));
        if (train) p_.io.logits = x();
        break;
      }
      case PlanOp::Identity:
        f.out[n.id] = x();
        break;
    }
  }

  // ---- backward -----------------------------------------------------------------------
  // Gradient contributions per plan node output, summed (add nodes) when the producer needs
  // the total.
  struct Backward {
    std::map<int, std::vector<TensorId>> parts;
  };

  TensorId total_grad(const PlanNode& n, Backward& b, std::vector<Node>& nodes) {
    auto& parts = b.parts[n.id];
    KILN_CHECK(!parts.empty(), Internal, "no gradient reaches '", n.name, "'");
    TensorId g = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) {
      const TensorId sum = feature(n.name + ":dsum" + std::to_string(i), n.shape);
      nodes.push_back(make_node(OpKind::add, {g, parts[i]}, {sum}, {}, n.name + " grad sum"));
      g = sum;
    }
    parts = {g};
    return g;
  }

  TensorId grad_out(Region r, const std::string& param_name) { return param_in(param_name, r); }

  void backward_node(const PlanNode& n, Forward& f, Backward& b, std::vector<Node>& nodes) {
    const bool amp = p_.options.amp;
    auto in_node = [&](size_t i) -> const PlanNode& { return plan_.nodes[static_cast<size_t>(n.inputs[i])]; };
    auto needs = [&](size_t i) { return in_node(i).requires_grad; };
    auto new_grad = [&](size_t i) {
      const PlanNode& src = in_node(i);
      const TensorId g = feature(n.name + ":dx" + std::to_string(i), src.shape);
      b.parts[src.id].push_back(g);
      return g;
    };
    if (n.op == PlanOp::SoftmaxCE) {
      b.parts[n.inputs[0]].push_back(f.saved.at(n.id)[0]);
      return;
    }
    if (n.op == PlanOp::Input || !n.requires_grad) return;
    // A fused BN+add+ReLU sums two gradient contributions itself (ops.def's dy2): no add node.
    TensorId dy2 = kNoTensor;
    if (n.op == PlanOp::BnAddReLU && p_.options.fuse_grad_sum && b.parts[n.id].size() == 2) {
      dy2 = b.parts[n.id].back();
      b.parts[n.id].pop_back();
    }
    const TensorId dy = total_grad(n, b, nodes);
    const TensorId xin = f.out.count(n.inputs.empty() ? -1 : n.inputs[0]) ? f.out.at(n.inputs[0]) : kNoTensor;
    const std::string& name = n.name;
    switch (n.op) {
      case PlanOp::Conv: {
        std::vector<TensorId> outs{grad_out(amp ? Region::grads_f16 : Region::grads_f32, name + ".weight")};
        if (n.bias) outs.push_back(grad_out(Region::grads_f32, name + ".bias"));
        nodes.push_back(make_node(OpKind::conv_bwd_weight, {xin, dy}, outs, window_attrs(n), name + " bwd weight"));
        if (needs(0)) {
          nodes.push_back(make_node(OpKind::conv_bwd_data, {dy, compute_weight(name + ".weight")}, {new_grad(0)},
                                    window_attrs(n), name + " bwd data"));
        }
        break;
      }
      case PlanOp::BatchNorm: {
        Attrs a;
        a.eps = n.eps;
        nodes.push_back(make_node(OpKind::bn_bwd, {xin, dy, param_in(name + ".weight", Region::params_f32), f.saved.at(n.id)[0]},
                                  {needs(0) ? new_grad(0) : feature(name + ":dx_unused", in_node(0).shape),
                                   grad_out(Region::grads_f32, name + ".weight"), grad_out(Region::grads_f32, name + ".bias")},
                                  a, name + " bwd"));
        break;
      }
      case PlanOp::CBR: {
        Attrs a = window_attrs(n);
        a.eps = n.eps;
        a.first_layer = !needs(0);
        const auto& saved = f.saved.at(n.id);
        std::vector<TensorId> outs{needs(0) ? new_grad(0) : kNoTensor,
                                   grad_out(amp ? Region::grads_f16 : Region::grads_f32, name + ".weight"),
                                   grad_out(Region::grads_f32, n.bn_name + ".weight"),
                                   grad_out(Region::grads_f32, n.bn_name + ".bias"), feature(name + ":dz", n.conv_shape())};
        if (n.bias) outs.push_back(grad_out(Region::grads_f32, name + ".bias"));
        a.pool = n.pool;  // dy is then the pooled map's gradient (ops.def's cbr_pool_bwd)
        nodes.push_back(make_node(n.pool ? OpKind::cbr_pool_bwd : OpKind::cbr_bwd,
                                  {xin, compute_weight(name + ".weight"), saved[2], dy, saved[1],
                                   param_in(n.bn_name + ".weight", Region::params_f32), saved[0]},
                                  outs, a, name + (n.pool ? " cbr+" + n.pool_name + " bwd" : " cbr bwd")));
        break;
      }
      case PlanOp::BnAddReLU: {
        Attrs a;
        a.eps = n.eps;
        const auto& saved = f.saved.at(n.id);
        const TensorId dx = needs(0) ? new_grad(0) : feature(name + ":dx_unused", in_node(0).shape);
        const TensorId dres = needs(1) ? new_grad(1) : feature(name + ":dres_unused", in_node(1).shape);
        std::vector<TensorId> ins{xin, dy, saved[1], param_in(n.bn_name + ".weight", Region::params_f32), saved[0]};
        if (dy2 != kNoTensor) ins.push_back(dy2);
        nodes.push_back(make_node(OpKind::bn_add_relu_bwd, ins,
                                  {dx, dres, grad_out(Region::grads_f32, n.bn_name + ".weight"),
                                   grad_out(Region::grads_f32, n.bn_name + ".bias")},
                                  a, n.bn_name + " bn+add+relu bwd"));
        break;
      }
      case PlanOp::ReLU:
        if (needs(0)) nodes.push_back(make_node(OpKind::relu_bwd, {f.out.at(n.id), dy}, {new_grad(0)}, {}, name + " bwd"));
        break;
      case PlanOp::MaxPool:
        if (needs(0)) {
          nodes.push_back(make_node(OpKind::maxpool_bwd, {dy, f.saved.at(n.id)[0]}, {new_grad(0)}, window_attrs(n),
                                    name + " bwd"));
        }
        break;
      case PlanOp::AvgPool:
        if (needs(0)) nodes.push_back(make_node(OpKind::avgpool_bwd, {dy}, {new_grad(0)}, window_attrs(n), name + " bwd"));
        break;
      case PlanOp::GlobalAvgPool:
        if (needs(0)) nodes.push_back(make_node(OpKind::gap_bwd, {dy}, {new_grad(0)}, {}, name + " bwd"));
        break;
      case PlanOp::Flatten:
        if (needs(0)) {
          const PlanNode& src = in_node(0);
          std::vector<int64_t> d{p_.options.batch};
          d.insert(d.end(), src.shape.dims.begin(), src.shape.dims.end());
          b.parts[src.id].push_back(view(dy, name + ":dx", Shape(d), Layout::NHWC));
        }
        break;
      case PlanOp::FC: {
        std::vector<TensorId> outs{grad_out(Region::grads_f32, name + ".weight")};
        if (n.bias) outs.push_back(grad_out(Region::grads_f32, name + ".bias"));
        nodes.push_back(make_node(OpKind::fc_bwd_weight, {xin, dy}, outs, {}, name + " bwd weight"));
        if (needs(0)) {
          nodes.push_back(make_node(OpKind::fc_bwd_data, {dy, compute_weight(name + ".weight")}, {new_grad(0)}, {},
                                    name + " bwd data"));
        }
        break;
      }
      case PlanOp::Dropout:
        if (needs(0)) {
          Attrs a;
          a.p = n.p;
          nodes.push_back(make_node(OpKind::dropout_bwd, {dy, f.saved.at(n.id)[0]}, {new_grad(0)}, a, name + " bwd"));
        }
        break;
      case PlanOp::Add:
        // The gradient of a sum reaches both operands unchanged: views, no copy.
        for (size_t i = 0; i < 2; ++i) {
          if (needs(i)) {
            b.parts[in_node(i).id].push_back(
                view(dy, name + ":d" + std::to_string(i), p_.tensor(dy).shape, p_.tensor(dy).layout));
          }
        }
        break;
      default:
        KILN_FAIL(Internal, "no backward for plan op ", plan_op_name(n.op));
    }
  }

  // ---- the training step ----------------------------------------------------------------
  void build_train() {
    const CompileOptions& o = p_.options;
    const Shape& in = plan_.input;
    input_ = feature("input", in);
    labels_ = tensor("labels", Region::aux, Shape{o.batch}, DType::I32, Layout::Flat);
    p_.io.input = input_;
    p_.io.labels = labels_;
    for (int s = 0; s < 2; ++s) {
      Phase t{PhaseKind::transfer, s == 0 ? "transfer_a" : "transfer_b", 2, transfer_nodes(s, input_, labels_)};
      p_.train.push_back(std::move(t));
    }

    Forward f;
    f.out[0] = input_;
    Phase first_fwd{PhaseKind::forward_first, "forward_first", 0, {}};
    Phase deep{PhaseKind::forward_backward, "forward_backward", 0, {}};
    Phase first_bwd{PhaseKind::backward_first, "backward_first", 0, {}};
    const auto live = plan_.live();
    for (const PlanNode* n : live) {
      forward_node(*n, f, n->first_layer ? first_fwd.nodes : deep.nodes, /*train=*/true, Region::params_f32, "");
    }
    Backward b;
    for (auto it = live.rbegin(); it != live.rend(); ++it) {
      backward_node(**it, f, b, (*it)->first_layer ? first_bwd.nodes : deep.nodes);
    }
    for (Phase* ph : {&first_fwd, &deep, &first_bwd}) {
      if (!ph->nodes.empty()) p_.train.push_back(std::move(*ph));
    }

    // FP16 convolution weight gradients → FP32 (FC and BN gradients are FP32 already, S10).
    if (o.amp && !conv_range_.empty()) {
      Phase ph{PhaseKind::grad_cast, "grad_cast", 0, {}};
      ph.nodes.push_back(make_node(OpKind::cast, {range_tensor(Region::grads_f16, conv_range_, "conv")},
                                   {range_tensor(Region::grads_f32, conv_range_, "conv")}, {}, "conv weight grads"));
      p_.train.push_back(std::move(ph));
    }
    const Range all{0, p_.param_elems};
    if (o.amp || o.clip_grad > 0 || o.clip_grad_norm > 0) {
      Phase ph{PhaseKind::check_scale, "check_scale", 1, {}};
      const TensorId g = range_tensor(Region::grads_f32, all, "all");
      if (o.amp || o.clip_grad > 0) {
        Attrs a;
        a.clip = o.clip_grad;
        ph.nodes.push_back(make_node(OpKind::check_clip, {g, p_.io.loss_scale}, {p_.io.overflow, g}, a, "grads"));
      }
      if (o.clip_grad_norm > 0) {  // after the per-element clip, as a script calling both would
        Attrs a;
        a.max_norm = o.clip_grad_norm;
        ph.nodes.push_back(make_node(OpKind::grad_norm, {g, p_.io.loss_scale}, {p_.io.clip_coef}, a, "grad norm"));
      }
      p_.train.push_back(std::move(ph));
    }
    build_optimizer();
    // The loss scale changes only after the optimizer has unscaled this step's gradients with
    // the scale they were made with (as GradScaler.update() follows step()): a growth step
    // must not apply half an update.
    if (o.amp) {
      Attrs s;
      s.growth_interval = o.loss_scale_growth_interval;
      p_.train.back().nodes.push_back(make_node(OpKind::loss_scale_update,
                                                {p_.io.overflow, p_.io.loss_scale, p_.io.good_steps},
                                                {p_.io.loss_scale, p_.io.good_steps}, s, "loss scale"));
    }
    if (o.ema) {
      Phase ph{PhaseKind::ema, "ema", 1, {}};
      Attrs a;
      a.ema_decay = o.ema_decay;
      ph.nodes.push_back(make_node(OpKind::ema, {range_tensor(Region::params_f32, all, "all"), p_.io.overflow},
                                   {range_tensor(Region::ema_f32, all, "all")}, a, "ema"));
      if (o.amp && !decay_range_.empty()) {
        ph.nodes.push_back(make_node(OpKind::cast, {range_tensor(Region::ema_f32, decay_range_, "compute")},
                                     {range_tensor(Region::ema_f16, decay_range_, "compute")}, {}, "ema compute copy"));
      }
      p_.train.push_back(std::move(ph));
    }
    if (o.amp && !decay_range_.empty()) {
      Phase ph{PhaseKind::weight_cast, "weight_cast", 1, {}};
      ph.nodes.push_back(make_node(OpKind::cast, {range_tensor(Region::params_f32, decay_range_, "compute")},
                                   {range_tensor(Region::params_f16, decay_range_, "compute")}, {}, "compute weights"));
      p_.train.push_back(std::move(ph));
    }
  }

  void build_optimizer() {
    const CompileOptions& o = p_.options;
    Phase ph{PhaseKind::optimizer, "optimizer", 1, {}};
    Attrs base;
    base.momentum = o.momentum;
    base.nesterov = o.nesterov;
    base.beta1 = o.beta1;
    base.beta2 = o.beta2;
    base.adam_eps = o.adam_eps;
    base.lars_eta = o.lars_eta;
    const ProgramIO& io = p_.io;
    auto emit = [&](Range r, float wd, const std::string& what) {
      if (r.empty()) return;
      Attrs a = base;
      a.weight_decay = wd;
      const TensorId w = range_tensor(Region::params_f32, r, what);
      const TensorId g = range_tensor(Region::grads_f32, r, what);
      if (o.optimizer == "sgd") {
        const TensorId m = o.momentum != 0.0f ? range_tensor(Region::moment1, r, what) : kNoTensor;
        ph.nodes.push_back(make_node(OpKind::sgd, {w, g, m, io.lr, io.loss_scale, io.overflow, io.clip_coef}, {w, m},
                                     a, "sgd " + what));
      } else if (o.optimizer == "adamw") {
        const TensorId m = range_tensor(Region::moment1, r, what);
        const TensorId v = range_tensor(Region::moment2, r, what);
        ph.nodes.push_back(make_node(OpKind::adamw,
                                     {w, g, m, v, io.lr, io.loss_scale, io.overflow, io.optimizer_steps, io.clip_coef},
                                     {w, m, v}, a, "adamw " + what));
      }
    };
    if (o.optimizer == "lars") {
      // LARS's trust ratio is per parameter: one node per conv/fc weight. BatchNorm
      // parameters and biases are not adapted (as in the MLPerf ResNet recipe): plain
      // momentum SGD over their range, without weight decay.
      for (const ParamDesc& d : p_.params) {
        if (!d.decay) continue;
        Attrs a = base;
        a.weight_decay = o.weight_decay;
        const Region regions[3] = {Region::params_f32, Region::grads_f32, Region::moment1};
        TensorId t[3];
        for (int i = 0; i < 3; ++i) t[i] = d.tensor[static_cast<size_t>(regions[i])];
        ph.nodes.push_back(make_node(OpKind::lars, {t[0], t[1], t[2], io.lr, io.loss_scale, io.overflow, io.clip_coef},
                                     {t[0], t[2]}, a, "lars " + d.name));
      }
      if (!no_decay_range_.empty()) {
        const TensorId w = range_tensor(Region::params_f32, no_decay_range_, "no_decay");
        const TensorId g = range_tensor(Region::grads_f32, no_decay_range_, "no_decay");
        const TensorId m = range_tensor(Region::moment1, no_decay_range_, "no_decay");
        Attrs a = base;
        a.weight_decay = 0.0f;
        ph.nodes.push_back(make_node(OpKind::sgd, {w, g, m, io.lr, io.loss_scale, io.overflow, io.clip_coef}, {w, m},
                                     a, "sgd no_decay"));
      }
    } else {
      emit(decay_range_, o.weight_decay, "decay");
      emit(no_decay_range_, 0.0f, "no_decay");
    }
    // After every adamw node has read it: AdamW's t counts applied updates only, as PyTorch's
    // state['step'] under GradScaler, which skips optimizer.step() on overflow.
    if (o.optimizer == "adamw") {
      ph.nodes.push_back(make_node(OpKind::step_count, {io.overflow, io.optimizer_steps}, {io.optimizer_steps}, {},
                                   "optimizer steps"));
    }
    p_.train.push_back(std::move(ph));
  }

  void build_eval(std::vector<Phase>& out, bool ema) {
    Phase ph{PhaseKind::eval_forward, ema ? "eval_ema_forward" : "eval_forward", 0, {}};
    const TensorId input = feature(ema ? "eval_ema_input" : "eval_input", plan_.input);
    const TensorId saved_labels = labels_;
    labels_ = tensor(ema ? "eval_ema_labels" : "eval_labels", Region::aux, Shape{p_.options.batch}, DType::I32, Layout::Flat);
    ph.nodes = transfer_nodes(0, input, labels_);
    Forward f;
    f.out[0] = input;
    const std::string tag = ema ? ":eval_ema" : ":eval";
    for (const PlanNode* n : plan_.live()) {
      if (n->op == PlanOp::CBR || n->op == PlanOp::BnAddReLU) {
        eval_fused(*n, f, ph.nodes, ema ? Region::ema_f32 : Region::params_f32, tag);
      } else {
        forward_node(*n, f, ph.nodes, /*train=*/false, ema ? Region::ema_f32 : Region::params_f32, tag);
      }
    }
    labels_ = saved_labels;
    out.push_back(std::move(ph));
  }

  // Evaluation of a fused node: its convolution (CBR), then BatchNorm, [the residual add,]
  // and ReLU in one bn_relu_infer pass with the unfused chain's roundings (issue 5's
  // inference form; KILN_FUSION=0 plans the unfused chain).
  void eval_fused(const PlanNode& n, Forward& f, std::vector<Node>& nodes, Region master, const std::string& tag) {
    TensorId x = f.out.at(n.inputs[0]);
    if (n.op == PlanOp::CBR) {
      PlanNode c = n;
      c.op = PlanOp::Conv;
      c.shape = n.conv_shape();
      Forward tmp{{{n.inputs[0], x}}, {}};
      forward_node(c, tmp, nodes, false, master, tag);
      x = tmp.out.at(n.id);
    }
    const auto& [rm, rv] = running_.at(n.bn_name);
    std::vector<TensorId> in{x, param_in(n.bn_name + ".weight", master), param_in(n.bn_name + ".bias", master), rm, rv};
    if (n.op == PlanOp::BnAddReLU) in.push_back(f.out.at(n.inputs[1]));
    Attrs a;
    a.eps = n.eps;
    const TensorId y = feature(n.name + ":relu" + tag, n.conv_shape());
    nodes.push_back(make_node(OpKind::bn_relu_infer, in, {y}, a, n.name + " bn+relu infer"));
    f.out[n.id] = y;
    if (n.pool) {  // the merged max-pool, as its own node: evaluation keeps no argmax
      PlanNode pool;
      pool.id = n.id;
      pool.op = PlanOp::MaxPool;
      pool.name = n.pool_name;
      pool.shape = n.shape;
      pool.k = pool.stride = n.pool;
      Forward tmp{{{n.id, y}}, {}};
      pool.inputs = {n.id};
      forward_node(pool, tmp, nodes, false, master, tag);
      f.out[n.id] = tmp.out.at(n.id);
    }
  }

  void build_init() {
    const CompileOptions& o = p_.options;
    Phase ph{PhaseKind::init, "init", 0, {}};
    Attrs scale;
    scale.value = o.amp ? o.initial_loss_scale : 1.0f;
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.loss_scale}, scale, "loss scale"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.overflow}, {}, "overflow flag"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.good_steps}, {}, "good steps"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.optimizer_steps}, {}, "optimizer steps"));
    const Range all{0, p_.param_elems};
    if (o.amp && !decay_range_.empty()) {
      ph.nodes.push_back(make_node(OpKind::cast, {range_tensor(Region::params_f32, decay_range_, "compute")},
                                   {range_tensor(Region::params_f16, decay_range_, "compute")}, {}, "compute weights"));
    }
    if (o.ema) {
      ph.nodes.push_back(make_node(OpKind::copy, {range_tensor(Region::params_f32, all, "all")},
                                   {range_tensor(Region::ema_f32, all, "all")}, {}, "ema start"));
      if (o.amp && !decay_range_.empty()) {
        ph.nodes.push_back(make_node(OpKind::cast, {range_tensor(Region::ema_f32, decay_range_, "compute")},
                                     {range_tensor(Region::ema_f16, decay_range_, "compute")}, {}, "ema compute copy"));
      }
    }
    p_.init.push_back(std::move(ph));
  }

  const ArchPlan& plan_;
  Program p_;
  std::map<std::string, size_t> param_index_;
  std::map<std::string, std::pair<TensorId, TensorId>> running_;
  Range conv_range_, decay_range_, no_decay_range_;
  TensorId input_ = kNoTensor, labels_ = kNoTensor;
};

}  // namespace

Program compile_program(const ArchPlan& plan, const CompileOptions& options) {
  Program p = Compiler(plan, options).run();
  add_data_parallel(p);  // S27: nothing when options.world == 1
  return p;
}

}  // namespace kiln
