// The SM90-or-today choice of a layer (timed_form.h).
#include "backend/cuda/timed_form.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "backend/cuda/conv_engines.h"

namespace kiln::cuda {

namespace {

constexpr const char* kSm90 = "sm90";
constexpr const char* kToday = "cudnn+kiln";
// Each form runs twice untimed (module load, caches), then kRounds times, alternating the two so
// that a clock or thermal drift falls on both; the medians decide.
constexpr int kWarmup = 2;
constexpr int kRounds = 7;

// The tensors in `keep`, copied aside on the stream and back when this goes out of scope.
class KeptBytes {
 public:
  KeptBytes(const Context& ctx, const std::vector<TensorId>& keep, cudaStream_t stream)
      : stream_(stream) {
    size_t total = 0;
    for (TensorId id : keep) {
      if (id == kNoTensor) continue;
      const size_t bytes = static_cast<size_t>(ctx.tensor(id).bytes());
      spans_.push_back({ctx.ptr(id), total, bytes});
      total += (bytes + 255) / 256 * 256;
    }
    if (total == 0) return;
    copy_ = std::make_unique<DeviceBuffer>(total);
    auto* base = static_cast<uint8_t*>(copy_->get());
    for (const Span& s : spans_) {
      CUDA_CHECK(cudaMemcpyAsync(base + s.at, s.p, s.bytes, cudaMemcpyDeviceToDevice, stream_));
    }
  }
  void restore() {
    if (!copy_) return;
    auto* base = static_cast<uint8_t*>(copy_->get());
    for (const Span& s : spans_) {
      CUDA_CHECK(cudaMemcpyAsync(s.p, base + s.at, s.bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  struct Span {
    void* p;
    size_t at, bytes;
  };
  cudaStream_t stream_;
  std::vector<Span> spans_;
  std::unique_ptr<DeviceBuffer> copy_;
};

// The stream's workspace, swapped for a temporary one as large as its factories asked for so
// far, and swapped back when this goes out of scope (also when a form throws).
class TemporaryWorkspace {
 public:
  TemporaryWorkspace(Context& ctx, int stream)
      : res_(ctx.streams[static_cast<size_t>(stream)]), saved_(res_.workspace) {
    if (res_.workspace_bytes > 0) {
      buffer_ = std::make_unique<DeviceBuffer>(res_.workspace_bytes);
      res_.workspace = buffer_->get();
    }
  }
  ~TemporaryWorkspace() { res_.workspace = saved_; }
  TemporaryWorkspace(const TemporaryWorkspace&) = delete;
  TemporaryWorkspace& operator=(const TemporaryWorkspace&) = delete;

 private:
  StreamRes& res_;
  void* saved_;
  std::unique_ptr<DeviceBuffer> buffer_;
};

float run_timed(Context& ctx, const std::vector<Kernel*>& form, cudaStream_t stream, cudaEvent_t t0,
                cudaEvent_t t1) {
  CUDA_CHECK(cudaEventRecord(t0, stream));
  for (Kernel* k : form) k->run(ctx);
  CUDA_CHECK(cudaEventRecord(t1, stream));
  CUDA_CHECK(cudaEventSynchronize(t1));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
  return ms;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One debug line: node n's two times, whether timed now or found, and the form it keeps.
void log_timed_choice(const Node& n, const TimedChoice& c) {
  log_debug(op_name(n.op), " node '", n.label, "': the SM90 form ", c.sm90_ms,
            " ms, cuDNN with kiln's pass ", c.today_ms, " ms (",
            c.measured_now ? "timed now" : "timed before", "): keeps ",
            c.sm90 ? "the SM90 form" : "cuDNN with kiln's pass");
}

}  // namespace

std::string timed_form_key(const std::string& form, const ConvGeom& g, DType dt,
                           const std::string& extra, const char* generation) {
  std::ostringstream key;
  key << generation << "." << form << ":" << g.x.n << "," << g.x.h << "," << g.x.w << "," << g.x.c
      << ":" << g.k << "," << g.r << "," << g.s << ":" << g.sh << "," << g.sw << "," << g.ph << ","
      << g.pw << ":" << dtype_name(dt) << (extra.empty() ? "" : ":") << extra;
  return key.str();
}

FormChoice form_choice_from(const EngineEntry& e, const char* first, const char* second) {
  FormChoice c;
  c.found = true;
  for (const EngineChoice& choice : e.choices) {
    if (choice.engine == first) c.first_ms = choice.ms;
    if (choice.engine == second) c.second_ms = choice.ms;
  }
  c.first = !e.choices.empty() && e.choices[0].engine == first;
  return c;
}

FormChoice choose_faster_form(Context& ctx, int stream, const std::string& key,
                              const NamedForm& first, const NamedForm& second,
                              const std::vector<TensorId>& keep, bool may_time) {
  const bool tuning = !ctx.opts.tune_path.empty();
  if (const EngineEntry* e = ctx.engine_table.find(key); e != nullptr && !tuning) {
    return form_choice_from(*e, first.name, second.name);
  }
  if (const EngineEntry* e = ctx.tuned.find(key)) {
    return form_choice_from(*e, first.name, second.name);  // another stream's
  }
  if (EngineEntry e; !tuning && autotuned_choice(key, e)) {
    return form_choice_from(e, first.name, second.name);
  }
  if (!may_time) return {};

  const auto started = std::chrono::steady_clock::now();
  const cudaStream_t st = ctx.streams[static_cast<size_t>(stream)].stream;
  TemporaryWorkspace workspace(ctx, stream);
  KeptBytes kept(ctx, keep, st);
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  std::vector<float> a, b;
  try {
    for (int r = 0; r < kWarmup; ++r) {
      run_timed(ctx, first.kernels, st, t0, t1);
      run_timed(ctx, second.kernels, st, t0, t1);
    }
    for (int r = 0; r < kRounds; ++r) {
      a.push_back(run_timed(ctx, first.kernels, st, t0, t1));
      b.push_back(run_timed(ctx, second.kernels, st, t0, t1));
    }
  } catch (...) {
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    throw;
  }
  CUDA_CHECK(cudaEventDestroy(t0));
  CUDA_CHECK(cudaEventDestroy(t1));
  kept.restore();

  FormChoice c;
  c.found = c.measured_now = true;
  c.first_ms = median(a), c.second_ms = median(b);
  c.first = c.first_ms < c.second_ms;
  EngineEntry entry;
  entry.key = key;
  const EngineChoice f{first.name, 0, c.first_ms}, s{second.name, 0, c.second_ms};
  entry.choices = c.first ? std::vector<EngineChoice>{f, s} : std::vector<EngineChoice>{s, f};
  if (tuning) {
    ctx.tuned.put(entry);
  } else {
    remember_autotuned(std::move(entry));
  }
  ctx.autotune_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return c;
}

TimedChoice time_sm90_against_today(const Node& n, Context& ctx, int stream, const std::string& key,
                                    const std::vector<Kernel*>& sm90,
                                    const std::vector<Kernel*>& today,
                                    const std::vector<TensorId>& keep) {
  const FormChoice f =
      choose_faster_form(ctx, stream, key, {kSm90, sm90}, {kToday, today}, keep, true);
  TimedChoice c;
  c.sm90 = f.first, c.measured_now = f.measured_now;
  c.sm90_ms = f.first_ms, c.today_ms = f.second_ms;
  ++ctx.sm90_timed;
  if (!c.sm90) ++ctx.sm90_timed_today;
  if (c.measured_now) ++ctx.sm90_timed_now;
  log_timed_choice(n, c);
  return c;
}

}  // namespace kiln::cuda
