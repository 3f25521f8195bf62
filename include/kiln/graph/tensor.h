// Regions and tensor descriptors. A DTensor owns no memory: it names a region, a byte
// offset, a shape and a dtype. The backend maps each region to one allocation, made once
// after MEMORY_LOCKED (ARCHITECTURE.md, "Static memory").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/core/shape.h"

namespace kiln {

// The semantic regions (memory_plan.h). Parameter regions share one slot layout: every
// parameter has the same slot index in each of them, and an FP32 slot is exactly twice the
// FP16 slot, so one range kernel covers the whole model.
#define KILN_REGIONS(X)                                                                       \
  X(params_f32, "master weights, FP32")                                                       \
  X(params_f16, "AMP compute weights, FP16 (AMP only)")                                       \
  X(grads_f32, "parameter gradients that reach the optimizer, FP32")                          \
  X(grads_f16, "convolution weight gradients as cuDNN writes them, FP16 (AMP only)")          \
  X(moment1, "optimizer first moment (momentum / Adam m), FP32")                              \
  X(moment2, "optimizer second moment (Adam v), FP32")                                        \
  X(ema_f32, "EMA of the weights, FP32")                                                      \
  X(ema_f16, "EMA of the weights, FP16 (AMP only)")                                           \
  X(bn_running, "BatchNorm running mean and variance, FP32")                                  \
  X(ema_bn_running, "EMA of the BatchNorm running mean and variance, FP32 (EMA only)")        \
  X(bn_saved, "BatchNorm saved batch mean and inverse std of the step, FP32")                 \
  X(features, "activations and their gradients, reused by liveness; FP32, or FP16 under AMP") \
  X(aux, "masks and pooling indices (u8/i32), reused by liveness")                            \
  X(scalars, "loss, loss scale, overflow flag, counters, learning rate")                      \
  X(input_a, "input batch A (images and labels), filled while B is used")                     \
  X(input_b, "input batch B")

enum class Region : uint8_t {
#define KILN_REGION_ENUM(name, doc) name,
  KILN_REGIONS(KILN_REGION_ENUM)
#undef KILN_REGION_ENUM
};
inline constexpr int kRegionCount = 0
#define KILN_REGION_COUNT(name, doc) +1
    KILN_REGIONS(KILN_REGION_COUNT)
#undef KILN_REGION_COUNT
    ;

const char* region_name(Region r);
const char* region_doc(Region r);

inline constexpr int64_t kAlignment = 256;  // every tensor's first byte (ARCHITECTURE.md)

enum class Layout : uint8_t { Flat, NHWC, NC, KRSC, OI };
const char* layout_name(Layout l);

using TensorId = int32_t;
inline constexpr TensorId kNoTensor = -1;

struct DTensor {
  TensorId id = kNoTensor;
  std::string name;  // "layer1.0.conv1:y", "layer1.0.conv1.weight:grad"
  Region region = Region::features;
  int64_t offset = -1;  // bytes from the region's start; -1 until the MemoryPlan places it
  Shape shape;
  DType dtype = DType::F32;
  Layout layout = Layout::Flat;
  // A view shares another tensor's bytes (flatten; the gradient of a residual add).
  TensorId view_of = kNoTensor;

  int64_t numel() const { return shape.numel(); }
  int64_t bytes() const { return shape.numel() * static_cast<int64_t>(dtype_size(dtype)); }
};

}  // namespace kiln
