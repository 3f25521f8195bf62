// Engine: the lifecycle PLANNING → MEMORY_LOCKED → COMPILED around one model on
// one backend, and the step-level API the Trainer, the CLI, the tests and the C++ users
// call. Calling a step out of order is a kiln::Error(State) that says which step is next.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/backend/backend.h"
#include "kiln/blueprint/blueprint.h"
#include "kiln/core/switches.h"
#include "kiln/data/mixup.h"
#include "kiln/graph/program.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {

enum class Lifecycle { PLANNING, MEMORY_LOCKED, COMPILED };
const char* lifecycle_name(Lifecycle s);

struct EngineOptions {
  CompileOptions compile;
  // The switches (switches.def): the process's KILN_* variables unless a field is set. The
  // Engine passes them to the backend and sets compile.memory_reuse from them.
  Switches switches = Switches::from_environment();
  std::string device = "auto";  // auto, cpu, cuda
};

// A batch as the input pipeline hands it over: float images; uint8 pixels with their
// normalisation; an encoded batch that the backend decodes (Backend::decodes_jpeg); or a batch
// already in device memory (Backend::stage_batch_device: a CUDA tensor from Python).
// Exactly one of f32, u8, encoded and device is set.
struct InputView {
  const float* f32 = nullptr;
  const uint8_t* u8 = nullptr;
  const EncodedBatch* encoded = nullptr;
  const DeviceBatch* device = nullptr;
  const int32_t* labels = nullptr;  // ignored for encoded and device (they carry their own)
  const InputNormalization* norm = nullptr;  // u8, encoded, and device batches of U8
  // u8: null, or each sample's value augmentations (one per sample of the batch); encoded
  // batches carry theirs in their images.
  const SampleAugment* augments = nullptr;
};

struct StepStats {
  float loss = 0;              // mean cross-entropy of the batch
  int64_t top1 = 0, top5 = 0;  // hits in the batch
  bool overflow = false;       // AMP: the step was skipped on the device
  float loss_scale = 1;
};

// The fusion the Engine asks of the planner and compiler for a backend's capabilities and
// o.switches (fusion, fuse_fp32, fuse_pool, fuse_grad_sum): the plan options returned, and
// o.compile.fuse_grad_sum set. `kiln plan` and `kiln program` print the same choice.
PlanOptions fusion_options(const BackendCaps& caps, EngineOptions& o);

// The Engine's two planning steps, which the tools that show a plan without running it
// (kiln plan / program / memory) call too, so they print what an Engine would run: the
// ArchPlan fused for `caps` (o.compile takes the switches' memory reuse and fuse_grad_sum),
// then the Program with its memory laid out and validated, as lock_memory() holds it.
// Neither makes a backend or allocates.
ArchPlan plan_for(const BluePrint& blueprint, const BackendCaps& caps, EngineOptions& o);
Program program_for(const ArchPlan& plan, const CompileOptions& options, const std::string& model);

