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

// Per-thread scratch, reused across samples: one source row as floats, and the horizontal
// pass's output rows.
thread_local std::vector<float> tl_src;
thread_local std::vector<float> tl_rows;

// Four floats, loaded and stored unaligned (GCC / clang vector extension: SSE on x86, NEON on
// ARM), holding one RGB pixel plus a lane that is ignored.
typedef float v4f __attribute__((vector_size(16)));
inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, v4f v) {
  std::memcpy(p, &v, sizeof v);
}

// Horizontal pass of one source row (as floats, with slack after its end for max_taps pixels
// and 4 floats) into out_w x 3 floats (one float of slack after the end). Every output runs
// max_taps taps (the unused weights are 0, over finite pixels), four outputs at a time so that
// their sums are independent chains. Outputs with no taps are 0; the order is mirrored when
// flip, so the vertical pass needs no flip.
void horizontal_row3(const float* src, const ResampleTaps& tx, bool flip, float* dst) {
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  const int32_t nk = tx.max_taps;
  auto at = [&](int64_t i) { return flip ? out_w - 1 - i : i; };
  // Each 4-float store spills one float into the next pixel: stores go in increasing address
  // order, so the spill is overwritten by that pixel's own store.
  int64_t i = 0;
  for (; i + 4 <= out_w; i += 4) {
    const int64_t x[4] = {at(i), at(i + 1), at(i + 2), at(i + 3)};
    const float* w[4];
    const float* s[4];
    for (int j = 0; j < 4; ++j) {
      w[j] = tx.weight.data() + x[j] * nk;
      s[j] = src + static_cast<int64_t>(tx.first[static_cast<size_t>(x[j])]) * 3;
    }
    v4f a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
    for (int32_t k = 0; k < nk; ++k) {
      a0 += w[0][k] * load4(s[0] + 3 * k);
      a1 += w[1][k] * load4(s[1] + 3 * k);
      a2 += w[2][k] * load4(s[2] + 3 * k);
      a3 += w[3][k] * load4(s[3] + 3 * k);
    }
    store4(dst + i * 3, a0);
    store4(dst + i * 3 + 3, a1);
    store4(dst + i * 3 + 6, a2);
    store4(dst + i * 3 + 9, a3);
  }
  for (; i < out_w; ++i) {
    const int64_t x = at(i);
    const float* w = tx.weight.data() + x * nk;
    const float* s = src + static_cast<int64_t>(tx.first[static_cast<size_t>(x)]) * 3;
    v4f a = {0, 0, 0, 0};
    for (int32_t k = 0; k < nk; ++k) a += w[k] * load4(s + 3 * k);
    store4(dst + i * 3, a);
  }
}

void horizontal_row(const float* src, const ResampleTaps& tx, int64_t c, bool flip, float* dst) {
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  const int32_t stride = tx.max_taps;
  for (int64_t x = 0; x < out_w; ++x) {
    float* d = dst + (flip ? out_w - 1 - x : x) * c;
    const int32_t n = tx.count[static_cast<size_t>(x)];
    const float* w = tx.weight.data() + x * stride;
    const float* s = src + static_cast<int64_t>(tx.first[static_cast<size_t>(x)]) * c;
    if (c == 1) {
      float a = 0;
      for (int32_t k = 0; k < n; ++k) a += w[k] * s[k];
      d[0] = a;
      continue;
    }
    for (int64_t ch = 0; ch < c; ++ch) {
      float a = 0;
      for (int32_t k = 0; k < n; ++k) a += w[k] * s[k * c + ch];
      d[ch] = a;
    }
  }
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

void resample_u8(const uint8_t* src, int64_t src_h, int64_t src_w, int64_t channels, int64_t stride,
                 const SampleGeometry& g, uint8_t* out) {
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
  int64_t r0, r1, c0, c1;
  tap_span(ty, &r0, &r1);
  tap_span(tx, &c0, &c1);
  std::vector<float>& rows = tl_rows;
  std::vector<float>& srow = tl_src;
  if (rows.size() < static_cast<size_t>((r1 - r0) * row + 4)) {
    rows.resize(static_cast<size_t>((r1 - r0) * row + 4));
  }
  // Slack for max_taps pixels past the end (read with weight 0: the values must be finite, and
  // resize's zeros and converted bytes are) and for 4-float loads.
  const size_t srow_size = static_cast<size_t>((src_w + tx.max_taps) * c + 4);
  if (srow.size() < srow_size) srow.resize(srow_size);
  for (int64_t r = r0; r < r1; ++r) {
    // Only the columns the taps read are converted; the rest of srow is never read.
    const uint8_t* s = src + r * stride;
    for (int64_t i = c0 * c; i < c1 * c; ++i) srow[static_cast<size_t>(i)] = s[i];
    float* d = rows.data() + (r - r0) * row;
    if (c == 3) {
      horizontal_row3(srow.data(), tx, g.flip, d);
    } else {
      horizontal_row(srow.data(), tx, c, g.flip, d);
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
    if (n == 1) {
      for (int64_t i = 0; i < row; ++i) a[i] = 0.0f;
    } else {
      const float w0 = w[0];
      for (int64_t i = 0; i < row; ++i) a[i] = w0 * base[i];
      for (int32_t k = 1; k < n - 1; ++k) {
        const float wk = w[k];
        const float* s = base + k * row;
        for (int64_t i = 0; i < row; ++i) a[i] += wk * s[i];
      }
    }
    // The last tap, rounding and the store in one pass. The weights are >= 0 and sum to at
    // most 1, so values lie in [0, 255] up to float error; the clamp only guards that error.
    const float wl = w[n - 1];
    const float* sl = base + (n - 1) * row;
    for (int64_t i = 0; i < row; ++i) {
      float v = a[i] + wl * sl[i] + 0.5f;
      v = v < 0.0f ? 0.0f : v;
      v = v > 255.0f ? 255.0f : v;
      o[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
    }
  }
}

}  // namespace kiln
