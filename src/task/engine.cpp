#include "kiln/task/engine.h"

#include <cmath>
#include <cstring>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/graph/compiler.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/process_group/process_group.h"

namespace kiln {

const char* lifecycle_name(Lifecycle s) {
  switch (s) {
    case Lifecycle::PLANNING:
      return "PLANNING";
    case Lifecycle::MEMORY_LOCKED:
      return "MEMORY_LOCKED";
    case Lifecycle::COMPILED:
      return "COMPILED";
  }
  return "?";
}

Engine::Engine(const BluePrint& blueprint, EngineOptions options)
    : blueprint_(blueprint), options_(std::move(options)) {
  backend_ = make_backend(options_.device, options_.switches);
  const BackendCaps caps = backend_->caps();
  if (options_.compile.amp) {
    const bool ok = options_.compile.amp_dtype == DType::BF16 ? caps.bf16 : caps.fp16;
    KILN_CHECK(ok, Unsupported, "--amp: the ", backend_->name(), " backend has no ",
               dtype_name(options_.compile.amp_dtype),
               " compute; train without --amp or use --device cuda");
  }
  plan_ = plan_for(blueprint_, caps, options_);
}

ArchPlan plan_for(const BluePrint& blueprint, const BackendCaps& caps, EngineOptions& o) {
  o.compile.memory_reuse = o.switches.memory_reuse;
  o.compile.dresidual_from_dgrad = o.switches.dresidual_from_dgrad;
  return make_plan(blueprint, fusion_options(caps, o));
}

Program program_for(const ArchPlan& plan, const CompileOptions& options, const std::string& model) {
  Program program = lower_program(plan, options);
  program.model = model;
  plan_memory(program);
  validate_program(program);
  return program;
}

PlanOptions fusion_options(const BackendCaps& caps, EngineOptions& o) {
  PlanOptions po;
  const Switches& sw = o.switches;
  po.fusion = sw.fusion;
  po.amp = o.compile.amp;
  // SyncBN splits BatchNorm into ops that the fused CBR / BN+add+ReLU kernels lack.
  const bool sync_bn = o.compile.world > 1 && o.compile.sync_bn;
  po.backend_fuses_cbr = caps.fused_cbr && !sync_bn;
  po.backend_fuses_cbr_pool = caps.fused_cbr_pool && !sync_bn && sw.fuse_pool;
  po.backend_fuses_overlapping_pool =
      po.backend_fuses_cbr_pool && caps.fused_overlapping_pool && sw.fuse_overlapping_pool;
  po.backend_fuses_bn_add_relu = caps.fused_bn_add_relu && !sync_bn;
  po.backend_fuses_residual_bn =
      po.backend_fuses_bn_add_relu && caps.fused_residual_bn && sw.fuse_residual_bn;
  // The CPU does not fuse in FP32 by default: there the fused program gives the same bits at
  // the same speed, so it is the tests' tool for checking fused programs.
  po.backend_fuses_fp32 = caps.fused_fp32 && resolve(sw.fuse_fp32, caps.fp32_fusion_default);
  // Only the fused BN+add+ReLU takes a second gradient, so this changes nothing without fusion.
  o.compile.fuse_grad_sum = caps.fused_grad_sum && sw.fusion && sw.fuse_grad_sum;
  o.compile.pool_pooled_sums = po.backend_fuses_cbr_pool && sw.pool_pooled_sums;
  o.compile.fuse_weight_cast = sw.fuse_weight_cast;
  return po;
}

Engine::~Engine() = default;

void Engine::require(Lifecycle s, const char* what) const {
  if (state_ == s) return;
  const char* next = state_ == Lifecycle::PLANNING        ? "lock_memory()"
                     : state_ == Lifecycle::MEMORY_LOCKED ? "compile()"
                                                          : "nothing: it is compiled";
  KILN_FAIL(State, what, " needs the engine in state ", lifecycle_name(s), " but it is ",
            lifecycle_name(state_), "; the next step is ", next);
}

void Engine::lock_memory() {
  require(Lifecycle::PLANNING, "lock_memory()");
  program_ = std::make_unique<Program>(program_for(plan_, options_.compile, blueprint_.name));
  state_ = Lifecycle::MEMORY_LOCKED;
}

const Program& Engine::program() const {
  KILN_CHECK(program_ != nullptr, State, "program() needs lock_memory() first (state ",
             lifecycle_name(state_), ")");
  return *program_;
}

Backend& Engine::backend() {
  return *backend_;
}

void Engine::compile(uint64_t seed) {
  require(Lifecycle::MEMORY_LOCKED, "compile()");
  backend_->prepare(*program_);
  state_ = Lifecycle::COMPILED;
  init_weights(*this, seed);
}

namespace {

std::string size_str(const BluePrint& b) {
  return std::to_string(b.input.height) + "x" + std::to_string(b.input.width);
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.dims.size(); ++i) out += (i ? ", " : "") + std::to_string(s.dims[i]);
  return out + "]";
}

// The regions an evaluation variant takes from its training engine.
constexpr Region kSharedRegions[] = {Region::params_f32, Region::params_f16,
                                     Region::ema_f32,    Region::ema_f16,
                                     Region::bn_running, Region::ema_bn_running};

}  // namespace

