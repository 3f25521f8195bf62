// kiln.Engine: a compiled training step driven from Python. Batches come as NumPy arrays or
// anything with __dlpack__ (torch tensors): NHWC, or NCHW whose memory is NHWC (channels_last),
// float32, or uint8 normalised with the engine's mean/std. A CUDA tensor is copied device to
// device into the step's input (Backend::stage_batch_device) after the stream its producer wrote
// it on. The GIL is released while a step runs.
#include "kiln/task/engine.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>

#include "bind.h"
#include "kiln/core/error.h"
#include "kiln/data/input_batch.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/plan/arch_plan.h"
#include "kiln/task/checkpoint.h"

namespace kiln::py {

using namespace nb::literals;
using Array = nb::ndarray<nb::ro>;

namespace {

// What a step returns; top1/top5 are fractions of the batch's labelled samples.
struct PyStats {
  double loss = 0, top1 = 0, top5 = 0;
  int64_t correct1 = 0, correct5 = 0, count = 0;
  bool overflowed = false;
  double loss_scale = 1;
};

class PyEngine;

// A step's statistics as Python holds them. A training step's stay on the device until first
// read, so that a Python loop runs ahead of the GPU (Engine::train_step_deferred); the engine
// settles every unread cell before the device could reuse its slots, and when it goes.
struct StatsCell {
  std::optional<PyStats> values;
  Engine::StatTickets tickets{};
  int64_t count = 0;
  PyEngine* owner = nullptr;
};

struct PyStepStats {
  std::shared_ptr<StatsCell> cell;
  const PyStats& get() const;
};

PyStats to_py(const StepStats& s, int64_t count) {
  PyStats p;
  p.loss = s.loss;
  p.correct1 = s.top1;
  p.correct5 = s.top5;
  p.count = count;
  p.top1 = count ? static_cast<double>(s.top1) / static_cast<double>(count) : 0;
  p.top5 = count ? static_cast<double>(s.top5) / static_cast<double>(count) : 0;
  p.overflowed = s.overflow;
  p.loss_scale = s.loss_scale;
  return p;
}

std::string dims_str(const Array& a, bool strides) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < a.ndim(); ++i)
    os << (i ? ", " : "") << (strides ? a.stride(i) : static_cast<int64_t>(a.shape(i)));
  os << "]";
  return os.str();
}

std::string dtype_str(const nb::dlpack::dtype& d) {
  const char* kind = d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)  ? "float"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)  ? "int"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) ? "uint"
                     : d.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bool) ? "bool"
                                                                                    : "other";
  return std::string(kind) + std::to_string(d.bits);
}

class PyEngine {
 public:
  PyEngine(const BluePrint& model, EngineOptions o, bool compile_now, uint64_t seed,
           std::vector<float> mean, std::vector<float> std_)
      : engine_(std::make_unique<Engine>(model, std::move(o))),
        h_(model.input.height),
        w_(model.input.width),
        c_(model.input.channels),
        classes_(model.num_classes) {
    norm_.mean = std::move(mean);
    norm_.std = std::move(std_);
    KILN_CHECK(norm_.mean.size() == norm_.std.size(), InvalidArgument, "mean has ",
               norm_.mean.size(), " values but std has ", norm_.std.size(),
               "; give one of each per channel (", c_, ")");
    KILN_CHECK(norm_.mean.empty() || norm_.mean.size() == static_cast<size_t>(c_), InvalidArgument,
               "mean/std need one value per input channel (", c_, "), got ", norm_.mean.size());
    if (compile_now) {
      engine_->lock_memory();
      engine_->compile(seed);
    }
  }

  ~PyEngine() {
    // Python holds the GIL here; the waits are for steps already queued.
    const std::lock_guard<std::mutex> one_step(step_mutex_);
    for (const std::shared_ptr<StatsCell>& c : pending_) {
      try {
        settle_locked(*c);
      } catch (...) {  // a device error after the last step: the statistics are lost
        c->values = PyStats{};
      }
    }
  }