class Engine {
 public:
  // PLANNING: the backend is chosen (its capabilities steer the fusion passes) and the
  // ArchPlan is built.
  Engine(const BluePrint& blueprint, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Lifecycle state() const { return state_; }
  const ArchPlan& plan() const { return plan_; }
  const EngineOptions& options() const { return options_; }
  const BluePrint& blueprint() const { return blueprint_; }

  // PLANNING → MEMORY_LOCKED: lower the plan to its Program (lower_program), place its
  // memory, validate it.
  void lock_memory();
  const Program& program() const;

  // MEMORY_LOCKED → COMPILED, kiln's one step called compile: the backend allocates its
  // regions and prepares every node (Backend::prepare); the weights get torchvision's
  // initialisation from `seed`.
  void compile(uint64_t seed = 0);
  Backend& backend();

  // COMPILED. One training step on a batch of program().options.batch samples (NHWC float
  // images, int32 labels). `read_stats` = false skips the host read of loss and accuracy
  // (no synchronisation; the returned stats are then empty).
  StepStats train_step(const float* images, const int32_t* labels, float lr,
                       bool read_stats = true);
  // The training loop's form: enqueues the step and returns the statistics of the step
  // before it, which a GPU has finished by then or nearly, so the host prepares the next batch
  // while this one runs instead of waiting for it (Backend::read_later). Empty on the first
  // call and after pending_stats(), which waits for the newest step's statistics (a
  // synchronous train_step drops them).
  std::optional<StepStats> train_step_async(const float* images, const int32_t* labels, float lr);
  std::optional<StepStats> train_step_async(const InputView& input, float lr);
  std::optional<StepStats> pending_stats();
  // A step's statistics left on the device until collect_stats() asks for them, so that a
  // caller runs ahead of the device and reads a step's loss when it wants it (Python's
  // train_step, as a PyTorch loop reads loss.item()). Tickets stay valid while fewer than
  // kDeferredSteps newer steps have been enqueued; collect each once.
  struct StatTickets {
    uint64_t loss, correct, overflow, loss_scale;
  };
  static constexpr int64_t kDeferredSteps = Backend::kLateReadSlots / 4 - 2;
  StatTickets train_step_deferred(const InputView& input, float lr);
  StepStats collect_stats(const StatTickets& tickets);
  // A step on the batch already staged in the input slot this step uses (A and B alternate),
  // with no host copy: `kiln bench --stage once` trains on one fixed batch resident on the
  // device, as PyTorch's reference does. The slot must have been staged by an earlier step.
  StepStats train_step_on_staged(float lr, bool read_stats = true);
  // Evaluation of one batch; `valid` < batch marks the rest as padding (not counted).
  StepStats eval_batch(const float* images, const int32_t* labels, int64_t valid, bool ema = false);
  StepStats eval_batch(const InputView& input, int64_t valid, bool ema = false);
  // The mixup / cutmix of the next training step (a program compiled with
  // CompileOptions::mix): written with the step's learning rate, then back to unmixed, so a
  // step without a set_mix() call trains on its batch as it is.
  void set_mix(const MixDraw& draw);
  int64_t steps_done() const { return steps_; }
  void set_steps_done(int64_t steps) { steps_ = steps; }

  // Evaluation at another input size (torchvision's --val-crop-size; SPEC S26): an engine for
  // `blueprint`, this model built for that size, compiled for evaluation only
  // (CompileOptions::eval_only: no gradients, optimizer state or backward activations) on a
  // backend of its own whose weight regions are this engine's - master weights, FP16 compute
  // copies, BatchNorm running statistics and their EMA copies, shared in place, not copied - so
  // it evaluates whatever this engine has trained or loaded, with nothing to refresh. This
  // engine must be compiled and outlive the variant; the variant waits for this engine's queued
  // work before each batch, and this engine must not run while the variant does.
  std::unique_ptr<Engine> eval_variant(const BluePrint& blueprint);
  // Why `blueprint` cannot evaluate with this engine's weights - the first parameter or buffer
  // whose shape or place differs (an fc layer after a flatten takes an input-size-dependent
  // width) - or "" when it can. Needs lock_memory(); lowers the variant's program, allocates
  // nothing: a caller can refuse before compiling.
  std::string eval_variant_mismatch(const BluePrint& blueprint) const;
  bool is_eval_variant() const { return owner_ != nullptr; }

  // Parameters and buffers by name, in kiln's layout, FP32 (master weights). For a buffer,
  // Region::ema_f32 (or ema_bn_running) is its EMA copy; any other region the live one.
  std::vector<float> read_param(const std::string& name, Region region = Region::params_f32);
  void write_param(const std::string& name, const std::vector<float>& values,
                   Region region = Region::params_f32);
  // After writing master weights by hand: refresh the FP16 copies and restart the EMA.
  void refresh_derived_weights();

 private:
  void require(Lifecycle s, const char* what) const;
  TensorId buffer_tensor(const BufferDesc& b, Region region) const;
  void enqueue_step(const InputView* input, float lr);  // null: the batch already staged
  void stage(int slot, const InputView& input);
  StepStats read_step_stats();
  StatTickets read_stats_later();
  EngineOptions variant_options() const;

  BluePrint blueprint_;
  EngineOptions options_;
  std::unique_ptr<Backend> backend_;
  ArchPlan plan_;
  std::unique_ptr<Program> program_;
  Lifecycle state_ = Lifecycle::PLANNING;
  int64_t steps_ = 0;
  int slot_ = 0;
  bool staged_[2] = {false, false};     // a batch was staged into input slot A / B
  std::optional<StatTickets> pending_;  // train_step_async's newest step, not yet collected
  std::vector<float> pad_images_;
  std::vector<uint8_t> pad_u8_;
  std::vector<int32_t> pad_labels_;
  MixDraw mix_;
  Engine* owner_ = nullptr;  // an evaluation variant's training engine (its weight regions)
};

// torchvision's initialisation: conv kaiming-normal (fan_out, ReLU), BatchNorm 1/0, fc as
// nn.Linear (uniform ±1/sqrt(fan_in)) — VGG's fc normal(0, 0.01) with zero bias.
void init_weights(Engine& engine, uint64_t seed);

}  // namespace kiln
