#include "kiln/task/checkpoint.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "kiln/core/error.h"
#include "kiln/core/log.h"

namespace kiln {

namespace {

constexpr const char* kFormat = "kiln-checkpoint-1";

StTensor f32_tensor(const std::vector<int64_t>& shape, const std::vector<float>& v) {
  StTensor t;
  t.dtype = DType::F32;
  t.shape = shape;
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

template <typename T>
StTensor scalar_tensor(DType dtype, T value) {
  StTensor t;
  t.dtype = dtype;
  t.shape = {};
  t.data.resize(sizeof(T));
  std::memcpy(t.data.data(), &value, sizeof(T));
  return t;
}

std::vector<float> as_floats(const StTensor& t, const std::string& name, const std::string& file) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  if (t.dtype == DType::F32) {
    std::memcpy(v.data(), t.data.data(), v.size() * 4);
  } else if (t.dtype == DType::F16 || t.dtype == DType::BF16) {
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, t.data.data() + 2 * i, 2);
      v[i] = t.dtype == DType::F16 ? half_to_float(h) : bf16_to_float(h);
    }
  } else {
    KILN_FAIL(Checkpoint, "'", file, "': tensor '", name, "' is ", dtype_name(t.dtype),
              "; expected F32, F16 or BF16");
  }
  return v;
}

const StTensor& need(const StFile& f, const std::string& name, const std::vector<int64_t>& shape,
                     const std::string& file) {
  auto it = f.tensors.find(name);
  KILN_CHECK(it != f.tensors.end(), Checkpoint, "'", file, "': tensor '", name,
             "' is missing; the file was not made for this model (or is damaged)");
  KILN_CHECK(it->second.shape == shape, Checkpoint, "'", file, "': tensor '", name, "' has shape ",
             Shape(it->second.shape).str(), " but the model needs ", Shape(shape).str());
  return it->second;
}

std::string meta(const StFile& f, const std::string& key, const std::string& file) {
  auto it = f.metadata.find(key);
  KILN_CHECK(it != f.metadata.end(), Checkpoint, "'", file, "': metadata '", key,
             "' is missing; not a kiln checkpoint");
  return it->second;
}

int64_t meta_int(const StFile& f, const std::string& key, const std::string& file) {
  const std::string s = meta(f, key, file);
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    KILN_CHECK(used == s.size(), Checkpoint, "'", file, "': metadata '", key, "' = '", s,
               "' is not an integer");
    return v;
  } catch (const std::logic_error&) {
    KILN_FAIL(Checkpoint, "'", file, "': metadata '", key, "' = '", s, "' is not an integer");
  }
}

int64_t meta_int_or(const StFile& f, const std::string& key, int64_t fallback,
                    const std::string& file) {
  return f.metadata.count(key) ? meta_int(f, key, file) : fallback;  // older checkpoints lack it
}

std::string bn_of(const std::string& buffer) {
  return buffer.substr(0, buffer.rfind('.'));
}

// An EMA weight and its FP16 copy: the host's round-to-nearest-even cast equals the device's.
void write_ema_weight(Engine& engine, const ParamDesc& d, const std::vector<float>& v) {
  engine.write_param(d.name, v, Region::ema_f32);
  if (d.compute_copy && d.tensor[static_cast<size_t>(Region::ema_f16)] != kNoTensor) {
    engine.write_param(d.name, v, Region::ema_f16);
  }
}

}  // namespace

namespace {

// kiln's layout (KRSC weights; an fc weight's input read as HWC) and torch's (KCRS; CHW), one
// index map for both directions: `to_torch` moves element kiln[i] to torch[j], else torch[j]
// back to kiln[i].
std::vector<float> relayout(const ParamDesc& p, const std::vector<float>& v, bool to_torch) {
  std::vector<float> out(v.size());
  auto move = [&](int64_t kiln_at, int64_t torch_at) {
    const auto k = static_cast<size_t>(kiln_at), t = static_cast<size_t>(torch_at);
    if (to_torch) {
      out[t] = v[k];
    } else {
      out[k] = v[t];
    }
  };
  if (p.kind == ParamKind::ConvWeight) {
    const int64_t K = p.shape[0], R = p.shape[1], S = p.shape[2], C = p.shape[3];
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t c = 0; c < C; ++c)
            move(((k * R + r) * S + s) * C + c, ((k * C + c) * R + r) * S + s);
    return out;
  }
  if (p.kind == ParamKind::FcWeight && p.fc_input_chw[0] > 0) {
    const int64_t O = p.shape[0], C = p.fc_input_chw[0], H = p.fc_input_chw[1],
                  W = p.fc_input_chw[2];
    for (int64_t o = 0; o < O; ++o)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w)
          for (int64_t c = 0; c < C; ++c)
            move(o * C * H * W + (h * W + w) * C + c, o * C * H * W + (c * H + h) * W + w);
    return out;
  }
  return v;
}

}  // namespace