EngineOptions Engine::variant_options() const {
  // Everything else as the owner's, world and SyncBN included: they steer the fusion passes,
  // and a fused layer declares its parameters in another order than the unfused ones.
  EngineOptions o = options_;
  o.compile.eval_only = true;
  return o;
}

std::string Engine::eval_variant_mismatch(const BluePrint& blueprint) const {
  const Program& own = program();
  const std::string at = " at " + size_str(blueprint_), there = " at " + size_str(blueprint);
  if (blueprint.input.channels != blueprint_.input.channels)
    return "it takes " + std::to_string(blueprint.input.channels) + " channels" + there + " and " +
           std::to_string(blueprint_.input.channels) + at;
  if (blueprint.num_classes != blueprint_.num_classes)
    return "it has " + std::to_string(blueprint.num_classes) + " classes" + there + " and " +
           std::to_string(blueprint_.num_classes) + at;
  EngineOptions o = variant_options();
  Program v;
  try {
    v = program_for(plan_for(blueprint, backend_->caps(), o), o.compile, blueprint.name);
  } catch (const Error& e) {  // e.g. an adaptive pool that cannot reach its size from there
    return std::string("it cannot be planned") + there + ": " + e.what();
  }
  const std::string depends =
      " (its parameters depend on the input size, as an fc layer after a flatten does; globally "
      "pooled models such as the ResNets do not)";
  if (v.params.size() != own.params.size())
    return "it has " + std::to_string(v.params.size()) + " parameters" + there + " and " +
           std::to_string(own.params.size()) + at;
  for (size_t i = 0; i < v.params.size(); ++i) {
    const ParamDesc &a = own.params[i], &b = v.params[i];
    if (a.name != b.name || !(a.shape == b.shape) || a.slot != b.slot)
      return "its parameter '" + a.name + "' is " + shape_str(a.shape) + at + " but '" + b.name +
             "' is " + shape_str(b.shape) + there + depends;
  }
  if (v.buffers.size() != own.buffers.size() || v.buffer_elems != own.buffer_elems)
    return "its BatchNorm buffers differ" + there;
  for (size_t i = 0; i < v.buffers.size(); ++i) {
    const BufferDesc &a = own.buffers[i], &b = v.buffers[i];
    if (a.name != b.name || own.tensor(a.tensor).offset != v.tensor(b.tensor).offset)
      return "its buffer '" + a.name + "' lies elsewhere" + there;
  }
  for (Region r : kSharedRegions) {
    const auto i = static_cast<size_t>(r);
    if (v.memory.region_bytes[i] > own.memory.region_bytes[i])
      return std::string("its region ") + region_name(r) + " is larger" + there;
  }
  return "";
}

