// MemoryPlan: the size of every region and where each tensor lies in it.
// Activations and their gradients reuse memory by liveness; KILN_MEMORY_REUSE=0 (or
// CompileOptions::memory_reuse=false) gives every feature tensor its own bytes.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "kiln/graph/tensor.h"

namespace kiln {

struct Program;

struct MemoryPlan {
  std::array<int64_t, kRegionCount> region_bytes{};  // indexed by Region; 0 = region absent
  int64_t features_without_reuse = 0;  // what the features region would need without reuse
  int64_t aux_without_reuse = 0;
  bool locked = false;
  int64_t total() const {
    int64_t t = 0;
    for (int64_t b : region_bytes) t += b;
    return t;
  }
};

// Places every tensor of the program (static regions in order, features and aux by
// liveness over the schedule train → eval → eval_ema → init) and locks the plan.
void plan_memory(Program& program);

std::string describe_memory(const Program& program);

}  // namespace kiln
