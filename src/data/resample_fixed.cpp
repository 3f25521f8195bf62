// The uint8 resample in 16-bit fixed point, as Pillow-SIMD does it, but keeping fraction bits
// between the passes where PIL rounds to bytes. Vertical pass first: a tap pair of two source
// rows is one pmaddwd (byte pixels widened to int16, times int16 weights, summed in int32),
// rounded to an int16 intermediate with F fraction bits (7, or fewer where bicubic's overshoot
// needs the range). Horizontal pass: for an RGB output pixel, one pshufb puts two neighbouring
// pixels' channels side by side and one pmaddwd applies a tap pair to all three channels
// (AVX2: two output pixels an instruction; grey rows: a gather of eight outputs' tap pairs).
// The AVX2 loops run where the CPU has AVX2 (checked at run time), else SSE2/SSSE3. Weights carry
// 15 fraction bits where every weight and sum fits (14 when a weight is 1), and each output's
// weights are nudged to sum exactly to one, so flat regions come out exact. Integer sums are exact,
// so the SIMD and the plain loops agree bit for bit.
#include "resample_fixed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // SSE2 everywhere; SSSE3 and AVX2 functions by target attribute
#define KILN_RESAMPLE_X86 1
#else
#define KILN_RESAMPLE_X86 0
#endif

#include "kiln/core/error.h"

