// The switch table (switches.def): each type's parser, the errors that name the variable and
// what it accepts, the base a process starts from, and the rule by which a set field (a flag)
// beats a variable. Variables come from a map here, never from the process environment.
#include "kiln/core/switches.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "kiln/core/error.h"

namespace kiln {
namespace {

Switches parse(const std::map<std::string, std::string>& vars, const Switches& base = Switches{}) {
  return Switches::parse(
      [&](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
      },
      base);
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    parse(vars);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    return e.what();
  }
  return "";
}

TEST(Switches, DefaultsAreTheTables) {
  const Switches s = parse({});
  EXPECT_TRUE(s.fusion);
  EXPECT_TRUE(s.memory_reuse);
  EXPECT_TRUE(s.cuda_graphs);
  EXPECT_FALSE(s.tf32) << "FP32 means FP32 unless asked";
  EXPECT_EQ(s.streams, 3);
  EXPECT_EQ(s.fuse_fp32, Auto::automatic);
  EXPECT_EQ(s.log, "info");
  EXPECT_EQ(s.fp32_winograd, "1");
  EXPECT_EQ(s.cbr_form, "kiln");
  EXPECT_EQ(s.engine_table, "");
  EXPECT_EQ(s.dist_timeout, 600);
}

TEST(Switches, EachTypeParses) {
  const Switches s = parse({{"KILN_FUSION", "off"},
                            {"KILN_TF32", "YES"},
                            {"KILN_CUDA_GRAPHS", "0"},
                            {"KILN_STREAMS", "1"},
                            {"KILN_FUSE_FP32", "1"},
                            {"KILN_AUTOTUNE", "auto"},
                            {"KILN_LOG", "debug"},
                            {"KILN_CBR_FORM", "genstats"},
                            {"KILN_FP32_WINOGRAD", "off"},
                            {"KILN_ENGINE_TABLE", "/tmp/table.tsv"},
                            {"KILN_DIST_TIMEOUT", "3"}});
  EXPECT_FALSE(s.fusion);
  EXPECT_TRUE(s.tf32);
  EXPECT_FALSE(s.cuda_graphs);
  EXPECT_EQ(s.streams, 1);
  EXPECT_FALSE(s.streams_on());
  EXPECT_EQ(s.fuse_fp32, Auto::on);
  EXPECT_EQ(s.autotune, Auto::automatic);
  EXPECT_EQ(s.log_level(), LogLevel::Debug);
  EXPECT_EQ(s.cbr_form, "genstats");
  EXPECT_EQ(s.fp32_winograd, "0") << "a choice of 0|1 takes the bool spellings";
  EXPECT_EQ(parse({{"KILN_FP32_WINOGRAD", "only"}}).fp32_winograd, "only");
  EXPECT_EQ(s.engine_table, "/tmp/table.tsv");
  EXPECT_EQ(s.dist_timeout, 3);
  EXPECT_TRUE(parse({{"KILN_FUSION", ""}}).fusion) << "an empty variable is an unset one";
}

TEST(Switches, BadValuesNameTheVariableAndItsChoices) {
  EXPECT_EQ(
      error_of({{"KILN_FUSION", "maybe"}}),
      "KILN_FUSION=maybe is not a switch value; use one of 0|1 (or off|on, false|true, no|yes)");
  EXPECT_EQ(error_of({{"KILN_CBR_FORM", "fast"}}),
            "KILN_CBR_FORM=fast is not accepted; use one of kiln|genstats");
  EXPECT_EQ(error_of({{"KILN_LOG", "verbose"}}),
            "KILN_LOG=verbose is not accepted; use one of error|warn|info|debug");
  EXPECT_EQ(error_of({{"KILN_FP32_WINOGRAD", "sometimes"}}),
            "KILN_FP32_WINOGRAD=sometimes is not accepted; use one of 0|1|only");
  EXPECT_EQ(error_of({{"KILN_STREAMS", "two"}}),
            "KILN_STREAMS=two is not a whole number; use an integer such as 1");
  EXPECT_EQ(
      error_of({{"KILN_AUTOTUNE", "perhaps"}}),
      "KILN_AUTOTUNE=perhaps is not accepted; use auto or 0|1 (or off|on, false|true, no|yes)");
}

// A variable that is set replaces the base; the base stands where none is (the tests' main
// keeps logs quiet and autotuning's cache in a temporary folder this way).
TEST(Switches, VariablesOverTheBase) {
  Switches base;
  base.log = "warn";
  base.autotune_cache = "/tmp/cache";
  const Switches s = parse({{"KILN_LOG", "error"}}, base);
  EXPECT_EQ(s.log, "error");
  EXPECT_EQ(s.autotune_cache, "/tmp/cache");
}

// The table's rule: a flag given (Switches::set, as the command line does) wins over the
// variable; a flag not given leaves the variable's value; neither leaves the default.
TEST(Switches, AGivenFlagWinsOverItsVariable) {
  Switches s = parse({{"KILN_FUSION", "0"}, {"KILN_TF32", "1"}});
  EXPECT_TRUE(s.set("fusion", "1", "--fusion"));
  EXPECT_TRUE(s.fusion);
  EXPECT_TRUE(s.tf32) << "no --tf32 given: the variable stands";
  EXPECT_TRUE(s.memory_reuse) << "neither: the default";
  EXPECT_FALSE(s.set("no_such_switch", "1", "--x"));
  try {
    s.set("memory_reuse", "sideways", "--memory-reuse");
    ADD_FAILURE() << "a bad flag value must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--memory-reuse=sideways"), std::string::npos) << e.what();
  }
}

// One row per switch, each variable once and named KILN_*, each with a meaning; the printed
// table shows values that differ from the default with a '*'.
TEST(Switches, TableListsEverySwitchOnce) {
  Switches s;
  s.fusion = false;
  std::set<std::string> variables;
  for (const Switches::Row& r : s.rows()) {
    EXPECT_EQ(r.variable.rfind("KILN_", 0), 0u) << r.variable;
    EXPECT_TRUE(variables.insert(r.variable).second) << r.variable << " twice";
    EXPECT_FALSE(r.meaning.empty()) << r.variable;
  }
  EXPECT_GE(variables.size(), 25u);
  const std::string table = s.table();
  const size_t row = table.find("  KILN_FUSION ");
  ASSERT_NE(row, std::string::npos) << table;
  EXPECT_NE(table.substr(row, table.find('\n', row) - row).find(" 0* "), std::string::npos)
      << table;
}

}  // namespace
}  // namespace kiln
