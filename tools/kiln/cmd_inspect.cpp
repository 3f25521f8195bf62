// kiln plan / program / memory: print what the compiler decided, without running anything.
#include <cstdio>

#include "cli.h"
#include "flags.h"
#include "kiln/backend/backend.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/plan/arch_plan.h"
#include "kiln/task/engine.h"

namespace kiln::cli {

namespace {

std::vector<FlagSpec> common_flags() {
  return {{"model", "model name (or the first positional argument)", "", false},
          {"batch", "batch size", "256", false},
          {"batch-size", "same as --batch", "", false},
          {"amp", "FP16 mixed precision", "off", true},
          {"fusion", "fused CBR / BN+add+ReLU where the device has them (KILN_FUSION)", "on", true},
          {"memory-reuse", "activation memory reuse by liveness (KILN_MEMORY_REUSE)", "on", true},
          {"device", "whose capabilities steer the passes: auto, cpu, cuda", "auto", false},
          {"num-classes", "classes (0 = the form's default)", "0", false},
          {"image-size", "input height and width (0 = the form's default)", "0", false},
          {"optimizer", "sgd, adamw or lars", "sgd", false},
          {"ema", "keep an EMA of the weights", "off", true},
          {"eval-only",
           "the evaluation variant's program (kiln train --val-crop-size other than the training "
           "crop): evaluation and weights only; its weight regions are the training program's",
           "off", true},
          {"tensors", "program: show every tensor's region, offset and shape", "off", true}};
}

struct Inspect {
  ArchPlan plan;
  Program program;
};

Inspect build(const Flags& f) {
  std::string model = f.str("model");
  if (model.empty() && !f.positional().empty()) model = f.positional()[0];
  KILN_CHECK(!model.empty(), InvalidArgument, "name a model, e.g. kiln plan resnet50");
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  const BluePrint bp = make_model(model, zo);
  EngineOptions eo;
  eo.switches = switches_from(f);
  eo.compile.amp = f.on("amp", false);
  eo.compile.batch = f.i64("batch", f.i64("batch-size", 256));
  eo.compile.optimizer = f.str("optimizer", "sgd");
  eo.compile.ema = f.on("ema", false);
  eo.compile.eval_only = f.on("eval-only", false);
  const std::string device = f.str("device", "auto");
  KILN_CHECK(device == "auto" || device == "cpu" || device == "cuda", InvalidArgument,
             "--device must be auto, cpu or cuda, got '", device, "'");
  // The fusion the Engine would choose on that backend; none where it lacks the precision
  // (the CPU under --amp, which the Engine refuses) or where it cannot be asked (a CUDA plan
  // without a GPU): no capabilities, so no fused kernels.
  const bool cuda = device == "cuda" || (device == "auto" && cuda_available());
  BackendCaps caps;
  if (!cuda || cuda_available()) {
    const BackendCaps real = make_backend(cuda ? "cuda" : "cpu", eo.switches)->caps();
    if (!eo.compile.amp || real.fp16) caps = real;
  }
  Inspect r;
  r.plan = plan_for(bp, caps, eo);
  r.program = program_for(r.plan, eo.compile, model);
  return r;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  Flags f("plan", "MODEL [flags]", common_flags());
  if (!f.parse(argc, argv, 2)) return 0;
  const Inspect r = build(f);
  std::printf("%s", describe_plan(r.plan).c_str());
  return 0;
}

int cmd_program(int argc, char** argv) {
  Flags f("program", "MODEL [flags]", common_flags());
  if (!f.parse(argc, argv, 2)) return 0;
  const Inspect r = build(f);
  std::printf("%s", describe_program(r.program, f.on("tensors", false)).c_str());
  return 0;
}

int cmd_memory(int argc, char** argv) {
  Flags f("memory", "MODEL [--batch N] [--amp] [flags]", common_flags());
  if (!f.parse(argc, argv, 2)) return 0;
  const Inspect r = build(f);
  std::printf("%s", describe_memory(r.program).c_str());
  return 0;
}

}  // namespace kiln::cli
