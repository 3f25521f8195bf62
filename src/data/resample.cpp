// resample_u8: a sample geometry's taps (sample_geometry.h) applied to an 8-bit HWC image, as
// two separable passes in float with one rounding at the end. horizontal_first is PIL's order;
// vertical_first runs the horizontal pass, whose gathers cost more per tap than the vertical
// pass's contiguous rows, on output rows instead of source rows.
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kiln/core/error.h"
#include "kiln/data/sample_geometry.h"
#include "resample_fixed.h"

namespace kiln {
namespace {

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

// ---- Horizontal first: PIL's order -----------------------------------------------------------

// Per-thread scratch, reused across samples: one source row as floats, and the horizontal
// pass's output rows.
thread_local std::vector<float> tl_src;
thread_local std::vector<float> tl_rows;

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

void resample_horizontal_first(const uint8_t* src, int64_t src_w, int64_t c, int64_t stride,
                               const ResampleTaps& ty, const ResampleTaps& tx, bool flip,
                               uint8_t* out) {
  const int64_t out_h = static_cast<int64_t>(ty.count.size());
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
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
      horizontal_row3(srow.data(), tx, flip, d);
    } else {
      horizontal_row(srow.data(), tx, c, flip, d);
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
    // The last tap, rounding and the store in one pass. Bilinear weights are >= 0 and sum to
    // at most 1, so values lie in [0, 255] up to float error; bicubic ones overshoot, which
    // the clamp cuts as PIL's clip8 does.
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

// ---- Vertical first --------------------------------------------------------------------------

// Per-thread scratch, reused across samples.
struct VerticalFirstScratch {
  std::vector<float> ring;         // source rows as floats, one slot per vertical tap
  std::vector<int64_t> ring_row;   // the source row each slot holds, -1 for none
  std::vector<const float*> rows;  // one output's taps: slots of the ring
  std::vector<float> column;       // one output row after the vertical pass, zero slack after
  std::vector<float> row;          // the same after the horizontal pass
  // The horizontal taps in output order (the flip folded in): each output's first tap as a
  // float index into `column`, and its max_taps weights broadcast to 4 lanes (3 channels).
  std::vector<int32_t> offset;
  std::vector<v4f> wide;
};
thread_local VerticalFirstScratch tl_vf;

// dst[j] (+)= sum_k w[k] * rows[k][j] over N taps, left to right: one pass over the row for up
// to four taps instead of one per tap.
template <int N>
void vertical_taps(float* __restrict dst, const float* const* rows, const float* w, int64_t n,
                   bool init) {
  const float* __restrict r0 = rows[0];
  const float* __restrict r1 = rows[N > 1 ? 1 : 0];
  const float* __restrict r2 = rows[N > 2 ? 2 : 0];
  const float* __restrict r3 = rows[N > 3 ? 3 : 0];
  const float w0 = w[0], w1 = N > 1 ? w[1] : 0, w2 = N > 2 ? w[2] : 0, w3 = N > 3 ? w[3] : 0;
  for (int64_t j = 0; j < n; ++j) {
    float a = init ? w0 * r0[j] : dst[j] + w0 * r0[j];
    if (N > 1) a += w1 * r1[j];
    if (N > 2) a += w2 * r2[j];
    if (N > 3) a += w3 * r3[j];
    dst[j] = a;
  }
}

void vertical_row(float* dst, const float* const* rows, const float* w, int32_t taps, int64_t n) {
  for (int32_t k = 0; k < taps; k += 4) {
    const bool init = k == 0;
    switch (std::min(4, taps - k)) {
      case 1:
        vertical_taps<1>(dst, rows + k, w + k, n, init);
        break;
      case 2:
        vertical_taps<2>(dst, rows + k, w + k, n, init);
        break;
      case 3:
        vertical_taps<3>(dst, rows + k, w + k, n, init);
        break;
      default:
        vertical_taps<4>(dst, rows + k, w + k, n, init);
        break;
    }
  }
}

// Horizontal pass of one 3-channel row with NK taps per output (0: nk at run time), four
// outputs at a time so that their sums are independent chains; a tap is one load, one multiply
// and one add. Stores spill one float into the next pixel, which its own store overwrites.
template <int NK>
void horizontal3(const float* column, const int32_t* offset, const v4f* wide, int32_t nk_run,
                 int64_t out_w, float* dst) {
  const int32_t nk = NK > 0 ? NK : nk_run;
  int64_t i = 0;
  for (; i + 4 <= out_w; i += 4) {
    const v4f* w = wide + i * nk;
    const float *s0 = column + offset[i], *s1 = column + offset[i + 1],
                *s2 = column + offset[i + 2], *s3 = column + offset[i + 3];
    v4f a0 = w[0] * load4(s0), a1 = w[nk] * load4(s1), a2 = w[2 * nk] * load4(s2),
        a3 = w[3 * nk] * load4(s3);
    for (int32_t k = 1; k < nk; ++k) {
      a0 += w[k] * load4(s0 + 3 * k);
      a1 += w[nk + k] * load4(s1 + 3 * k);
      a2 += w[2 * nk + k] * load4(s2 + 3 * k);
      a3 += w[3 * nk + k] * load4(s3 + 3 * k);
    }
    store4(dst + i * 3, a0);
    store4(dst + i * 3 + 3, a1);
    store4(dst + i * 3 + 6, a2);
    store4(dst + i * 3 + 9, a3);
  }
  for (; i < out_w; ++i) {
    const v4f* w = wide + i * nk;
    const float* s = column + offset[i];
    v4f a = w[0] * load4(s);
    for (int32_t k = 1; k < nk; ++k) a += w[k] * load4(s + 3 * k);
    store4(dst + i * 3, a);
  }
}

void horizontal3_any(const float* column, const int32_t* offset, const v4f* wide, int32_t nk,
                     int64_t out_w, float* dst) {
  switch (nk) {
    case 1:
      return horizontal3<1>(column, offset, wide, nk, out_w, dst);
    case 2:
      return horizontal3<2>(column, offset, wide, nk, out_w, dst);
    case 3:
      return horizontal3<3>(column, offset, wide, nk, out_w, dst);
    case 4:
      return horizontal3<4>(column, offset, wide, nk, out_w, dst);
    case 5:
      return horizontal3<5>(column, offset, wide, nk, out_w, dst);
    case 6:
      return horizontal3<6>(column, offset, wide, nk, out_w, dst);
    default:
      return horizontal3<0>(column, offset, wide, nk, out_w, dst);
  }
}

// Other channel counts: output i of the flipped row reads output out_w - 1 - i's taps.
void horizontal_any(const float* column, const ResampleTaps& tx, const int32_t* offset, int64_t c,
                    bool flip, float* dst) {
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  for (int64_t i = 0; i < out_w; ++i) {
    const int64_t x = flip ? out_w - 1 - i : i;
    const int32_t n = tx.count[static_cast<size_t>(x)];
    const float* w = tx.weight.data() + x * tx.max_taps;
    const float* s = column + offset[i];
    for (int64_t ch = 0; ch < c; ++ch) {
      float a = 0;
      for (int32_t k = 0; k < n; ++k) a += w[k] * s[k * c + ch];
      dst[i * c + ch] = a;
    }
  }
}

// Rounds to nearest and clamps to [0, 255] (on SSE2: truncation of v + 0.5 toward zero, then
// the saturating packs): float error for bilinear, bicubic's overshoot as PIL's clip8.
void round_row(const float* src, int64_t n, uint8_t* dst) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 half = _mm_set1_ps(0.5f);
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_cvttps_epi32(_mm_add_ps(_mm_loadu_ps(src + i), half));
    const __m128i b = _mm_cvttps_epi32(_mm_add_ps(_mm_loadu_ps(src + i + 4), half));
    const __m128i c = _mm_cvttps_epi32(_mm_add_ps(_mm_loadu_ps(src + i + 8), half));
    const __m128i d = _mm_cvttps_epi32(_mm_add_ps(_mm_loadu_ps(src + i + 12), half));
    const __m128i v = _mm_packus_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), v);
  }
