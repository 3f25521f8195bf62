// PIL's antialiased bilinear resampling (Resample.c: precompute_coeffs, then a horizontal and a
// vertical pass), with float accumulation and one rounding at the end.
#include "kiln/data/sample_geometry.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kiln/core/error.h"

namespace kiln {
namespace {

double triangle(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

void check_axis(const ResampleAxis& a, const char* name) {
  KILN_CHECK(a.out > 0 && a.scale > 0 && std::isfinite(a.scale) && std::isfinite(a.origin),
             InvalidArgument, "sample geometry: the ", name, " axis needs out > 0 and a finite ",
             "scale > 0, got out ", a.out, ", scale ", a.scale, ", origin ", a.origin);
  KILN_CHECK(a.lo <= a.hi && a.valid_lo <= a.valid_hi, InvalidArgument, "sample geometry: the ",
             name, " axis has lo ", a.lo, " > hi ", a.hi, " or valid_lo ", a.valid_lo,
             " > valid_hi ", a.valid_hi);
}

// The source index range [first, first + count) that outputs with count > 0 read.
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

// Per-thread scratch: the horizontal pass's rows (float), reused across samples.
thread_local std::vector<float> tl_rows;

// Horizontal pass of one source row into out_w x C floats; outputs with no taps are 0. `dst`
// is written in output order, mirrored when flip (so the vertical pass needs no flip).
template <int C>
void horizontal_row(const uint8_t* src, const ResampleTaps& tx, int64_t channels, bool flip,
                    float* dst) {
  const int64_t c = C > 0 ? C : channels;
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  const int32_t stride = tx.max_taps;
  for (int64_t x = 0; x < out_w; ++x) {
    float* d = dst + (flip ? out_w - 1 - x : x) * c;
    const int32_t n = tx.count[static_cast<size_t>(x)];
    const float* w = tx.weight.data() + x * stride;
    const uint8_t* s = src + static_cast<int64_t>(tx.first[static_cast<size_t>(x)]) * c;
    if constexpr (C == 3) {
      float a0 = 0, a1 = 0, a2 = 0;
      for (int32_t k = 0; k < n; ++k, s += 3) {
        a0 += w[k] * s[0];
        a1 += w[k] * s[1];
        a2 += w[k] * s[2];
      }
      d[0] = a0, d[1] = a1, d[2] = a2;
    } else if constexpr (C == 1) {
      float a = 0;
      for (int32_t k = 0; k < n; ++k) a += w[k] * s[k];
      d[0] = a;
    } else {
      for (int64_t ch = 0; ch < c; ++ch) {
        float a = 0;
        for (int32_t k = 0; k < n; ++k) a += w[k] * s[k * c + ch];
        d[ch] = a;
      }
    }
  }
}

uint8_t to_u8(float v) {
  v = std::min(255.0f, std::max(0.0f, v));
  return static_cast<uint8_t>(static_cast<int>(v + 0.5f));
}

}  // namespace

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
         valid_lo == o.valid_lo && valid_hi == o.valid_hi;
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
  const double support = std::max(a.scale, 1.0);  // bilinear's support 1, widened when shrinking
  const double inv = 1.0 / support;
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
      w[static_cast<size_t>(j - xmin)] = triangle((static_cast<double>(j) - centre + 0.5) * inv);
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
             "rescale_source needs positive sizes, got ", g.src_h, "x", g.src_w, " -> ", new_h,
             "x", new_w);
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
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, "shift_source needs a positive window, got ", h,
             "x", w);
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
  // floating point), in both axes.
  auto need = [](double scale) {
    const double m = std::ceil(8.0 / scale - 1e-9);
    return static_cast<int>(std::min(8.0, std::max(1.0, m)));
  };
  return std::max(need(g.y.scale), need(g.x.scale));
}

void resample_u8(const uint8_t* src, int64_t src_h, int64_t src_w, int64_t channels,
                 int64_t stride, const SampleGeometry& g, uint8_t* out) {
  KILN_CHECK(src_h == g.src_h && src_w == g.src_w, InvalidArgument, "resample_u8: the image is ",
             src_h, "x", src_w, " but the geometry refers to ", g.src_h, "x", g.src_w,
             "; shift or rescale the geometry to the decoded image");
  KILN_CHECK(channels >= 1 && stride >= src_w * channels, InvalidArgument,
             "resample_u8: ", channels, " channels with a row stride of ", stride, " bytes for ",
             src_w, " pixels");
  const ResampleTaps ty = resample_taps(g.y, src_h);
  const ResampleTaps tx = resample_taps(g.x, src_w);
  const int64_t out_h = g.y.out, out_w = g.x.out, c = channels;
  const int64_t row = out_w * c;
  int64_t r0, r1;
  tap_span(ty, &r0, &r1);
  std::vector<float>& rows = tl_rows;
  if (rows.size() < static_cast<size_t>((r1 - r0) * row)) {
    rows.resize(static_cast<size_t>((r1 - r0) * row));
  }
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* s = src + r * stride;
    float* d = rows.data() + (r - r0) * row;
    if (c == 3) {
      horizontal_row<3>(s, tx, c, g.flip, d);
    } else if (c == 1) {
      horizontal_row<1>(s, tx, c, g.flip, d);
    } else {
      horizontal_row<0>(s, tx, c, g.flip, d);
    }
  }
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(row));
  for (int64_t y = 0; y < out_h; ++y) {
    uint8_t* o = out + y * row;
    const int32_t n = ty.count[static_cast<size_t>(y)];
    if (n == 0) {
      std::memset(o, 0, static_cast<size_t>(row));
      continue;
    }
    const float* w = ty.weight.data() + y * ty.max_taps;
    const float* base = rows.data() + (ty.first[static_cast<size_t>(y)] - r0) * row;
    float* a = acc.data();
    {
      const float w0 = w[0];
      for (int64_t i = 0; i < row; ++i) a[i] = w0 * base[i];
    }
    for (int32_t k = 1; k < n; ++k) {
      const float wk = w[k];
      const float* s = base + k * row;
      for (int64_t i = 0; i < row; ++i) a[i] += wk * s[i];
    }
    for (int64_t i = 0; i < row; ++i) o[i] = to_u8(a[i]);
  }
}

}  // namespace kiln