  // The engine for anything but a step: the statistics still on the device are read first.
  Engine& engine() {
    settle_all();
    return *engine_;
  }
  const Engine& peek() const { return *engine_; }
  int64_t batch() const { return engine_->options().compile.batch; }

  PyStepStats train_step(nb::handle images_obj, nb::handle labels_obj, float lr) {
    Input images = import(images_obj, "train_step", "images"),
          labels = import(labels_obj, "train_step", "labels");
    Batch b = batch_of(images, labels, "train_step", false);
    InputView in = b.view(norm_);
    auto cell = std::make_shared<StatsCell>();
    cell->count = b.count;
    cell->owner = this;
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> one_step(step_mutex_);
      // An unread step older than the device keeps slots for is read now.
      while (!pending_.empty() &&
             (pending_.front()->values ||
              static_cast<int64_t>(pending_.size()) >= Engine::kDeferredSteps)) {
        settle_locked(*pending_.front());
        pending_.pop_front();
      }
      cell->tickets = engine_->train_step_deferred(in, lr);
      pending_.push_back(cell);
    }
    return PyStepStats{std::move(cell)};
  }

  PyStepStats eval_step(nb::handle images_obj, nb::handle labels_obj, bool ema) {
    Input images = import(images_obj, "eval_step", "images"),
          labels = import(labels_obj, "eval_step", "labels");
    Batch b = batch_of(images, labels, "eval_step", true);
    InputView in = b.view(norm_);
    StepStats s;
    settle_all();
    {
      nb::gil_scoped_release unlocked;
      const std::lock_guard<std::mutex> one_step(step_mutex_);
      s = engine_->eval_batch(in, b.count, ema);
    }
    auto cell = std::make_shared<StatsCell>();
    cell->count = b.count;
    cell->values = to_py(s, b.count);
    return PyStepStats{std::move(cell)};
  }

  // Reads one training step's statistics (waits for that step alone).
  void settle(StatsCell& c) {
    if (c.values) return;
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> one_step(step_mutex_);
    settle_locked(c);
  }

 private:
  void settle_locked(StatsCell& c) {
    if (!c.values) c.values = to_py(engine_->collect_stats(c.tickets), c.count);
  }
  void settle_all() {
    nb::gil_scoped_release unlocked;
    const std::lock_guard<std::mutex> one_step(step_mutex_);
    for (const std::shared_ptr<StatsCell>& c : pending_) settle_locked(*c);
    pending_.clear();
  }

  // An input as DLPack sees it; `ordered`: its producer has ordered its pending writes before
  // kiln's staging stream.
  struct Input {
    Array a;
    bool ordered = false;
  };
  struct Batch {
    const float* f32 = nullptr;
    const uint8_t* u8 = nullptr;
    std::vector<int32_t> labels;
    int64_t count = 0;
    std::optional<DeviceBatch> device;  // images in CUDA memory
    InputView view(const InputNormalization& norm) {
      InputView v;
      v.f32 = f32;
      v.u8 = u8;
      v.labels = labels.data();
      v.norm = &norm;
      if (device) {
        if (!device->labels_on_device) device->labels = labels.data();
        v.device = &*device;
      }
      return v;
    }
  };

  static bool on_cuda(const Array& a) { return a.device_type() == nb::device::cuda::value; }

  // DLPack's stream protocol: a producer on the engine's GPU is handed kiln's staging stream
  // (__dlpack__(stream=)), on which it orders its pending writes (torch: after its current
  // stream) before it hands the capsule over; anything else is imported as it comes.
  Input import(nb::handle obj, const char* what, const char* which) {
    Input in;
    const DeviceStaging ds = engine_->backend().device_staging();
    if (ds.device >= 0 && ds.stream != 0 && nb::hasattr(obj, "__dlpack_device__") &&
        nb::hasattr(obj, "__dlpack__")) {
      const nb::tuple dev = nb::cast<nb::tuple>(obj.attr("__dlpack_device__")());
      if (dev.size() == 2 && nb::cast<int64_t>(nb::int_(dev[0])) == nb::device::cuda::value &&
          nb::cast<int64_t>(nb::int_(dev[1])) == ds.device) {
        const nb::object capsule = obj.attr("__dlpack__")("stream"_a = ds.stream);
        in.ordered = true;
        KILN_CHECK(nb::try_cast(capsule, in.a), InvalidArgument, what, ": ", which,
                   ".__dlpack__() gave no DLPack tensor nanobind can read");
        return in;
      }
    }
    KILN_CHECK(nb::try_cast(obj, in.a), InvalidArgument, what, ": ", which,
               " must be a NumPy array or have __dlpack__ (a torch tensor), got ",
               nb::type_name(obj.type()).c_str());
    return in;
  }

  // Checks a batch against the compiled step and names what was expected when it disagrees.
  Batch batch_of(const Input& image_in, const Input& label_in, const char* what, bool partial_ok) {
    const Array& images = image_in.a;
    const Array& labels = label_in.a;
    const int64_t n = batch();
    std::ostringstream want;
    want << "[" << n << ", " << h_ << ", " << w_ << ", " << c_ << "] (NHWC), or [" << n << ", "
         << c_ << ", " << h_ << ", " << w_ << "] in channels_last memory";
    const bool device = on_cuda(images);
    KILN_CHECK(device || images.device_type() == nb::device::cpu::value, InvalidArgument, what,
               ": images are in DLPack device type ", images.device_type(),
               " memory; kiln takes host (CPU) or CUDA memory: pass tensor.cpu()");
    const bool is_f32 = images.dtype() == nb::dtype<float>();
    const bool is_u8 = images.dtype() == nb::dtype<uint8_t>();
    KILN_CHECK(is_f32 || is_u8, InvalidArgument, what,
               ": images must be float32 (or uint8 with the engine's mean/std), got ",
               dtype_str(images.dtype()));
    KILN_CHECK(!is_u8 || !norm_.mean.empty(), InvalidArgument, what,
               ": uint8 images need the normalisation: kiln.Engine(..., mean=[...], std=[...]) "
               "(0..1 units, per channel)");
    KILN_CHECK(images.ndim() == 4, InvalidArgument, what, ": images must be ", want.str(),
               ", got shape ", dims_str(images, false));
    const int64_t count = static_cast<int64_t>(images.shape(0));
    KILN_CHECK(count == n || (partial_ok && count > 0 && count < n), InvalidArgument, what,
               ": the step was compiled for a batch of ", n, partial_ok ? " (or fewer)" : "",
               ", got ", count, " images (shape ", dims_str(images, false), ")");
    // Element strides of N, H, W, C in NHWC memory; a dimension of size 1 may have any stride.
    const int64_t nhwc[4] = {h_ * w_ * c_, w_ * c_, c_, 1};
    auto matches = [&](const int order[4]) {  // order: the array's axis holding N, H, W, C
      for (int k = 0; k < 4; ++k) {
        const int64_t size[4] = {count, h_, w_, c_};
        if (static_cast<int64_t>(images.shape(order[k])) != size[k]) return false;
        if (size[k] > 1 && images.stride(order[k]) != nhwc[k]) return false;
      }
      return true;
    };
    static const int kNHWC[4] = {0, 1, 2, 3}, kNCHW[4] = {0, 2, 3, 1};
    KILN_CHECK(matches(kNHWC) || matches(kNCHW), InvalidArgument, what, ": images must be ",
               want.str(), ", dense; got shape ", dims_str(images, false), " with element strides ",
               dims_str(images, true),
               " (np.ascontiguousarray, or tensor.contiguous(memory_format=torch.channels_last), "
               "makes a copy that fits)");
    Batch b;
    b.count = count;
    if (device) {
      b.device = device_batch(image_in, label_in, count, is_u8, what, b.labels);
      return b;
    }
    KILN_CHECK(
        !on_cuda(labels), InvalidArgument, what,
        ": the labels are in CUDA memory but the images on the host; pass both on one device");
    if (is_f32)
      b.f32 = static_cast<const float*>(images.data());
    else
      b.u8 = static_cast<const uint8_t*>(images.data());
    b.labels = labels_of(labels, count, what);
    return b;
  }

  // Images in CUDA memory, already checked for shape and strides; labels on the host (checked
  // and converted here into `host_labels`) or on the same GPU (converted on the device).
  DeviceBatch device_batch(const Input& images, const Input& labels, int64_t count, bool is_u8,
                           const char* what, std::vector<int32_t>& host_labels) const {
    DeviceBatch d;
    d.images = images.a.data();
    d.dtype = is_u8 ? DType::U8 : DType::F32;
    d.count = count;
    d.device = images.a.device_id();
    // Without the stream protocol (a raw capsule), the producer's stream is unknown: the
    // legacy default stream, as DLPack's consumer without a stream assumes.
    d.ordered = images.ordered && (labels.ordered || !on_cuda(labels.a));
    d.stream = 0;
    if (!on_cuda(labels.a)) {
      host_labels = labels_of(labels.a, count, what);  // Batch::view points d.labels at them
      return d;
    }
    const Array& l = labels.a;
    KILN_CHECK(l.device_id() == images.a.device_id(), InvalidArgument, what,
               ": the labels are on cuda:", l.device_id(),
               " but the images on cuda:", images.a.device_id(), "; pass both on one device");
    KILN_CHECK(l.ndim() == 1 && static_cast<int64_t>(l.shape(0)) == count, InvalidArgument, what,
               ": labels must be one-dimensional with one label per image (", count,
               "), got shape ", dims_str(l, false));
    KILN_CHECK(count == 1 || l.stride(0) == 1, InvalidArgument, what,
               ": labels in CUDA memory must be contiguous, got element stride ", l.stride(0),
               " (labels.contiguous())");
    const bool i32 = l.dtype() == nb::dtype<int32_t>(), i64 = l.dtype() == nb::dtype<int64_t>();
    KILN_CHECK(i32 || i64, InvalidArgument, what, ": labels must be int32 or int64, got ",
               dtype_str(l.dtype()));
    d.labels = l.data();
    d.label_dtype = i32 ? DType::I32 : DType::I64;
    d.labels_on_device = true;
    return d;
  }

  std::vector<int32_t> labels_of(const Array& labels, int64_t count, const char* what) const {
    KILN_CHECK(labels.device_type() == nb::device::cpu::value, InvalidArgument, what,
               ": labels are on a device; pass labels.cpu()");
    KILN_CHECK(labels.ndim() == 1 && static_cast<int64_t>(labels.shape(0)) == count,
               InvalidArgument, what, ": labels must be one-dimensional with one label per image (",
               count, "), got shape ", dims_str(labels, false));
    const bool i32 = labels.dtype() == nb::dtype<int32_t>(),
               i64 = labels.dtype() == nb::dtype<int64_t>();
    KILN_CHECK(i32 || i64, InvalidArgument, what, ": labels must be int32 or int64, got ",
               dtype_str(labels.dtype()));
    std::vector<int32_t> out(static_cast<size_t>(count));
    const int64_t step = labels.stride(0);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t v = i32 ? static_cast<const int32_t*>(labels.data())[i * step]
                            : static_cast<const int64_t*>(labels.data())[i * step];
      KILN_CHECK(v >= 0 && v < classes_, InvalidArgument, what, ": label ", v, " at index ", i,
                 " is outside 0..", classes_ - 1);
      out[static_cast<size_t>(i)] = static_cast<int32_t>(v);
    }
    return out;
  }

  std::unique_ptr<Engine> engine_;
  std::mutex step_mutex_;  // without the GIL, two Python threads could step one engine at once
  std::deque<std::shared_ptr<StatsCell>> pending_;  // training steps whose statistics are unread
  int64_t h_, w_, c_, classes_;
  InputNormalization norm_;
};

