// The one reader of KILN_* variables, and the parser and printer of switches.def's table.
#include "kiln/core/switches.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// 1 / 0 for a bool spelling, -1 otherwise.
int bool_spelling(const std::string& v) {
  const std::string s = lower(v);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return 1;
  if (s == "0" || s == "false" || s == "off" || s == "no") return 0;
  return -1;
}

const char* kBoolAccepts = "0|1 (or off|on, false|true, no|yes)";

std::vector<std::string> split_choices(const std::string& choices) {
  std::vector<std::string> out;
  std::stringstream ss(choices);
  for (std::string w; std::getline(ss, w, '|');) out.push_back(w);
  return out;
}

void parse_into(bool& out, const std::string& v, const std::string& origin, const char*) {
  const int b = bool_spelling(v);
  KILN_CHECK(b >= 0, InvalidArgument, origin, "=", v, " is not a switch value; use one of ",
             kBoolAccepts);
  out = b == 1;
}

void parse_into(int64_t& out, const std::string& v, const std::string& origin, const char*) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  KILN_CHECK(!v.empty() && end && *end == '\0', InvalidArgument, origin, "=", v,
             " is not a whole number; use an integer such as 1");
  out = x;
}

void parse_into(Auto& out, const std::string& v, const std::string& origin, const char*) {
  if (lower(v) == "auto") {
    out = Auto::automatic;
    return;
  }
  const int b = bool_spelling(v);
  KILN_CHECK(b >= 0, InvalidArgument, origin, "=", v, " is not accepted; use auto or ",
             kBoolAccepts);
  out = b == 1 ? Auto::on : Auto::off;
}

void parse_into(std::string& out, const std::string& v, const std::string& origin,
                const char* choices) {
  if (choices[0] == '\0') {
    out = v;
    return;
  }
  const std::vector<std::string> words = split_choices(choices);
  const bool has01 =
      std::count(words.begin(), words.end(), "0") && std::count(words.begin(), words.end(), "1");
  const int b = bool_spelling(v);
  const std::string w = has01 && b >= 0 ? std::to_string(b) : lower(v);
  KILN_CHECK(std::count(words.begin(), words.end(), w) > 0, InvalidArgument, origin, "=", v,
             " is not accepted; use one of ", choices);
  out = w;
}

std::string text_of(bool b) {
  return b ? "1" : "0";
}
std::string text_of(int64_t x) {
  return std::to_string(x);
}
std::string text_of(Auto a) {
  return auto_text(a);
}
std::string text_of(const std::string& s) {
  return s;
}

std::string accepts_of(bool, const char*) {
  return "0|1";
}
std::string accepts_of(int64_t, const char*) {
  return "an integer";
}
std::string accepts_of(Auto, const char*) {
  return "auto, 0 or 1";
}
std::string accepts_of(const std::string&, const char* choices) {
  return choices[0] ? choices : "any text";
}

const char* type_of(bool, const char*) {
  return "bool";
}
const char* type_of(int64_t, const char*) {
  return "int";
}
const char* type_of(Auto, const char*) {
  return "auto";
}
const char* type_of(const std::string&, const char* choices) {
  return choices[0] ? "choice" : "text";
}

std::string shown(const std::string& s) {
  return s.empty() ? "\"\"" : s;
}

Switches& mutable_base() {
  static Switches b;
  return b;
}

}  // namespace

const Switches& Switches::base() {
  return mutable_base();
}
void Switches::set_base(const Switches& b) {
  mutable_base() = b;
}

Switches Switches::parse(const std::function<const char*(const char*)>& get, Switches s) {
#define KILN_SWITCH(field, variable, type, fallback, choices, meaning) \
  if (const char* v = get(variable); v != nullptr && v[0] != '\0') {   \
    parse_into(s.field, v, variable, choices);                         \
  }
#include "kiln/core/switches.def"
#undef KILN_SWITCH
  return s;
}

Switches Switches::from_environment() {
  return parse([](const char* name) -> const char* { return std::getenv(name); }, base());
}

bool Switches::set(const std::string& name, const std::string& value, const std::string& origin) {
#define KILN_SWITCH(field, variable, type, fallback, choices, meaning) \
  if (name == #field) {                                                \
    parse_into(field, value, origin, choices);                         \
    return true;                                                       \
  }
#include "kiln/core/switches.def"
#undef KILN_SWITCH
  return false;
}

std::vector<Switches::Row> Switches::rows() const {
  std::vector<Row> out;
  const Switches defaults;
#define KILN_SWITCH(field, variable, type, fallback, choices, meaning)               \
  out.push_back({#field, variable, type_of(field, choices), text_of(defaults.field), \
                 text_of(field), accepts_of(field, choices), meaning});
#include "kiln/core/switches.def"
#undef KILN_SWITCH
  return out;
}

std::string Switches::table() const {
  const std::vector<Row> all = rows();
  size_t wv = 8, wx = 5, wd = 7;
  for (const Row& r : all) {
    wv = std::max(wv, r.variable.size());
    wx = std::max(wx, shown(r.value).size());
    wd = std::max(wd, shown(r.fallback).size());
  }
  auto pad = [](const std::string& s, size_t w) {
    return s + std::string(w - std::min(w, s.size()) + 2, ' ');
  };
  std::ostringstream os;
  os << "kiln's switches (include/kiln/core/switches.def). A flag given on the command line wins,\n"
        "then the variable, then the default; '*' marks a value that is not the default.\n\n";
  os << "  " << pad("VARIABLE", wv) << pad("VALUE", wx + 1) << pad("DEFAULT", wd)
     << "MEANING (ACCEPTS)\n";
  for (const Row& r : all) {
    os << "  " << pad(r.variable, wv)
       << pad(shown(r.value) + (r.value != r.fallback ? "*" : ""), wx + 1)
       << pad(shown(r.fallback), wd) << r.meaning << " (" << r.accepts << ")\n";
  }
  return os.str();
}

LogLevel Switches::log_level() const {
  if (log == "error") return LogLevel::Error;
  if (log == "warn") return LogLevel::Warn;
  if (log == "debug") return LogLevel::Debug;
  return LogLevel::Info;
}

LogLevel initial_log_level() {
  // Tolerant: a bad KILN_LOG is reported by the edge's from_environment, not by a log line.
  try {
    auto only_log = [](const char* name) -> const char* {
      return std::string(name) == "KILN_LOG" ? std::getenv(name) : nullptr;
    };
    return Switches::parse(only_log, Switches::base()).log_level();
  } catch (const Error&) {
    return LogLevel::Info;
  }
}

}  // namespace kiln
