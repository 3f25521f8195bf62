#include "task/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace kiln {

Progress::Progress(const std::string& mode) {
  const bool tty = isatty(fileno(stdout)) != 0;
  bar_ = mode == "bar" || (mode == "auto" && tty);
  plain_ = mode == "plain" || (mode == "auto" && !tty);
}

void Progress::update(int64_t epoch, int64_t epochs, int64_t step, int64_t steps, double loss,
                      double ips, float lr, double elapsed) {
  const double frac = static_cast<double>(step) / static_cast<double>(steps);
  // Time left in the epoch: the mean time per step so far times the steps left.
  const double eta =
      step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(steps - step) : 0;
  // No loss yet (statistics arrive a step late): a dash, not a 0 that reads as a measurement.
  char loss_text[32] = "-";
  if (std::isfinite(loss)) std::snprintf(loss_text, sizeof loss_text, "%.4f", loss);
  char input_text[64] = "";
  if (loader_ips_ > 0) {
    std::snprintf(input_text, sizeof input_text, " (loader %.0f img/s, waited %.0f%%)", loader_ips_,
                  100.0 * wait_fraction_);
  }
  if (bar_) {
    const int width = 30;
    const int filled = static_cast<int>(frac * width);
    char bar[64];
    for (int i = 0; i < width; ++i) bar[i] = i < filled ? '#' : '.';
    bar[width] = '\0';
    std::printf("\repoch %lld/%lld [%s] %lld/%lld loss %s  %.0f img/s%s  lr %.4g  eta %.0fs   ",
                static_cast<long long>(epoch), static_cast<long long>(epochs), bar,
                static_cast<long long>(step), static_cast<long long>(steps), loss_text, ips,
                input_text, static_cast<double>(lr), eta);
    std::fflush(stdout);
    drawn_ = true;
  } else if (plain_) {
    const int64_t decile = static_cast<int64_t>(frac * 10);
    if (decile != last_decile_ && (decile > 0 || step == 1)) {
      last_decile_ = decile;
      std::printf("epoch %lld/%lld step %lld/%lld loss %s %.0f img/s%s lr %.4g eta %.0fs\n",
                  static_cast<long long>(epoch), static_cast<long long>(epochs),
                  static_cast<long long>(step), static_cast<long long>(steps), loss_text, ips,
                  input_text, static_cast<double>(lr), eta);
      std::fflush(stdout);
    }
  }
}

void Progress::set_input(double loader_images_per_second, double wait_fraction) {
  loader_ips_ = loader_images_per_second;
  wait_fraction_ = wait_fraction;
}

void Progress::finish() {
  if (bar_ && drawn_) std::printf("\n");
  drawn_ = false;
  last_decile_ = -1;
}

void Progress::line(int64_t epoch, int64_t epochs, double seconds, const MetricsRow& row) {
  if (!bar_ && !plain_) return;
  std::printf("epoch %lld/%lld done in %.1fs:", static_cast<long long>(epoch),
              static_cast<long long>(epochs), seconds);
  for (const auto& [k, v] : row) {
    if (k == "test_top1" || k == "test_top5" || k == "test_loss" || k == "train_loss" ||
        k == "ema_test_top1") {
      std::printf(" %s %s", k.c_str(), v.csv().c_str());
    }
  }
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace kiln
