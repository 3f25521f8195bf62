// kiln bench: training steps per second on synthetic data. Warm-up steps are not
// timed; the figure is the median over repeats of `steps` timed steps; the last line is JSON
// for scripts (bench/compare.sh reads it). With --data folder the batches come from an image
// folder through the loader; --input-only then times the input pipeline alone, from the files
// to the staged input buffer, without the step.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "flags.h"
#include "kiln/backend/backend.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/auto_augment.h"
#include "kiln/data/dataset.h"
#include "kiln/data/loader.h"
#include "kiln/data/transforms.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/engine.h"

namespace kiln::cli {

namespace {

using Clock = std::chrono::steady_clock;

// CPU seconds of every thread of this process (the loader's workers included).
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

// Batches from an image folder with ImageNet's training transforms, through the loader, into
// the staged input slots (--input-only) or through whole training steps.
int bench_folder(const Flags& f, const std::string& model, const BluePrint& bp,
                 const EngineOptions& eo) {
  KILN_CHECK(f.str("data") == "folder", InvalidArgument, "kiln bench --data ", f.str("data"),
             ": only an image folder (--data folder --data-dir DIR) is read by the bench; leave "
             "--data out "
             "for synthetic batches");
  KILN_CHECK(f.has("data-dir"), InvalidArgument,
             "kiln bench --data folder needs --data-dir DIR holding train/<class>/*.jpg");
  KILN_CHECK(dist::world() == 1, InvalidArgument, "kiln bench --data folder runs in one process");
  const bool input_only = f.on("input-only", false);
  DatasetSpec spec;
  spec.kind = "folder";
  spec.root = f.str("data-dir");
  spec.split = "train";
  spec.channels = bp.input.channels;
  const std::shared_ptr<Dataset> data = open_dataset(spec);
  Pipeline p;
  const Normalization stats = normalization_for("folder", bp.input.channels);
  p.add<ToFloat>().add<RandomResizedCrop>(bp.input.height).add<RandomHorizontalFlip>(0.5f);
  // The training recipe's value augmentations, to time what they add on each input path.
  if (f.has("auto-augment")) {
    p.add<AutoAugment>(parse_auto_augment(f.str("auto-augment")),
                       static_cast<int>(f.i64("ra-num-ops", 2)),
                       static_cast<int>(f.i64("ra-magnitude", 9)));
  }
  p.add<Normalize>(stats.mean, stats.std);
  const double erase = f.f64("random-erase", 0);
  KILN_CHECK(erase >= 0 && erase <= 1, InvalidArgument,
             "--random-erase is a probability in [0, 1] (0 = off), got ", erase);
  if (erase > 0) p.add<RandomErasing>(static_cast<float>(erase));
  Engine engine(bp, eo);
  Backend& backend = engine.backend();
  const DecodeWhere where = parse_decode_where(f.str("decode", "auto"));
  std::string no_jpeg;
  const bool device_jpeg = backend.decodes_jpeg(&no_jpeg);
  KILN_CHECK(where != DecodeWhere::gpu || device_jpeg, InvalidArgument, "--decode gpu: ", no_jpeg,
             "; use --decode cpu");
  LoaderOptions lo;
  lo.batch_size = eo.compile.batch;
  lo.workers = static_cast<int>(f.i64("workers", default_loader_workers()));
  apply_loader_switches(lo, eo.switches);
  lo.output =
      device_jpeg && where != DecodeWhere::cpu ? LoaderOutput::encoded : LoaderOutput::uint8;
  // --no-input-u8: the float32 path (full decode, float transforms, float copy), for comparison.
  if (!f.on("input-u8", true)) {
    KILN_CHECK(where != DecodeWhere::gpu, InvalidArgument,
               "--no-input-u8 decodes on the host; drop --decode gpu");
    lo.output = LoaderOutput::float32;
  }
  Loader loader(data, p, lo);
  engine.lock_memory();
  engine.compile(1);
  const InputNormalization norm = p.normalization(bp.input.channels);
  const int64_t n = lo.batch_size;
  const auto hwc = loader.sample_hwc();
  std::vector<uint8_t> pixels(static_cast<size_t>(n * hwc[0] * hwc[1] * hwc[2]));
  std::vector<float> floats(lo.output == LoaderOutput::float32 ? pixels.size() : 0);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  std::vector<SampleAugment> augments;
  EncodedBatch enc[2];
  int64_t epoch = 0, done = 0;
  loader.start_epoch(epoch);
  StepStats first{}, last{};
  // Host time per part of a batch, summed over the timed repeats: where the thread that feeds
  // the device spends a step (the GPU idles if these add up to more than its step).
  double next_s = 0, step_s = 0;
  bool timing = false;
  // One batch from the loader into slot A/B (alternating); a step on it unless input_only.
  auto step = [&](bool read) {
    const int slot = static_cast<int>(done++ % 2);
    InputView v;
    v.norm = &norm;
    v.labels = labels.data();
    const auto t_next = Clock::now();
    for (;;) {
      const int64_t got =
          lo.output == LoaderOutput::encoded ? loader.next_encoded(enc[slot])
          : lo.output == LoaderOutput::uint8
              ? loader.next_u8(pixels, labels.data(), loader.has_augments() ? &augments : nullptr)
              : loader.next(floats.data(), labels.data());
      if (got == n) break;
      loader.start_epoch(++epoch);  // drop_last: 0 means the epoch ended
    }
    const auto t_step = Clock::now();
    if (timing) next_s += std::chrono::duration<double>(t_step - t_next).count();
    struct StepTimer {
      const bool on;
      const Clock::time_point t0;
      double& sum;
      ~StepTimer() {
        if (on) sum += std::chrono::duration<double>(Clock::now() - t0).count();
      }
    } step_timer{timing, t_step, step_s};
    if (lo.output == LoaderOutput::encoded) {
      v.encoded = &enc[slot];
    } else if (lo.output == LoaderOutput::uint8) {
      v.u8 = pixels.data();
      if (loader.has_augments()) v.augments = augments.data();
    } else {
      v.f32 = floats.data();
    }
    if (input_only) {
      if (v.encoded) {
        backend.stage_batch_encoded(slot, *v.encoded, norm);
      } else if (v.u8) {
        backend.stage_batch_u8(slot, v.u8, v.labels, norm, v.augments);
      } else {
        backend.stage_batch(slot, v.f32, v.labels);
      }
      return StepStats{};
    }
    engine.train_step_async(v, 0.01f);
    const std::optional<StepStats> s = read ? engine.pending_stats() : std::nullopt;
    return s ? *s : StepStats{};
  };
  const int64_t steps = f.i64("steps", 50), warmup = f.i64("warmup", 10),
                repeats = f.i64("repeats", 3);
  KILN_CHECK(steps > 0 && warmup >= 0 && repeats > 0, InvalidArgument,
             "--steps and --repeats must be > 0");
  for (int64_t i = 0; i < warmup; ++i) {
    const StepStats s = step(i == 0);
    if (i == 0) first = s;
  }
  std::vector<double> rates;
  const DecodeCounters dc0 = backend.decode_counters();
  const bool profiler_range = f.on("cuda-profiler-range", false);
  KILN_CHECK(!profiler_range || backend.has_profiler_range(), InvalidArgument,
             "--cuda-profiler-range needs the CUDA backend (--device cuda)");
  if (profiler_range) backend.profiler_range(true);
  timing = true;
  // Host cores busy over the timed repeats only: start-up (compiling the step) would dilute it.
  const double cpu0 = process_cpu_seconds();
  const auto wall0 = Clock::now();
  for (int64_t r = 0; r < repeats; ++r) {
    if (!input_only) engine.pending_stats();
    backend.synchronize();
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < steps; ++i) step(false);
    if (!input_only) engine.pending_stats();
    backend.synchronize();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    rates.push_back(static_cast<double>(steps * n) / secs);
    std::printf("repeat %lld: %.1f images/s (%.2f ms/batch)\n", static_cast<long long>(r + 1),
                rates.back(), 1e3 * secs / static_cast<double>(steps));
  }
  const double cores_busy =
      (process_cpu_seconds() - cpu0) / std::chrono::duration<double>(Clock::now() - wall0).count();
  timing = false;
  if (profiler_range) backend.profiler_range(false);
  if (!input_only) last = step(true);
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  const LoaderStats ls = loader.stats();
  const DecodeCounters dc = backend.decode_counters();
  const double timed = static_cast<double>(steps * repeats);
  auto per_batch_ms = [&](double end, double begin) { return 1e3 * (end - begin) / timed; };
  std::printf("host ms per batch: loader %.2f, %s %.2f", 1e3 * next_s / timed,
              input_only ? "staging" : "staging + step launch + wait for the previous step",
              1e3 * step_s / timed);
  if (dc.batches > dc0.batches) {
    std::printf(
        " (of it staging encoded batches %.2f: bitstream copy %.2f, parse and plan %.2f, engine "
        "call %.2f, "
        "hybrid decoder %.2f, host images %.2f)",
        per_batch_ms(dc.stage_seconds, dc0.stage_seconds),
        per_batch_ms(dc.copy_seconds, dc0.copy_seconds),
        per_batch_ms(dc.parse_seconds, dc0.parse_seconds),
        per_batch_ms(dc.engine_call_seconds, dc0.engine_call_seconds),
        per_batch_ms(dc.hybrid_seconds, dc0.hybrid_seconds),
        per_batch_ms(dc.host_decode_seconds, dc0.host_decode_seconds));
  }
  std::printf("; %.1f host cores busy in this process\n", cores_busy);
  const char* decode = lo.output == LoaderOutput::encoded ? "gpu"
                       : lo.output == LoaderOutput::uint8 ? "cpu"
                                                          : "cpu-float32";
  std::printf(
      "%s from %s, batch %lld, decode %s, %d workers on %s: %.1f images/s (median of %lld; loader "
      "alone "
      "%.0f images/s; %lld corrupt files skipped)\n",
      input_only ? "input pipeline" : model.c_str(), spec.root.c_str(), static_cast<long long>(n),
      decode, lo.workers, backend.caps().device.c_str(), median, static_cast<long long>(repeats),
      ls.rate(), static_cast<long long>(data->corrupt_skipped()));
  std::printf(
      "{\"bench\":\"%s\",\"model\":\"%s\",\"batch\":%lld,\"amp\":%s,\"decode\":\"%s\",\"workers\":%"
      "d,"
      "\"images_per_second\":%.1f,\"loader_images_per_second\":%.1f,\"host_cores_busy\":%.2f,"
      "\"skipped_images\":%lld,"
      "\"decoded\":{\"hardware\":%lld,\"gpu_hybrid\":%lld,\"host\":%lld}",
      input_only ? "kiln-input" : "kiln-folder", model.c_str(), static_cast<long long>(n),
      eo.compile.amp ? "true" : "false", decode, lo.workers, median, ls.rate(), cores_busy,
      static_cast<long long>(data->corrupt_skipped()), static_cast<long long>(dc.hardware),
      static_cast<long long>(dc.gpu_hybrid), static_cast<long long>(dc.host));
  if (!input_only) {
    std::printf(",\"first_loss\":%.5f,\"last_loss\":%.5f", static_cast<double>(first.loss),
                static_cast<double>(last.loss));
  }
  std::printf("}\n");
  return 0;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  Flags f(
      "bench", "--model NAME [--batch N] [--amp] [flags]",
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
       {"stage",
        "every-step: copy the batch from the host each step, as a loader does; once: "
        "train on a batch resident on the device, as PyTorch's reference does",
        "every-step", false},
       {"data",
        "folder: batches from an image folder through the loader (default: one synthetic batch)",
        "", false},
       {"data-dir", "the image folder (holding train/<class>/*.jpg)", "", false},
       {"input-only",
        "with --data folder: time the input pipeline alone, files to the staged input buffer",
        "off", true},
       {"decode", "with --data folder: auto, gpu or cpu", "auto", false},
       {"input-u8",
        "with --data folder: uint8 pixels (--no-input-u8: the float32 path, for comparison)", "on",
        true},
       {"workers", "with --data folder: loader threads (default: the machine's cores)", "", false},
       {"auto-augment", "with --data folder: ra or ta_wide after the crop and flip", "", false},
       {"ra-num-ops", "with --auto-augment ra: ops per image", "2", false},
       {"ra-magnitude", "with --auto-augment ra: the magnitude bin, 0..30", "9", false},
       {"random-erase", "with --data folder: RandomErasing's probability (0 = off)", "0", false},
       {"profile", "print where the time goes (CPU: per op kind; CUDA: per phase)", "off", true},
       {"cuda-profiler-range",
        "CUDA: record only the timed steps under an external profiler "
        "(ncu --profile-from-start off; bench/kernel_breakdown.py)",
        "off", true}});
  if (!f.parse(argc, argv, 2)) return 0;
  // under mpirun or srun, one process per GPU, each with --batch; the figure is the sum.
  const Switches switches = switches_from(f);
  dist::init(false, switches.dist_timeout);
  std::string model = f.str("model", "resnet50");
  if (!f.has("model") && !f.positional().empty()) model = f.positional()[0];
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  const BluePrint bp = make_model(model, zo);
  EngineOptions eo;
  eo.device = f.str("device", "auto");
  eo.switches = switches;
  eo.compile.batch = f.i64("batch", f.i64("batch-size", 256));
  eo.compile.amp = f.on("amp", false);
  eo.compile.tf32 = switches.tf32;
  eo.compile.optimizer = f.str("opt", "sgd");
  eo.compile.weight_decay = 5e-5f;
  eo.compile.world = dist::world();
  if (f.has("data") || f.on("input-only", false)) return bench_folder(f, model, bp, eo);
  const int64_t steps = f.i64("steps", 50), warmup = f.i64("warmup", 10),
                repeats = f.i64("repeats", 3);
  const std::string stage = f.str("stage", "every-step");
  KILN_CHECK(stage == "every-step" || stage == "once", InvalidArgument, "--stage ", stage,
             " is not a staging mode; use every-step (the default) or once");
  const bool stage_once = stage == "once";
  KILN_CHECK(steps > 0 && warmup >= 0 && repeats > 0, InvalidArgument,
             "--steps and --repeats must be > 0");

