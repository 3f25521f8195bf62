// The kiln command line's commands.
#pragma once
#include "kiln/core/switches.h"

namespace kiln::cli {

class Flags;

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

}  // namespace kiln::cli
