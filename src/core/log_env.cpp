#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "kiln/core/env.h"
#include "kiln/core/log.h"

namespace kiln {

static LogLevel parse_level() {
  const char* v = std::getenv("KILN_LOG");
  if (!v) return LogLevel::Info;
  const std::string s(v);
  if (s == "error") return LogLevel::Error;
  if (s == "warn") return LogLevel::Warn;
  if (s == "debug") return LogLevel::Debug;
  return LogLevel::Info;
}

static std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(parse_level())};
  return level;
}

LogLevel log_level() { return static_cast<LogLevel>(level_ref().load()); }
void set_log_level(LogLevel level) { level_ref().store(static_cast<int>(level)); }

void log_line(LogLevel level, const std::string& text) {
  static std::mutex mu;
  static const char* tags[] = {"error", "warn", "info", "debug"};
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "kiln %s: %s\n", tags[static_cast<int>(level)], text.c_str());
}

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return false;
  KILN_FAIL(InvalidArgument, "environment variable ", name, "='", v,
            "' is not a switch; set it to 0 or 1");
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  KILN_CHECK(end && *end == '\0', InvalidArgument, "environment variable ", name, "='", v,
             "' is not an integer");
  return x;
}

std::string env_string(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

}  // namespace kiln
