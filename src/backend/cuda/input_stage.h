// The GPU half of the input pipeline: one kernel per batch turns every sample into the step's
// input slot (the antialiased resample of sample_geometry.h, the flip, the normalisation and
// the cast to the slot's dtype), from decoded pixels already on the device: nvJPEG's output
// (jpeg_stage.h) or host-decoded bytes copied there; with AutoAugment's ops it writes the
// resampled bytes instead, for augment_stage.h. A second kernel normalises plain uint8
// batches (stage_batch_u8, stage_batch_device), a third converts device labels. All run on
// the transfer stream the caller gives.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/host_device.h"
#include "kiln/core/dtype.h"
#include "kiln/data/input_batch.h"

namespace kiln::cuda {

// One axis of a sample's geometry (ResampleAxis) plus where its decoded pixels are: the
// device buffer holds source pixels [win_lo, win_lo + win_n) of the image's `size`.
struct AxisDesc {
  double origin = 0, scale = 1;
  int32_t out = 0, lo = 0, hi = 0, valid_lo = 0, valid_hi = 0;
  int32_t size = 0;
  int32_t win_lo = 0, win_n = 0;
  int32_t bicubic = 0;  // ResampleFilter::bicubic, else bilinear
};

// A sample's value augmentations on the device (augment_stage.h): its ops are
// ops[first_op, first_op + ops) of the batch's AugmentOpParams; outputs in the erase box are
// set to erase_value after the normalisation (erase_h 0: none).
struct AugmentDesc {
  int32_t first_op = 0, ops = 0;
  int32_t erase_top = 0, erase_left = 0, erase_h = 0, erase_w = 0;
  float erase_value = 0;
  int32_t zero = 0;  // a padding sample of an encoded batch: every value written is 0
};
KILN_HD inline bool erased(const AugmentDesc& a, int32_t y, int32_t x) {
  return y >= a.erase_top && y < a.erase_top + a.erase_h && x >= a.erase_left &&
         x < a.erase_left + a.erase_w;
}

struct SampleDesc {
  const uint8_t* src = nullptr;  // decoded window, HWC, `pitch` bytes a row; null: reads as 0
  int64_t pitch = 0;
  AxisDesc y, x;
  int32_t flip = 0;
  int32_t zero = 0;  // a padding sample (k >= batch.size): every value written is 0
};

// x = v * scale[c] + shift[c] with scale = 1 / (255 std), shift = -mean / std: the same floats,
// in the same order of rounding, as normalize_u8 on the host.
inline constexpr int kMaxInputChannels = 4;
struct NormParams {
  float scale[kMaxInputChannels] = {};
  float shift[kMaxInputChannels] = {};
  int32_t channels = 0;
};
NormParams make_norm_params(const InputNormalization& norm, int64_t channels, const char* who);

// The axis of `a` over an image of `size` pixels, with the whole image decoded.
AxisDesc axis_desc(const ResampleAxis& a, int64_t size);
// A sample whose final pixels (h x w x c bytes) are at `src`: each output reads one source pixel.
SampleDesc copy_desc(const uint8_t* src, int64_t h, int64_t w, int64_t c);

// PIL's taps of output i (sample_geometry.h): normalised over the source pixels of [lo, hi)
// inside the support, those outside the image then dropped (they read as 0), and the
// zero-weight ends trimmed. count 0: the output is 0. Host and device share it, so the window
// the decoder is asked for is exactly what the kernel reads; the filter is filter_weight's.
struct Taps {
  int32_t first = 0, count = 0;
  int32_t bicubic = 0;
  double centre = 0, inv_support = 1, inv_sum = 0;
};
KILN_HD inline double filter_at(int32_t bicubic, double x) {
  x = x < 0 ? -x : x;
  if (!bicubic) return x < 1 ? 1 - x : 0;
  const double a = -0.5;
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}
KILN_HD inline Taps axis_taps(const AxisDesc& a, int32_t i) {
  Taps t;
  const int32_t vlo = a.valid_lo > 0 ? a.valid_lo : 0,
                vhi = a.valid_hi < a.out ? a.valid_hi : a.out;
  if (i < vlo || i >= vhi) return t;
  const double fscale = a.scale > 1 ? a.scale : 1;
  const double support = (a.bicubic ? 2 : 1) * fscale;
  const double inv = 1 / fscale;
  const double centre = a.origin + (static_cast<double>(i) + 0.5) * a.scale;
  const double fmin = floor(centre - support + 0.5), fmax = floor(centre + support + 0.5);
  const int64_t xmin = fmin > a.lo ? static_cast<int64_t>(fmin) : a.lo;
  const int64_t xmax = fmax < a.hi ? static_cast<int64_t>(fmax) : a.hi;
  if (xmax <= xmin) return t;
  double sum = 0;
  for (int64_t j = xmin; j < xmax; ++j)
    sum += filter_at(a.bicubic, (static_cast<double>(j) - centre + 0.5) * inv);
  if (sum <= 0) return t;
  int64_t j0 = xmin > 0 ? xmin : 0, j1 = xmax < a.size ? xmax : a.size;
  while (j0 < j1 && filter_at(a.bicubic, (static_cast<double>(j0) - centre + 0.5) * inv) == 0) ++j0;
  while (j1 > j0 && filter_at(a.bicubic, (static_cast<double>(j1 - 1) - centre + 0.5) * inv) == 0)
    --j1;
  if (j1 <= j0) return t;
  t.first = static_cast<int32_t>(j0);
  t.count = static_cast<int32_t>(j1 - j0);
  t.bicubic = a.bicubic;
  t.centre = centre;
  t.inv_support = inv;
  t.inv_sum = 1 / sum;
  return t;
}
// The weight of source pixel j (inside the taps), rounded to float as the CPU's taps are.
KILN_HD inline float tap_weight(const Taps& t, int32_t j) {
  return static_cast<float>(
      filter_at(t.bicubic, (static_cast<double>(j) - t.centre + 0.5) * t.inv_support) * t.inv_sum);
}

// The source pixels an axis reads, [*first, *last), empty (first == last) when none.
void axis_span(const AxisDesc& a, int64_t* first, int64_t* last);

// out (batch x h x w x channels of `dtype`, F32 or F16) from the device descriptors; with
// `augments` (device, batch entries, or null), each sample's erase box set to its value.
void launch_stage_samples(const SampleDesc* descs, int64_t batch, int64_t h, int64_t w,
                          const NormParams& norm, void* out, DType dtype, cudaStream_t stream,
                          const AugmentDesc* augments = nullptr);
// The resampled samples as bytes (batch x h x w x channels), rounded as the host's
// resample_u8 rounds (v + 0.5 clamped to [0, 255], truncated): the input of the ops.
void launch_stage_samples_u8(const SampleDesc* descs, int64_t batch, int64_t h, int64_t w,
                             int64_t channels, uint8_t* out, cudaStream_t stream);
// out[p, c] = normalised in[p, c] over `pixels` pixels (device pointers).
void launch_normalize_u8(const uint8_t* in, int64_t pixels, const NormParams& norm, void* out,
                         DType dtype, cudaStream_t stream);

// out[i] = label i as int32 for i < count (in: I32 or I64 device memory), -1 (padding) for
// count <= i < batch. A label outside 0..classes-1 becomes `classes`, which poisons the step
// (loss.cu: a NaN loss) instead of passing as padding: the device cannot raise an error.
void launch_stage_labels(const void* in, DType dtype, int64_t count, int64_t batch, int32_t classes,
                         int32_t* out, cudaStream_t stream);

}  // namespace kiln::cuda
