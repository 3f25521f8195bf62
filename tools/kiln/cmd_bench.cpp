// kiln bench: training steps per second on synthetic data (SPEC Q3). Warm-up steps are not
// timed; the figure is the median over repeats of `steps` timed steps; the last line is JSON
// for scripts (bench/compare.sh reads it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "cli.h"
#include "flags.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/dist/dist.h"
#include "kiln/task/engine.h"

namespace kiln::cli {

int cmd_bench(int argc, char** argv) {
  Flags f("bench", "--model NAME [--batch N] [--amp] [flags]",
          {{"model", "model from the zoo", "resnet50", false},
           {"batch", "batch size", "256", false},
           {"batch-size", "same as --batch", "", false},
           {"amp", "FP16 mixed precision", "off", true},
           {"tf32", "FP32 convolutions and matmuls may use TF32 (GPU)", "off", true},
           {"device", "auto, cpu or cuda", "auto", false},
           {"steps", "timed steps per repeat", "50", false},
           {"warmup", "untimed steps first", "10", false},
           {"repeats", "repeats (the median is reported)", "3", false},
           {"fusion", "fused ops where the device has them", "on", true},
           {"num-classes", "classes (0 = the form's default)", "0", false},
           {"image-size", "input size (0 = the form's default)", "0", false},
           {"opt", "optimizer", "sgd", false},
           {"stage", "every-step: copy the batch from the host each step, as a loader does; once: "
                     "train on a batch resident on the device, as PyTorch's reference does",
            "every-step", false},
           {"profile", "print where the time goes (CPU: per op kind; CUDA: per phase)", "off", true},
           {"cuda-profiler-range", "CUDA: record only the timed steps under an external profiler "
                                   "(ncu --profile-from-start off; bench/kernel_breakdown.py)", "off", true}});
  if (!f.parse(argc, argv, 2)) return 0;
  // S27: under mpirun or srun, one process per GPU, each with --batch; the figure is the sum.
  dist::init();
  std::string model = f.str("model", "resnet50");
  if (!f.has("model") && !f.positional().empty()) model = f.positional()[0];
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  const BluePrint bp = make_model(model, zo);
  EngineOptions eo;
  eo.device = f.str("device", "auto");
  eo.fusion = f.on("fusion", true);
  eo.compile.batch = f.i64("batch", f.i64("batch-size", 256));
  eo.compile.amp = f.on("amp", false);
  eo.compile.tf32 = f.on("tf32", false);
  eo.compile.optimizer = f.str("opt", "sgd");
  eo.compile.weight_decay = 5e-5f;
  eo.compile.world = dist::world();
  const int64_t steps = f.i64("steps", 50), warmup = f.i64("warmup", 10), repeats = f.i64("repeats", 3);
  const std::string stage = f.str("stage", "every-step");
  KILN_CHECK(stage == "every-step" || stage == "once", InvalidArgument, "--stage ", stage,
             " is not a staging mode; use every-step (the default) or once");
  const bool stage_once = stage == "once";
  KILN_CHECK(steps > 0 && warmup >= 0 && repeats > 0, InvalidArgument, "--steps and --repeats must be > 0");

  const auto t_compile = std::chrono::steady_clock::now();
  Engine engine(bp, eo);
  engine.lock_memory();
  engine.compile(1);
  const double compile_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_compile).count();
  if (dist::is_root()) {
    // What the merge passes fused: a bench's figure depends on it (KILN_FUSION, KILN_FUSE_POOL).
    int cbr = 0, pooled = 0, bar = 0;
    for (const PlanNode* p : engine.plan().live()) {
      cbr += p->op == PlanOp::CBR;
      pooled += p->op == PlanOp::CBR && p->pool != 0;
      bar += p->op == PlanOp::BnAddReLU;
    }
    std::printf("fused layers: %d Conv+BN+ReLU (%d with their max-pool folded in; KILN_FUSE_POOL=0 keeps pools "
                "apart), %d BN+add+ReLU (KILN_FUSION=0 turns fusion off)\n",
                cbr, pooled, bar);
  }
  if (auto* api = dynamic_cast<CudaBackendApi*>(&engine.backend()); api && dist::is_root()) {
    const CudaBackendApi::EngineTableUse use = api->engine_table_use();
    std::printf("convolution engines: %d from the engine table%s%s, %d timed while compiling (%d of them timed "
                "by an earlier compile: this process or the autotune cache), %d from cuDNN's heuristics\n",
                use.from_table, use.table.empty() ? "" : " ", use.table.c_str(), use.autotuned, use.remembered,
                use.heuristics);
    std::printf("weight gradients on the side stream: %d (KILN_SIDE_WGRAD=1 forks them there)\n",
                api->side_stream_wgrads());
    if (!eo.compile.amp) {
      std::printf("FP32 convolutions on Winograd / FFT engines: %d (KILN_FP32_WINOGRAD=0 refuses them)\n",
                  api->fp32_transformed_plans());
    }
    const CudaBackendApi::CbrForms forms = api->cbr_forms();
    if (forms.genstats + forms.fallbacks > 0) {
      std::printf("CBR forward (KILN_CBR_FORM=genstats): %d as conv+genstats, %d fell back to kiln's form\n",
                  forms.genstats, forms.fallbacks);
    }
  }