const PyStats& PyStepStats::get() const {
  if (!cell->values) cell->owner->settle(*cell);
  return *cell->values;
}

// A safetensors tensor as a NumPy array that owns its bytes.
nb::object to_numpy(StTensor&& t) {
  auto* bytes = new std::vector<uint8_t>(std::move(t.data));
  nb::capsule owner(bytes, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
  std::vector<size_t> shape(t.shape.begin(), t.shape.end());
  nb::dlpack::dtype dt = t.dtype == DType::I64   ? nb::dtype<int64_t>()
                         : t.dtype == DType::I32 ? nb::dtype<int32_t>()
                                                 : nb::dtype<float>();
  KILN_CHECK(t.dtype == DType::F32 || t.dtype == DType::I64 || t.dtype == DType::I32, Internal,
             "state_dict: unexpected dtype ", dtype_name(t.dtype));
  nb::ndarray<nb::numpy> a(bytes->data(), shape.size(), shape.data(), owner, nullptr, dt);
  return nb::cast(a);
}

nb::dict state_dict(PyEngine& e, bool ema) {
  StFile f = export_state_dict(e.engine(), ema);
  nb::dict out;
  for (auto& [name, t] : f.tensors) out[nb::str(name.c_str())] = to_numpy(std::move(t));
  return out;
}

// A float32 array in torchvision's layout of parameter d (kiln's layout `v`).
nb::object torch_array(const ParamDesc& d, const std::vector<float>& v) {
  StTensor t;
  t.dtype = DType::F32;
  t.shape = d.torch_shape.dims;
  const std::vector<float> out = to_torch_layout(d, v);
  t.data.resize(out.size() * sizeof(float));
  std::memcpy(t.data.data(), out.data(), t.data.size());
  return to_numpy(std::move(t));
}

// The optimizer's per-parameter state under PyTorch's names for it (python/kiln/__init__.py
// documents the dict): SGD and LARS keep momentum_buffer, AdamW exp_avg, exp_avg_sq and step.
struct Slot {
  const char* name;
  Region region;
};
std::vector<Slot> optimizer_slots(const Program& p) {
  std::vector<Slot> s;
  const bool adamw = p.options.optimizer == "adamw";
  if (!p.params.empty() &&
      p.params.front().tensor[static_cast<size_t>(Region::moment1)] != kNoTensor) {
    s.push_back({adamw ? "exp_avg" : "momentum_buffer", Region::moment1});
  }
  if (adamw) s.push_back({"exp_avg_sq", Region::moment2});
  return s;
}

int32_t applied_steps(Engine& e) {
  int32_t applied = 0;
  e.backend().read(e.program().tensor(e.program().io.optimizer_steps), &applied);
  return applied;
}

nb::dict optimizer_state_dict(PyEngine& e) {
  Engine& en = e.engine();
  const Program& p = en.program();
  const bool adamw = p.options.optimizer == "adamw";
  const int32_t applied = adamw ? applied_steps(en) : 0;
  nb::dict state;
  for (const ParamDesc& d : p.params) {
    nb::dict s;
    for (const Slot& slot : optimizer_slots(p))
      s[slot.name] = torch_array(d, en.read_param(d.name, slot.region));
    if (adamw) s["step"] = applied;
    if (nb::len(s) > 0) state[nb::str(d.name.c_str())] = s;
  }
  nb::dict out;
  out["optimizer"] = p.options.optimizer;
  out["step"] = en.steps_done();
  out["state"] = state;
  return out;
}

std::string quoted(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "'" : ", '") + n + "'";
  return s;
}

