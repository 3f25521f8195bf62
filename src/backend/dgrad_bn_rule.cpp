// The schedule's and the memory plan's rule for the fused data gradient (dgrad_bn_rule.h).
#include "backend/dgrad_bn_rule.h"

#include <algorithm>
#include <vector>

#include "backend/node_checks.h"

namespace kiln {

namespace {

// The bytes of a tensor's storage (a view as its base), as the memory plan placed them.
struct Bytes {
  Region region;
  int64_t begin, end;
};
Bytes bytes_of(const Program& p, TensorId id) {
  const DTensor& t = p.storage(id);
  return {t.region, t.offset, t.offset + t.bytes()};
}
bool overlap(const Bytes& a, const Bytes& b) {
  return a.region == b.region && a.begin < b.end && b.begin < a.end;
}

std::string named(const Program& p, TensorId id) {
  return "'" + p.tensor(id).name + "'";
}

// Whether m is a BatchNorm backward that reads dx as the gradient at its ReLU's output, and if
// so its tensors in u.
bool read_as_bn_gradient(const Node& m, TensorId dx, DgradBnUse& u) {
  if (m.op == OpKind::cbr_bwd && in_at(m, 3) == dx) {  // "x, w, z, dy, mask, gamma, saved"
    u.z = in_at(m, 2), u.mask = in_at(m, 4), u.saved = in_at(m, 6);
    u.g = dx;
    return true;
  }
  // "x, w, z, dy (pooled), mask, gamma, saved, [zp, mp]": with the forward's pooled picks, the
  // sums' terms are dy's against zp under mp, a map of dx's shape (ops.def), so the kernel
  // reads those as a CBR's z and mask, and writes g = mp ? dy : 0 for the dx pass to route.
  if (m.op == OpKind::cbr_pool_bwd && in_at(m, 3) == dx && in_at(m, 7) != kNoTensor) {
    u.z = in_at(m, 7), u.mask = in_at(m, 8), u.saved = in_at(m, 6);
    u.g = dx;
    return true;
  }
  // "x, dy, mask, gamma, saved, [dy2] -> dx, dresidual, ...": g = mask ? dy + dy2 : 0 in FP16,
  // whose sum rounds the same either way round, so dx may be either contribution.
  if (m.op == OpKind::bn_add_relu_bwd && (in_at(m, 1) == dx || in_at(m, 5) == dx)) {
    u.z = in_at(m, 0), u.mask = in_at(m, 2), u.saved = in_at(m, 4);
    u.other = in_at(m, 1) == dx ? in_at(m, 5) : in_at(m, 1);
    u.g = out_at(m, 1);
    return true;
  }
  return false;
}

}  // namespace

DgradBnUse dgrad_bn_use(const Program& p, const Node& producer, TensorId dx) {
  DgradBnUse u;
  if (dx == kNoTensor) return u;
  std::vector<const Node*> order;  // the memory plan's liveness order
  for (const Phase& ph : p.train) {
    for (const Node& m : ph.nodes) order.push_back(&m);
  }
  const auto t1 =
      static_cast<size_t>(std::find(order.begin(), order.end(), &producer) - order.begin());
  if (t1 == order.size()) return u;  // not a training node (a fused part, an evaluation node)
  const TensorId dx_root = p.storage(dx).id;
  auto reads_dx = [&](const Node& m) {
    return std::any_of(m.in.begin(), m.in.end(),
                       [&](TensorId id) { return id != kNoTensor && p.storage(id).id == dx_root; });
  };
  size_t t2 = t1 + 1;
  while (t2 < order.size() && !reads_dx(*order[t2])) ++t2;
  if (t2 == order.size() || !read_as_bn_gradient(*order[t2], dx, u)) return u;
  u.consumer = order[t2];
  const std::string bn = "the BatchNorm backward '" + u.consumer->label + "'";

  if (u.consumer->op == OpKind::bn_add_relu_bwd && in_at(*u.consumer, 1) == in_at(*u.consumer, 5)) {
    u.refusal = bn + " reads dx as both of its gradients";
    return u;
  }
  if (u.g == kNoTensor) {
    u.refusal = bn + " has no dresidual to write g to";
    return u;
  }
  // dx's only reader must be the consumer, once: any other would read g, or (where g goes to
  // dresidual) bytes nobody wrote.
  int reads = 0;
  for (const auto* list : {&p.train, &p.eval, &p.eval_ema, &p.init}) {
    for (const Phase& ph : *list) {
      for (const Node& m : ph.nodes) {
        for (TensorId id : m.in) {
          if (id == kNoTensor || p.storage(id).id != dx_root) continue;
          if (&m != u.consumer || ++reads > 1) {
            u.refusal = "dx " + named(p, dx) + " is read by node '" + m.label + "' too, not only " +
                        "by " + bn;
            return u;
          }
        }
      }
    }
  }
  // What the consumer would read at its own step is read at the producer's: nothing from the
  // producer's step up to the consumer's may write it (the producer's own outputs included).
  std::vector<std::pair<TensorId, const char*>> moved{
      {u.z, "its input z"}, {u.mask, "its ReLU mask"}, {u.saved, "its saved mean"}};
  if (u.other != kNoTensor) moved.push_back({u.other, "its other gradient contribution"});
  for (size_t t = t1; t < t2; ++t) {
    for (TensorId out : order[t]->out) {
      if (out == kNoTensor) continue;
      for (const auto& [id, role] : moved) {
        if (id == kNoTensor) continue;
        if (overlap(bytes_of(p, out), bytes_of(p, id))) {
          u.refusal = "node '" + order[t]->label + "' writes " + named(p, out) + " over " + role +
                      " " + named(p, id) + ", which " + bn + " reads after it";
          return u;
        }
      }
    }
  }
  if (u.g == dx) return u;
  // g would be in dresidual from the producer's step on; the plan placed it from the consumer's.
  // Where a tensor touched in between shares its bytes (with memory reuse, typically one that
  // dies at the producer's step), g goes to dx, whose bytes are dx's from the producer's step.
  const Bytes g = bytes_of(p, u.g);
  for (size_t t = t1; t < t2; ++t) {
    for (const auto* ids : {&order[t]->in, &order[t]->out}) {
      for (TensorId id : *ids) {
        if (id == kNoTensor || !overlap(bytes_of(p, id), g)) continue;
        u.copy_to = u.g;
        u.g = dx;
        return u;
      }
    }
  }
  return u;
}

std::string unread_output_refusal(const Program& p, const Node& n, TensorId t) {
  const auto in_train = [&] {
    for (const Phase& ph : p.train) {
      for (const Node& m : ph.nodes) {
        if (&m == &n) return true;
      }
    }
    return false;
  };
  if (!in_train()) return "'" + n.label + "' is not a training node";
  if (t == kNoTensor) return "";
  const TensorId root = p.storage(t).id;
  for (const Phase& ph : p.train) {
    for (const Node& m : ph.nodes) {
      if (&m == &n) continue;
      for (const TensorId id : m.in) {
        if (id != kNoTensor && p.storage(id).id == root)
          return named(p, t) + " is read by '" + m.label + "'";
      }
    }
  }
  return "";
}

}  // namespace kiln
