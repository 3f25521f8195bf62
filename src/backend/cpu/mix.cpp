// mix_batch on the CPU: mixup / cutmix of the staged batch into the step's input (ops.def),
// one pass that also is the transfer's copy (or cast to y's dtype). The pixel formula is
// formula::mix_value, as the CUDA kernel.
#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"
#include "kiln/core/dtype.h"

namespace kiln::cpu {

// "x (f32 NHWC, a staged batch), mix (f32[8]) -> y (NHWC, f32/f16/bf16)" (check_mix_batch)
KernelPtr make_mix_batch(const Node& n, Context& ctx) {
  const MixNode mb = check_mix_batch(ctx, n);
  const Nhwc g = mb.g;
  const DType to = mb.to;
  const float* xp = ctx.ptr<float>(mb.x);
  const float* mp = ctx.ptr<float>(mb.mix);
  uint8_t* yp = ctx.ptr<uint8_t>(mb.y);
  KILN_CHECK(
      static_cast<const void*>(xp) != yp, InvalidArgument, "mix_batch node '", n.label,
      "': x and y share their bytes, but a sample reads its partner's; give y its own tensor");
  const std::string label = n.label;
  return make_loop([=](Context&) {
    const formula::MixStep m = formula::mix_step(mp);
    KILN_CHECK(m.kind >= 0 && m.kind <= 2 && m.y0 >= 0 && m.y0 <= m.y1 && m.y1 <= g.h &&
                   m.x0 >= 0 && m.x0 <= m.x1 && m.x1 <= g.w,
               InvalidArgument, "mix_batch node '", label, "': mix kind ", m.kind, " box rows [",
               m.y0, ", ", m.y1, ") columns [", m.x0, ", ", m.x1, ") does not fit a ", g.h, "x",
               g.w, " image");
    const int64_t per = g.h * g.w * g.c;
    for (int64_t s = 0; s < g.n; ++s) {
      const float* self = xp + s * per;
      const float* partner = xp + ((s + g.n - 1) % g.n) * per;
      for (int64_t h = 0; h < g.h; ++h) {
        for (int64_t w = 0; w < g.w; ++w) {
          const int64_t at = (h * g.w + w) * g.c;
          for (int64_t c = 0; c < g.c; ++c) {
            const float v = formula::mix_value(self[at + c], partner[at + c], h, w, m);
            const int64_t i = s * per + at + c;
            if (to == DType::F32) {
              reinterpret_cast<float*>(yp)[i] = v;
            } else {
              reinterpret_cast<uint16_t*>(yp)[i] =
                  to == DType::F16 ? float_to_half(v) : float_to_bf16(v);
            }
          }
        }
      }
    }
  });
}

}  // namespace kiln::cpu
