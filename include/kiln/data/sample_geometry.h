// A sample's crop, resize and flip collapsed into one resampling of the decoded image, so that
// every input path computes the same pixels from the same random draws: the float transforms,
// the uint8 CPU path (which decodes only the rows and columns the geometry reads, at the
// smallest libjpeg DCT scale that keeps its detail) and the GPU path (nvJPEG, then one kernel).
//
// The filter is PIL's bilinear (a triangle, support 1) or bicubic (the cubic convolution kernel
// with a = -0.5, support 2), widened by the scale when shrinking, which is what torchvision's
// RandomResizedCrop / Resize do with antialias=True and what PIL does: output pixel i of an axis
// is centred on source coordinate origin + (i + 0.5) * scale; it weighs the source pixels j of
// [lo, hi) within support * max(scale, 1) of it by filter((j + 0.5 - centre) / max(scale, 1)),
// with the weights renormalised to sum to 1. [lo, hi) is the crop box for RandomResizedCrop
// (PIL crops before resizing) and the image for Resize. Outputs outside [valid_lo, valid_hi)
// are 0 (CenterCrop and RandomCrop padding), and so are source pixels outside the image.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

enum class ResampleFilter : int32_t { bilinear, bicubic };
const char* filter_name(ResampleFilter f);  // "bilinear", "bicubic"
// "bilinear" or "bicubic" (torchvision's --interpolation); anything else is refused.
ResampleFilter parse_filter(const std::string& name);
// PIL's filters (Resample.c): the triangle and the cubic with a = -0.5, which can be negative
// (so a bicubic output can overshoot the source's range and is clamped when rounded to bytes).
double filter_weight(ResampleFilter f, double x);
double filter_support(ResampleFilter f);  // 1 or 2 source pixels at scale 1

struct ResampleAxis {
  int64_t out = 0;  // output pixels
  double origin = 0;
  double scale = 1;                    // source pixels per output pixel
  int64_t lo = 0, hi = 0;              // source pixels the filter may read
  int64_t valid_lo = 0, valid_hi = 0;  // outputs that read the source; the rest are 0
  ResampleFilter filter = ResampleFilter::bilinear;

  // One source pixel per output (scale 1, origin integral): a plain copy.
  bool is_copy() const;
  static ResampleAxis identity(int64_t size);
  bool operator==(const ResampleAxis& o) const;
};

struct SampleGeometry {
  int64_t src_h = 0, src_w = 0;  // the image the axes refer to
  ResampleAxis y, x;
  bool flip = false;  // mirror the output left to right (applied last)

  int64_t out_h() const { return y.out; }
  int64_t out_w() const { return x.out; }
  static SampleGeometry identity(int64_t h, int64_t w);  // the image as it is
  bool operator==(const SampleGeometry& o) const;
};

// The source rows and columns the geometry reads (a decoder may skip the rest): the union of
// the taps of every output that reads the source, clipped to the image; empty when none does.
struct SourceWindow {
  int64_t top = 0, left = 0, height = 0, width = 0;
};
SourceWindow source_window(const SampleGeometry& g);

// The same output expressed on a copy of the source scaled to new_h x new_w, and on a window
// h x w starting at (top, left) of the source: coordinates scale by new / old (or by the
// factors given), the support stays the output pixel's footprint, lo / hi round to the nearest
// scaled pixel. libjpeg's DCT scaling maps pixel j of the scaled image to source pixels
// [8j / M, 8(j + 1) / M) and gives ceil(size * M / 8) pixels, so its factor is exactly M / 8,
// not new / old: rescale_source_dct says so.
SampleGeometry rescale_source(const SampleGeometry& g, int64_t new_h, int64_t new_w);
SampleGeometry rescale_source(const SampleGeometry& g, int64_t new_h, int64_t new_w, double fy,
                              double fx);
SampleGeometry rescale_source_dct(const SampleGeometry& g, int m);
SampleGeometry shift_source(const SampleGeometry& g, int64_t top, int64_t left, int64_t h,
                            int64_t w);

// The DCT scale M (of M/8: 1, 2, 4 or 8) to decode at: the smallest whose scaled image still
// has at least one source pixel per output pixel in both axes, so only downsampling follows.
// Powers of two only: libjpeg-turbo's other scales have no SIMD IDCT and are slower than the
// full-size decode.
int dct_scale_for(const SampleGeometry& g);

// The filter taps of one axis, computed once per sample: PIL's precompute_coeffs, with taps
// outside the image and zero-weight end taps dropped.
struct ResampleTaps {
  std::vector<int32_t> first;  // per output: first source index
  std::vector<int32_t> count;  // per output: number of taps (0: the output is 0)
  std::vector<float> weight;   // per output, `max_taps` weights
  int32_t max_taps = 0;
};
ResampleTaps resample_taps(const ResampleAxis& axis, int64_t src_size);
// The source index range [lo, hi) that outputs with count > 0 read; empty (0, 0) when none do.
void tap_span(const ResampleTaps& t, int64_t* lo, int64_t* hi);

// Resamples an 8-bit HWC image (rows `stride` bytes apart) into out (out_h x out_w x channels
// bytes), accumulating in float and rounding to nearest once. The two orders of the separable
// passes differ only by float rounding (about 1e-5 of a level): vertical_first (the default)
// runs the horizontal pass, the costlier one, on output rows only; horizontal_first is the
// order of PIL and of the float transforms (the switch KILN_RESAMPLE_VERTICAL_FIRST=0 picks it,
// through ResampledDecodeOptions).
//
// math = fixed16 (KILN_RESAMPLE_FIXED_POINT, the loader's default) computes the same taps in
// 16-bit fixed point, vertical pass first whatever the order: weights of 15 fraction bits (14
// where a weight is 1), an intermediate of up to 7 fraction bits; about 0.01 of a level from
// the float result, so a value within that of a .5 boundary may round the other way (see
// data_resample_fixed_test). fixed16 picks AVX2 or SSSE3 loops at run time; fixed16_ssse3 and
// fixed16_plain force the SSSE3 loops and plain ones (what runs where the CPU lacks SSSE3):
// the same integer arithmetic, bit for bit (the tests compare them).
enum class ResampleOrder { horizontal_first, vertical_first };
enum class ResampleMath { float32, fixed16, fixed16_ssse3, fixed16_plain };
void resample_u8(const uint8_t* src, int64_t src_h, int64_t src_w, int64_t channels, int64_t stride,
                 const SampleGeometry& g, uint8_t* out,
                 ResampleOrder order = ResampleOrder::vertical_first,
                 ResampleMath math = ResampleMath::float32);

}  // namespace kiln