namespace kiln {
namespace {

// One axis's taps as int16: per output (in output order: the flip folded in), max_taps weights
// of value q / 2^bits, zero past the output's count.
struct FixedAxis {
  std::vector<int16_t> q;
  std::vector<int32_t> first;  // first source index per output (its count may be 0)
  std::vector<int32_t> count;
  int32_t max_taps = 1;
  int bits = 15;
  int64_t pos = 0, neg = 0;  // largest per-output sum of the positive / negated negative q
};

// The largest bits <= 15 at which every weight fits int16 and every output's sum of |q| is at
// most max_abs_sum (the caller's bound against int32 overflow).
FixedAxis quantise(const ResampleTaps& t, bool flip, int64_t max_abs_sum) {
  const int64_t out = static_cast<int64_t>(t.count.size());
  const int32_t nk = t.max_taps;
  FixedAxis f;
  f.max_taps = nk;
  f.q.assign(static_cast<size_t>(out * nk), 0);
  f.first.assign(static_cast<size_t>(out), 0);
  f.count.assign(static_cast<size_t>(out), 0);
  std::vector<int64_t> v(static_cast<size_t>(nk));
  for (int bits = 15; bits >= 8; --bits) {
    bool fits = true;
    f.bits = bits;
    f.pos = f.neg = 0;
    const double one = std::ldexp(1.0, bits);
    for (int64_t i = 0; i < out && fits; ++i) {
      const size_t x = static_cast<size_t>(flip ? out - 1 - i : i);
      const int32_t n = t.count[x];
      f.first[static_cast<size_t>(i)] = t.first[x];
      f.count[static_cast<size_t>(i)] = n;
      int16_t* q = f.q.data() + i * nk;
      if (n == 0) continue;
      int64_t sum = 0;
      size_t largest = 0;
      for (size_t k = 0; k < static_cast<size_t>(n); ++k) {
        v[k] = std::llround(static_cast<double>(t.weight[x * static_cast<size_t>(nk) + k]) * one);
        sum += v[k];
        if (v[k] > v[largest]) largest = k;
      }
      v[largest] += static_cast<int64_t>(one) - sum;  // the weights sum to exactly one
      int64_t pos = 0, neg = 0;
      for (size_t k = 0; k < static_cast<size_t>(n) && fits; ++k) {
        fits = v[k] >= -32767 && v[k] <= 32767;
        (v[k] > 0 ? pos : neg) += std::abs(v[k]);
        q[k] = static_cast<int16_t>(v[k]);
      }
      fits = fits && pos + neg <= max_abs_sum;
      f.pos = std::max(f.pos, pos);
      f.neg = std::max(f.neg, neg);
    }
    if (fits) return f;
  }
  KILN_FAIL(Internal, "resample_u8 (fixed point): no weight precision fits the ", t.max_taps,
            "-tap filter; use KILN_RESAMPLE_FIXED_POINT=0");
}

// ---- The vertical pass: dst[j] = round(sum_k q[k] * rows[k][j] / 2^shift), as int16 -------

void vertical_plain(const uint8_t* const* rows, const int16_t* q, int32_t taps, int64_t from,
                    int64_t n, int shift, int16_t* dst) {
  const int32_t half = 1 << (shift - 1);
  for (int64_t j = from; j < n; ++j) {
    int32_t a = 0;
    for (int32_t k = 0; k < taps; ++k) a += int32_t{q[k]} * rows[k][j];
    dst[j] = static_cast<int16_t>((a + half) >> shift);
  }
}

#if KILN_RESAMPLE_X86
// Two taps at a time: the rows' bytes interleaved (a0 b0 a1 b1 ...), widened to int16 and
// multiplied by (qa, qb) pairs with pmaddwd; 16 values an iteration.
void vertical_sse2(const uint8_t* const* rows, const int16_t* q, int32_t taps, int64_t n, int shift,
                   int16_t* dst) {
  const __m128i zero = _mm_setzero_si128();
  const __m128i half = _mm_set1_epi32(1 << (shift - 1));
  const __m128i count = _mm_cvtsi32_si128(shift);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m128i a0 = half, a1 = half, a2 = half, a3 = half;
    for (int32_t k = 0; k < taps; k += 2) {
      const bool pair = k + 1 < taps;
      const __m128i ra = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + j));
      const __m128i rb =
          pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k + 1] + j)) : zero;
      const int32_t qb = pair ? q[k + 1] : 0;
      const __m128i w = _mm_set1_epi32(static_cast<int32_t>(
          (static_cast<uint32_t>(static_cast<uint16_t>(qb)) << 16) | static_cast<uint16_t>(q[k])));
      const __m128i lo = _mm_unpacklo_epi8(ra, rb), hi = _mm_unpackhi_epi8(ra, rb);
      a0 = _mm_add_epi32(a0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w));
      a1 = _mm_add_epi32(a1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w));
      a2 = _mm_add_epi32(a2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w));
      a3 = _mm_add_epi32(a3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w));
    }
    a0 = _mm_sra_epi32(a0, count), a1 = _mm_sra_epi32(a1, count);
    a2 = _mm_sra_epi32(a2, count), a3 = _mm_sra_epi32(a3, count);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm_packs_epi32(a0, a1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j + 8), _mm_packs_epi32(a2, a3));
  }
  vertical_plain(rows, q, taps, j, n, shift, dst);
}
#endif

// ---- The horizontal pass: out = clamp(round(sum_k q[k] * mid[offset + k c + ch] / 2^shift)) --

void horizontal_plain(const int16_t* mid, const FixedAxis& fx, const int32_t* offset, int64_t c,
                      int shift, uint8_t* dst) {
  const int64_t out_w = static_cast<int64_t>(fx.count.size());
  const int32_t nk = fx.max_taps;
  const int32_t half = 1 << (shift - 1);
  for (int64_t i = 0; i < out_w; ++i) {
    const int16_t* q = fx.q.data() + i * nk;
    const int16_t* s = mid + offset[i];
    for (int64_t ch = 0; ch < c; ++ch) {
      int32_t a = 0;
      for (int32_t k = 0; k < nk; ++k) a += int32_t{q[k]} * s[k * c + ch];
      const int32_t v = (a + half) >> shift;
      dst[i * c + ch] = static_cast<uint8_t>(std::min(255, std::max(0, v)));
    }
  }
}

