// The data-parallel pass (see kiln/graph/data_parallel.h). It works on the Program alone:
// the first layer is whatever the backward_first phase writes gradients for, and a phase
// writes a bucket when one of its outputs overlaps the bucket's range of grads_f32.
#include "kiln/graph/data_parallel.h"

#include <algorithm>
#include <set>

#include "kiln/core/error.h"

namespace kiln {

namespace {

struct Range {
  int64_t begin = 0, end = 0;  // elements of a parameter region
};

TensorId add_tensor(Program& p, const std::string& name, Region region, Shape shape,
                    int64_t offset = -1) {
  DTensor t;
  t.id = static_cast<TensorId>(p.tensors.size());
  t.name = name;
  t.region = region;
  t.shape = std::move(shape);
  t.dtype = DType::F32;
  t.layout = Layout::Flat;
  t.offset = offset;
  const TensorId id = t.id;
  p.tensors.push_back(std::move(t));
  return id;
}

Node make(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, const Attrs& a,
          std::string label) {
  Node n;
  n.op = op;
  n.in = std::move(in);
  n.out = std::move(out);
  n.attrs = a;
  n.label = std::move(label);
  return n;
}

bool is_training_compute(PhaseKind k) {
  return k == PhaseKind::forward_first || k == PhaseKind::forward_backward ||
         k == PhaseKind::backward_first;
}

// The BatchNorm's name from its saved-statistics tensor ("layer1.0.bn1:saved").
std::string bn_name(const Program& p, TensorId saved) {
  std::string s = p.tensor(saved).name;
  const size_t colon = s.rfind(':');
  return colon == std::string::npos ? s : s.substr(0, colon);
}

// ---- SyncBN ---------------------------------------------------------------------------
void sync_batchnorm(Program& p) {
  const int world = p.options.world;
  for (Phase& ph : p.train) {
    if (!is_training_compute(ph.kind)) continue;
    std::vector<Node> out;
    out.reserve(ph.nodes.size());
    for (Node& n : ph.nodes) {
      switch (n.op) {
        case OpKind::bn_fwd_train: {
          // x, gamma, beta, running_mean, running_var -> y, saved
          const std::string bn = bn_name(p, n.out.at(1));
          const int64_t c = p.tensor(n.in.at(1)).numel();
          const TensorId stats = add_tensor(p, bn + ":stats", Region::bn_saved, Shape{2, c});
          const TensorId all =
              add_tensor(p, bn + ":stats_all", Region::bn_saved, Shape{world, 2, c});
          Attrs a = n.attrs;
          a.world = world;
          out.push_back(make(OpKind::bn_stats, {n.in[0]}, {stats}, a, bn + " batch stats"));
          out.push_back(make(OpKind::allgather, {stats}, {all}, a, bn + " batch stats"));
          std::vector<TensorId> in = n.in;
          in.resize(5, kNoTensor);
          in.push_back(all);
          out.push_back(make(OpKind::bn_fwd_sync, in, n.out, a, n.label + " (SyncBN)"));
          break;
        }
        case OpKind::bn_bwd: {
          // x, dy, gamma, saved -> dx, dgamma, dbeta
          const std::string bn = bn_name(p, n.in.at(3));
          const int64_t c = p.tensor(n.in.at(2)).numel();
          const TensorId sums = add_tensor(p, bn + ":grad_sums", Region::bn_saved, Shape{2, c});
          Attrs a = n.attrs;
          a.world = world;
          out.push_back(make(OpKind::bn_bwd_reduce, {n.in[0], n.in[1], n.in[3]},
                             {n.out.at(1), n.out.at(2), sums}, a, bn + " bwd sums"));
          out.push_back(make(OpKind::allreduce, {sums}, {sums}, a, bn + " bwd sums"));
          out.push_back(make(OpKind::bn_bwd_sync, {n.in[0], n.in[1], n.in[2], n.in[3], sums},
                             {n.out.at(0)}, a, n.label + " (SyncBN)"));
          break;
        }
        case OpKind::cbr_fwd:
        case OpKind::cbr_bwd:
        case OpKind::cbr_pool_fwd:
        case OpKind::cbr_pool_bwd:
        case OpKind::bn_add_relu_fwd:
        case OpKind::bn_add_relu_bwd:
          KILN_FAIL(Unsupported, "SyncBN over ", p.options.world,
                    " ranks needs BatchNorm unfused, but node '", n.label, "' is a fused ",
                    op_name(n.op), "; plan the model without fusion (--no-fusion, ",
                    "KILN_FUSION=0) or keep BatchNorm per rank (--no-sync-bn)");
        default:
          out.push_back(std::move(n));
      }
    }
    ph.nodes = std::move(out);
  }
}

// ---- gradient buckets -----------------------------------------------------------------
std::vector<Range> merge(std::vector<Range> v) {
  std::sort(v.begin(), v.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& r : v) {
    if (r.end <= r.begin) continue;
    if (!out.empty() && r.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, r.end);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// The element range a tensor of a parameter region covers.
Range range_of(const Program& p, TensorId id) {
  const DTensor& t = p.tensor(id);
  const int64_t first = t.offset / static_cast<int64_t>(dtype_size(t.dtype));
  return {first, first + t.numel()};
}

bool overlaps(const Range& a, const std::vector<Range>& bucket) {
  for (const Range& b : bucket) {
    if (a.begin < b.end && b.begin < a.end) return true;
  }
  return false;
}

void gradient_buckets(Program& p) {
  const int world = p.options.world;
  const auto g32 = static_cast<size_t>(Region::grads_f32),
             g16 = static_cast<size_t>(Region::grads_f16);
  // Parameters whose gradients the first layer's backward writes (in FP32 or FP16).
  std::set<TensorId> first_grads;
  for (const Phase& ph : p.train) {
    if (ph.kind != PhaseKind::backward_first) continue;
    for (const Node& n : ph.nodes) first_grads.insert(n.out.begin(), n.out.end());
  }
  std::vector<Range> first;
  for (const ParamDesc& d : p.params) {
    const bool in_first = first_grads.count(d.tensor[g32]) ||
                          (d.tensor[g16] != kNoTensor && first_grads.count(d.tensor[g16]));
    if (in_first) first.push_back({d.slot, d.slot + d.slot_elems});
  }
  first = merge(first);
  std::vector<Range> deep;  // the complement of `first` in [0, param_elems)
  int64_t cursor = 0;
  for (const Range& r : first) {
    if (r.begin > cursor) deep.push_back({cursor, r.begin});
    cursor = r.end;
  }
  if (cursor < p.param_elems) deep.push_back({cursor, p.param_elems});

  // Each bucket goes after the last phase before the update that writes into its range of
  // grads_f32 (the gradient-computing phases, or grad_cast under AMP).
  size_t update = p.train.size();
  for (size_t i = 0; i < p.train.size(); ++i) {
    const PhaseKind k = p.train[i].kind;
    if (k == PhaseKind::check_scale || k == PhaseKind::bn_stats || k == PhaseKind::optimizer ||
        k == PhaseKind::ema || k == PhaseKind::weight_cast) {
      update = i;
      break;
    }
  }
  auto last_writer = [&](const std::vector<Range>& bucket) -> int64_t {
    int64_t last = -1;
    for (size_t i = 0; i < update; ++i) {
      if (p.train[i].kind == PhaseKind::transfer) continue;
      for (const Node& n : p.train[i].nodes) {
        for (TensorId id : n.out) {
          if (id != kNoTensor && p.storage(id).region == Region::grads_f32 &&
              overlaps(range_of(p, id), bucket)) {
            last = static_cast<int64_t>(i);
          }
        }
      }
    }
    KILN_CHECK(last >= 0 || bucket.empty(), Internal,
               "data parallel: no phase writes the gradients of a bucket");
    return last;
  };
  auto bucket_phase = [&](const std::vector<Range>& bucket, const std::string& what) {
    Phase ph{PhaseKind::communicate, "communicate_" + what, 1, {}};
    Attrs a;
    a.world = world;
    for (const Range& r : bucket) {
      const std::string span = "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
      const TensorId t =
          add_tensor(p, std::string(region_name(Region::grads_f32)) + "[" + what + " " + span + "]",
                     Region::grads_f32, Shape{r.end - r.begin}, r.begin * 4);
      ph.nodes.push_back(make(OpKind::allreduce, {t}, {t}, a, "grads " + what + " " + span));
    }
    return ph;
  };
  const int64_t deep_at = last_writer(deep), first_at = last_writer(first);
  // Insert at the later position first, so that the earlier index stays valid. At the same
  // position (AMP: both after grad_cast) the deep bucket must run first; an insertion pushes
  // the earlier ones right, so the first-layer bucket is inserted before the deep one.
  std::vector<std::pair<int64_t, Phase>> inserts;
  if (!first.empty()) inserts.push_back({first_at, bucket_phase(first, "first")});
  if (!deep.empty()) inserts.push_back({deep_at, bucket_phase(deep, "deep")});
  std::stable_sort(inserts.begin(), inserts.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& [at, ph] : inserts) {
    p.train.insert(p.train.begin() + at + 1, std::move(ph));
  }
}

// ---- overflow flag and averaging --------------------------------------------------------
void reduce_overflow_and_average(Program& p) {
  const int world = p.options.world;
  for (Phase& ph : p.train) {
    if (ph.kind == PhaseKind::check_scale) {
      int64_t last_check = -1;
      for (size_t i = 0; i < ph.nodes.size(); ++i) {
        Node& n = ph.nodes[i];
        if (n.op == OpKind::grad_norm)
          n.attrs.grad_average = 1.0f / static_cast<float>(world);  // the mean's norm
        if (n.op != OpKind::check_clip) continue;
        n.attrs.clip *= static_cast<float>(world);  // the bound of the sum of `world` averages
        last_check = static_cast<int64_t>(i);
      }
      if (last_check >= 0) {
        const TensorId flag = ph.nodes[static_cast<size_t>(last_check)].out.at(0);
        Attrs a;
        a.world = world;
        a.reduce_max = true;
        ph.nodes.insert(
            ph.nodes.begin() + last_check + 1,
            make(OpKind::allreduce, {flag}, {flag}, a, "overflow flag (max over ranks)"));
      }
    }
    if (ph.kind == PhaseKind::optimizer) {
      for (Node& n : ph.nodes) {
        if (n.op == OpKind::sgd || n.op == OpKind::adamw || n.op == OpKind::lars) {
          n.attrs.grad_average = 1.0f / static_cast<float>(world);
        }
      }
    }
  }
}

}  // namespace

void add_data_parallel(Program& p) {
  const CompileOptions& o = p.options;
  KILN_CHECK(o.world >= 1, InvalidArgument, "world size must be >= 1, got ", o.world);
  if (o.world == 1) return;
  KILN_CHECK(!p.memory.locked, State, "add_data_parallel runs before the memory plan is locked");
  if (o.sync_bn) sync_batchnorm(p);
  gradient_buckets(p);
  reduce_overflow_and_average(p);
}

}  // namespace kiln
