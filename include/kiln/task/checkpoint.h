// Checkpoints in safetensors: weights and BatchNorm buffers under torchvision's
// names and layouts (so a checkpoint loads into torchvision as it is), optimizer moments,
// EMA weights and BatchNorm statistics, loss-scale state, and the run's position (epoch, step) and
// seed in the metadata. Written to a temporary file and renamed; resuming restores all of it.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/io/safetensors.h"
#include "kiln/task/engine.h"

namespace kiln {

// The training statistics of an epoch so far: a mid-epoch checkpoint holds them so that the
// resumed epoch's metrics row is the uninterrupted one's.
struct EpochSums {
  double loss_sum = 0;  // saved exactly (hexadecimal), the row's mean must not move
  int64_t loss_count = 0, seen = 0, hits = 0, overflows = 0;
};

// What a checkpoint holds beside the tensors. The loader's draws are a pure function of
// (seed, epoch, sample index) and dropout's masks of (seed, step), so epoch, step_in_epoch,
// step and seed are every random stream's state; the loss scale is saved with the tensors.
struct TrainState {
  int64_t epoch = 0;          // epochs completed
  int64_t step = 0;           // optimizer steps taken
  int64_t step_in_epoch = 0;  // steps of epoch `epoch` (0-based) taken; 0 at an epoch's end
  uint64_t seed = 0;
  double best_top1 = 0;
  int64_t stale_epochs = 0;  // epochs without a better top-1 (early stop)
  EpochSums sums;            // of the epoch in progress (step_in_epoch > 0)
  std::string config;        // the run's options (config_json), checked on resume
  // The finished epoch's metrics row, written to the metrics files after this checkpoint: a
  // run killed between the two gets it back on resume.
  std::string row_csv, row_jsonl;
};

void save_checkpoint(Engine& engine, const std::string& path, const TrainState& state);
// Restores everything save_checkpoint wrote; checks that it was made for this model and
// these options. Errors are kiln::Error(Checkpoint) naming the file and the tensor.
TrainState load_checkpoint(Engine& engine, const std::string& path);

// torchvision state_dict: parameters, running statistics and num_batches_tracked; with `ema`
// the EMA model's (EMA weights and the EMA of the running statistics), under the same names.
StFile export_state_dict(Engine& engine, bool ema = false);
void export_weights(Engine& engine, const std::string& path, bool ema = false);
// Loads parameters and running statistics by torchvision name from a state_dict saved with
// safetensors (F32, F16 or BF16); every parameter and buffer of the model must be there.
void import_weights(Engine& engine, const std::string& path);
// The same from tensors in memory (the Python module's load_state_dict); `what` names them.
void import_state_dict(Engine& engine, const StFile& file, const std::string& what);
// A state_dict of the EMA model (export_state_dict(engine, true)'s names) into the EMA weights
// and EMA BatchNorm statistics; the model must be compiled with EMA. Call after
// import_state_dict, whose refresh restarts the EMA at the live weights.
void import_ema_state_dict(Engine& engine, const StFile& file, const std::string& what);
// The EMA model of a checkpoint (its ema.* tensors) as a state_dict under torchvision's names.
// A checkpoint from before the EMA had BatchNorm statistics of its own gives the live ones
// (with a warning), as its training evaluated the EMA; one without EMA weights is an error.
StFile ema_state_of_checkpoint(const Program& program, const StFile& file, const std::string& path);

// kiln layout (conv KRSC, fc columns H,W,C) ↔ torchvision layout (conv OIHW, fc columns C,H,W).
std::vector<float> to_torch_layout(const ParamDesc& p, const std::vector<float>& kiln_values);
std::vector<float> from_torch_layout(const ParamDesc& p, const std::vector<float>& torch_values);

}  // namespace kiln
