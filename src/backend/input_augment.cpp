// augment_normalize_u8 (backend.h): a uint8 batch's value augmentations on the host, in the
// order the float transforms apply them (the ops on the bytes, Normalize, then RandomErasing).
#include <algorithm>
#include <cstring>
#include <exception>

#include "kiln/backend/backend.h"
#include "kiln/data/auto_augment.h"

namespace kiln {

void augment_normalize_u8(const uint8_t* in, int64_t batch, int64_t h, int64_t w, int64_t c,
                          const SampleAugment* augments, const InputNormalization& norm,
                          float* out) {
  KILN_CHECK(batch >= 0 && h > 0 && w > 0 && c > 0 && static_cast<int64_t>(norm.mean.size()) == c,
             InvalidArgument, "augment_normalize_u8: a batch of ", batch, " x ", h, "x", w, "x", c,
             " with ", norm.mean.size(), " channel statistics");
  const int64_t per = h * w * c;
  // Checked before the parallel loop: an exception must not leave an OpenMP region.
  for (int64_t k = 0; augments && k < batch; ++k) {
    const EraseBox& e = augments[k].erase;
    if (e.height == 0 || e.width == 0) continue;
    KILN_CHECK(e.top >= 0 && e.left >= 0 && e.height > 0 && e.width > 0 && e.top + e.height <= h &&
                   e.left + e.width <= w,
               InvalidArgument, "sample ", k, "'s erase box ", e.height, "x", e.width, " at (",
               e.top, ", ", e.left, ") is not inside its ", h, "x", w, " image");
  }
  // One sample per iteration, spread over the cores: on the CPU backend this runs on the
  // trainer's thread, where the float pipeline ran the same ops in the loader's workers. An
  // op's error is carried out of the parallel region and rethrown after it.
  std::exception_ptr failure;
#pragma omp parallel
  {
    Image im;
    im.height = h, im.width = w, im.channels = c;
#pragma omp for schedule(dynamic)
    for (int64_t k = 0; k < batch; ++k) {
      const uint8_t* src = in + k * per;
      float* dst = out + k * per;
      const SampleAugment* a = augments ? &augments[k] : nullptr;
      if (a && !a->ops.empty()) {
        im.pixels.assign(src, src + per);
        try {
          for (const auto& [op, m] : a->ops) {
            apply_augment_params(im, augment_op_params(op, m, h, w));
          }
        } catch (...) {
#pragma omp critical(kiln_augment_failure)
          if (!failure) failure = std::current_exception();
        }
        src = im.pixels.data();
      }
      normalize_u8(src, h * w, norm, dst);
      if (!a || a->erase.height == 0 || a->erase.width == 0) continue;
      const EraseBox& e = a->erase;
      for (int64_t y = e.top; y < e.top + e.height; ++y) {
        std::fill_n(dst + (y * w + e.left) * c, e.width * c, e.value);
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace kiln