#if KILN_RESAMPLE_X86
// One output pixel's three int32 sums (and a zero lane): per tap pair, the 8 int16 from the
// pair's first channel are shuffled to (c0 c0' c1 c1' c2 c2' 0 0) and pmaddwd'ed with
// (qa qb qa qb qa qb 0 0). PAIRS > 0: that many pairs, unrolled; 0: `pairs` at run time.
template <int PAIRS>
__attribute__((target("ssse3"))) inline __m128i pixel3(const int16_t* s, const int16_t* w,
                                                       int32_t pairs, __m128i half, __m128i count) {
  const __m128i order = _mm_setr_epi8(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1);
  const int32_t np = PAIRS > 0 ? PAIRS : pairs;
  __m128i a = half;
  for (int32_t p = 0; p < np; ++p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 6 * p));
    a = _mm_add_epi32(a,
                      _mm_madd_epi16(_mm_shuffle_epi8(v, order),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * p))));
  }
  return _mm_sra_epi32(a, count);
}

// Four RGB pixels a store of 16 bytes (12 of them the pixels); out_w is padded to a multiple
// of 4 with zero-weight outputs, and dst has the slack.
template <int PAIRS>
__attribute__((target("ssse3"))) void horizontal3_ssse3(const int16_t* mid, const int16_t* wide,
                                                        int32_t pairs, const int32_t* offset,
                                                        int64_t out_w, int shift, uint8_t* dst) {
  const __m128i half = _mm_set1_epi32(1 << (shift - 1));
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m128i squeeze = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  for (int64_t i = 0; i < out_w; i += 4) {
    __m128i p[4];
    for (int j = 0; j < 4; ++j) {
      p[j] = pixel3<PAIRS>(mid + offset[i + j], wide + (i + j) * pairs * 8, pairs, half, count);
    }
    const __m128i bytes =
        _mm_packus_epi16(_mm_packs_epi32(p[0], p[1]), _mm_packs_epi32(p[2], p[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * i), _mm_shuffle_epi8(bytes, squeeze));
  }
}

// The same with AVX2: two pixels in the two 128-bit lanes (their weights side by side in
// `wide`, 16 int16 per pixel pair and tap pair), four a store.
template <int PAIRS>
__attribute__((target("avx2"))) inline __m256i pixel3x2(const int16_t* s0, const int16_t* s1,
                                                        const int16_t* w, int32_t pairs,
                                                        __m256i half, __m128i count) {
  const __m256i order = _mm256_setr_epi8(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1, 0, 1,
                                         6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1);
  const int32_t np = PAIRS > 0 ? PAIRS : pairs;
  __m256i a = half;
  for (int32_t p = 0; p < np; ++p) {
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s0 + 6 * p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s1 + 6 * p)), 1);
    a = _mm256_add_epi32(
        a, _mm256_madd_epi16(_mm256_shuffle_epi8(v, order),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * p))));
  }
  return _mm256_sra_epi32(a, count);
}

template <int PAIRS>
__attribute__((target("avx2"))) void horizontal3_avx2(const int16_t* mid, const int16_t* wide,
                                                      int32_t pairs, const int32_t* offset,
                                                      int64_t out_w, int shift, uint8_t* dst) {
  const __m256i half = _mm256_set1_epi32(1 << (shift - 1));
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m128i squeeze = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  for (int64_t i = 0; i < out_w; i += 4) {
    const __m256i a = pixel3x2<PAIRS>(mid + offset[i], mid + offset[i + 1],
                                      wide + (i / 2) * pairs * 16, pairs, half, count);
    const __m256i b = pixel3x2<PAIRS>(mid + offset[i + 2], mid + offset[i + 3],
                                      wide + (i / 2 + 1) * pairs * 16, pairs, half, count);
    // Lane 0 holds pixels i, i+2; lane 1 pixels i+1, i+3 (4 bytes each after the packs).
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_setzero_si256());
    const __m128i ordered =
        _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * i), _mm_shuffle_epi8(ordered, squeeze));
  }
}

using Horizontal3 = void (*)(const int16_t*, const int16_t*, int32_t, const int32_t*, int64_t, int,
                             uint8_t*);
