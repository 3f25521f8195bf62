// The SM90 CUTLASS GEMM's eligibility rule (sm90_conv_rule.h).
#include "backend/sm90_conv_rule.h"

#include <cstdint>
#include <limits>

namespace kiln {

namespace {

// What both kernels need of the machine: built, and a compute capability 9.0 GPU.
std::string device_refusal(const Sm90ConvQuery& q) {
  if (!q.built) {
    return "is not built into this kiln (it needs nvcc >= 12 and the CUTLASS headers "
           "scripts/setup.sh stages in .deps/cutlass)";
  }
  if (q.cc_major != 9 || q.cc_minor != 0) {
    return "needs a compute capability 9.0 GPU (Hopper); this one is " +
           std::to_string(q.cc_major) + "." + std::to_string(q.cc_minor);
  }
  return "";
}

// And of the operands: FP16, channels in whole 16-byte TMA rows.
std::string operand_refusal(const Sm90ConvQuery& q) {
  if (q.x != DType::F16 || q.w != DType::F16 || q.z != DType::F16) {
    return std::string("takes FP16 features and weights (AMP) only; these are ") + dtype_name(q.x) +
           " / " + dtype_name(q.w) + " -> " + dtype_name(q.z);
  }
  if (q.g.x.c % 8 != 0 || q.g.k % 8 != 0) {
    return "needs input and output channels in multiples of 8 (16-byte TMA rows); these are " +
           std::to_string(q.g.x.c) + " -> " + std::to_string(q.g.k);
  }
  return "";
}

}  // namespace

std::string sm90_conv_refusal(const Sm90ConvQuery& q) {
  const ConvGeom& g = q.g;
  if (std::string why = device_refusal(q); !why.empty()) return why;
  if (g.r != 1 || g.s != 1 || g.sh != 1 || g.sw != 1 || g.ph != 0 || g.pw != 0) {
    return "takes 1x1 stride-1 unpadded convolutions only; this one is " + std::to_string(g.r) +
           "x" + std::to_string(g.s) + ", stride " + std::to_string(g.sh) + "x" +
           std::to_string(g.sw) + ", padding " + std::to_string(g.ph) + "x" + std::to_string(g.pw);
  }
  if (std::string why = operand_refusal(q); !why.empty()) return why;
  const int64_t rows = g.x.n * g.x.h * g.x.w, most = std::numeric_limits<int32_t>::max();
  if (rows > most || g.x.c > most || g.k > most) {
    return "indexes rows and channels in 32 bits; this one has " + std::to_string(rows) +
           " rows of " + std::to_string(g.x.c) + " channels";
  }
  return "";
}

bool sm90_conv_gemm_tried(Auto sw, bool built, int cc_major, int cc_minor, DType features) {
  return resolve(sw, built && cc_major == 9 && cc_minor == 0 && features == DType::F16);
}

bool sm90_gemm_shape(const ConvGeom& g) {
  return g.r == 1 && g.s == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
}

std::string sm90_implicit_conv_refusal(const Sm90ConvQuery& q) {
  const ConvGeom& g = q.g;
  if (std::string why = device_refusal(q); !why.empty()) return why;
  if (std::string why = operand_refusal(q); !why.empty()) return why;
  // TMA's im2col mode for 2-D: filter offsets below 256, corners within [-128, 127].
  if (g.r > 255 || g.s > 255 || g.ph > 127 || g.pw > 127 || g.ph + 1 - g.r < -128 ||
      g.pw + 1 - g.s < -128) {
    return "takes filters under 256 taps a side and paddings under 128 (TMA's im2col); this one "
           "is " +
           std::to_string(g.r) + "x" + std::to_string(g.s) + ", padding " + std::to_string(g.ph) +
           "x" + std::to_string(g.pw);
  }
  const int64_t rows = g.y.n * g.y.h * g.y.w, most = std::numeric_limits<int32_t>::max();
  if (rows > most || g.x.n * g.x.h * g.x.w > most) {
    return "indexes pixels in 32 bits; this one has " + std::to_string(rows) + " output pixels";
  }
  return "";
}

std::string sm90_implicit_dgrad_refusal(const Sm90ConvQuery& q) {
  const ConvGeom& g = q.g;
  if (std::string why = device_refusal(q); !why.empty()) return why;
  if (g.sh != 1 || g.sw != 1 || 2 * g.ph != g.r - 1 || 2 * g.pw != g.s - 1) {
    return "takes stride-1 filters padded to keep the size (2 x padding = filter - 1); this one "
           "is " +
           std::to_string(g.r) + "x" + std::to_string(g.s) + ", stride " + std::to_string(g.sh) +
           "x" + std::to_string(g.sw) + ", padding " + std::to_string(g.ph) + "x" +
           std::to_string(g.pw);
  }
  if (std::string why = operand_refusal(q); !why.empty()) return why;
  // The data gradient is a convolution of dy with the flipped filter and padding r - 1 - ph:
  // TMA's im2col limits as the forward's.
  if (g.r > 255 || g.s > 255 || g.ph > 127 || g.pw > 127) {
    return "takes filters under 256 taps a side (TMA's im2col); this one is " +
           std::to_string(g.r) + "x" + std::to_string(g.s);
  }
  if (g.x_rows() > std::numeric_limits<int32_t>::max()) {
    return "indexes pixels in 32 bits; this one has " + std::to_string(g.x_rows()) + " pixels";
  }
  return "";
}

bool sm90_implicit_dgrad_tried(Auto sw, bool dgrad) {
  return dgrad && resolve(sw, kCutlassConvDgradByDefault);
}

bool sm90_implicit_conv_tried(Auto sw, bool cutlass) {
  return cutlass && resolve(sw, kCutlassConvByDefault);
}

bool sm90_dgrad_tried(Auto sw, bool cutlass) {
  return resolve(sw, kCutlassDgradByDefault && cutlass);
}

Sm90Forms sm90_forms(const Sm90Switches& sw, bool built, int cc_major, int cc_minor,
                     DType features) {
  const bool timed = sw.timed && !sw.deterministic;
  auto by_timing = [&](Auto s) { return timed && s == Auto::automatic; };
  Sm90Forms f;
  f.gemm = sm90_conv_gemm_tried(sw.gemm, built, cc_major, cc_minor, features);
  f.gemm_timed = f.gemm && by_timing(sw.gemm);
  f.dgrad = by_timing(sw.dgrad) ? f.gemm : sm90_dgrad_tried(sw.dgrad, f.gemm);
  f.dgrad_timed = f.dgrad && by_timing(sw.dgrad);
  f.conv = by_timing(sw.conv) ? f.gemm : sm90_implicit_conv_tried(sw.conv, f.gemm);
  f.conv_timed = f.conv && by_timing(sw.conv);
  f.conv_dgrad =
      by_timing(sw.conv_dgrad) ? f.dgrad : sm90_implicit_dgrad_tried(sw.conv_dgrad, f.dgrad);
  f.conv_dgrad_timed = f.conv_dgrad && by_timing(sw.conv_dgrad);
  return f;
}

}  // namespace kiln
