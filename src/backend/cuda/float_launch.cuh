// The usual shape of a kiln kernel: one launch a run, instantiated for the node's float dtype.
//   return float_launch(dt, stream, "what", [=](auto t, cudaStream_t s) {
//     using T = decltype(t);
//     my_kernel<T><<<grid, threads, 0, s>>>(...);
//   });
#pragma once
#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/device_util.cuh"

namespace kiln::cuda {

// A kernel of one launch a run, for dt's float type T: launch(T{}, stream) enqueues it.
template <typename Launch>
KernelPtr float_launch(DType dt, int stream, const char* what, Launch launch) {
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t s) {
      launch(T{}, s);
      KILN_LAUNCH_CHECK(what);
    });
  });
  return k;
}

}  // namespace kiln::cuda