Horizontal3 pick_horizontal3(bool avx2, int32_t pairs) {
  switch (pairs) {
    case 1:
      return avx2 ? horizontal3_avx2<1> : horizontal3_ssse3<1>;
    case 2:
      return avx2 ? horizontal3_avx2<2> : horizontal3_ssse3<2>;
    case 3:
      return avx2 ? horizontal3_avx2<3> : horizontal3_ssse3<3>;
    case 4:
      return avx2 ? horizontal3_avx2<4> : horizontal3_ssse3<4>;
    default:
      return avx2 ? horizontal3_avx2<0> : horizontal3_ssse3<0>;
  }
}

// Grey rows with AVX2: eight outputs a step; per tap pair, one gather of the eight outputs'
// two neighbouring int16 (as an int32) and one pmaddwd with their weights (16 int16 per eight
// outputs and tap pair in `wide`). out_w is padded to a multiple of 8 like the RGB pass's.
__attribute__((target("avx2"))) void horizontal1_avx2(const int16_t* mid, const int16_t* wide,
                                                      int32_t pairs, const int32_t* offset,
                                                      int64_t out_w, int shift, uint8_t* dst) {
  const __m256i half = _mm256_set1_epi32(1 << (shift - 1));
  const __m128i count = _mm_cvtsi32_si128(shift);
  for (int64_t i = 0; i < out_w; i += 8) {
    const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + i));
    const int16_t* w = wide + (i / 8) * pairs * 16;
    __m256i a = half;
    for (int32_t p = 0; p < pairs; ++p) {
      const __m256i v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(mid + 2 * p), at, 2);
      a = _mm256_add_epi32(
          a,
          _mm256_madd_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * p))));
    }
    a = _mm256_sra_epi32(a, count);
    const __m128i words =
        _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi16(words, words));
  }
}

// Vertical pass with AVX2: 16 values an iteration, bytes widened with vpmovzxbw; the packs
// work per lane and the lanes hold values 0-7 and 8-15, so the order comes out right. TAPS > 0:
// that many taps, unrolled, the rows and weights held in registers; 0: `taps` at run time.
template <int TAPS>
__attribute__((target("avx2"))) void vertical_avx2(const uint8_t* const* rows, const int16_t* q,
                                                   const int32_t* pair_weights, int32_t taps,
                                                   int64_t n, int shift, int16_t* dst) {
  constexpr int kMax = TAPS > 0 ? TAPS : 1;
  const int32_t nt = TAPS > 0 ? TAPS : taps;
  const uint8_t* r[kMax + 1];
  __m256i w[(kMax + 1) / 2];
  if (TAPS > 0) {
    for (int k = 0; k < TAPS; ++k) r[k] = rows[k];
    for (int k = 0; k < TAPS; k += 2) w[k / 2] = _mm256_set1_epi32(pair_weights[k / 2]);
  }
  const __m256i half = _mm256_set1_epi32(1 << (shift - 1));
  const __m128i count = _mm_cvtsi32_si128(shift);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256i lo = half, hi = half;
    for (int32_t k = 0; k < nt; k += 2) {
      const uint8_t* ra = TAPS > 0 ? r[k] : rows[k];
      const __m256i a =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ra + j)));
      __m256i b = _mm256_setzero_si256();
      if (k + 1 < nt) {
        const uint8_t* rb = TAPS > 0 ? r[k + 1] : rows[k + 1];
        b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rb + j)));
      }
      const __m256i wk = TAPS > 0 ? w[k / 2] : _mm256_set1_epi32(pair_weights[k / 2]);
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), wk));
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), wk));
    }
    lo = _mm256_sra_epi32(lo, count), hi = _mm256_sra_epi32(hi, count);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_packs_epi32(lo, hi));
  }
  vertical_plain(rows, q, taps, j, n, shift, dst);
}

using Vertical = void (*)(const uint8_t* const*, const int16_t*, const int32_t*, int32_t, int64_t,
                          int, int16_t*);