std::vector<float> to_torch_layout(const ParamDesc& p, const std::vector<float>& v) {
  return relayout(p, v, /*to_torch=*/true);
}

std::vector<float> from_torch_layout(const ParamDesc& p, const std::vector<float>& v) {
  return relayout(p, v, /*to_torch=*/false);
}

StFile export_state_dict(Engine& engine, bool ema) {
  const Program& p = engine.program();
  KILN_CHECK(!ema || p.options.ema, InvalidArgument, "model '", p.model,
             "' has no EMA weights: it was trained (or is loaded) without --ema");
  const Region weights = ema ? Region::ema_f32 : Region::params_f32;
  const Region buffers = ema ? Region::ema_bn_running : Region::bn_running;
  StFile f;
  for (const ParamDesc& d : p.params) {
    f.tensors[d.name] =
        f32_tensor(d.torch_shape.dims, to_torch_layout(d, engine.read_param(d.name, weights)));
  }
  std::set<std::string> bns;
  for (const BufferDesc& b : p.buffers) {
    f.tensors[b.name] =
        f32_tensor(p.tensor(b.tensor).shape.dims, engine.read_param(b.name, buffers));
    bns.insert(bn_of(b.name));
  }
  // An integer: the EMA model's is the live one's, as timm's ModelEmaV3 copies it.
  for (const std::string& bn : bns) {
    f.tensors[bn + ".num_batches_tracked"] =
        scalar_tensor<int64_t>(DType::I64, engine.steps_done());
  }
  f.metadata["format"] = "pt";
  f.metadata["model"] = p.model;
  return f;
}

void export_weights(Engine& engine, const std::string& path, bool ema) {
  write_safetensors(path, export_state_dict(engine, ema));
}

void import_weights(Engine& engine, const std::string& path) {
  import_state_dict(engine, read_safetensors(path), path);
}

void import_state_dict(Engine& engine, const StFile& f, const std::string& path) {
  const Program& p = engine.program();
  for (const ParamDesc& d : p.params) {
    const StTensor& t = need(f, d.name, d.torch_shape.dims, path);
    engine.write_param(d.name, from_torch_layout(d, as_floats(t, d.name, path)));
  }
  for (const BufferDesc& b : p.buffers) {
    const StTensor& t = need(f, b.name, p.tensor(b.tensor).shape.dims, path);
    engine.write_param(b.name, as_floats(t, b.name, path));
  }
  engine.refresh_derived_weights();
}

void import_ema_state_dict(Engine& engine, const StFile& f, const std::string& path) {
  const Program& p = engine.program();
  KILN_CHECK(p.options.ema, InvalidArgument, "'", path, "': EMA weights given, but model '",
             p.model, "' was compiled without EMA; compile it with --ema (ema=True)");
  for (const ParamDesc& d : p.params) {
    const StTensor& t = need(f, d.name, d.torch_shape.dims, path);
    write_ema_weight(engine, d, from_torch_layout(d, as_floats(t, d.name, path)));
  }
  for (const BufferDesc& b : p.buffers) {
    const StTensor& t = need(f, b.name, p.tensor(b.tensor).shape.dims, path);
    engine.write_param(b.name, as_floats(t, b.name, path), Region::ema_bn_running);
  }
}

StFile ema_state_of_checkpoint(const Program& p, const StFile& f, const std::string& path) {
  KILN_CHECK(f.tensors.count("ema." + p.params.front().name), Checkpoint, "'", path,
             "' has no EMA weights (ema.* tensors): the run was trained without --ema, or the file "
             "is exported weights (evaluate those without --ema)");
  StFile out;
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("ema.", 0) == 0) out.tensors[name.substr(4)] = t;
  }
  bool warned = false;
  for (const BufferDesc& b : p.buffers) {
    if (out.tensors.count(b.name)) continue;
    // A checkpoint from before the EMA kept BatchNorm statistics of its own: the live ones,
    // which is what its EMA was evaluated with during training.
    auto live = f.tensors.find(b.name);
    KILN_CHECK(live != f.tensors.end(), Checkpoint, "'", path, "': tensor '", b.name,
               "' is missing");
    out.tensors[b.name] = live->second;
    if (!warned) {
      log_warn("'", path,
               "' has EMA weights but no EMA BatchNorm statistics (an older "
               "checkpoint): the EMA model uses the live model's statistics");
      warned = true;
    }
  }
  return out;
}

