// The lowering context's helpers and the table of every plan op's lowering.
#include "graph/lower/lower.h"

#include <iterator>

#include "kiln/core/error.h"

namespace kiln::lower {

TensorId Context::tensor(const std::string& name, Region region, Shape shape, DType dtype,
                         Layout layout, int64_t offset) {
  DTensor t;
  t.id = static_cast<TensorId>(p.tensors.size());
  t.name = name;
  t.region = region;
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.layout = layout;
  t.offset = offset;
  p.tensors.push_back(t);
  return t.id;
}

TensorId Context::view(TensorId of, const std::string& name, Shape shape, Layout layout) {
  const DTensor base = p.tensor(of);
  TensorId id = tensor(name, base.region, std::move(shape), base.dtype, layout);
  p.tensors[static_cast<size_t>(id)].view_of = of;
  return id;
}

TensorId Context::feature(const std::string& name, const Shape& per_sample) {
  std::vector<int64_t> d{p.options.batch};
  d.insert(d.end(), per_sample.dims.begin(), per_sample.dims.end());
  return tensor(name, Region::features, Shape(d), p.feature_dtype,
                per_sample.rank() == 3 ? Layout::NHWC : Layout::NC);
}

bool Context::has_region(Region r) const {
  const CompileOptions& o = p.options;
  switch (r) {
    case Region::params_f32:
      return true;
    case Region::params_f16:
      return o.amp;
    case Region::grads_f32:
      return !o.eval_only;
    case Region::grads_f16:
      return o.amp && !o.eval_only;
    case Region::moment1:
      return !o.eval_only && (o.optimizer != "sgd" || o.momentum != 0.0f);
    case Region::moment2:
      return !o.eval_only && o.optimizer == "adamw";
    case Region::ema_f32:
      return o.ema;
    case Region::ema_f16:
      return o.ema && o.amp;
    default:
      return false;
  }
}

DType Context::region_dtype(Region r) const {
  const bool half = r == Region::params_f16 || r == Region::grads_f16 || r == Region::ema_f16;
  return half ? p.options.amp_dtype : DType::F32;
}

// A 1-D tensor over a range of a parameter region (for the region ops).
TensorId Context::range_tensor(Region r, Range range, const std::string& what) {
  const DType dt = region_dtype(r);
  return tensor(std::string(region_name(r)) + "[" + what + "]", r, Shape{range.end - range.begin},
                dt, Layout::Flat, range.begin * static_cast<int64_t>(dtype_size(dt)));
}

TensorId Context::aux(const std::string& name, int64_t elems, DType dtype) {
  return tensor(name, Region::aux, Shape{elems}, dtype, Layout::Flat);
}

void Context::bn_params(std::vector<ParamSpec>& specs, const std::string& name, int64_t c) {
  specs.push_back({name + ".weight", ParamKind::BnWeight, Shape{c}, Shape{c}});
  specs.push_back({name + ".bias", ParamKind::BnBias, Shape{c}, Shape{c}});
  // Placed here, in model order, each 256-byte aligned: the EMA copies sit at the same offsets
  // of their region, so that the EMA phase covers them all with one range op.
  auto place = [&](const std::string& buffer, Region r, int64_t offset) {
    return tensor(buffer, r, Shape{c}, DType::F32, Layout::Flat, offset);
  };
  const int64_t slot = align_up(c * 4, kAlignment);
  const int64_t mean_at = p.buffer_elems * 4, var_at = mean_at + slot;
  p.buffer_elems += 2 * slot / 4;
  running_[name] = {place(name + ".running_mean", Region::bn_running, mean_at),
                    place(name + ".running_var", Region::bn_running, var_at)};
  BufferDesc mean{name + ".running_mean", running_[name].first, kNoTensor};
  BufferDesc var{name + ".running_var", running_[name].second, kNoTensor};
  if (p.options.ema) {
    running_ema_[name] = {place(name + ".running_mean:ema", Region::ema_bn_running, mean_at),
                          place(name + ".running_var:ema", Region::ema_bn_running, var_at)};
    mean.ema = running_ema_[name].first;
    var.ema = running_ema_[name].second;
  }
  p.buffers.push_back(mean);
  p.buffers.push_back(var);
}

void Context::index_params() {
  for (ParamDesc& d : p.params) param_index_[d.name] = &d - p.params.data();
}

const ParamDesc& Context::param(const std::string& name) const {
  auto it = param_index_.find(name);
  KILN_CHECK(it != param_index_.end(), Internal, "no parameter named ", name);
  return p.params[it->second];
}

TensorId Context::compute_weight(const std::string& name, Region master) const {
  const ParamDesc& d = param(name);
  if (p.options.amp && d.compute_copy) {
    const Region copy = master == Region::ema_f32 ? Region::ema_f16 : Region::params_f16;
    return d.tensor[static_cast<size_t>(copy)];
  }
  return d.tensor[static_cast<size_t>(master)];
}

TensorId Context::total_grad(const PlanNode& n, Backward& b, std::vector<Node>& nodes) {
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

TensorId Context::new_grad(const PlanNode& n, size_t i, Backward& b) {
  const PlanNode& src = input(n, i);
  const TensorId g = feature(n.name + ":dx" + std::to_string(i), src.shape);
  b.parts[src.id].push_back(g);
  return g;
}

Node make_node(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, const Attrs& a,
               const std::string& label) {
  Node n;
  n.op = op;
  n.in = std::move(in);
  n.out = std::move(out);
  n.attrs = a;
  n.label = label;
  return n;
}

Attrs window_attrs(const PlanNode& n) {
  Attrs a;
  a.kh = a.kw = n.k;
  a.sh = a.sw = n.stride;
  a.ph = a.pw = n.pad;
  return a;
}

namespace {
constexpr const LayerLowering* kLowerings[] = {
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_PLAN_##role(&lower_##name, )
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
};
static_assert(std::size(kLowerings) == kPlanOpCount, "layers.def and the lowering table disagree");
}  // namespace

const LayerLowering& lowering(PlanOp op) {
  return *kLowerings[static_cast<size_t>(op)];
}

}  // namespace kiln::lower