  const auto t_compile = std::chrono::steady_clock::now();
  Engine engine(bp, eo);
  engine.lock_memory();
  engine.compile(1);
  const double compile_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_compile).count();
  if (dist::is_root()) {
    // What the merge passes fused: a bench's figure depends on it (KILN_FUSION, KILN_FUSE_POOL).
    int cbr = 0, pooled = 0, overlapping = 0, bar = 0, res_bn = 0;
    for (const PlanNode* p : engine.plan().live()) {
      cbr += p->op == PlanOp::CBR;
      pooled += p->op == PlanOp::CBR && p->pool != 0;
      overlapping +=
          p->op == PlanOp::CBR && p->pool != 0 && (p->pool_stride != p->pool || p->pool_pad != 0);
      bar += p->op == PlanOp::BnAddReLU;
      res_bn += p->op == PlanOp::BnAddReLU && !p->res_bn_name.empty();
    }
    std::printf(
        "fused layers: %d Conv+BN+ReLU (%d with their max-pool folded in, %d of those overlapping; "
        "KILN_FUSE_POOL=0 keeps pools apart, KILN_FUSE_OVERLAPPING_POOL=%d), %d BN+add+ReLU (%d "
        "with their shortcut's BatchNorm, KILN_FUSE_RESIDUAL_BN=%d; KILN_FUSION=0 turns fusion "
        "off)\n",
        cbr, pooled, overlapping, eo.switches.fuse_overlapping_pool ? 1 : 0, bar, res_bn,
        eo.switches.fuse_residual_bn ? 1 : 0);
  }
  if (const CompileReport use = engine.backend().compile_report();
      use.chooses_engines && dist::is_root()) {
    std::printf(
        "convolution engines: %d from the engine table%s%s, %d timed while compiling (%d of them "
        "timed "
        "by an earlier compile: this process or the autotune cache), %d from cuDNN's heuristics\n",
        use.from_table, use.table.empty() ? "" : " ", use.table.c_str(), use.autotuned,
        use.remembered, use.heuristics);
    std::printf("weight gradients on the side stream: %d (KILN_SIDE_WGRAD=1 forks them there)\n",
                use.side_stream_wgrads);
    if (!eo.compile.amp) {
      std::printf(
          "FP32 convolutions on Winograd / FFT engines: %d (KILN_FP32_WINOGRAD=0 refuses them)\n",
          use.fp32_transformed_plans);
    }
    if (use.cbr_cutlass + use.cbr_cutlass_fallbacks + use.conv_cutlass +
            use.conv_cutlass_fallbacks >
        0) {
      std::printf(
          "CBR forward (KILN_CUTLASS=%s): %d on the SM90 CUTLASS GEMM, %d kept their form; "
          "convolutions before BN+add+ReLU: %d on the GEMM, %d kept (the log says why)\n",
          auto_text(eo.switches.cutlass), use.cbr_cutlass, use.cbr_cutlass_fallbacks,
          use.conv_cutlass, use.conv_cutlass_fallbacks);
    }
    if (use.cbr_cutlass_conv > 0) {
      std::printf(
          "  of those, %d on the SM90 implicit-GEMM convolution "
          "(KILN_CUTLASS_CONV=%s)\n",
          use.cbr_cutlass_conv, auto_text(eo.switches.cutlass_conv));
    }
    if (use.dgrad_cutlass + use.dgrad_cutlass_fallbacks > 0) {
      std::printf(
          "data gradients before a BatchNorm backward (KILN_CUTLASS_DGRAD=%s): %d on the SM90 "
          "kernel with BatchNorm's sums, %d kept cuDNN (the log says why)\n",
          auto_text(eo.switches.cutlass_dgrad), use.dgrad_cutlass, use.dgrad_cutlass_fallbacks);
    }
    if (use.dgrad_cutlass_conv > 0) {
      std::printf(
          "  of those, %d on the SM90 implicit-GEMM data gradient (KILN_CUTLASS_CONV_DGRAD=%s)\n",
          use.dgrad_cutlass_conv, auto_text(eo.switches.cutlass_conv_dgrad));
    }
    if (use.dgrad_cutlass_wide > 0) {
      std::printf("  of those, %d on the 256x128 unit (KILN_CONV_DGRAD_WIDE_TILE=1)\n",
                  use.dgrad_cutlass_wide);
    }
    if (use.dgrad_cutlass_pingpong > 0) {
      std::printf("  of those, %d on a ping-pong unit (KILN_CONV_DGRAD_PINGPONG=1)\n",
                  use.dgrad_cutlass_pingpong);
    }
    if (use.sm90_timed > 0) {
      std::printf(
          "SM90 or cuDNN timed per layer (KILN_CUTLASS_TIMED=1): %d layers, %d kept cuDNN with "
          "kiln's pass\n",
          use.sm90_timed, use.sm90_timed_today);
    }
    if (use.residual_bn_sums_in_dx > 0) {
      std::printf(
          "shortcut BatchNorm backwards summed in the BN+add+ReLU dx pass "
          "(KILN_RESIDUAL_BN_SUMS_IN_DX=0 turns it off): %d\n",
          use.residual_bn_sums_in_dx);
    }
    if (use.convs_padded + use.pad_timed > 0) {
      std::printf(
          "channel padding (KILN_PAD_CHANNELS=%s): %d convolution kernels on padded copies "
          "(%d chose by timing)\n",
          auto_text(eo.switches.pad_channels), use.convs_padded, use.pad_timed);
    }
    if (use.cbr_genstats + use.cbr_fallbacks > 0) {
      std::printf(
          "CBR forward (KILN_CBR_FORM=genstats): %d as conv+genstats, %d fell back to kiln's "
          "form\n",
          use.cbr_genstats, use.cbr_fallbacks);
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

  engine.backend().set_profiling(eo.switches.profile);
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
  const bool profiler_range = f.on("cuda-profiler-range", false);
  KILN_CHECK(!profiler_range || engine.backend().has_profiler_range(), InvalidArgument,
             "--cuda-profiler-range needs the CUDA backend (--device cuda)");
  if (profiler_range) engine.backend().profiler_range(true);
  std::vector<double> rates;
  const DecodeCounters copies0 = engine.backend().decode_counters();
  for (int64_t r = 0; r < repeats; ++r) {
    engine.backend().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) step(done++, false);
    engine.backend().synchronize();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(steps * n * dist::world()) / secs);
    if (dist::is_root())
      std::printf("repeat %lld: %.1f images/s (%.2f ms/step)\n", static_cast<long long>(r + 1),
                  rates.back(), 1e3 * secs / static_cast<double>(steps));
  }
  if (profiler_range) engine.backend().profiler_range(false);
  const DecodeCounters copies = engine.backend().decode_counters();
  last = step(done++, true);
  if (!dist::is_root()) return 0;
  if (copies.host_batches > copies0.host_batches) {
    // After a synchronize the step waits this long, and then the transfer, for its batch.
    const int64_t threads = eo.switches.stage_copy_threads;
    std::printf(
        "host copy of each batch into pinned memory: %.2f ms (KILN_STAGE_COPY_THREADS=%s)\n",
        1e3 * (copies.host_copy_seconds - copies0.host_copy_seconds) /
            static_cast<double>(copies.host_batches - copies0.host_batches),
        threads == 0 ? "0, auto" : std::to_string(threads).c_str());
  }
  if (eo.switches.profile) std::printf("%s", engine.backend().profile_report().c_str());
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  std::printf(
      "%s batch %lld %s on %s: %.1f images/s (median of %lld), compile %.1fs, loss %.4f -> %.4f\n",
      model.c_str(), static_cast<long long>(n), eo.compile.amp ? "AMP" : "FP32",
      engine.backend().caps().device.c_str(), median, static_cast<long long>(repeats), compile_s,
      static_cast<double>(first.loss), static_cast<double>(last.loss));
  std::printf(
      "{\"bench\":\"kiln\",\"model\":\"%s\",\"batch\":%lld,\"amp\":%s,\"images_per_second\":%.1f,"
      "\"compile_seconds\":%.2f,\"first_loss\":%.5f,\"last_loss\":%.5f,\"world\":%d,\"stage\":\"%"
      "s\","
      "\"tf32\":%s}\n",
      model.c_str(), static_cast<long long>(n), eo.compile.amp ? "true" : "false", median,
      compile_s, static_cast<double>(first.loss), static_cast<double>(last.loss), dist::world(),
      stage.c_str(), eo.compile.tf32 ? "true" : "false");
  return 0;
}

}  // namespace kiln::cli
