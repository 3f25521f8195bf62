#include "kiln/io/json.h"

#include <charconv>
#include <cmath>

namespace kiln {

std::string json_escape(std::string_view s) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() + 8);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xf];
        } else {
          out += ch;
        }
    }
  }
  return out;
}

std::string json_string(std::string_view s) {
  // Appended piece by piece: "\"" + str + "\"" trips a false -Wrestrict in GCC 12.
  std::string out = "\"";
  out += json_escape(s);
  out += '"';
  return out;
}

std::string format_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  // std::to_chars ignores the locale, unlike snprintf, so a host with a decimal comma cannot
  // turn 0.5 into "0,5" and break every CSV and JSON reader.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::general, 9);
  return std::string(buf, res.ptr);
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  return format_number(v);
}

}  // namespace kiln
