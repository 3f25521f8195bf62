// The kiln command line's commands.
#pragma once
#include <vector>

#include "flags.h"
#include "kiln/core/switches.h"

namespace kiln {
struct TrainConfig;
}

namespace kiln::cli {

int run(int argc, char** argv);

int cmd_train(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_memory(int argc, char** argv);
int cmd_program(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_tune(int argc, char** argv);
int cmd_switches(int argc, char** argv);

// The switches a command runs with: the KILN_* variables, then the flags given that name a
// switch (--fusion, --memory-reuse, --tf32, --profile) over them (switches.def's rule).
Switches switches_from(const Flags& f);

// kiln train's flags, the one table that the CLI, run files and Python's kiln.train share, and
// the run they describe (--resume adopts the checkpoint's settings).
std::vector<FlagSpec> train_flags();
TrainConfig train_config(const Flags& f);

}  // namespace kiln::cli
