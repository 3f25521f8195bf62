// kiln tune: the engine experience table. Compiles MODEL's training step on the
// GPU with KILN_TUNE set, which makes the CUDA backend build and time every cuDNN engine of
// every convolution graph (forward, data and weight gradient) on the step's own buffers and
// merge the three fastest of each into the table file; later compiles on the same GPU and
// cuDNN version look their shapes up there (KILN_ENGINE_TABLE=0 turns that off).
#include <cstdio>
#include <cstdlib>

#include "cli.h"
#include "flags.h"
#include "kiln/backend/backend.h"
#include "kiln/backend/engine_table.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/task/engine.h"

namespace kiln::cli {

int cmd_tune(int argc, char** argv) {
  Flags f(
      "tune", "MODEL [--batch N] [--amp] [--out FILE]",
      {{"model", "model from the zoo", "resnet50", false},
       {"batch", "batch size", "256", false},
       {"batch-size", "same as --batch", "", false},
       {"amp", "FP16 mixed precision", "off", true},
       {"fusion", "fused ops where the device has them", "on", true},
       {"num-classes", "classes (0 = the form's default)", "0", false},
       {"image-size", "input size (0 = the form's default)", "0", false},
       {"out", "table file (default: configs/engines/<gpu>_cudnn<version>.tsv of the source tree)",
        "", false}});
  if (!f.parse(argc, argv, 2)) return 0;
  std::string model = f.str("model", "resnet50");
  if (!f.has("model") && !f.positional().empty()) model = f.positional()[0];
  KILN_CHECK(cuda_available(), InvalidArgument,
             "kiln tune measures cuDNN engines and needs a CUDA GPU; none is "
             "visible here (a CPU build has nothing to tune)");
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  const BluePrint bp = make_model(model, zo);
  const std::string out = f.str("out", "");
  EngineOptions eo;
  eo.device = "cuda";
  eo.switches = switches_from(f);
  eo.switches.tune = out.empty() ? "auto" : out;
  eo.compile.batch = f.i64("batch", f.i64("batch-size", 256));
  eo.compile.amp = f.on("amp", false);
  Engine engine(bp, eo);
  engine.lock_memory();
  engine.compile(1);
  const CompileReport use = engine.backend().compile_report();
  KILN_CHECK(use.chooses_engines, State,
             "kiln tune: the engine did not compile on the CUDA backend");
  const EngineTable table = EngineTable::load(use.table);
  std::printf(
      "%s batch %lld %s: tuned %d convolution plans; %s now holds %zu entries (%s, cuDNN %lld)\n",
      model.c_str(), static_cast<long long>(eo.compile.batch), eo.compile.amp ? "AMP" : "FP32",
      use.from_table, use.table.c_str(), table.entries().size(), table.gpu.c_str(),
      static_cast<long long>(table.cudnn));
  return 0;
}

}  // namespace kiln::cli