void save_checkpoint(Engine& engine, const std::string& path, const TrainState& state) {
  const Program& p = engine.program();
  StFile f = export_state_dict(engine);
  for (Region r : {Region::moment1, Region::moment2, Region::ema_f32}) {
    for (const ParamDesc& d : p.params) {
      if (d.tensor[static_cast<size_t>(r)] == kNoTensor) continue;
      const std::string prefix =
          r == Region::ema_f32 ? "ema." : std::string("optimizer.") + region_name(r) + ".";
      f.tensors[prefix + d.name] =
          f32_tensor(d.torch_shape.dims, to_torch_layout(d, engine.read_param(d.name, r)));
    }
  }
  if (p.options.ema) {  // the EMA model's BatchNorm statistics, beside its weights
    for (const BufferDesc& b : p.buffers) {
      f.tensors["ema." + b.name] = f32_tensor(p.tensor(b.tensor).shape.dims,
                                              engine.read_param(b.name, Region::ema_bn_running));
    }
  }
  float scale = 1;
  int32_t good = 0;
  engine.backend().read(p.tensor(p.io.loss_scale), &scale);
  engine.backend().read(p.tensor(p.io.good_steps), &good);
  f.tensors["kiln.loss_scale"] = scalar_tensor<float>(DType::F32, scale);
  f.tensors["kiln.good_steps"] = scalar_tensor<int32_t>(DType::I32, good);
  if (p.options.optimizer == "adamw") {  // AdamW's t (the only reader of the count)
    int32_t applied = 0;
    engine.backend().read(p.tensor(p.io.optimizer_steps), &applied);
    f.tensors["kiln.optimizer_steps"] = scalar_tensor<int32_t>(DType::I32, applied);
  }
  f.metadata["format"] = kFormat;
  f.metadata["model"] = p.model;
  f.metadata["optimizer"] = p.options.optimizer;
  f.metadata["amp"] = p.options.amp ? "1" : "0";
  f.metadata["ema"] = p.options.ema ? "1" : "0";
  f.metadata["epoch"] = std::to_string(state.epoch);
  f.metadata["step"] = std::to_string(state.step);
  f.metadata["seed"] = std::to_string(state.seed);
  f.metadata["best_top1"] = std::to_string(state.best_top1);
  f.metadata["config"] = state.config;
  f.metadata["step_in_epoch"] = std::to_string(state.step_in_epoch);
  f.metadata["stale_epochs"] = std::to_string(state.stale_epochs);
  char hex[64];
  std::snprintf(hex, sizeof(hex), "%a", state.sums.loss_sum);
  f.metadata["epoch_loss_sum"] = hex;
  f.metadata["epoch_loss_count"] = std::to_string(state.sums.loss_count);
  f.metadata["epoch_seen"] = std::to_string(state.sums.seen);
  f.metadata["epoch_hits"] = std::to_string(state.sums.hits);
  f.metadata["epoch_overflows"] = std::to_string(state.sums.overflows);
  if (!state.row_csv.empty()) f.metadata["metrics_row_csv"] = state.row_csv;
  if (!state.row_jsonl.empty()) f.metadata["metrics_row_jsonl"] = state.row_jsonl;
  write_safetensors(path, f);
}