  // One learnable synthetic batch, staged every step as a real loader would: each of 16
  // classes adds its own fixed pattern to the noise, so the loss must fall (the first and
  // last loss are printed: a check that the step trains, not only that it runs).
  const int64_t n = eo.compile.batch;
  const int64_t per = int64_t{bp.input.height} * bp.input.width * bp.input.channels;
  const int classes = std::min(bp.num_classes, 16);
  std::vector<float> images(static_cast<size_t>(n * per));
  std::vector<int32_t> labels(static_cast<size_t>(n));
  Rng rng(7);
  std::vector<float> patterns(static_cast<size_t>(classes * per));
  for (float& x : patterns) x = static_cast<float>(rng.normal());
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(classes)));
    labels[static_cast<size_t>(i)] = l;
    for (int64_t j = 0; j < per; ++j) {
      images[static_cast<size_t>(i * per + j)] =
          patterns[static_cast<size_t>(l * per + j)] + 0.5f * static_cast<float>(rng.normal());
    }
  }

  engine.backend().set_profiling(f.on("profile", false));
  StepStats first{}, last{};
  // The first two steps always stage (they fill input slots A and B).
  auto step = [&](int64_t i, bool read) {
    return stage_once && i >= 2 ? engine.train_step_on_staged(0.01f, read)
                                : engine.train_step(images.data(), labels.data(), 0.01f, read);
  };
  int64_t done = 0;
  for (int64_t i = 0; i < warmup; ++i) {
    const StepStats s = step(done++, i == 0);
    if (i == 0) first = s;
  }
  auto* cuda_api = dynamic_cast<CudaBackendApi*>(&engine.backend());
  const bool profiler_range = f.on("cuda-profiler-range", false);
  KILN_CHECK(!profiler_range || cuda_api != nullptr, InvalidArgument,
             "--cuda-profiler-range needs the CUDA backend (--device cuda)");
  if (profiler_range) cuda_api->profiler_range(true);
  std::vector<double> rates;
  for (int64_t r = 0; r < repeats; ++r) {
    engine.backend().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) step(done++, false);
    engine.backend().synchronize();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(steps * n * dist::world()) / secs);
    if (dist::is_root()) std::printf("repeat %lld: %.1f images/s (%.2f ms/step)\n", static_cast<long long>(r + 1), rates.back(),
                1e3 * secs / static_cast<double>(steps));
  }
  if (profiler_range) cuda_api->profiler_range(false);
  last = step(done++, true);
  if (!dist::is_root()) return 0;
  if (f.on("profile", false)) std::printf("%s", engine.backend().profile_report().c_str());
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  std::printf("%s batch %lld %s on %s: %.1f images/s (median of %lld), compile %.1fs, loss %.4f -> %.4f\n",
              model.c_str(), static_cast<long long>(n), eo.compile.amp ? "AMP" : "FP32",
              engine.backend().caps().device.c_str(), median, static_cast<long long>(repeats), compile_s,
              static_cast<double>(first.loss), static_cast<double>(last.loss));
  std::printf("{\"bench\":\"kiln\",\"model\":\"%s\",\"batch\":%lld,\"amp\":%s,\"images_per_second\":%.1f,"
              "\"compile_seconds\":%.2f,\"first_loss\":%.5f,\"last_loss\":%.5f,\"world\":%d,\"stage\":\"%s\","
              "\"tf32\":%s}\n",
              model.c_str(), static_cast<long long>(n), eo.compile.amp ? "true" : "false", median, compile_s,
              static_cast<double>(first.loss), static_cast<double>(last.loss), dist::world(), stage.c_str(),
              eo.compile.tf32 ? "true" : "false");
  return 0;
}

}  // namespace kiln::cli
