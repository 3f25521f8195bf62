// What the CUDA backend offers beyond the Backend interface, with no CUDA header in sight
// (so the trainer and the CLI can use it in any build). Profiling itself goes through
// Backend::set_profiling / profile_report (GPU time per phase; with KILN_PROFILE_OPS=1 also
// per op kind, nodes then launching one by one between events). Get at this with
// dynamic_cast<CudaBackendApi*>(backend) when the backend's name() is "cuda".
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "kiln/backend/backend.h"

namespace kiln {

class CudaBackendApi : public Backend {
 public:
  // Milliseconds of GPU time per phase of the last run(), in schedule order; waits for that
  // run to finish. Empty when profiling is off.
  virtual std::vector<std::pair<std::string, float>> phase_times() = 0;
  // How the last prepare() chose its convolution engines: plans from the
  // experience table (or measured, under KILN_TUNE), plans chosen by timing a few engines
  // while compiling (a graph the table lacks; KILN_AUTOTUNE=0 turns it off) and plans left
  // to cuDNN's heuristics.
  struct EngineTableUse {
    int from_table = 0, heuristics = 0, autotuned = 0;
    int remembered =
        0;  // of autotuned: timed by an earlier compile (this process, or the autotune cache)
    std::string table;  // the file consulted or written; empty when none
  };
  virtual EngineTableUse engine_table_use() const = 0;
  // How the last prepare() built its fused CBR forwards under KILN_CBR_FORM=genstats: as one
  // conv+genstats cuDNN graph, or falling back to kiln's form (no engine for that graph).
  // Where KILN_CUTLASS has them try it: on the SM90 CUTLASS GEMM, or kept in their form.
  struct CbrForms {
    int genstats = 0, fallbacks = 0;
    int cutlass = 0, cutlass_fallbacks = 0;
  };
  virtual CbrForms cbr_forms() const = 0;
  // Weight-gradient convolutions of the compiled program that run on the side stream
  // (KILN_SIDE_WGRAD; 0 when off).
  virtual int side_stream_wgrads() const = 0;
  // FP32 convolution plans of the last prepare() on Winograd or FFT engines
  // (KILN_FP32_WINOGRAD: allowed by default, =0 refuses them, =only prefers them).
  virtual int fp32_transformed_plans() const = 0;
};

}  // namespace kiln
