// A strict, non-recursive JSON reader for schema-directed parsing (the safetensors header).
// The caller says what it expects next (an object, a string, an unsigned integer); anything
// else throws one kiln::Error naming the file, the byte offset and the problem. Only the JSON
// subset kiln reads is accepted: objects, arrays, strings with every escape, non-negative
// integers. A document that nests deeper than its schema is rejected by the schema, so no
// input can drive the reader into deep recursion (it is fuzzed: tests/fuzz/).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "kiln/core/error.h"

namespace kiln::detail {

// Offset of the first byte that is not valid UTF-8 (overlong forms, surrogates and code points
// past U+10FFFF are invalid), or npos when all of `s` is valid.
size_t find_invalid_utf8(std::string_view s);

class JsonCursor {
 public:
  // Errors read "<prefix>byte <N> of the JSON header: <problem><suffix>".
  JsonCursor(std::string_view text, ErrorKind kind, std::string prefix, std::string suffix);

  // Skips whitespace, then consumes `c` if it comes next.
  bool consume(char c);
  // Skips whitespace, then consumes `c` or fails with "expected 'c' <context>".
  void expect(char c, std::string_view context);
  // A string literal, escapes decoded to UTF-8.
  std::string read_string(std::string_view context);
  // A non-negative integer literal no larger than `max`; fractions, exponents, signs and
  // leading zeros are rejected (the safetensors header holds only sizes and offsets).
  uint64_t read_uint(std::string_view context, uint64_t max);
  // True when only whitespace is left.
  bool at_end();
  size_t pos() const { return pos_; }

  // Reads `{ "key": value, ... }`; on_key(key) must consume the value.
  template <typename F>
  void read_object(std::string_view context, F&& on_key) {
    expect('{', context);
    if (consume('}')) return;
    for (;;) {
      std::string key = read_string("as an object key");
      expect(':', "after an object key");
      on_key(key);
      if (consume(',')) continue;
      expect('}', "or ',' after an object member");
      return;
    }
  }

  // Reads `[ item, ... ]`; on_item() must consume one item.
  template <typename F>
  void read_array(std::string_view context, F&& on_item) {
    expect('[', context);
    if (consume(']')) return;
    for (;;) {
      on_item();
      if (consume(',')) continue;
      expect(']', "or ',' after an array item");
      return;
    }
  }

  [[noreturn]] void fail(std::string_view problem) const { fail_at(pos_, problem); }
  [[noreturn]] void fail_at(size_t pos, std::string_view problem) const;

 private:
  void skip_ws();
  uint32_t read_hex4();
  std::string describe_next() const;

  std::string_view text_;
  size_t pos_ = 0;
  ErrorKind kind_;
  std::string prefix_;
  std::string suffix_;
};

}  // namespace kiln::detail
