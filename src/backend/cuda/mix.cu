// mix_batch on the GPU: mixup / cutmix of the staged FP32 batch into the step's input (FP16 or
// BF16 under AMP, FP32 otherwise), in place of the transfer's copy or cast; the GPU twin of
// src/backend/cpu/mix.cpp, through the same formula::mix_value. The step's mix (kind, lambda,
// box) is read from the device scalars the host wrote before the step, so a captured graph
// replays with each step's own draw. A box outside the image is clipped (the host never
// writes one; the CPU refuses it).
#include "backend/cuda/device_util.cuh"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void mix_batch_kernel(const float* x, const float* mix, T* y, int64_t N, int64_t H,
                                 int64_t W, int64_t C) {
  formula::MixStep m = formula::mix_step(mix);
  m.y0 = m.y0 < 0 ? 0 : m.y0, m.y1 = m.y1 > H ? H : m.y1;
  m.x0 = m.x0 < 0 ? 0 : m.x0, m.x1 = m.x1 > W ? W : m.x1;
  const int64_t per = H * W * C, count = N * per;
  KILN_GRID_STRIDE(i, count) {
    const int64_t s = i / per, r = i - s * per;
    const int64_t h = r / (W * C), w = (r / C) % W;
    const int64_t p = ((s + N - 1) % N) * per + r;
    y[i] = from_f<T>(formula::mix_value(x[i], x[p], h, w, m));
  }
}

}  // namespace

// "x (f32 NHWC, a staged batch), mix (f32[8]) -> y (NHWC, f32/f16/bf16)" (check_mix_batch)
KernelPtr make_mix_batch(const Node& n, Context& ctx, int stream) {
  const MixNode mb = check_mix_batch(ctx, n);
  const Nhwc g = mb.g;
  const DType to = mb.to;
  const float* xp = ctx.ptr<float>(mb.x);
  const float* mp = ctx.ptr<float>(mb.mix);
  void* yp = ctx.ptr(mb.y);
  KILN_CHECK(
      static_cast<const void*>(xp) != yp, InvalidArgument, "mix_batch node '", n.label,
      "': x and y share their bytes, but a sample reads its partner's; give y its own tensor");
  const unsigned grid = grid_for(ctx, g.numel(), kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(to, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t s) {
      mix_batch_kernel<T>
          <<<grid, kThreads, 0, s>>>(xp, mp, static_cast<T*>(yp), g.n, g.h, g.w, g.c);
      KILN_LAUNCH_CHECK("mix_batch");
    });
  });
  return k;
}

}  // namespace kiln::cuda