#endif
  for (; i < n; ++i) {
    float v = src[i] + 0.5f;
    v = v < 0.0f ? 0.0f : v;
    v = v > 255.0f ? 255.0f : v;
    dst[i] = static_cast<uint8_t>(static_cast<int32_t>(v));
  }
}

void resample_vertical_first(const uint8_t* src, int64_t c, int64_t stride, const ResampleTaps& ty,
                             const ResampleTaps& tx, bool flip, uint8_t* out) {
  const int64_t out_h = static_cast<int64_t>(ty.count.size());
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  const int64_t row = out_w * c;
  int64_t r0, r1, c0, c1;
  tap_span(ty, &r0, &r1);
  tap_span(tx, &c0, &c1);
  if (r1 <= r0 || c1 <= c0) {
    std::memset(out, 0, static_cast<size_t>(out_h * row));
    return;
  }
  VerticalFirstScratch& s = tl_vf;
  // The vertical pass covers the columns the taps read, [c0, c1); the horizontal pass reads
  // max_taps pixels from each output's first, beyond c1 for the last ones: zeros there.
  const int64_t n = (c1 - c0) * c;
  const int32_t nk = tx.max_taps;
  const size_t column_size = static_cast<size_t>(n + (nk + 2) * c + 4);
  if (s.column.size() < column_size) s.column.resize(column_size);
  std::fill(s.column.begin() + n, s.column.begin() + static_cast<std::ptrdiff_t>(column_size),
            0.0f);
  if (s.row.size() < static_cast<size_t>(row + 4)) s.row.resize(static_cast<size_t>(row + 4));
  s.offset.resize(static_cast<size_t>(out_w));
  if (c == 3) s.wide.resize(static_cast<size_t>(out_w * nk));
  for (int64_t i = 0; i < out_w; ++i) {
    const size_t x = static_cast<size_t>(flip ? out_w - 1 - i : i);
    // An output with no taps has zero weights; any offset inside the row does.
    const int64_t f = tx.count[x] > 0 ? tx.first[x] : c0;
    s.offset[static_cast<size_t>(i)] = static_cast<int32_t>((f - c0) * c);
    if (c != 3) continue;
    for (int32_t k = 0; k < nk; ++k) {
      const float w = tx.weight[x * static_cast<size_t>(nk) + static_cast<size_t>(k)];
      s.wide[static_cast<size_t>(i * nk + k)] = v4f{w, w, w, w};
    }
  }
  // A ring of converted source rows: an output's taps are consecutive rows, at most max_taps of
  // them, so they fall in distinct slots; each slot remembers its row.
  const int32_t slots = ty.max_taps;
  if (s.ring.size() < static_cast<size_t>(slots * n)) s.ring.resize(static_cast<size_t>(slots * n));
  s.ring_row.assign(static_cast<size_t>(slots), -1);
  s.rows.resize(static_cast<size_t>(slots));
  for (int64_t y = 0; y < out_h; ++y) {
    uint8_t* o = out + y * row;
    const int32_t taps = ty.count[static_cast<size_t>(y)];
    if (taps == 0) {
      std::memset(o, 0, static_cast<size_t>(row));
      continue;
    }
    const int64_t first = ty.first[static_cast<size_t>(y)];
    for (int32_t k = 0; k < taps; ++k) {
      const int64_t r = first + k;
      const size_t slot = static_cast<size_t>(r % slots);
      float* d = s.ring.data() + static_cast<int64_t>(slot) * n;
      if (s.ring_row[slot] != r) {
        const uint8_t* p = src + r * stride + c0 * c;
        for (int64_t j = 0; j < n; ++j) d[j] = p[j];
        s.ring_row[slot] = r;
      }
      s.rows[static_cast<size_t>(k)] = d;
    }
    vertical_row(s.column.data(), s.rows.data(), ty.weight.data() + y * ty.max_taps, taps, n);
    if (c == 3) {
      horizontal3_any(s.column.data(), s.offset.data(), s.wide.data(), nk, out_w, s.row.data());
    } else {
      horizontal_any(s.column.data(), tx, s.offset.data(), c, flip, s.row.data());
    }
    round_row(s.row.data(), row, o);
  }
}

}  // namespace

