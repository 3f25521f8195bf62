// Logging to stderr with a level: the KILN_LOG switch (error, warn, info, debug) at first,
// set_log_level after.
#pragma once
#include "kiln/core/error.h"

namespace kiln {

enum class LogLevel { Error = 0, Warn = 1, Info = 2, Debug = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_line(LogLevel level, const std::string& text);

template <typename... Args>
void log_info(Args&&... args) {
  if (log_level() >= LogLevel::Info)
    log_line(LogLevel::Info, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(Args&&... args) {
  if (log_level() >= LogLevel::Warn)
    log_line(LogLevel::Warn, detail::concat(std::forward<Args>(args)...));
}
template <typename... Args>
void log_debug(Args&&... args) {
  if (log_level() >= LogLevel::Debug)
    log_line(LogLevel::Debug, detail::concat(std::forward<Args>(args)...));
}

}  // namespace kiln
