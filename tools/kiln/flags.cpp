#include "flags.h"

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/io/run_file.h"

namespace kiln::cli {

Flags::Flags(std::string command, std::string usage, std::vector<FlagSpec> specs)
    : command_(std::move(command)), usage_(std::move(usage)), specs_(std::move(specs)) {
  specs_.push_back(
      {"config", "YAML or JSON run file; flags on the command line override it", "", false});
  specs_.push_back({"help", "this text", "", true});
}

const FlagSpec* Flags::find(const std::string& name) const {
  for (const FlagSpec& s : specs_) {
    if (s.name == name || (!s.alias.empty() && s.alias == name)) return &s;
  }
  return nullptr;
}

std::string Flags::help() const {
  std::ostringstream os;
  os << "usage: kiln " << command_ << " " << usage_ << "\n\nflags:\n";
  for (const FlagSpec& s : specs_) {
    std::string left = std::string(s.short_name ? std::string("  -") + s.short_name + ", " : "  ") +
                       "--" + s.name + (s.is_switch ? "" : " VALUE");
    if (left.size() < 28) left.resize(28, ' ');
    os << left << " " << s.help;
    if (!s.alias.empty()) os << " (also --" << s.alias << ")";
    if (!s.fallback.empty()) os << " (default " << s.fallback << ")";
    os << "\n";
  }
  return os.str();
}

void Flags::set(const std::string& name, const std::string& value, const std::string& origin) {
  const FlagSpec* spec = find(name);
  if (!spec) {
    std::string list;
    for (const FlagSpec& s : specs_) list += (list.empty() ? "--" : ", --") + s.name;
    KILN_FAIL(InvalidArgument, "unknown flag --", name, " for 'kiln ", command_, "'", origin,
              "; its flags are ", list);
  }
  values_[spec->name] = value;  // an alias lands under the flag's own name
}

bool Flags::parse(int argc, char** argv, int first) {
  std::map<std::string, std::string> from_command_line;
  std::string config;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.size() == 2 && a[0] == '-' && a[1] != '-') {
      for (const FlagSpec& s : specs_) {
        if (s.short_name == a[1]) a = "--" + s.name;
      }
      KILN_CHECK(a.rfind("--", 0) == 0, InvalidArgument, "unknown flag ", argv[i], " for 'kiln ",
                 command_, "'; run kiln ", command_, " --help for its flags");
    }
    if (a.rfind("--", 0) != 0 || a == "--") {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    for (char& ch : name) {
      if (ch == '_') ch = '-';
    }
    if (name == "help") {
      std::printf("%s", help().c_str());
      return false;
    }
    const FlagSpec* spec = find(name);
    if (!spec && name.rfind("no-", 0) == 0) {
      const FlagSpec* neg = find(name.substr(3));
      if (neg && neg->is_switch) {
        from_command_line[neg->name] = "false";
        continue;
      }
    }
    if (!spec) set(name, "", "");  // throws with the list of flags
    name = spec->name;
    if (spec->is_switch) {
      from_command_line[name] = has_value ? value : "true";
      continue;
    }
    if (!has_value) {
      KILN_CHECK(i + 1 < argc, InvalidArgument, "flag --", name, " needs a value (", spec->help,
                 ")");
      value = argv[++i];
    }
    if (name == "config") {
      config = value;
    } else {
      from_command_line[name] = value;
    }
  }
  if (!config.empty()) {
    for (const auto& [k, v] : read_run_file(config)) set(k, v, " (in run file " + config + ")");
  }
  for (const auto& [k, v] : from_command_line) set(k, v, "");
  return true;
}

bool Flags::has(const std::string& name) const {
  return values_.count(name) != 0;
}

std::string Flags::str(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

int64_t Flags::i64(const std::string& name, int64_t fallback) const {
  if (!has(name)) return fallback;
  const std::string v = str(name);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  KILN_CHECK(!v.empty() && end && *end == '\0', InvalidArgument, "--", name,
             " takes an integer, got '", v, "'");
  // strtoll clamps an overflowing value to 2^63-1 silently.
  KILN_CHECK(errno != ERANGE, InvalidArgument, "--", name, " ", v, " is out of range (at most ",
             LLONG_MAX, ")");
  return x;
}

double Flags::f64(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  const std::string v = str(name);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  KILN_CHECK(!v.empty() && end && *end == '\0', InvalidArgument, "--", name,
             " takes a number, got '", v, "'");
  return x;
}

bool Flags::on(const std::string& name, bool fallback) const {
  if (!has(name)) return fallback;
  const std::string v = str(name);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return false;
  KILN_FAIL(InvalidArgument, "--", name, " is a switch; give true or false, got '", v, "'");
}

std::vector<int64_t> Flags::i64_list(const std::string& name) const {
  std::vector<int64_t> out;
  std::stringstream ss(str(name));
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    KILN_CHECK(!item.empty() && end && *end == '\0', InvalidArgument, "--", name,
               " takes a comma-separated list of integers, got '", str(name), "'");
    out.push_back(x);
  }
  return out;
}

}  // namespace kiln::cli
