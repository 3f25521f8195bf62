// The engine choice for conv.cpp's graphs (conv_engines.h): the table, tuning, autotuning and
// the autotune cache.
#include "backend/cuda/conv_engines.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <set>

#include "backend/engine_timing_rule.h"
#include "kiln/core/log.h"

namespace kiln::cuda {

namespace {

struct Timed {
  int64_t index;
  EngineChoice choice;
  std::vector<float> times;
  std::string dropped;  // why time_runs gave up on it, for the debug log
};

// Runs plan `t.index` `untimed` + `timed` times, appending the timed ones; false if it fails
// or a run takes longer than `give_up_ms`. The runs are read by time_candidate
// (backend/engine_timing_rule.h): a long first run is repeated, since it may be the kernel
// loading; a warm-up longer than kSlowRunMs counts as the first timed run.
bool time_runs(fe::graph::Graph& graph, cudnnHandle_t handle, cudaStream_t stream,
               std::unordered_map<int64_t, void*>& pack, Timed& t, int untimed, int timed,
               float give_up_ms) {
  void* wsp = nullptr;
  if (t.choice.workspace > 0 &&
      cudaMalloc(&wsp, static_cast<size_t>(t.choice.workspace)) != cudaSuccess) {
    cudaGetLastError();
    t.dropped = "its workspace could not be allocated";
    return false;
  }
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  auto run = [&]() -> float {
    CUDA_CHECK(cudaEventRecord(t0, stream));
    const bool ran = graph.execute_plan_at_index(handle, pack, wsp, t.index).is_good();
    CUDA_CHECK(cudaEventRecord(t1, stream));
    CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    return ran ? ms : -1.0f;
  };
  bool ok = time_candidate(run, untimed, timed, give_up_ms, t.times, t.dropped);
  if (cudaGetLastError() != cudaSuccess) ok = false;
  CUDA_CHECK(cudaEventDestroy(t0));
  CUDA_CHECK(cudaEventDestroy(t1));
  if (wsp) CUDA_CHECK(cudaFree(wsp));
  return ok;
}

// The measured candidates, fastest first (empty when none ran). Leaves no plan built as
// current: the caller executes by index.
std::vector<Timed> time_engines(fe::graph::Graph& graph, cudnnHandle_t handle, cudaStream_t stream,
                                std::unordered_map<int64_t, void*>& pack, const TimingRule& rule,
                                int64_t workspace_cap) {
  const int64_t count = graph.get_execution_plan_count();
  auto runtime_compiled = [&](int64_t i) {
    std::vector<fe::BehaviorNote_t> notes;
    return graph.get_behavior_notes_for_plan_at_index(i, notes).is_good() &&
           std::find(notes.begin(), notes.end(), fe::BehaviorNote_t::RUNTIME_COMPILATION) !=
               notes.end();
  };
  std::vector<Timed> candidates;
  for (int64_t i = 0; i < count && static_cast<int64_t>(candidates.size()) < rule.max_candidates;
       ++i) {
    Timed t{i, {}, {}, {}};
    if (graph.get_plan_name_at_index(i, t.choice.engine).is_bad()) continue;
    if (rule.precompiled_after_first && !candidates.empty() && runtime_compiled(i)) continue;
    if (graph.build_plan_at_index(i).is_bad()) continue;
    if (graph.get_workspace_size_plan_at_index(i, t.choice.workspace).is_bad() ||
        t.choice.workspace > workspace_cap) {
      continue;
    }
    candidates.push_back(std::move(t));
  }
  // A runtime-compiled first choice is timed last, so a slow one (FP32's are, up to seconds a
  // run on VGG16 at batch 256) gives up after one run against the best precompiled engine.
  if (candidates.size() > 1 && runtime_compiled(candidates[0].index)) {
    std::rotate(candidates.begin(), candidates.begin() + 1, candidates.end());
  }
  std::vector<Timed> round1;
  float best = 1e30f;
  for (Timed& t : candidates) {
    if (!time_runs(graph, handle, stream, pack, t, rule.untimed, 1, rule.cut * best)) {
      log_debug("  ", t.choice.engine, " dropped: ", t.dropped);
      continue;
    }
    log_debug("  ", t.choice.engine, ": ", t.times[0], " ms",
              runtime_compiled(t.index) ? " (runtime-compiled)" : "");
    best = std::min(best, t.times[0]);
    round1.push_back(std::move(t));
  }
  std::vector<Timed> measured;
  for (Timed& t : round1) {
    if (t.times[0] > rule.cut * best) continue;
    if (rule.timed > 1 && !time_runs(graph, handle, stream, pack, t, 0, rule.timed - 1, 1e30f))
      continue;
    std::sort(t.times.begin(), t.times.end());
    t.choice.ms = t.times[t.times.size() / 2];
    measured.push_back(std::move(t));
  }
  std::sort(measured.begin(), measured.end(),
            [](const Timed& a, const Timed& b) { return a.choice.ms < b.choice.ms; });
  return measured;
}

EngineEntry entry_of(const std::string& key, const std::vector<Timed>& measured) {
  EngineEntry entry;
  entry.key = key;
  for (const Timed& t : measured) entry.choices.push_back(t.choice);
  return entry;
}

// Compile-time autotuning: what it chose is kept for the whole process, keyed like the
// table, so every later compile of the same graph (the eval program, another engine in the
// same process) takes the same engine without timing it again, and two compiles of one model
// in a process compute with the same engines.
std::mutex g_autotuned_mutex;
EngineTable g_autotuned;
bool g_autotuned_new = false;          // timed since the cache was last written
std::set<std::string> g_cache_loaded;  // cache files merged into g_autotuned

}  // namespace

std::string graph_first_name(fe::graph::Graph& graph) {
  std::string name;
  return graph.get_execution_plan_count() > 0 && graph.get_plan_name_at_index(0, name).is_good()
             ? name
             : "none";
}

int64_t pick_from_table(fe::graph::Graph& graph, const EngineEntry& entry) {
  const int64_t count = graph.get_execution_plan_count();
  for (const EngineChoice& choice : entry.choices) {
    for (int64_t i = 0; i < count; ++i) {
      std::string name;
      if (graph.get_plan_name_at_index(i, name).is_bad() || name != choice.engine) continue;
      if (graph.build_plan_at_index(i).is_good()) return i;
      break;
    }
  }
  return -1;
}

int64_t tune_engines(Context& ctx, fe::graph::Graph& graph, cudnnHandle_t handle,
                     cudaStream_t stream, std::unordered_map<int64_t, void*>& pack,
                     const std::string& key) {
  if (const EngineEntry* done = ctx.tuned.find(key)) {  // the same graph on another stream
    const int64_t i = pick_from_table(graph, *done);
    if (i >= 0) return i;
  }
  const std::vector<Timed> measured =
      time_engines(graph, handle, stream, pack, kTuneRule, ctx.workspace_cap);
  if (measured.empty()) return -1;
  ctx.tuned.put(entry_of(key, measured));
  log_info("tuned ", key, ": ", measured.size(), " engines, fastest ", measured[0].choice.engine,
           " ", measured[0].choice.ms, " ms (heuristics' first: ", graph_first_name(graph), ")");
  return measured[0].index;
}

int64_t autotune_engines(Context& ctx, fe::graph::Graph& graph, const TimingRule& rule,
                         cudnnHandle_t handle, cudaStream_t stream,
                         std::unordered_map<int64_t, void*>& pack, const std::string& key) {
  std::lock_guard<std::mutex> lock(g_autotuned_mutex);
  if (const EngineEntry* done = g_autotuned.find(key)) {
    const int64_t i = pick_from_table(graph, *done);
    if (i >= 0) {
      ++ctx.autotune_remembered;
      return i;
    }
  }
  const auto started = std::chrono::steady_clock::now();
  const std::vector<Timed> measured =
      time_engines(graph, handle, stream, pack, rule, ctx.workspace_cap);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (measured.empty()) return -1;
  g_autotuned.put(entry_of(key, measured));
  g_autotuned_new = true;
  log_debug("autotuned ", key, " in ", seconds, " s: ", measured.size(), " engines timed, fastest ",
            measured[0].choice.engine, " ", measured[0].choice.ms,
            " ms (heuristics' first: ", graph_first_name(graph), ")");
  return measured[0].index;
}

bool autotuned_choice(const std::string& key, EngineEntry& out) {
  std::lock_guard<std::mutex> lock(g_autotuned_mutex);
  const EngineEntry* done = g_autotuned.find(key);
  if (done == nullptr) return false;
  out = *done;
  return true;
}

void remember_autotuned(EngineEntry entry) {
  std::lock_guard<std::mutex> lock(g_autotuned_mutex);
  g_autotuned.put(std::move(entry));
  g_autotuned_new = true;
}

void autotune_cache_load(const std::string& path, const std::string& gpu, int64_t cudnn) {
  std::lock_guard<std::mutex> lock(g_autotuned_mutex);
  if (!g_cache_loaded.insert(path).second) return;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  try {
    EngineTable file = EngineTable::load(path);
    if (file.gpu != gpu || file.cudnn != cudnn) {
      log_warn("autotune cache ", path, " holds ", file.gpu, " with cuDNN ", file.cudnn, ", not ",
               gpu, " with cuDNN ", cudnn, "; ignoring it");
      return;
    }
    const size_t n = file.entries().size();
    file.merge(g_autotuned);  // what this process timed wins
    g_autotuned = std::move(file);
    log_info("autotune cache: ", n, " convolution graphs' engines from ", path,
             " (KILN_AUTOTUNE_CACHE=0 turns it off)");
  } catch (const Error& e) {
    log_warn("autotune cache ", path,
             " is unreadable, so it is ignored (delete it, or KILN_AUTOTUNE_CACHE=0): ", e.what());
  }
}

void autotune_cache_save(const std::string& path, const std::string& gpu, int64_t cudnn) {
  std::lock_guard<std::mutex> lock(g_autotuned_mutex);
  if (!g_autotuned_new) return;
  try {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    EngineTable out;
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) {
      try {
        out = EngineTable::load(path);  // another process's results stay
      } catch (const Error&) {
        out = EngineTable{};  // an unreadable cache is replaced
      }
      if (out.gpu != gpu || out.cudnn != cudnn) out = EngineTable{};
    }
    out.gpu = gpu;
    out.cudnn = cudnn;
    out.merge(g_autotuned);
    out.save(path);
    g_autotuned_new = false;
    log_info("autotune cache: ", out.entries().size(), " convolution graphs' engines kept in ",
             path);
  } catch (const std::exception& e) {
    log_warn("autotune cache: could not write ", path, " (", e.what(),
             "); the next process times its engines again");
  }
}

}  // namespace kiln::cuda
