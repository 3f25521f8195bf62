// RAII for CUDA Graphs: a capture guard that always ends the capture it began (so an
// exception inside a phase never leaves a stream stuck in capture mode), and an owner of
// the instantiated graph. Destructors report but never throw (STYLE.md, tiny-cuda-nn).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>

#include "backend/cuda/cuda_kernel.h"

namespace kiln::cuda {

class GraphExec {
 public:
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  GraphExec(GraphExec&& o) noexcept : graph_(o.graph_), exec_(o.exec_) {
    o.graph_ = nullptr;
    o.exec_ = nullptr;
  }
  GraphExec& operator=(GraphExec&& o) noexcept {
    if (this != &o) {
      reset();
      graph_ = o.graph_;
      exec_ = o.exec_;
      o.graph_ = nullptr;
      o.exec_ = nullptr;
    }
    return *this;
  }
  ~GraphExec() { reset(); }

  bool ready() const { return exec_ != nullptr; }
  // Takes ownership of a captured graph and instantiates it.
  void instantiate(cudaGraph_t graph) {
    reset();
    graph_ = graph;
    CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  void launch(cudaStream_t s) const { CUDA_CHECK(cudaGraphLaunch(exec_, s)); }
  void reset() {
    if (exec_ && cudaGraphExecDestroy(exec_) != cudaSuccess)
      std::fprintf(stderr, "kiln: cudaGraphExecDestroy failed\n");
    if (graph_ && cudaGraphDestroy(graph_) != cudaSuccess)
      std::fprintf(stderr, "kiln: cudaGraphDestroy failed\n");
    exec_ = nullptr;
    graph_ = nullptr;
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Begins capturing `stream` (thread-local mode: other threads may keep using CUDA); end()
// returns the graph. Leaving the scope without end() (an exception) aborts the capture.
class CaptureGuard {
 public:
  explicit CaptureGuard(cudaStream_t s) : stream_(s) {
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    active_ = true;
  }
  CaptureGuard(const CaptureGuard&) = delete;
  CaptureGuard& operator=(const CaptureGuard&) = delete;
  cudaGraph_t end() {
    cudaGraph_t g = nullptr;
    active_ = false;
    CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
    return g;
  }
  ~CaptureGuard() {
    if (!active_) return;
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
    cudaGetLastError();  // the capture's error is the one already being thrown
  }

 private:
  cudaStream_t stream_;
  bool active_ = false;
};

}  // namespace kiln::cuda