void resample_u8(const uint8_t* src, int64_t src_h, int64_t src_w, int64_t channels, int64_t stride,
                 const SampleGeometry& g, uint8_t* out, ResampleOrder order, ResampleMath math) {
  KILN_CHECK(src_h == g.src_h && src_w == g.src_w, InvalidArgument, "resample_u8: the image is ",
             src_h, "x", src_w, " but the geometry refers to ", g.src_h, "x", g.src_w,
             "; shift or rescale the geometry to the decoded image");
  KILN_CHECK(channels >= 1 && stride >= src_w * channels, InvalidArgument,
             "resample_u8: ", channels, " channels with a row stride of ", stride, " bytes for ",
             src_w, " pixels");
  const ResampleTaps ty = resample_taps(g.y, src_h);
  const ResampleTaps tx = resample_taps(g.x, src_w);
  if (math != ResampleMath::float32) {
    const FixedSimd simd = math == ResampleMath::fixed16         ? FixedSimd::best
                           : math == ResampleMath::fixed16_ssse3 ? FixedSimd::ssse3
                                                                 : FixedSimd::plain;
    resample_u8_fixed(src, channels, stride, ty, tx, g.flip, out, simd);
    return;
  }
  if (order == ResampleOrder::vertical_first) {
    resample_vertical_first(src, channels, stride, ty, tx, g.flip, out);
  } else {
    resample_horizontal_first(src, src_w, channels, stride, ty, tx, g.flip, out);
  }
}

}  // namespace kiln
