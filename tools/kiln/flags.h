// A small flag parser for the kiln CLI: each command declares its flags (name, help, and
// whether it takes a value); `--name value`, `--name=value` and, for switches, `--name` /
// `--no-name` are accepted, and `-x value` for a flag with a short name; `--config FILE` merges a
// YAML/JSON run file underneath the command line. An unknown flag is an error that lists the
// command's flags.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace kiln::cli {

struct FlagSpec {
  std::string name;  // without dashes
  std::string help;
  std::string fallback;  // shown in --help; "" = none
  bool is_switch = false;
  char short_name = 0;  // e.g. 'b' for -b, as torchvision's scripts spell --batch-size; 0 = none
  std::string alias;  // another name accepted for it (timm's --mixup for --mixup-alpha); "" = none
};

class Flags {
 public:
  Flags(std::string command, std::string usage, std::vector<FlagSpec> specs);
  // Parses argv[first..]; positional arguments are collected in order. Returns false when
  // --help was asked (help already printed).
  bool parse(int argc, char** argv, int first);

  bool has(const std::string& name) const;
  std::string str(const std::string& name, const std::string& fallback = "") const;
  int64_t i64(const std::string& name, int64_t fallback) const;
  double f64(const std::string& name, double fallback) const;
  bool on(const std::string& name, bool fallback) const;
  std::vector<int64_t> i64_list(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  std::string help() const;

 private:
  const FlagSpec* find(const std::string& name) const;
  void set(const std::string& name, const std::string& value, const std::string& origin);

  std::string command_, usage_;
  std::vector<FlagSpec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace kiln::cli
