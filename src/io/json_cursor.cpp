#include "io/json_cursor.h"

#include <cstdio>

namespace kiln::detail {

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;  // a continuation byte first, an overlong lead (0xc0, 0xc1) or past 0xf4
    }
    if (n - i < len) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
    if (overlong || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return i;
    i += len;
  }
  return std::string_view::npos;
}

JsonCursor::JsonCursor(std::string_view text, ErrorKind kind, std::string prefix,
                       std::string suffix)
    : text_(text), kind_(kind), prefix_(std::move(prefix)), suffix_(std::move(suffix)) {}

void JsonCursor::fail_at(size_t pos, std::string_view problem) const {
  throw Error(kind_,
              detail::concat(prefix_, "byte ", pos, " of the JSON header: ", problem, suffix_));
}

std::string JsonCursor::describe_next() const {
  if (pos_ >= text_.size()) return "the end of the header";
  const auto c = static_cast<unsigned char>(text_[pos_]);
  char buf[32];
  if (c >= 0x20 && c < 0x7f) {
    std::snprintf(buf, sizeof(buf), "'%c'", c);
  } else {
    std::snprintf(buf, sizeof(buf), "byte 0x%02x", c);
  }
  return buf;
}

void JsonCursor::skip_ws() {
  while (pos_ < text_.size()) {
    const char c = text_[pos_];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    ++pos_;
  }
}

bool JsonCursor::consume(char c) {
  skip_ws();
  if (pos_ < text_.size() && text_[pos_] == c) {
    ++pos_;
    return true;
  }
  return false;
}

void JsonCursor::expect(char c, std::string_view context) {
  if (consume(c)) return;
  fail(detail::concat("expected '", c, "' ", context, ", found ", describe_next()));
}

bool JsonCursor::at_end() {
  skip_ws();
  return pos_ == text_.size();
}

uint32_t JsonCursor::read_hex4() {
  if (text_.size() - pos_ < 4) fail("truncated \\u escape (needs 4 hex digits)");
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const char c = text_[pos_];
    uint32_t d;
    if (c >= '0' && c <= '9') {
      d = static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      d = static_cast<uint32_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      d = static_cast<uint32_t>(c - 'A' + 10);
    } else {
      fail(detail::concat("invalid hex digit in \\u escape: ", describe_next()));
    }
    v = (v << 4) | d;
    ++pos_;
  }
  return v;
}

static void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string JsonCursor::read_string(std::string_view context) {
  skip_ws();
  if (pos_ >= text_.size() || text_[pos_] != '"') {
    fail(detail::concat("expected a string ", context, ", found ", describe_next()));
  }
  const size_t start = pos_;
  ++pos_;
  std::string out;
  for (;;) {
    if (pos_ >= text_.size()) fail_at(start, "unterminated string");
    const char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      return out;
    }
    if (static_cast<unsigned char>(c) < 0x20) {
      fail("raw control character in a string (JSON requires it escaped)");
    }
    if (c != '\\') {
      out += c;
      ++pos_;
      continue;
    }
    ++pos_;
    if (pos_ >= text_.size()) fail_at(start, "unterminated string");
    const char e = text_[pos_++];
    switch (e) {
      case '"':
        out += '"';
        break;
      case '\\':
        out += '\\';
        break;
      case '/':
        out += '/';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'u': {
        uint32_t cp = read_hex4();
        if (cp >= 0xdc00 && cp <= 0xdfff) fail("lone low surrogate in a \\u escape");
        if (cp >= 0xd800 && cp <= 0xdbff) {
          // A character past U+FFFF is written as a surrogate pair: \uD83D\uDE00.
          if (text_.size() - pos_ < 2 || text_[pos_] != '\\' || text_[pos_ + 1] != 'u') {
            fail("high surrogate in a \\u escape not followed by a low surrogate");
          }
          pos_ += 2;
          const uint32_t lo = read_hex4();
          if (lo < 0xdc00 || lo > 0xdfff) fail("high surrogate followed by a non-low surrogate");
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        append_utf8(out, cp);
        break;
      }
      default:
        --pos_;
        fail(detail::concat("invalid escape '\\", describe_next(), "' in a string"));
    }
  }
}

uint64_t JsonCursor::read_uint(std::string_view context, uint64_t max) {
  skip_ws();
  const size_t start = pos_;
  if (pos_ < text_.size() && text_[pos_] == '-') {
    fail(detail::concat("negative number ", context, " (sizes and offsets are never negative)"));
  }
  if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
    fail(detail::concat("expected a non-negative integer ", context, ", found ", describe_next()));
  }
  uint64_t v = 0;
  while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
    const auto d = static_cast<uint64_t>(text_[pos_] - '0');
    if (d > max || v > (max - d) / 10)
      fail_at(start, detail::concat("integer ", context, " is larger than ", max));
    v = v * 10 + d;
    ++pos_;
  }
  if (pos_ - start > 1 && text_[start] == '0') fail_at(start, "integer with a leading zero");
  if (pos_ < text_.size() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
    fail_at(start, detail::concat("expected an integer ", context, ", found a fractional number"));
  }
  return v;
}

}  // namespace kiln::detail
