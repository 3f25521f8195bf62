#include "cli.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/core/switches.h"

namespace kiln::cli {

static const char* kUsage =
    "kiln: trains convolutional networks by compiling the whole training step ahead of time\n\n"
    "usage: kiln COMMAND [flags]   (kiln COMMAND --help for each command's flags)\n\n"
    "commands:\n"
    "  train     train a model (default: the small CNN on Fashion-MNIST)\n"
    "  eval      evaluate weights on a dataset's test split\n"
    "  export    write a checkpoint's weights under torchvision's names (safetensors)\n"
    "  plan      print a model's ArchPlan: layers, shapes, passes\n"
    "  program   print the compiled phases and their nodes\n"
    "  memory    print the memory plan: regions and their sizes\n"
    "  bench     time training steps on synthetic data (images/s)\n"
    "  tune      measure cuDNN's engines for a model's convolutions (the engine table, GPU)\n"
    "  switches  print every KILN_* switch: its variable, value, default and meaning\n";

int run(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::printf("%s", kUsage);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  // The edge: every KILN_* variable is checked once, before any work (a bad one is an error).
  set_log_level(Switches::from_environment().log_level());
  if (cmd == "train") return cmd_train(argc, argv);
  if (cmd == "eval") return cmd_eval(argc, argv);
  if (cmd == "export") return cmd_export(argc, argv);
  if (cmd == "plan") return cmd_plan(argc, argv);
  if (cmd == "memory") return cmd_memory(argc, argv);
  if (cmd == "program") return cmd_program(argc, argv);
  if (cmd == "bench") return cmd_bench(argc, argv);
  if (cmd == "tune") return cmd_tune(argc, argv);
  if (cmd == "switches" || cmd == "--help-switches") return cmd_switches(argc, argv);
  KILN_FAIL(InvalidArgument, "unknown command '", cmd, "'; run kiln --help for the list");
}

}  // namespace kiln::cli
