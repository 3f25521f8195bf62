// Checkpoints (SPEC S25) in safetensors: weights and BatchNorm buffers under torchvision's
// names and layouts (so a checkpoint loads into torchvision as it is), optimizer moments,
// EMA weights, loss-scale state, and the run's position (epoch, step) and seed in the
// metadata. Written to a temporary file and renamed; resuming restores all of it.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/io/safetensors.h"
#include "kiln/task/engine.h"

namespace kiln {

struct TrainState {
  int64_t epoch = 0;  // epochs completed
  int64_t step = 0;   // optimizer steps taken
  uint64_t seed = 0;
  double best_top1 = 0;
  std::string config;  // the run's options, for the record
};

void save_checkpoint(Engine& engine, const std::string& path, const TrainState& state);
// Restores everything save_checkpoint wrote; checks that it was made for this model and
// these options. Errors are kiln::Error(Checkpoint) naming the file and the tensor.
TrainState load_checkpoint(Engine& engine, const std::string& path);

// torchvision state_dict: parameters, running statistics and num_batches_tracked.
StFile export_state_dict(Engine& engine);
void export_weights(Engine& engine, const std::string& path);
// Loads parameters and running statistics by torchvision name from a state_dict saved with
// safetensors (F32, F16 or BF16); every parameter and buffer of the model must be there.
void import_weights(Engine& engine, const std::string& path);

// kiln layout (conv KRSC, fc columns H,W,C) ↔ torchvision layout (conv OIHW, fc columns C,H,W).
std::vector<float> to_torch_layout(const ParamDesc& p, const std::vector<float>& kiln_values);
std::vector<float> from_torch_layout(const ParamDesc& p, const std::vector<float>& torch_values);

}  // namespace kiln
