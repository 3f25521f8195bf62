#include "kiln/data/mixup.h"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"

namespace kiln {

void check_mix_options(const MixOptions& o) {
  KILN_CHECK(std::isfinite(o.mixup_alpha) && o.mixup_alpha >= 0, InvalidArgument,
             "--mixup-alpha must be a finite number >= 0 (0 = off), got ", o.mixup_alpha);
  KILN_CHECK(std::isfinite(o.cutmix_alpha) && o.cutmix_alpha >= 0, InvalidArgument,
             "--cutmix-alpha must be a finite number >= 0 (0 = off), got ", o.cutmix_alpha);
  KILN_CHECK(o.prob >= 0 && o.prob <= 1, InvalidArgument,
             "--mixup-prob must be in [0, 1] (the share of mixed steps), got ", o.prob);
  KILN_CHECK(o.switch_prob >= 0 && o.switch_prob <= 1, InvalidArgument,
             "--mixup-switch-prob must be in [0, 1] (cutmix's share when both are on), got ",
             o.switch_prob);
}

MixDraw draw_mix(const MixOptions& o, uint64_t seed, int64_t epoch, int64_t step, int64_t h,
                 int64_t w) {
  MixDraw d;
  if (!o.enabled()) return d;
  Rng rng =
      Rng::derive(seed + kMixSeedTag, static_cast<uint64_t>(epoch), static_cast<uint64_t>(step));
  if (o.prob < 1.0 && !(rng.uniform() < o.prob)) return d;
  bool cutmix = o.cutmix_alpha > 0;
  if (o.mixup_alpha > 0 && o.cutmix_alpha > 0) cutmix = rng.uniform() < o.switch_prob;
  const double alpha = cutmix ? o.cutmix_alpha : o.mixup_alpha;
  const double lambda = rng.beta(alpha, alpha);
  if (!cutmix) {
    d.kind = MixKind::mixup;
    d.lambda = lambda;
    return d;
  }
  // torchvision's RandomCutmix: the box's half sizes truncate toward zero, then it is clipped.
  const auto cx = static_cast<int64_t>(rng.below(static_cast<uint64_t>(w)));
  const auto cy = static_cast<int64_t>(rng.below(static_cast<uint64_t>(h)));
  const double r = 0.5 * std::sqrt(1.0 - lambda);
  const auto half_w = static_cast<int64_t>(r * static_cast<double>(w));
  const auto half_h = static_cast<int64_t>(r * static_cast<double>(h));
  d.kind = MixKind::cutmix;
  d.x0 = std::max<int64_t>(cx - half_w, 0);
  d.x1 = std::min<int64_t>(cx + half_w, w);
  d.y0 = std::max<int64_t>(cy - half_h, 0);
  d.y1 = std::min<int64_t>(cy + half_h, h);
  d.lambda = 1.0 - static_cast<double>((d.x1 - d.x0) * (d.y1 - d.y0)) / static_cast<double>(w * h);
  return d;
}

std::array<float, kMixParams> mix_params(const MixDraw& d) {
  std::array<float, kMixParams> p{};
  p[kMixKind] = static_cast<float>(static_cast<int32_t>(d.kind));
  p[kMixLambda] = static_cast<float>(d.lambda);
  p[kMixRest] = static_cast<float>(1.0 - d.lambda);
  p[kMixY0] = static_cast<float>(d.y0);
  p[kMixY1] = static_cast<float>(d.y1);
  p[kMixX0] = static_cast<float>(d.x0);
  p[kMixX1] = static_cast<float>(d.x1);
  return p;
}

}  // namespace kiln