Vertical pick_vertical_avx2(int32_t taps) {
  switch (taps) {
    case 1:
      return vertical_avx2<1>;
    case 2:
      return vertical_avx2<2>;
    case 3:
      return vertical_avx2<3>;
    case 4:
      return vertical_avx2<4>;
    case 5:
      return vertical_avx2<5>;
    case 6:
      return vertical_avx2<6>;
    default:
      return vertical_avx2<0>;
  }
}

bool cpu_has_ssse3() {
  static const bool has = __builtin_cpu_supports("ssse3");
  return has;
}
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// Per-thread scratch, reused across samples.
struct FixedScratch {
  std::vector<int16_t> mid;           // one output row after the vertical pass, zero slack after
  std::vector<int32_t> offset;        // each output's first tap, as an index into mid
  std::vector<int16_t> wide;          // the horizontal tap pairs laid out for the SIMD pass
  std::vector<int32_t> pair_weights;  // one output row's vertical tap pairs, packed
  std::vector<const uint8_t*> rows;   // one output row's source rows
  std::vector<uint8_t> row;           // one output row, with slack for the padded outputs
};
thread_local FixedScratch tl_fixed;

}  // namespace

void resample_u8_fixed(const uint8_t* src, int64_t c, int64_t stride, const ResampleTaps& ty,
                       const ResampleTaps& tx, bool flip, uint8_t* out, FixedSimd level) {
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
#if KILN_RESAMPLE_X86
  const bool avx2 = level == FixedSimd::best && cpu_has_avx2();
  const bool simd = level != FixedSimd::plain && cpu_has_ssse3();
#else
  const bool avx2 = false, simd = false;
  (void)level;
#endif
  // Vertical weights, then the intermediate's fraction bits F: the most that keeps every
  // vertical sum (within [-255 neg, 255 pos] / 2^bits) inside int16; 7 at most, so that the
  // vertical shift is at least 1.
  const FixedAxis fy = quantise(ty, false, 65535);
  int frac = 7;
  int64_t bound = 0;  // the largest |intermediate|
  for (; frac > 0; --frac) {
    bound = ((255 * std::max(fy.pos, fy.neg)) >> (fy.bits - frac)) + 1;
    if (bound <= 32767) break;
  }
  if (frac == 0) bound = ((255 * std::max(fy.pos, fy.neg)) >> fy.bits) + 1;
  KILN_CHECK(bound <= 32767, Internal, "resample_u8 (fixed point): the vertical filter's sums ",
             "reach ", bound, " levels; use KILN_RESAMPLE_FIXED_POINT=0");
  const int vshift = fy.bits - frac;
  // Horizontal sums: bound * sum |q| plus the rounding term (< 2^22) must fit int32.
  const int64_t max_abs = (std::numeric_limits<int32_t>::max() - (int64_t{1} << 22)) / bound;
  const FixedAxis fx = quantise(tx, flip, std::min<int64_t>(max_abs, 65535));
  const int hshift = frac + fx.bits;

  FixedScratch& s = tl_fixed;
  const int64_t n = (c1 - c0) * c;
  const int32_t nk = fx.max_taps;
  const int32_t pairs = (nk + 1) / 2;
  const size_t mid_size = static_cast<size_t>(n + (2 * pairs + 2) * c + 16);
  if (s.mid.size() < mid_size) s.mid.resize(mid_size);
  std::fill(s.mid.begin() + n, s.mid.begin() + static_cast<std::ptrdiff_t>(mid_size), 0);
  // The SIMD horizontal passes run outputs in fours (RGB) or eights (grey, AVX2): the padding
  // outputs have zero weights and offset 0, and land in the row buffer's slack.
  const bool rgb_simd = simd && c == 3;
  const bool grey_simd = avx2 && c == 1;
  const int64_t padded = rgb_simd ? (out_w + 3) / 4 * 4 : grey_simd ? (out_w + 7) / 8 * 8 : out_w;
  s.offset.assign(static_cast<size_t>(padded), 0);
  for (int64_t i = 0; i < out_w; ++i) {
    // An output with no taps has zero weights; any offset inside the row does.
    const int64_t f = fx.count[static_cast<size_t>(i)] > 0 ? fx.first[static_cast<size_t>(i)] : c0;
    s.offset[static_cast<size_t>(i)] = static_cast<int32_t>((f - c0) * c);
  }
  if (rgb_simd) {
    // Per output and tap pair (qa qb qa qb qa qb 0 0); with AVX2, two outputs' side by side.
    s.wide.assign(static_cast<size_t>(padded * pairs * 8), 0);
    for (int64_t i = 0; i < out_w; ++i) {
      const int16_t* q = fx.q.data() + i * nk;
      for (int32_t k = 0; k < nk; ++k) {
        const int64_t at =
            avx2 ? ((i / 2) * pairs + k / 2) * 16 + (i % 2) * 8 : (i * pairs + k / 2) * 8;
        int16_t* w = s.wide.data() + at + (k & 1);
        w[0] = w[2] = w[4] = q[k];
      }
    }
  }
  if (grey_simd) {
    s.wide.assign(static_cast<size_t>(padded * pairs * 2), 0);
    for (int64_t i = 0; i < out_w; ++i) {
      const int16_t* q = fx.q.data() + i * nk;
      for (int32_t k = 0; k < nk; ++k) {
        s.wide[static_cast<size_t>(((i / 8) * pairs + k / 2) * 16 + (i % 8) * 2 + (k & 1))] = q[k];
      }
    }
  }
  if (s.row.size() < static_cast<size_t>(row + 32)) s.row.resize(static_cast<size_t>(row + 32));
  s.rows.resize(static_cast<size_t>(ty.max_taps));
  s.pair_weights.resize(static_cast<size_t>((ty.max_taps + 1) / 2));
#if KILN_RESAMPLE_X86
  const Horizontal3 horizontal3 = rgb_simd ? pick_horizontal3(avx2, pairs) : nullptr;
#endif
  for (int64_t y = 0; y < out_h; ++y) {
    uint8_t* o = out + y * row;
    const int32_t taps = fy.count[static_cast<size_t>(y)];
    if (taps == 0) {
      std::memset(o, 0, static_cast<size_t>(row));
      continue;
    }
    const int64_t first = fy.first[static_cast<size_t>(y)];
    for (int32_t k = 0; k < taps; ++k) {
      s.rows[static_cast<size_t>(k)] = src + (first + k) * stride + c0 * c;
    }
    const int16_t* q = fy.q.data() + y * fy.max_taps;
#if KILN_RESAMPLE_X86
    if (avx2) {
      for (int32_t k = 0; k < taps; k += 2) {
        const uint16_t b = k + 1 < taps ? static_cast<uint16_t>(q[k + 1]) : 0;
        s.pair_weights[static_cast<size_t>(k / 2)] =
            static_cast<int32_t>((uint32_t{b} << 16) | static_cast<uint16_t>(q[k]));
      }
      pick_vertical_avx2(taps)(s.rows.data(), q, s.pair_weights.data(), taps, n, vshift,
                               s.mid.data());
    } else if (simd) {
      vertical_sse2(s.rows.data(), q, taps, n, vshift, s.mid.data());
    } else {
      vertical_plain(s.rows.data(), q, taps, 0, n, vshift, s.mid.data());
    }
    if (rgb_simd || grey_simd) {
      (rgb_simd ? horizontal3 : horizontal1_avx2)(s.mid.data(), s.wide.data(), pairs,
                                                  s.offset.data(), padded, hshift, s.row.data());
      std::memcpy(o, s.row.data(), static_cast<size_t>(row));
      continue;
    }
#else
    vertical_plain(s.rows.data(), q, taps, 0, n, vshift, s.mid.data());
#endif
    horizontal_plain(s.mid.data(), fx, s.offset.data(), c, hshift, o);
  }
}

}  // namespace kiln