TrainState load_checkpoint(Engine& engine, const std::string& path) {
  const StFile f = read_safetensors(path);
  const Program& p = engine.program();
  KILN_CHECK(meta(f, "format", path) == kFormat, Checkpoint, "'", path, "': format '",
             meta(f, "format", path), "' is not ", kFormat,
             "; to start from plain weights use --init-from");
  KILN_CHECK(meta(f, "model", path) == p.model, Checkpoint, "'", path, "': made for model '",
             meta(f, "model", path), "', not '", p.model, "'; pass --model ",
             meta(f, "model", path));
  KILN_CHECK(meta(f, "optimizer", path) == p.options.optimizer, Checkpoint, "'", path,
             "': made with optimizer '", meta(f, "optimizer", path), "'; resume with --opt ",
             meta(f, "optimizer", path));
  import_weights(engine, path);  // parameters and running statistics
  for (Region r : {Region::moment1, Region::moment2, Region::ema_f32}) {
    for (const ParamDesc& d : p.params) {
      if (d.tensor[static_cast<size_t>(r)] == kNoTensor) continue;
      const std::string name =
          (r == Region::ema_f32 ? "ema." : std::string("optimizer.") + region_name(r) + ".") +
          d.name;
      if (r == Region::ema_f32 && !f.tensors.count(name))
        continue;  // EMA switched on at resume: starts at the weights
      const StTensor& t = need(f, name, d.torch_shape.dims, path);
      const std::vector<float> v = from_torch_layout(d, as_floats(t, name, path));
      if (r == Region::ema_f32) {
        write_ema_weight(engine, d, v);
      } else {
        engine.write_param(d.name, v, r);
      }
    }
  }
  // The EMA's BatchNorm statistics. A checkpoint made before they were kept has EMA weights
  // without them: the EMA statistics then start at the checkpoint's live ones (the init phase
  // copied them), which they approach anyway, rather than refusing the file.
  if (p.options.ema) {
    size_t missing = 0;
    for (const BufferDesc& b : p.buffers) {
      const std::string name = "ema." + b.name;
      if (!f.tensors.count(name)) {
        ++missing;
        continue;
      }
      const StTensor& t = need(f, name, p.tensor(b.tensor).shape.dims, path);
      engine.write_param(b.name, as_floats(t, name, path), Region::ema_bn_running);
    }
    if (missing > 0 && missing < p.buffers.size()) {
      KILN_FAIL(Checkpoint, "'", path, "': ", missing, " of ", p.buffers.size(),
                " EMA BatchNorm buffers (ema.*.running_mean/var) are missing; the file is damaged");
    }
    if (missing > 0 && f.tensors.count("ema." + p.params.front().name)) {
      log_warn("'", path,
               "' has EMA weights but no EMA BatchNorm statistics (an older checkpoint): "
               "the EMA model's statistics start from the live model's");
    }
  }
  const StTensor& scale = need(f, "kiln.loss_scale", {}, path);
  const StTensor& good = need(f, "kiln.good_steps", {}, path);
  KILN_CHECK(scale.dtype == DType::F32 && good.dtype == DType::I32, Checkpoint, "'", path, "'",
             ": loss-scale state has the wrong dtype");
  engine.backend().write(p.tensor(p.io.loss_scale), scale.data.data());
  engine.backend().write(p.tensor(p.io.good_steps), good.data.data());
  TrainState s;
  s.epoch = meta_int(f, "epoch", path);
  s.step = meta_int(f, "step", path);
  s.seed = static_cast<uint64_t>(meta_int(f, "seed", path));
  s.best_top1 = std::atof(meta(f, "best_top1", path).c_str());
  s.config = meta(f, "config", path);
  s.step_in_epoch = meta_int_or(f, "step_in_epoch", 0, path);
  s.stale_epochs = meta_int_or(f, "stale_epochs", 0, path);
  if (f.metadata.count("epoch_loss_sum")) {
    const std::string& v = f.metadata.at("epoch_loss_sum");
    char* end = nullptr;
    s.sums.loss_sum = std::strtod(v.c_str(), &end);
    KILN_CHECK(!v.empty() && end && *end == '\0', Checkpoint, "'", path,
               "': metadata 'epoch_loss_sum' = '", v, "' is not a number");
  }
  s.sums.loss_count = meta_int_or(f, "epoch_loss_count", 0, path);
  s.sums.seen = meta_int_or(f, "epoch_seen", 0, path);
  s.sums.hits = meta_int_or(f, "epoch_hits", 0, path);
  s.sums.overflows = meta_int_or(f, "epoch_overflows", 0, path);
  if (f.metadata.count("metrics_row_csv")) s.row_csv = f.metadata.at("metrics_row_csv");
  if (f.metadata.count("metrics_row_jsonl")) s.row_jsonl = f.metadata.at("metrics_row_jsonl");
  KILN_CHECK(s.epoch >= 0 && s.step >= 0 && s.step_in_epoch >= 0, Checkpoint, "'", path, "'",
             ": negative epoch or step in the metadata");
  // AdamW's t: older checkpoints lack it, and their runs counted every step.
  int32_t applied = static_cast<int32_t>(s.step);
  if (f.tensors.count("kiln.optimizer_steps")) {
    const StTensor& t = need(f, "kiln.optimizer_steps", {}, path);
    KILN_CHECK(t.dtype == DType::I32, Checkpoint, "'", path,
               "': kiln.optimizer_steps has the wrong dtype");
    std::memcpy(&applied, t.data.data(), sizeof(applied));
    KILN_CHECK(applied >= 0 && applied <= s.step, Checkpoint, "'", path, "': kiln.optimizer_steps ",
               applied, " is outside [0, step ", s.step, "]");
  }
  engine.backend().write(p.tensor(p.io.optimizer_steps), &applied);
  engine.set_steps_done(s.step);
  return s;
}

}  // namespace kiln