// Every name and shape is checked before anything is written: a refused dict changes nothing.
void load_optimizer_state_dict(PyEngine& e, nb::dict sd, bool strict) {
  Engine& en = e.engine();
  const Program& p = en.program();
  const std::string what = "load_optimizer_state_dict";
  std::vector<std::string> unexpected;
  for (auto [k, v] : sd) {
    const std::string key = nb::cast<std::string>(k);
    if (key != "optimizer" && key != "step" && key != "state") unexpected.push_back(key);
  }
  KILN_CHECK(
      sd.contains("optimizer") && sd.contains("step") && sd.contains("state"), InvalidArgument,
      what,
      ": the dict needs 'optimizer', 'step' and 'state' (as optimizer_state_dict() gives them)");
  const std::string opt = nb::cast<std::string>(sd["optimizer"]);
  KILN_CHECK(opt == p.options.optimizer, InvalidArgument, what, ": the state is of optimizer '",
             opt, "' but the engine's is '", p.options.optimizer,
             "'; build the Engine with optimizer='", opt, "'");
  const int64_t step = nb::cast<int64_t>(sd["step"]);
  KILN_CHECK(step >= 0, InvalidArgument, what, ": 'step' is ", step,
             "; it counts steps taken, >= 0");
  nb::dict state = nb::cast<nb::dict>(sd["state"]);
  const std::vector<Slot> slots = optimizer_slots(p);
  const bool adamw = opt == "adamw";
  struct Write {
    const ParamDesc* d;
    Region region;
    std::vector<float> values;
  };
  std::vector<Write> writes;
  int64_t applied = -1;
  for (auto [k, v] : state) {
    const std::string name = nb::cast<std::string>(k);
    if (!p.find_param(name)) unexpected.push_back("state['" + name + "']");
  }
  for (const ParamDesc& d : p.params) {
    if (slots.empty()) break;
    KILN_CHECK(state.contains(d.name.c_str()), InvalidArgument, what, ": the state of parameter '",
               d.name, "' is missing");
    nb::dict s = nb::cast<nb::dict>(state[d.name.c_str()]);
    for (auto [k, v] : s) {
      const std::string key = nb::cast<std::string>(k);
      bool known = adamw && key == "step";
      for (const Slot& slot : slots) known = known || key == slot.name;
      if (!known) unexpected.push_back("state['" + d.name + "']['" + key + "']");
    }
    for (const Slot& slot : slots) {
      KILN_CHECK(s.contains(slot.name), InvalidArgument, what, ": state['", d.name, "'] lacks '",
                 slot.name, "'");
      auto a = nb::cast<nb::ndarray<nb::ro, float, nb::c_contig, nb::device::cpu>>(s[slot.name]);
      std::vector<int64_t> shape;
      for (size_t i = 0; i < a.ndim(); ++i) shape.push_back(static_cast<int64_t>(a.shape(i)));
      KILN_CHECK(shape == d.torch_shape.dims, InvalidArgument, what, ": state['", d.name, "']['",
                 slot.name, "'] has shape ", Shape(shape).str(), " but the parameter's is ",
                 d.torch_shape.str());
      std::vector<float> torch_values(a.data(), a.data() + a.size());
      writes.push_back({&d, slot.region, from_torch_layout(d, torch_values)});
    }
    if (adamw) {
      KILN_CHECK(s.contains("step"), InvalidArgument, what, ": state['", d.name, "'] lacks 'step'");
      const int64_t t = nb::cast<int64_t>(s["step"]);
      KILN_CHECK(applied < 0 || t == applied, InvalidArgument, what, ": state['", d.name,
                 "']['step'] is ", t, " but another parameter's is ", applied,
                 "; kiln keeps one AdamW step count for all");
      KILN_CHECK(t >= 0 && t <= step && t <= INT32_MAX, InvalidArgument, what, ": state['", d.name,
                 "']['step'] is ", t, ", outside [0, step ", step, "]");
      applied = t;
    }
  }
  KILN_CHECK(!strict || unexpected.empty(), InvalidArgument, what, ": ", unexpected.size(),
             " entr(y/ies) the engine's optimizer does not have: ", quoted(unexpected),
             " (strict=False ignores them)");
  for (const Write& w : writes) en.write_param(w.d->name, w.values, w.region);
  if (adamw) {
    const auto t = static_cast<int32_t>(applied < 0 ? 0 : applied);
    en.backend().write(p.tensor(p.io.optimizer_steps), &t);
  }
  en.set_steps_done(step);
}

