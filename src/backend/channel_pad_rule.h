// How many input channels a half-precision convolution runs on when KILN_PAD_CHANNELS pads it
// (cuda/conv.cpp): cuDNN has tensor-core engines for 4 channels (first-layer kernels) and for
// multiples of 8, and for 3 (an RGB first layer) only slow ones. In plain C++ so that the CPU
// tests check it.
#pragma once
#include <cstdint>

namespace kiln {

// 4 for 1 to 4 channels (PyTorch's cuDNN ran ResNet-50's stem at 4 channels in 0.41 + 0.44 ms,
// forward + weight gradient, against 0.59 + 0.60 at 3 and more at 8: bench/RESULTS.md), the
// next multiple of 8 above 4; equal to c where c needs no padding.
inline int64_t padded_channel_count(int64_t c) {
  return c <= 4 ? 4 : (c + 7) / 8 * 8;
}

}  // namespace kiln
