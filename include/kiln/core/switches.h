// Switches: every optimisation switch and debug setting of kiln in one struct, made from the
// one table in switches.def. The environment is read once, at the edge (the kiln command
// line, EngineOptions / TrainConfig of the C++ API), and the struct is passed down; nothing
// below reads a KILN_* variable. Tests set fields, never the environment.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/core/log.h"

namespace kiln {

// A switch that may leave its choice to the backend or to another switch.
enum class Auto : int8_t { automatic, off, on };
inline bool resolve(Auto a, bool fallback) {
  return a == Auto::automatic ? fallback : a == Auto::on;
}
// As the environment spells it: auto, 1 or 0.
inline const char* auto_text(Auto a) {
  return a == Auto::automatic ? "auto" : a == Auto::on ? "1" : "0";
}

struct Switches {
#define KILN_SWITCH(field, variable, type, fallback, choices, meaning) type field = fallback;
#include "kiln/core/switches.def"
#undef KILN_SWITCH

  // The process's KILN_* variables over base(): each variable that is set (and not empty)
  // replaces its field. A value that does not parse is one InvalidArgument error naming the
  // variable and what it accepts. The only reader of KILN_* variables.
  static Switches from_environment();
  // The same over any source of variables (`get` returns null for unset) and any base: the
  // parser, testable without touching the environment.
  static Switches parse(const std::function<const char*(const char*)>& get, Switches base);

  // What a process starts from before its variables: the table's defaults unless its main
  // chose others once (the tests' main keeps autotuning's cache in a temporary folder).
  static const Switches& base();
  static void set_base(const Switches& b);

  // Sets one field from text as its variable would ("fusion", "0"); `origin` names the source
  // in the error ("KILN_FUSION", "--fusion"). Returns false for an unknown field name.
  bool set(const std::string& field, const std::string& value, const std::string& origin);

  // One row per switch: variable, type, default, value in force, accepted values, meaning.
  struct Row {
    std::string field, variable, type, fallback, value, accepts, meaning;
  };
  std::vector<Row> rows() const;
  // The table as `kiln switches` prints it.
  std::string table() const;

  LogLevel log_level() const;
  bool streams_on() const {
    return streams > 1;
  }
};

// The logger's level before an edge sets one: KILN_LOG over Switches::base(), Info when it
// does not parse (the edge's from_environment reports that).
LogLevel initial_log_level();

}  // namespace kiln
