#include "kiln/algo/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.h"

namespace kiln {

namespace {
constexpr double kPi = 3.14159265358979323846;
}

void check_schedule(const LrSchedule& s) {
  const char* kinds[] = {"constant", "step", "multistep", "cosine", "poly", "onecycle"};
  bool known = false;
  for (const char* k : kinds) known = known || s.kind == k;
  KILN_CHECK(known, InvalidArgument, "--sched '", s.kind,
             "' is not a schedule; use constant, step, multistep, cosine, poly or onecycle");
  KILN_CHECK(s.base_lr > 0 && std::isfinite(s.base_lr), InvalidArgument, "--lr must be > 0, got ",
             s.base_lr);
  KILN_CHECK(s.warmup_epochs >= 0, InvalidArgument, "--warmup-epochs must be >= 0");
  KILN_CHECK(s.kind != "step" || s.step_size > 0, InvalidArgument,
             "--step-size must be > 0 epochs");
  KILN_CHECK(s.gamma > 0, InvalidArgument, "--gamma must be > 0");
  KILN_CHECK(s.pct_start > 0 && s.pct_start < 1, InvalidArgument,
             "onecycle pct_start must be in (0, 1)");
  // A flag the schedule does not read would change nothing while looking as if it did.
  KILN_CHECK(s.milestones.empty() || s.kind == "multistep", InvalidArgument,
             "--milestones applies only to --sched ", "multistep, not ", s.kind,
             "; add --sched multistep or drop --milestones");
  KILN_CHECK(s.kind != "multistep" || !s.milestones.empty(), InvalidArgument,
             "--sched multistep needs --milestones (epochs, comma-separated, e.g. 30,60,80)");
  for (int64_t m : s.milestones) {
    KILN_CHECK(m >= 0, InvalidArgument, "--milestones are epochs and must be >= 0, got ", m);
  }
}

void check_schedule(const LrSchedule& s, int64_t epochs) {
  check_schedule(s);
  KILN_CHECK(s.kind != "onecycle" || s.warmup_epochs < static_cast<double>(epochs), InvalidArgument,
             "--warmup-epochs ", s.warmup_epochs,
             " is the rising phase of --sched onecycle and must be shorter than ", "--epochs ",
             epochs, "; give fewer warm-up epochs (0 rises for 30% of the run)");
}

float lr_at(const LrSchedule& s, int64_t step, int64_t total_steps, int64_t steps_per_epoch) {
  const double spe = static_cast<double>(std::max<int64_t>(steps_per_epoch, 1));
  const double total = static_cast<double>(std::max<int64_t>(total_steps, 1));
  const double t = static_cast<double>(step);
  const double epoch = t / spe;
  const double base = s.base_lr;
  if (s.kind == "onecycle") {
    // As torch.optim.lr_scheduler.OneCycleLR(anneal_strategy="cos", three_phase=False).
    const double initial = base / s.div_factor;
    const double final_lr = initial / s.final_div_factor;
    // --warmup-epochs, when given, is the rising phase: pct_start = warmup / epochs.
    const double pct_start =
        s.warmup_epochs > 0 ? s.warmup_epochs * spe / total : static_cast<double>(s.pct_start);
    const double up_end = pct_start * total - 1.0;
    const double down_end = total - 1.0;
    auto cos_anneal = [](double start, double end, double pct) {
      return end + (start - end) / 2.0 * (std::cos(kPi * pct) + 1.0);
    };
    if (t <= up_end)
      return static_cast<float>(cos_anneal(initial, base, up_end > 0 ? t / up_end : 1.0));
    const double pct = down_end > up_end ? (t - up_end) / (down_end - up_end) : 1.0;
    return static_cast<float>(cos_anneal(base, final_lr, std::min(pct, 1.0)));
  }
  const double warm_steps = s.warmup_epochs * spe;
  if (t < warm_steps) {
    const double f = s.warmup_start + (1.0 - s.warmup_start) * (t / warm_steps);
    return static_cast<float>(base * f);
  }
  double lr = base;
  if (s.kind == "step") {
    lr = base * std::pow(s.gamma, std::floor(epoch / static_cast<double>(s.step_size)));
  } else if (s.kind == "multistep") {
    int passed = 0;
    for (int64_t m : s.milestones) passed += epoch >= static_cast<double>(m) ? 1 : 0;
    lr = base * std::pow(s.gamma, passed);
  } else if (s.kind == "cosine") {
    const double span = std::max(total - warm_steps, 1.0);
    const double pct = std::min((t - warm_steps) / span, 1.0);
    lr = s.min_lr + (base - s.min_lr) * 0.5 * (1.0 + std::cos(kPi * pct));
  } else if (s.kind == "poly") {
    const double span = std::max(total - warm_steps, 1.0);
    const double pct = std::min((t - warm_steps) / span, 1.0);
    lr = base * std::pow(1.0 - pct, s.power);
  }
  return static_cast<float>(lr);
}

}  // namespace kiln
