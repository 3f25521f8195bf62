#include "kiln/core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "kiln/core/switches.h"

namespace kiln {

static std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(initial_log_level())};
  return level;
}

LogLevel log_level() {
  return static_cast<LogLevel>(level_ref().load());
}
void set_log_level(LogLevel level) {
  level_ref().store(static_cast<int>(level));
}

void log_line(LogLevel level, const std::string& text) {
  static std::mutex mu;
  static const char* tags[] = {"error", "warn", "info", "debug"};
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "kiln %s: %s\n", tags[static_cast<int>(level)], text.c_str());
}

}  // namespace kiln