std::unique_ptr<Engine> Engine::eval_variant(const BluePrint& blueprint) {
  require(Lifecycle::COMPILED, "eval_variant()");
  KILN_CHECK(owner_ == nullptr, InvalidArgument, "eval_variant: this engine of '", blueprint_.name,
             "' is itself an evaluation variant; make the variant from its training engine");
  const std::string mismatch = eval_variant_mismatch(blueprint);
  KILN_CHECK(mismatch.empty(), Model, "model '", blueprint_.name, "' cannot evaluate at ",
             size_str(blueprint), " with the weights it has at ", size_str(blueprint_), ": ",
             mismatch, "; evaluate at ", size_str(blueprint_));
  auto v = std::make_unique<Engine>(blueprint, variant_options());
  KILN_CHECK(std::string(v->backend_->name()) == backend_->name(), Internal, "eval_variant: a ",
             v->backend_->name(), " backend for a ", backend_->name(), " engine");
  v->lock_memory();
  for (Region r : kSharedRegions) {
    const auto i = static_cast<size_t>(r);
    if (v->program_->memory.region_bytes[i] == 0) continue;
    v->backend_->share_region(r, backend_->region_memory(r), program_->memory.region_bytes[i]);
  }
  v->backend_->prepare(*v->program_);
  v->state_ = Lifecycle::COMPILED;
  v->owner_ = this;
  v->backend_->run(Schedule::init, 0);  // its own scalars only (CompileOptions::eval_only)
  v->backend_->synchronize();
  return v;
}

void Engine::stage(int slot, const InputView& in) {
  const int set =
      (in.f32 != nullptr) + (in.u8 != nullptr) + (in.encoded != nullptr) + (in.device != nullptr);
  KILN_CHECK(set == 1, InvalidArgument,
             "a batch needs exactly one of float images, uint8 images, an encoded batch or a "
             "device batch, got ",
             set);
  KILN_CHECK(in.augments == nullptr || in.u8 != nullptr, InvalidArgument,
             "InputView::augments goes with uint8 images (encoded batches carry their own)");
  if (in.device) {
    const DeviceBatch& d = *in.device;
    KILN_CHECK(d.images != nullptr && d.labels != nullptr, InvalidArgument,
               "a device batch needs its images and labels");
    KILN_CHECK(d.dtype != DType::U8 || in.norm != nullptr, InvalidArgument,
               "a uint8 device batch needs its normalisation (InputView::norm)");
    backend_->stage_batch_device(slot, d, in.norm);
    return;
  }
  KILN_CHECK(in.encoded != nullptr || in.labels != nullptr, InvalidArgument,
             "a batch needs its labels");
  KILN_CHECK(in.f32 != nullptr || in.norm != nullptr, InvalidArgument,
             "uint8 and encoded batches need their normalisation (InputView::norm)");
  if (in.f32) {
    backend_->stage_batch(slot, in.f32, in.labels);
  } else if (in.u8) {
    backend_->stage_batch_u8(slot, in.u8, in.labels, *in.norm, in.augments);
  } else {
    KILN_CHECK(in.encoded->batch == program_->options.batch, InvalidArgument,
               "an encoded batch of ", in.encoded->batch, " for a step compiled for ",
               program_->options.batch);
    backend_->stage_batch_encoded(slot, *in.encoded, *in.norm);
  }
}

void Engine::enqueue_step(const InputView* input, float lr) {
  const Program& p = *program_;
  KILN_CHECK(!p.options.eval_only, State, "engine of '", blueprint_.name,
             "' was compiled for evaluation only (an evaluation variant); train its owner");
  if (input) {
    stage(slot_, *input);
    staged_[slot_] = true;
  }
  backend_->write(p.tensor(p.io.lr), &lr);
  const int32_t step = static_cast<int32_t>(steps_);
  backend_->write(p.tensor(p.io.step), &step);
  if (p.io.mix != kNoTensor) {
    const std::array<float, kMixParams> mix = mix_params(mix_);
    backend_->write(p.tensor(p.io.mix), mix.data());
    mix_ = MixDraw{};
  }
  backend_->run(Schedule::train, slot_);
  slot_ ^= 1;
  ++steps_;
}

