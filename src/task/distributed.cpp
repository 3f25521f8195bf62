// Data-parallel training at the task level (see kiln/task/distributed.h).
#include "kiln/task/distributed.h"

#include <cstring>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/process_group/process_group.h"

namespace kiln {

namespace {

// FNV-1a over bytes: equal states give equal hashes on every rank (same layout, same order).
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 1099511628211ull;
    }
  }
};

}  // namespace

void check_replicas_agree(Engine& engine, int64_t step, const char* when) {
  if (dist::world() == 1) return;
  const Program& p = engine.program();
  Fnv f;
  for (const ParamDesc& d : p.params) {
    for (Region r : {Region::params_f32, Region::moment1, Region::moment2, Region::ema_f32}) {
      if (d.tensor[static_cast<size_t>(r)] == kNoTensor) continue;
      const std::vector<float> v = engine.read_param(d.name, r);
      f.add(v.data(), v.size() * sizeof(float));
    }
  }
  for (const BufferDesc& b : p.buffers) {
    for (Region r : {Region::bn_running, Region::ema_bn_running}) {
      if (r == Region::ema_bn_running && b.ema == kNoTensor) continue;
      const std::vector<float> v = engine.read_param(b.name, r);
      f.add(v.data(), v.size() * sizeof(float));
    }
  }
  f.add(&step, sizeof step);
  std::vector<uint64_t> all(static_cast<size_t>(dist::world()));
  dist::allgather(&f.h, all.data(), 1, DType::I64, "the model hashes");
  std::string differ;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  KILN_CHECK(differ.empty(), State, "after ", when, " the model on rank(s) ", differ,
             " differs from rank 0's (weights, optimizer state, BatchNorm statistics or step): "
             "every rank must ",
             "start from the same state; give every rank the same --resume / --init-from file (on "
             "a file system ",
             "all nodes see) and the same kiln build");
}

void average_bn_running_stats(Engine& engine) {
  if (dist::world() == 1) return;
  const Program& p = engine.program();
  // The live buffers, and their EMA copies when EMA is on (each rank's follows its own).
  std::vector<double> all;
  std::vector<std::pair<const BufferDesc*, Region>> which;
  std::vector<std::vector<float>> parts;
  for (const BufferDesc& b : p.buffers) {
    for (Region r : {Region::bn_running, Region::ema_bn_running}) {
      if (r == Region::ema_bn_running && b.ema == kNoTensor) continue;
      which.push_back({&b, r});
      parts.push_back(engine.read_param(b.name, r));
      all.insert(all.end(), parts.back().begin(), parts.back().end());
    }
  }
  dist::allreduce(all.data(), static_cast<int64_t>(all.size()), dist::Reduce::sum,
                  "BatchNorm running statistics");
  size_t k = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (float& x : parts[i]) x = static_cast<float>(all[k++] / dist::world());
    engine.write_param(which[i].first->name, parts[i], which[i].second);
  }
}

void reduce_train_sums(double& loss_sum, int64_t& loss_count, int64_t& seen, int64_t& hits) {
  if (dist::world() == 1) return;
  double v[4] = {loss_sum, static_cast<double>(loss_count), static_cast<double>(seen),
                 static_cast<double>(hits)};
  dist::allreduce(v, 4, dist::Reduce::sum, "training metrics");
  loss_sum = v[0];
  loss_count = static_cast<int64_t>(v[1]);
  seen = static_cast<int64_t>(v[2]);
  hits = static_cast<int64_t>(v[3]);
}

void reduce_eval_sums(double& loss_sum, int64_t& top1, int64_t& top5, int64_t& count) {
  if (dist::world() == 1) return;
  double v[4] = {loss_sum, static_cast<double>(top1), static_cast<double>(top5),
                 static_cast<double>(count)};
  dist::allreduce(v, 4, dist::Reduce::sum, "evaluation metrics");
  loss_sum = v[0];
  top1 = static_cast<int64_t>(v[1]);
  top5 = static_cast<int64_t>(v[2]);
  count = static_cast<int64_t>(v[3]);
}

}  // namespace kiln
