// Placement of every tensor: static regions sequentially, features and aux by liveness.
#include "kiln/graph/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/graph/program.h"

namespace kiln {

namespace {

bool is_param_region(Region r) {
  switch (r) {
    case Region::params_f32:
    case Region::params_f16:
    case Region::grads_f32:
    case Region::grads_f16:
    case Region::moment1:
    case Region::moment2:
    case Region::ema_f32:
    case Region::ema_f16:
      return true;
    default:
      return false;
  }
}

bool is_buffer_region(Region r) {
  return r == Region::bn_running || r == Region::ema_bn_running;
}

bool is_reused_region(Region r) {
  return r == Region::features || r == Region::aux;
}

struct Interval {
  int64_t first = INT64_MAX;
  int64_t last = -1;
};

// Root of a view chain.
TensorId root_of(const Program& p, TensorId id) {
  while (p.tensors[static_cast<size_t>(id)].view_of != kNoTensor)
    id = p.tensors[static_cast<size_t>(id)].view_of;
  return id;
}

// A BN+add+ReLU backward's dresidual is live from the step of the data gradient that makes its
// later gradient contribution: the CUDA backend's SM90 data gradient writes g, which is
// dresidual, there (backend/dgrad_bn_rule.h). Placed from its own step, dresidual takes the
// bytes of a tensor that step's producer reads last, and the BatchNorm backward then copies g
// into it: one more write of the block's largest tensor, in each of ResNet-50's 15 blocks.
void extend_dresidual(const Program& p, std::vector<Interval>& live) {
  std::vector<int64_t> written_at(p.tensors.size(), -1);  // by root: the last writer's step
  std::vector<bool> by_data_gradient(p.tensors.size(), false);
  int64_t t = 0;
  for (const Phase& ph : p.train) {
    for (const Node& n : ph.nodes) {
      if (n.op == OpKind::bn_add_relu_bwd && n.out.size() > 1 && n.out[1] != kNoTensor) {
        int64_t later = -1;
        bool data_gradient = false;
        for (size_t i : {size_t{1}, size_t{5}}) {  // dy, dy2
          if (i >= n.in.size() || n.in[i] == kNoTensor) continue;
          const auto r = static_cast<size_t>(root_of(p, n.in[i]));
          if (written_at[r] > later) later = written_at[r], data_gradient = by_data_gradient[r];
        }
        auto& first = live[static_cast<size_t>(root_of(p, n.out[1]))].first;
        if (data_gradient) first = std::min(first, later);
      }
      const bool makes_dx =
          n.op == OpKind::conv_bwd_data || n.op == OpKind::cbr_bwd || n.op == OpKind::cbr_pool_bwd;
      for (size_t i = 0; i < n.out.size(); ++i) {
        if (n.out[i] == kNoTensor) continue;
        const auto r = static_cast<size_t>(root_of(p, n.out[i]));
        written_at[r] = t;
        by_data_gradient[r] = makes_dx && i == 0;  // their dx
      }
      ++t;
    }
  }
}

// Liveness over one linear order of every node: the train phases, then eval, eval_ema and
// init. The schedules never run at the same time, so their tensors may share bytes; within
// the train schedule both transfer phases come first, so staged copies stay valid.
std::vector<Interval> liveness(const Program& p) {
  std::vector<Interval> live(p.tensors.size());
  int64_t t = 0;
  auto touch = [&](TensorId id) {
    if (id == kNoTensor) return;
    Interval& iv = live[static_cast<size_t>(root_of(p, id))];
    iv.first = std::min(iv.first, t);
    iv.last = std::max(iv.last, t);
  };
  for (const auto* list : {&p.train, &p.eval, &p.eval_ema, &p.init}) {
    for (const Phase& ph : *list) {
      for (const Node& n : ph.nodes) {
        for (TensorId id : n.in) touch(id);
        for (TensorId id : n.out) touch(id);
        ++t;
      }
    }
  }
  if (p.options.dresidual_from_dgrad) extend_dresidual(p, live);
  return live;
}

}  // namespace

void plan_memory(Program& p) {
  KILN_CHECK(!p.memory.locked, State, "the memory plan of '", p.model,
             "' is already locked; compile a new Program to change it");
  MemoryPlan& m = p.memory;
  m.region_bytes.fill(0);

  // Parameter regions: the compiler fixed the slots; every region is param_elems long.
  for (const DTensor& t : p.tensors) {
    if (is_param_region(t.region) && t.view_of == kNoTensor) {
      KILN_CHECK(t.offset >= 0, Internal, "parameter tensor ", t.name, " has no slot");
      const int64_t size = p.param_elems * static_cast<int64_t>(dtype_size(t.dtype));
      auto& rb = m.region_bytes[static_cast<int>(t.region)];
      rb = std::max(rb, size);
    }
  }

  // The BatchNorm buffers and their EMA: the compiler placed them (the same offset in both
  // regions, lower.cpp) when it made them; tensors made without an offset go after them.
  for (const DTensor& t : p.tensors) {
    if (is_buffer_region(t.region) && t.view_of == kNoTensor && t.offset >= 0) {
      auto& rb = m.region_bytes[static_cast<int>(t.region)];
      rb = std::max(rb, align_up(t.offset + std::max<int64_t>(t.bytes(), 1), kAlignment));
    }
  }

  // Static regions: in tensor order, each 256-byte aligned.
  for (DTensor& t : p.tensors) {
    if (t.view_of != kNoTensor || is_param_region(t.region) || is_reused_region(t.region)) continue;
    if (is_buffer_region(t.region) && t.offset >= 0) continue;
    auto& rb = m.region_bytes[static_cast<int>(t.region)];
    t.offset = rb;
    rb = align_up(rb + std::max<int64_t>(t.bytes(), 1), kAlignment);
  }

  // Features and aux: greedy placement, largest first, at the lowest offset that overlaps
  // no placed tensor whose lifetime intersects (no reuse: every tensor gets its own bytes).
  const std::vector<Interval> live = liveness(p);
  for (Region region : {Region::features, Region::aux}) {
    std::vector<TensorId> ids;
    int64_t no_reuse = 0;
    for (const DTensor& t : p.tensors) {
      if (t.region == region && t.view_of == kNoTensor) {
        ids.push_back(t.id);
        no_reuse += align_up(std::max<int64_t>(t.bytes(), 1), kAlignment);
      }
    }
    (region == Region::features ? m.features_without_reuse : m.aux_without_reuse) = no_reuse;
    std::stable_sort(ids.begin(), ids.end(), [&](TensorId a, TensorId b) {
      return p.tensors[static_cast<size_t>(a)].bytes() > p.tensors[static_cast<size_t>(b)].bytes();
    });
    struct Placed {
      int64_t begin, end;
      Interval iv;
    };
    std::vector<Placed> placed;
    int64_t region_end = 0;
    for (TensorId id : ids) {
      DTensor& t = p.tensors[static_cast<size_t>(id)];
      const int64_t size = align_up(std::max<int64_t>(t.bytes(), 1), kAlignment);
      Interval iv = live[static_cast<size_t>(id)];
      if (iv.last < 0) iv = {0, INT64_MAX};  // never used by a node: keep it apart from all
      int64_t offset = 0;
      if (!p.options.memory_reuse) {
        offset = region_end;
      } else {
        std::vector<std::pair<int64_t, int64_t>> busy;
        for (const Placed& q : placed) {
          if (q.iv.first <= iv.last && iv.first <= q.iv.last) busy.push_back({q.begin, q.end});
        }
        std::sort(busy.begin(), busy.end());
        for (const auto& [b, e] : busy) {
          if (offset + size <= b) break;
          offset = std::max(offset, e);
        }
      }
      t.offset = offset;
      placed.push_back({offset, offset + size, iv});
      region_end = std::max(region_end, offset + size);
    }
    m.region_bytes[static_cast<int>(region)] = region_end;
  }

  // Views take their root's offset.
  for (DTensor& t : p.tensors) {
    if (t.view_of != kNoTensor) t.offset = p.tensors[static_cast<size_t>(root_of(p, t.id))].offset;
  }
  m.locked = true;
}

static std::string human_bytes(int64_t b) {
  char buf[64];
  if (b >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  } else if (b >= (1 << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(b) / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  }
  return buf;
}

std::string describe_memory(const Program& p) {
  std::ostringstream os;
  os << "memory plan of " << p.model << " (batch " << p.options.batch << ", "
     << (p.options.amp ? "AMP " : "FP32, ")
     << (p.options.amp ? dtype_name(p.options.amp_dtype) : "") << (p.options.amp ? ", " : "")
     << "memory reuse " << (p.options.memory_reuse ? "on" : "off") << ")\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-12s %14s  %s\n", "region", "bytes", "holds");
  os << line;
  for (int r = 0; r < kRegionCount; ++r) {
    const int64_t b = p.memory.region_bytes[static_cast<size_t>(r)];
    if (b == 0) continue;
    std::snprintf(line, sizeof line, "  %-12s %14s  %s\n", region_name(static_cast<Region>(r)),
                  human_bytes(b).c_str(), region_doc(static_cast<Region>(r)));
    os << line;
  }
  const int64_t feat = p.memory.region_bytes[static_cast<int>(Region::features)] +
                       p.memory.region_bytes[static_cast<int>(Region::aux)];
  const int64_t feat_no = p.memory.features_without_reuse + p.memory.aux_without_reuse;
  os << "  parameters: " << p.params.size() << " tensors, " << p.param_elems
     << " elements per parameter region\n";
  os << "  activations (features + aux): " << human_bytes(feat) << " with reuse, "
     << human_bytes(feat_no) << " without";
  if (feat > 0) {
    char r[64];
    std::snprintf(r, sizeof r, " (%.2fx)",
                  static_cast<double>(feat_no) / static_cast<double>(feat));
    os << r;
  }
  os << "\n  total: " << human_bytes(p.memory.total()) << "\n";
  return os.str();
}

}  // namespace kiln