void Engine::set_mix(const MixDraw& draw) {
  require(Lifecycle::COMPILED, "set_mix()");
  KILN_CHECK(!program_->options.eval_only, State,
             "set_mix: an evaluation-only engine trains nothing; set the mix on its owner");
  KILN_CHECK(program_->io.mix != kNoTensor || draw.kind == MixKind::none, InvalidArgument,
             "set_mix: the step was compiled without mixup / cutmix (CompileOptions::mix)");
  const DTensor& in = program_->tensor(program_->io.staged_images[0]);
  const int64_t h = in.shape[1], w = in.shape[2];
  KILN_CHECK(draw.lambda >= 0 && draw.lambda <= 1 && draw.y0 >= 0 && draw.y0 <= draw.y1 &&
                 draw.y1 <= h && draw.x0 >= 0 && draw.x0 <= draw.x1 && draw.x1 <= w,
             InvalidArgument, "set_mix: lambda ", draw.lambda, " and the box rows [", draw.y0, ", ",
             draw.y1, ") columns [", draw.x0, ", ", draw.x1, ") must be in [0, 1] and inside the ",
             h, "x", w, " input");
  mix_ = draw;
}

std::optional<StepStats> Engine::train_step_async(const float* images, const int32_t* labels,
                                                  float lr) {
  KILN_CHECK(images != nullptr && labels != nullptr, InvalidArgument,
             "train_step_async: images and labels are needed");
  InputView in;
  in.f32 = images;
  in.labels = labels;
  return train_step_async(in, lr);
}

std::optional<StepStats> Engine::train_step_async(const InputView& input, float lr) {
  require(Lifecycle::COMPILED, "train_step_async()");
  const dist::Watch watch("a training step");  // a rank gone mid-step must not hang this one
  KILN_CHECK(
      !input.device || input.device->count == 0 || input.device->count == program_->options.batch,
      InvalidArgument, "train_step: the step was compiled for a batch of ", program_->options.batch,
      ", got ", input.device ? input.device->count : 0, " samples on the device");
  enqueue_step(&input, lr);
  std::optional<StepStats> before = pending_stats();
  pending_ = read_stats_later();
  return before;
}

Engine::StatTickets Engine::read_stats_later() {
  const Program& p = *program_;
  return StatTickets{backend_->read_later(p.tensor(p.io.loss)),
                     backend_->read_later(p.tensor(p.io.correct)),
                     backend_->read_later(p.tensor(p.io.overflow)),
                     backend_->read_later(p.tensor(p.io.loss_scale))};
}

Engine::StatTickets Engine::train_step_deferred(const InputView& input, float lr) {
  require(Lifecycle::COMPILED, "train_step_deferred()");
  const dist::Watch watch("a training step");
  KILN_CHECK(
      !input.device || input.device->count == 0 || input.device->count == program_->options.batch,
      InvalidArgument, "train_step: the step was compiled for a batch of ", program_->options.batch,
      ", got ", input.device ? input.device->count : 0, " samples on the device");
  pending_stats();  // an async step's statistics are not handed over past this one
  enqueue_step(&input, lr);
  return read_stats_later();
}

std::optional<StepStats> Engine::pending_stats() {
  if (!pending_) return std::nullopt;
  const StatTickets t = *pending_;
  pending_.reset();
  return collect_stats(t);
}

StepStats Engine::collect_stats(const StatTickets& t) {
  StepStats s;
  backend_->collect(t.loss, &s.loss);
  int32_t correct[2];
  backend_->collect(t.correct, correct);
  s.top1 = correct[0];
  s.top5 = correct[1];
  int32_t overflow = 0;
  backend_->collect(t.overflow, &overflow);
  s.overflow = overflow != 0;
  backend_->collect(t.loss_scale, &s.loss_scale);
  return s;
}

StepStats Engine::train_step(const float* images, const int32_t* labels, float lr,
                             bool read_stats) {
  require(Lifecycle::COMPILED, "train_step()");
  KILN_CHECK(
      images != nullptr && labels != nullptr, InvalidArgument,
      "train_step: images and labels are needed (train_step_on_staged reuses a staged batch)");
  const dist::Watch watch("a training step");  // a rank gone mid-step must not hang this one
  pending_stats();  // an async step's statistics are not handed over past a synchronous step
  InputView in;
  in.f32 = images;
  in.labels = labels;
  enqueue_step(&in, lr);
  return read_stats ? read_step_stats() : StepStats{};
}

