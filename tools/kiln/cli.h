// The kiln command line's commands.
#pragma once

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

}  // namespace kiln::cli
