// kiln switches: the switch table (switches.def) with the values in force; and the one place
// where the command line's flags meet the KILN_* variables.
#include <cstdio>

#include "cli.h"
#include "flags.h"
#include "kiln/core/switches.h"

namespace kiln::cli {

Switches switches_from(const Flags& f) {
  Switches s = Switches::from_environment();
  // switches.def's rule: a flag that is given wins over its variable.
  for (const char* flag : {"fusion", "memory-reuse", "tf32", "profile", "deterministic"}) {
    if (!f.has(flag)) continue;
    std::string field = flag;
    for (char& c : field) c = c == '-' ? '_' : c;
    s.set(field, f.on(flag, false) ? "1" : "0", std::string("--") + flag);
  }
  return s;
}

int cmd_switches(int argc, char** argv) {
  Flags f(
      "switches", "[--fusion|--no-fusion] [--memory-reuse] [--tf32] [--profile] [--deterministic]",
      {{"fusion", "show the table as a command given --fusion / --no-fusion would run", "", true},
       {"memory-reuse", "likewise for --memory-reuse", "", true},
       {"tf32", "likewise for --tf32", "", true},
       {"profile", "likewise for --profile", "", true},
       {"deterministic", "likewise for --deterministic", "", true}});
  if (!f.parse(argc, argv, 2)) return 0;
  std::printf("%s", switches_from(f).table().c_str());
  return 0;
}

}  // namespace kiln::cli