StepStats Engine::train_step_on_staged(float lr, bool read_stats) {
  require(Lifecycle::COMPILED, "train_step_on_staged()");
  KILN_CHECK(staged_[slot_], State, "train_step_on_staged: input slot ", slot_ == 0 ? "A" : "B",
             " holds no training batch; train_step() stages one (two steps fill both slots)");
  const dist::Watch watch("a training step");
  pending_stats();
  enqueue_step(nullptr, lr);
  return read_stats ? read_step_stats() : StepStats{};
}

StepStats Engine::read_step_stats() {
  const Program& p = *program_;
  StepStats s;
  backend_->read(p.tensor(p.io.loss), &s.loss);
  int32_t correct[2];
  backend_->read(p.tensor(p.io.correct), correct);
  s.top1 = correct[0];
  s.top5 = correct[1];
  int32_t overflow = 0;
  backend_->read(p.tensor(p.io.overflow), &overflow);
  s.overflow = overflow != 0;
  backend_->read(p.tensor(p.io.loss_scale), &s.loss_scale);
  return s;
}

StepStats Engine::eval_batch(const float* images, const int32_t* labels, int64_t valid, bool ema) {
  InputView in;
  in.f32 = images;
  in.labels = labels;
  return eval_batch(in, valid, ema);
}

StepStats Engine::eval_batch(const InputView& input, int64_t valid, bool ema) {
  require(Lifecycle::COMPILED, "eval_batch()");
  const Program& p = *program_;
  KILN_CHECK(!ema || !p.eval_ema.empty(), InvalidArgument, "EMA evaluation needs EMA on (--ema)");
  const int64_t n = p.options.batch;
  KILN_CHECK(valid > 0 && valid <= n, InvalidArgument, "eval_batch: ", valid,
             " valid samples for batch ", n);
  InputView in = input;
  DeviceBatch part;
  if (in.device) {
    // The backend pads a device batch where it lands (the bytes stay on the device).
    KILN_CHECK(in.device->count == 0 || in.device->count == valid, InvalidArgument,
               "eval_batch: a device batch of ", in.device->count, " samples with ", valid,
               " valid");
    part = *in.device;
    part.count = valid;
    in.device = &part;
  } else if (valid < n && !in.encoded) {
    // A last partial batch: pad with zeros and label -1, which the loss ignores. (An encoded
    // batch carries its padding: labels -1 past its size.)
    const int64_t per = p.tensor(p.io.staged_images[0]).numel() / n;
    pad_labels_.assign(static_cast<size_t>(n), -1);
    KILN_CHECK(in.labels != nullptr, InvalidArgument, "a batch needs its labels");
    std::memcpy(pad_labels_.data(), in.labels, static_cast<size_t>(valid) * sizeof(int32_t));
    in.labels = pad_labels_.data();
    if (in.f32) {
      pad_images_.assign(static_cast<size_t>(n * per), 0.0f);
      std::memcpy(pad_images_.data(), in.f32, static_cast<size_t>(valid * per) * sizeof(float));
      in.f32 = pad_images_.data();
    } else if (in.u8) {
      pad_u8_.assign(static_cast<size_t>(n * per), 0);
      std::memcpy(pad_u8_.data(), in.u8, static_cast<size_t>(valid * per));
      in.u8 = pad_u8_.data();
    }
  }
  // Evaluation always reads slot A; a training step staged there has already run. A variant
  // reads its owner's weights: the owner's queued steps (their updates, the EMA) finish first.
  if (owner_) owner_->backend_->synchronize();
  backend_->synchronize();
  stage(0, in);
  staged_[0] = false;  // slot A now holds an evaluation batch
  backend_->run(ema ? Schedule::eval_ema : Schedule::eval, 0);
  StepStats s;
  backend_->read(p.tensor(p.io.loss), &s.loss);
  int32_t correct[2];
  backend_->read(p.tensor(p.io.correct), correct);
  s.top1 = correct[0];
  s.top5 = correct[1];
  return s;
}

// A buffer's live tensor, or its EMA for the EMA regions (ema_f32 names the EMA model).
TensorId Engine::buffer_tensor(const BufferDesc& b, Region region) const {
  if (region != Region::ema_f32 && region != Region::ema_bn_running) return b.tensor;
  KILN_CHECK(b.ema != kNoTensor, InvalidArgument, "buffer '", b.name,
             "' has no EMA copy: the engine was compiled without EMA (--ema / ema=True)");
  return b.ema;
}