// Float32 C-contiguous arrays by torchvision name (python/kiln/__init__.py converts tensors).
void load_state_dict(PyEngine& e, nb::dict sd, bool strict, bool ema) {
  StFile f;
  std::vector<std::string> unexpected;
  const Program& p = e.engine().program();
  auto known = [&](const std::string& n) {
    for (const ParamDesc& d : p.params)
      if (d.name == n) return true;
    for (const BufferDesc& b : p.buffers)
      if (b.name == n) return true;
    return n.size() > 20 && n.compare(n.size() - 20, 20, ".num_batches_tracked") == 0;
  };
  for (auto [k, v] : sd) {
    const std::string name = nb::cast<std::string>(k);
    if (!known(name)) {
      unexpected.push_back(name);
      continue;
    }
    if (name.size() > 20 && name.compare(name.size() - 20, 20, ".num_batches_tracked") == 0)
      continue;
    auto a = nb::cast<nb::ndarray<nb::ro, float, nb::c_contig, nb::device::cpu>>(v);
    StTensor t;
    t.dtype = DType::F32;
    for (size_t i = 0; i < a.ndim(); ++i) t.shape.push_back(static_cast<int64_t>(a.shape(i)));
    const auto* bytes = reinterpret_cast<const uint8_t*>(a.data());
    t.data.assign(bytes, bytes + a.size() * sizeof(float));
    f.tensors[name] = std::move(t);
  }
  if (strict && !unexpected.empty()) {
    KILN_FAIL(InvalidArgument, "load_state_dict: ", unexpected.size(),
              " tensor(s) the model does not have: ", quoted(unexpected),
              " (strict=False ignores them)");
  }
  if (ema) {
    import_ema_state_dict(e.engine(), f, "state_dict (ema)");
  } else {
    import_state_dict(e.engine(), f, "state_dict");
  }
}

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<PyStepStats>(
      m, "StepStats",
      "What a step gives back: loss, top-1/top-5 (fractions of the batch), overflow. "
      "A training step's values are read from the device when first asked for, so a "
      "loop that does not read them every step runs ahead of the GPU.")
      .def_prop_ro(
          "loss", [](const PyStepStats& s) { return s.get().loss; },
          "mean cross-entropy of the batch")
      .def_prop_ro(
          "top1", [](const PyStepStats& s) { return s.get().top1; },
          "fraction of the batch whose label is the top class")
      .def_prop_ro(
          "top5", [](const PyStepStats& s) { return s.get().top5; },
          "fraction of the batch whose label is among the top five")
      .def_prop_ro(
          "correct1", [](const PyStepStats& s) { return s.get().correct1; }, "top-1 hits")
      .def_prop_ro(
          "correct5", [](const PyStepStats& s) { return s.get().correct5; }, "top-5 hits")
      .def_prop_ro(
          "count", [](const PyStepStats& s) { return s.cell->count; },
          "labelled samples in the batch")
      .def_prop_ro(
          "overflowed", [](const PyStepStats& s) { return s.get().overflowed; },
          "AMP: the gradients overflowed and the step was skipped")
      .def_prop_ro(
          "loss_scale", [](const PyStepStats& s) { return s.get().loss_scale; },
          "AMP's loss scale after the step")
      .def("__repr__", [](const PyStepStats& st) {
        const PyStats& s = st.get();
        std::ostringstream os;
        os << "StepStats(loss=" << s.loss << ", top1=" << s.top1 << ", top5=" << s.top5
           << ", overflowed=" << (s.overflowed ? "True" : "False") << ")";
        return os.str();
      });

  nb::class_<PyEngine>(m, "_Engine")
      .def(
          "__init__",
          [](PyEngine* self, const BluePrint& model, int64_t batch, bool amp,
             const std::string& device, uint64_t seed, bool compile, const std::string& optimizer,
             float momentum, float weight_decay, bool nesterov, bool ema, float ema_decay,
             float clip_grad, std::vector<float> mean, std::vector<float> std_) {
            EngineOptions o;
            o.device = device;
            o.compile.batch = batch;
            o.compile.amp = amp;
            o.compile.optimizer = optimizer;
            o.compile.momentum = momentum;
            o.compile.weight_decay = weight_decay;
            o.compile.nesterov = nesterov;
            o.compile.ema = ema;
            o.compile.ema_decay = ema_decay;
            o.compile.clip_grad = clip_grad;
            o.compile.dropout_seed = seed;
            new (self)
                PyEngine(model, std::move(o), compile, seed, std::move(mean), std::move(std_));
          },
          "model"_a, "batch"_a, "amp"_a, "device"_a, "seed"_a, "compile"_a, "optimizer"_a,
          "momentum"_a, "weight_decay"_a, "nesterov"_a, "ema"_a, "ema_decay"_a, "clip_grad"_a,
          "mean"_a, "std"_a)
      .def_prop_ro("state",
                   [](PyEngine& e) { return std::string(lifecycle_name(e.peek().state())); })
      .def_prop_ro("batch", &PyEngine::batch)
      .def_prop_ro("backend", [](PyEngine& e) { return std::string(e.engine().backend().name()); })
      .def_prop_ro("steps", [](PyEngine& e) { return e.peek().steps_done(); })
      .def("lock_memory", [](PyEngine& e) { e.engine().lock_memory(); })
      .def(
          "compile", [](PyEngine& e, uint64_t seed) { e.engine().compile(seed); }, "seed"_a = 0)
      .def("train_step", &PyEngine::train_step, "images"_a, "labels"_a, nb::kw_only(), "lr"_a)
      .def("eval_step", &PyEngine::eval_step, "images"_a, "labels"_a, nb::kw_only(),
           "ema"_a = false)
      .def("state_dict", &state_dict, nb::kw_only(), "ema"_a = false)
      .def("load_state_dict", &load_state_dict, "state_dict"_a, "strict"_a = true, nb::kw_only(),
           "ema"_a = false)
      .def("optimizer_state_dict", &optimizer_state_dict)
      .def("load_optimizer_state_dict", &load_optimizer_state_dict, "state_dict"_a,
           "strict"_a = true)
      .def("plan_text", [](PyEngine& e) { return describe_plan(e.engine().plan()); })
      .def("plan_layers", [](PyEngine& e) { return e.engine().plan().live().size(); })
      .def("plan_notes", [](PyEngine& e) { return e.engine().plan().notes; })
      .def("memory_text", [](PyEngine& e) { return describe_memory(e.engine().program()); })
      .def("memory_bytes",
           [](PyEngine& e) {
             const MemoryPlan& mp = e.engine().program().memory;
             nb::dict d;
             for (int r = 0; r < kRegionCount; ++r) {
               if (mp.region_bytes[static_cast<size_t>(r)] > 0) {
                 d[region_name(static_cast<Region>(r))] = mp.region_bytes[static_cast<size_t>(r)];
               }
             }
             return nb::make_tuple(d, mp.total(), mp.features_without_reuse);
           })
      .def(
          "save_weights",
          [](PyEngine& e, const std::string& path) { export_weights(e.engine(), path); }, "path"_a)
      .def(
          "load_weights",
          [](PyEngine& e, const std::string& path) { import_weights(e.engine(), path); }, "path"_a);
}

}  // namespace kiln::py
