// resample_u8's fixed-point form (ResampleMath::fixed16, KILN_RESAMPLE_FIXED_POINT): the same
// taps as the float form, quantised to 16 bits, applied vertical pass first.
#pragma once
#include <cstdint>

#include "kiln/data/sample_geometry.h"

namespace kiln {

// best: AVX2 where the CPU has it, else SSE2 + SSSE3, else plain loops; ssse3: at most those;
// plain: the plain loops. The same integer arithmetic: bit for bit the same bytes.
enum class FixedSimd { plain, ssse3, best };
void resample_u8_fixed(const uint8_t* src, int64_t c, int64_t stride, const ResampleTaps& ty,
                       const ResampleTaps& tx, bool flip, uint8_t* out, FixedSimd level);

}  // namespace kiln
