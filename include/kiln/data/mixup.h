// Mixup and CutMix as torchvision's reference (RandomMixup / RandomCutmix under RandomChoice)
// and timm's Mixup in its per-batch mode: the host draws one mix per step, the device applies
// it to the staged batch (op mix_batch) and the loss takes the label pair with its weight
// (softmax_ce's mix input). Sample n's partner is sample n - 1 (mod N): torchvision's
// batch.roll(1, 0), so the partner's label is labels.roll(1).
//
// Draws: step `step` of epoch `epoch` draws from Rng::derive(seed + kMixSeedTag, epoch, step),
// a stream apart from the loader's (seed, epoch, sample + 1), so the sequence of mixes depends
// on the seed, the epoch and the step only - not on workers, ranks or the input path. Every
// rank draws the same mix for a step (its own batch, the same lambda and box).
#pragma once
#include <array>
#include <cstdint>

namespace kiln {

struct MixOptions {
  double mixup_alpha = 0;    // lambda ~ Beta(a, a); 0 = no mixup
  double cutmix_alpha = 0;   // box area from lambda ~ Beta(a, a); 0 = no cutmix
  double prob = 1.0;         // a step is mixed with this probability (timm's mixup_prob)
  double switch_prob = 0.5;  // with both on, cutmix's share (timm's switch_prob; torchvision 0.5)
  bool enabled() const { return mixup_alpha > 0 || cutmix_alpha > 0; }
};

enum class MixKind : int32_t { none = 0, mixup = 1, cutmix = 2 };

struct MixDraw {
  MixKind kind = MixKind::none;
  // The weight of the sample's own label: mixup's lambda; cutmix's 1 - box area / image area
  // (the box clipped at the borders, as both references correct it); 1 when unmixed.
  double lambda = 1.0;
  int64_t y0 = 0, y1 = 0, x0 = 0, x1 = 0;  // cutmix: rows [y0, y1), columns [x0, x1) pasted
};

inline constexpr uint64_t kMixSeedTag = 0x6d69787570637574ull;  // "mixupcut"

// Refuses alpha < 0, probabilities outside [0, 1] and non-finite values, naming the flag.
void check_mix_options(const MixOptions& o);

// The mix of one step for images h x w. torchvision's order of draws: whether to mix (prob),
// which (switch_prob, when both are on), lambda ~ Beta(alpha, alpha), then cutmix's centre
// (r_x in [0, w), r_y in [0, h)) and half sizes int(0.5 sqrt(1 - lambda) w), ... of h.
MixDraw draw_mix(const MixOptions& o, uint64_t seed, int64_t epoch, int64_t step, int64_t h,
                 int64_t w);

// The step parameters a draw reaches the device as (ProgramIO::mix, f32[kMixParams]), written
// like the learning rate before each step: kind, lambda, 1 - lambda (rounded from double, as
// torchvision's Python float), y0, y1, x0, x1 (exact in FP32 below 2^24), one spare.
enum MixParam : int {
  kMixKind,
  kMixLambda,
  kMixRest,
  kMixY0,
  kMixY1,
  kMixX0,
  kMixX1,
  kMixParams = 8
};
std::array<float, kMixParams> mix_params(const MixDraw& d);

}  // namespace kiln
