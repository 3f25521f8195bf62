// How a convolution graph's engine is chosen, and where the choice is kept: the experience
// table (`kiln tune` writes it), timing a few engines while compiling (autotuning, remembered
// for the process and in the autotune cache), or cuDNN's heuristics. Used by conv.cpp.
#pragma once
#include <cudnn_frontend.h>

#include <string>
#include <unordered_map>

#include "backend/cuda/cuda_kernel.h"
#include "kiln/backend/engine_table.h"

namespace kiln::cuda {

namespace fe = cudnn_frontend;

// How a graph's engines are timed on the node's own buffers. `kiln tune` (KILN_TUNE=<table
// file>) times every candidate and records the three fastest; compile-time autotuning (a graph
// the table lacks, KILN_AUTOTUNE) times the heuristics' first choice and the next few
// precompiled engines, as PyTorch's cudnn.benchmark does. Round 1 runs each candidate
// `untimed` times and then once timed; only those within `cut` of the fastest get the rest of
// their timed runs (an engine 4x slower than the best is never worth a backup slot, and
// FP32 VGG's worst dgrad engines take ~0.7 s a run); a candidate is dropped as soon as one
// of its runs, untimed or not, is beyond `cut` of the fastest so far. Candidates that do not
// build, need more workspace than Context::workspace_cap or fail to run are skipped. A
// workspace is allocated per candidate: this runs while compiling, before any step.
struct TimingRule {
  int64_t max_candidates;
  int untimed, timed;
  float cut;
  bool precompiled_after_first;  // after the first candidate, skip runtime-compiled engines (~1 s
                                 // of NVRTC each)
};
constexpr TimingRule kTuneRule{1 << 30, 2, 5, 4.0f, false};
constexpr TimingRule kAutotuneRule{6, 1, 3, 2.0f, true};
// conv+genstats graphs (KILN_CBR_FORM=genstats) have runtime-compiled engines only: the rule
// above would time the heuristics' first choice alone. Three of them are timed (~1 s of NVRTC
// each, once per shape thanks to the autotune cache): the conv-forms probe found the first
// choice is not always the fastest, and the form is opt-in.
constexpr TimingRule kAutotuneFusedRule{3, 1, 3, 2.0f, false};

// The heuristics' first engine's name, for the log.
std::string graph_first_name(fe::graph::Graph& graph);

// The first of the table's engines (winner, backup 1, backup 2) that exists among this
// graph's candidates and builds; -1 when none does.
int64_t pick_from_table(fe::graph::Graph& graph, const EngineEntry& entry);

// `kiln tune`: every candidate timed, the three fastest recorded in ctx.tuned; the fastest
// one's index, -1 when none ran.
int64_t tune_engines(Context& ctx, fe::graph::Graph& graph, cudnnHandle_t handle,
                     cudaStream_t stream, std::unordered_map<int64_t, void*>& pack,
                     const std::string& key);

// Compile-time autotuning by `rule`: the fastest engine's index (-1 when none ran), timed once
// per graph key and process (or taken from the autotune cache).
int64_t autotune_engines(Context& ctx, fe::graph::Graph& graph, const TimingRule& rule,
                         cudnnHandle_t handle, cudaStream_t stream,
                         std::unordered_map<int64_t, void*>& pack, const std::string& key);

// What compile-time timing chose for `key` before (this process, or the autotune cache), copied
// into `out`; false when nothing was. Shared with timed_form.cpp, whose SM90-or-cuDNN choices
// are kept beside the engines.
bool autotuned_choice(const std::string& key, EngineEntry& out);
// Keeps a choice timed while compiling for the rest of the process and the autotune cache.
void remember_autotuned(EngineEntry entry);

}  // namespace kiln::cuda