std::vector<float> Engine::read_param(const std::string& name, Region region) {
  require(Lifecycle::COMPILED, "read_param()");
  const Program& p = *program_;
  if (const ParamDesc* d = p.find_param(name)) {
    const TensorId id = d->tensor[static_cast<size_t>(region)];
    KILN_CHECK(id != kNoTensor, InvalidArgument, "parameter '", name, "' has no tensor in region ",
               region_name(region));
    return read_floats(*backend_, p.tensor(id));
  }
  for (const BufferDesc& b : p.buffers) {
    if (b.name == name) return read_floats(*backend_, p.tensor(buffer_tensor(b, region)));
  }
  KILN_FAIL(InvalidArgument, "model '", p.model, "' has no parameter or buffer named '", name, "'");
}

void Engine::write_param(const std::string& name, const std::vector<float>& values, Region region) {
  require(Lifecycle::COMPILED, "write_param()");
  KILN_CHECK(owner_ == nullptr, State, "write_param('", name,
             "'): an evaluation variant shares its training engine's weights; write them there");
  const Program& p = *program_;
  if (const ParamDesc* d = p.find_param(name)) {
    const TensorId id = d->tensor[static_cast<size_t>(region)];
    KILN_CHECK(id != kNoTensor, InvalidArgument, "parameter '", name, "' has no tensor in region ",
               region_name(region));
    write_floats(*backend_, p.tensor(id), values);
    return;
  }
  for (const BufferDesc& b : p.buffers) {
    if (b.name == name) {
      write_floats(*backend_, p.tensor(buffer_tensor(b, region)), values);
      return;
    }
  }
  KILN_FAIL(InvalidArgument, "model '", p.model, "' has no parameter or buffer named '", name, "'");
}

void Engine::refresh_derived_weights() {
  require(Lifecycle::COMPILED, "refresh_derived_weights()");
  backend_->run(Schedule::init, 0);
  backend_->synchronize();
}

void init_weights(Engine& engine, uint64_t seed) {
  const Program& p = engine.program();
  const bool vgg = engine.blueprint().name.rfind("vgg", 0) == 0;
  Rng rng(seed);
  for (const ParamDesc& d : p.params) {
    std::vector<float> v(static_cast<size_t>(d.shape.numel()));
    switch (d.kind) {
      case ParamKind::ConvWeight: {
        const double fan_out = static_cast<double>(d.shape[0]) * d.shape[1] * d.shape[2];
        const double std = std::sqrt(2.0 / fan_out);
        for (float& x : v) x = static_cast<float>(rng.normal() * std);
        break;
      }
      case ParamKind::FcWeight: {
        const double bound = 1.0 / std::sqrt(static_cast<double>(d.shape[1]));
        for (float& x : v)
          x = vgg ? static_cast<float>(rng.normal() * 0.01) : rng.uniform(-bound, bound);
        break;
      }
      case ParamKind::BnWeight:
        for (float& x : v) x = 1.0f;
        break;
      case ParamKind::BnBias:
        break;
      case ParamKind::Bias: {
        // nn.Linear's bias: uniform ±1/sqrt(fan_in); conv biases (VGG) and VGG's fc: zero.
        const ParamDesc* w = p.find_param(d.name.substr(0, d.name.size() - 4) + "weight");
        if (w && w->kind == ParamKind::FcWeight && !vgg) {
          const double bound = 1.0 / std::sqrt(static_cast<double>(w->shape[1]));
          for (float& x : v) x = rng.uniform(-bound, bound);
        }
        break;
      }
    }
    engine.write_param(d.name, v);
  }
  for (const BufferDesc& b : p.buffers) {
    const int64_t n = p.tensor(b.tensor).numel();
    const bool var = b.name.size() >= 3 && b.name.compare(b.name.size() - 3, 3, "var") == 0;
    engine.write_param(b.name, std::vector<float>(static_cast<size_t>(n), var ? 1.0f : 0.0f));
  }
  engine.refresh_derived_weights();
}

}  // namespace kiln
