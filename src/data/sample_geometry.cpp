// The sample geometry and PIL's antialiased filter taps (Resample.c: precompute_coeffs);
// the kernels that apply them to 8-bit images are in resample.cpp.
#include "kiln/data/sample_geometry.h"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"

namespace kiln {

const char* filter_name(ResampleFilter f) {
  return f == ResampleFilter::bicubic ? "bicubic" : "bilinear";
}

ResampleFilter parse_filter(const std::string& name) {
  if (name == "bilinear") return ResampleFilter::bilinear;
  if (name == "bicubic") return ResampleFilter::bicubic;
  KILN_FAIL(InvalidArgument, "interpolation '", name,
            "' is not one kiln has; use bilinear or bicubic");
}

double filter_weight(ResampleFilter f, double x) {
  x = std::fabs(x);
  if (f == ResampleFilter::bilinear) return x < 1.0 ? 1.0 - x : 0.0;
  // PIL's bicubic_filter with a = -0.5 (torchvision's antialiased bicubic uses the same a).
  constexpr double a = -0.5;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

double filter_support(ResampleFilter f) {
  return f == ResampleFilter::bicubic ? 2.0 : 1.0;
}

namespace {

void check_axis(const ResampleAxis& a, const char* name) {
  KILN_CHECK(a.out > 0 && a.scale > 0 && std::isfinite(a.scale) && std::isfinite(a.origin),
             InvalidArgument, "sample geometry: the ", name, " axis needs out > 0 and a finite ",
             "scale > 0, got out ", a.out, ", scale ", a.scale, ", origin ", a.origin);
  KILN_CHECK(a.lo <= a.hi && a.valid_lo <= a.valid_hi, InvalidArgument, "sample geometry: the ",
             name, " axis has lo ", a.lo, " > hi ", a.hi, " or valid_lo ", a.valid_lo,
             " > valid_hi ", a.valid_hi);
}

}  // namespace

void tap_span(const ResampleTaps& t, int64_t* lo, int64_t* hi) {
  *lo = 0, *hi = 0;
  bool any = false;
  for (size_t i = 0; i < t.count.size(); ++i) {
    if (t.count[i] == 0) continue;
    const int64_t a = t.first[i], b = a + t.count[i];
    *lo = any ? std::min(*lo, a) : a;
    *hi = any ? std::max(*hi, b) : b;
    any = true;
  }
}

bool ResampleAxis::is_copy() const {
  return scale == 1.0 && origin == std::floor(origin);
}

ResampleAxis ResampleAxis::identity(int64_t size) {
  ResampleAxis a;
  a.out = size;
  a.origin = 0;
  a.scale = 1;
  a.lo = 0, a.hi = size;
  a.valid_lo = 0, a.valid_hi = size;
  return a;
}

bool ResampleAxis::operator==(const ResampleAxis& o) const {
  return out == o.out && origin == o.origin && scale == o.scale && lo == o.lo && hi == o.hi &&
         valid_lo == o.valid_lo && valid_hi == o.valid_hi && filter == o.filter;
}

SampleGeometry SampleGeometry::identity(int64_t h, int64_t w) {
  SampleGeometry g;
  g.src_h = h, g.src_w = w;
  g.y = ResampleAxis::identity(h);
  g.x = ResampleAxis::identity(w);
  return g;
}

bool SampleGeometry::operator==(const SampleGeometry& o) const {
  return src_h == o.src_h && src_w == o.src_w && y == o.y && x == o.x && flip == o.flip;
}

ResampleTaps resample_taps(const ResampleAxis& a, int64_t src_size) {
  check_axis(a, "a");
  const double fscale = std::max(a.scale, 1.0);  // the filter widens when shrinking
  const double support = filter_support(a.filter) * fscale;
  const double inv = 1.0 / fscale;
  const int64_t bound = static_cast<int64_t>(std::ceil(support)) * 2 + 2;
  ResampleTaps t;
  t.first.assign(static_cast<size_t>(a.out), 0);
  t.count.assign(static_cast<size_t>(a.out), 0);
  std::vector<float> wide(static_cast<size_t>(a.out * bound), 0.0f);
  std::vector<double> w(static_cast<size_t>(bound));
  const int64_t vlo = std::max<int64_t>(0, a.valid_lo), vhi = std::min(a.out, a.valid_hi);
  for (int64_t i = vlo; i < vhi; ++i) {
    const double centre = a.origin + (static_cast<double>(i) + 0.5) * a.scale;
    // PIL rounds with (int)(v + 0.5); floor is the same for v >= 0 and right for padding (< 0).
    const int64_t xmin = std::max(a.lo, static_cast<int64_t>(std::floor(centre - support + 0.5)));
    const int64_t xmax = std::min(a.hi, static_cast<int64_t>(std::floor(centre + support + 0.5)));
    if (xmax <= xmin) continue;
    double sum = 0;
    for (int64_t j = xmin; j < xmax; ++j) {
      w[static_cast<size_t>(j - xmin)] =
          filter_weight(a.filter, (static_cast<double>(j) - centre + 0.5) * inv);
      sum += w[static_cast<size_t>(j - xmin)];
    }
    if (sum <= 0) continue;
    // Pixels outside the image read as 0: drop them after normalising, and trim zero weights.
    int64_t j0 = std::max<int64_t>(xmin, 0), j1 = std::min(xmax, src_size);
    while (j0 < j1 && w[static_cast<size_t>(j0 - xmin)] == 0) ++j0;
    while (j1 > j0 && w[static_cast<size_t>(j1 - 1 - xmin)] == 0) --j1;
    if (j1 <= j0) continue;
    t.first[static_cast<size_t>(i)] = static_cast<int32_t>(j0);
    t.count[static_cast<size_t>(i)] = static_cast<int32_t>(j1 - j0);
    for (int64_t j = j0; j < j1; ++j) {
      wide[static_cast<size_t>(i * bound + j - j0)] =
          static_cast<float>(w[static_cast<size_t>(j - xmin)] / sum);
    }
    t.max_taps = std::max(t.max_taps, static_cast<int32_t>(j1 - j0));
  }
  t.max_taps = std::max(t.max_taps, 1);
  t.weight.assign(static_cast<size_t>(a.out * t.max_taps), 0.0f);
  for (int64_t i = 0; i < a.out; ++i) {
    std::copy_n(&wide[static_cast<size_t>(i * bound)], t.max_taps,
                &t.weight[static_cast<size_t>(i * t.max_taps)]);
  }
  return t;
}

SourceWindow source_window(const SampleGeometry& g) {
  int64_t y0, y1, x0, x1;
  tap_span(resample_taps(g.y, g.src_h), &y0, &y1);
  tap_span(resample_taps(g.x, g.src_w), &x0, &x1);
  if (y1 <= y0 || x1 <= x0) return {};
  return {y0, x0, y1 - y0, x1 - x0};
}

namespace {
ResampleAxis rescale_axis(const ResampleAxis& a, double f) {
  ResampleAxis r = a;
  r.origin = a.origin * f;
  r.scale = a.scale * f;
  r.lo = static_cast<int64_t>(std::floor(static_cast<double>(a.lo) * f + 0.5));
  r.hi = static_cast<int64_t>(std::floor(static_cast<double>(a.hi) * f + 0.5));
  return r;
}
}  // namespace

SampleGeometry rescale_source(const SampleGeometry& g, int64_t new_h, int64_t new_w) {
  KILN_CHECK(new_h > 0 && new_w > 0 && g.src_h > 0 && g.src_w > 0, InvalidArgument,
             "rescale_source needs positive sizes, got ", g.src_h, "x", g.src_w, " -> ", new_h, "x",
             new_w);
  return rescale_source(g, new_h, new_w, static_cast<double>(new_h) / static_cast<double>(g.src_h),
                        static_cast<double>(new_w) / static_cast<double>(g.src_w));
}

SampleGeometry rescale_source(const SampleGeometry& g, int64_t new_h, int64_t new_w, double fy,
                              double fx) {
  KILN_CHECK(new_h > 0 && new_w > 0 && fy > 0 && fx > 0, InvalidArgument,
             "rescale_source needs positive sizes and factors, got ", new_h, "x", new_w,
             ", factors ", fy, ", ", fx);
  SampleGeometry r = g;
  r.src_h = new_h, r.src_w = new_w;
  r.y = rescale_axis(g.y, fy);
  r.x = rescale_axis(g.x, fx);
  return r;
}

SampleGeometry rescale_source_dct(const SampleGeometry& g, int m) {
  KILN_CHECK(m >= 1 && m <= 16, InvalidArgument, "a DCT scale is M/8 with M in 1..16, not ", m);
  if (m == 8) return g;
  const double f = m / 8.0;
  auto scaled = [m](int64_t n) { return (n * m + 7) / 8; };  // libjpeg's ceil(n * M / 8)
  return rescale_source(g, scaled(g.src_h), scaled(g.src_w), f, f);
}

SampleGeometry shift_source(const SampleGeometry& g, int64_t top, int64_t left, int64_t h,
                            int64_t w) {
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, "shift_source needs a positive window, got ", h, "x",
             w);
  SampleGeometry r = g;
  r.src_h = h, r.src_w = w;
  r.y.origin -= static_cast<double>(top);
  r.y.lo -= top, r.y.hi -= top;
  r.x.origin -= static_cast<double>(left);
  r.x.lo -= left, r.x.hi -= left;
  return r;
}

int dct_scale_for(const SampleGeometry& g) {
  // The smallest M with scale * M / 8 >= 1 (a little slack for scales like 8/3 computed in
  // floating point) in both axes, rounded up to a power of two: libjpeg-turbo has SIMD IDCTs
  // for 1/8, 2/8 and 4/8 only; 3/8, 5/8, 6/8 and 7/8 run plain C (and 12x12 or 14x14 IDCTs for
  // subsampled chroma), slower than the full-size decode they replace.
  auto need = [](double scale) {
    const double m = std::ceil(8.0 / scale - 1e-9);
    return static_cast<int>(std::min(8.0, std::max(1.0, m)));
  };
  const int m = std::max(need(g.y.scale), need(g.x.scale));
  int p = 1;
  while (p < m) p *= 2;
  return p;
}

}  // namespace kiln
