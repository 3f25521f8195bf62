// kiln train / eval / export.
#include <cstdint>
#include <cstdio>

#include "cli.h"
#include "flags.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/data/loader.h"
#include "kiln/dist/dist.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/trainer.h"

namespace kiln::cli {

namespace {

std::vector<FlagSpec> train_flags() {
  return {
      {"model", "model from the zoo (kiln plan --help lists them)", "cnn", false},
      {"data", "dataset: fashion-mnist, mnist, cifar10, cifar100, folder, synthetic", "fashion-mnist", false},
      {"data-dir", "dataset location (fashion-mnist: /usr/share/datasets/fashion-mnist)", "", false},
      {"epochs", "epochs to train", "5", false},
      {"batch-size", "batch size", "128", false, 'b'},
      {"lr", "peak learning rate", "0.1", false},
      {"sched", "schedule: onecycle, cosine, step, multistep, poly, constant", "onecycle", false},
      {"warmup-epochs", "linear warm-up epochs (not for onecycle)", "0", false},
      {"min-lr", "cosine floor", "0", false},
      {"step-size", "step schedule: epochs between decays", "30", false},
      {"milestones", "multistep schedule: epochs, comma-separated", "", false},
      {"gamma", "step/multistep decay factor", "0.1", false},
      {"opt", "optimizer: sgd, adamw, lars", "sgd", false},
      {"momentum", "SGD/LARS momentum", "0.9", false},
      {"nesterov", "Nesterov momentum", "on", true},
      {"weight-decay", "weight decay (not applied to BatchNorm and biases)", "5e-4", false},
      {"clip-grad", "clip each |gradient| to this value (0 = off)", "0", false},
      {"amp", "FP16 mixed precision (GPU)", "off", true},
      {"tf32", "FP32 convolutions and matmuls may use TF32 (GPU; PyTorch's cuDNN default)", "off", true},
      {"ema", "keep an EMA of the weights and evaluate it too", "off", true},
      {"ema-decay", "EMA decay per step", "0.999", false},
      {"eval-every", "evaluate every N epochs", "1", false},
      {"early-stop", "stop after N epochs without a better test top-1 (0 = never)", "0", false},
      {"stop-after-epochs", "end this run after N epochs, leaving a checkpoint to --resume (0 = never)", "0", false},
      {"output", "folder for metrics.csv, metrics.jsonl, last.safetensors, summary.json", "runs/default", false},
      {"resume", "continue from this checkpoint", "", false},
      {"init-from", "start from torchvision-named weights (safetensors)", "", false},
      {"seed", "seed for weights, shuffling and augmentation", "0", false},
      {"workers", "data loader threads", std::to_string(default_loader_workers()) + ", the machine's cores", false},
      {"decode", "where image files are decoded: auto (on the GPU when the build and device can), gpu or cpu", "auto",
       false},
      {"input-u8", "uint8 pixels to the device, normalised there (--no-input-u8: float32 from the host)", "on", true},
      {"device", "auto, cpu or cuda", "auto", false},
      {"hflip", "random horizontal flips", "on", true},
      {"crop-padding", "random crop with this much zero padding (0 = off)", "0", false},
      {"random-resized-crop", "ImageNet-style RandomResizedCrop (image folders)", "off", true},
      {"image-size", "input size (0 = the model's default)", "0", false},
      {"num-classes", "classes (0 = the dataset's)", "0", false},
      {"max-steps", "at most this many steps per epoch (0 = all)", "0", false},
      {"max-image-pixels", "image folders: a larger image is skipped as corrupt (width x height)", "67108864", false},
      {"synthetic-size", "samples in the synthetic dataset", "0", false},
      {"progress", "auto, bar, plain or none", "auto", false},
      {"fusion", "fused ops where the device has them", "on", true},
      {"profile", "print time per phase (GPU)", "off", true},
      {"distributed", "data parallel over MPI even when no launcher variables say so (mpirun and srun are detected)", "off", true},
      {"sync-bn", "with several processes, BatchNorm statistics over the global batch (--no-sync-bn: per process)", "on", true},
  };
}

// An integer flag that must fit its field; the range check comes before the narrowing cast.
int64_t int_flag(const Flags& f, const std::string& name, int64_t fallback, int64_t lo, int64_t hi) {
  const int64_t v = f.i64(name, fallback);
  KILN_CHECK(v >= lo && v <= hi, InvalidArgument, "--", name, " must be in ", lo, "..", hi, ", got ", v);
  return v;
}

TrainConfig to_config(const Flags& f) {
  TrainConfig c;
  c.model = f.str("model", c.model);
  c.data = f.str("data", c.data);
  c.data_dir = f.str("data-dir");
  c.epochs = f.i64("epochs", c.epochs);
  c.batch_size = f.i64("batch-size", c.batch_size);
  c.lr.kind = f.str("sched", "onecycle");
  c.lr.base_lr = static_cast<float>(f.f64("lr", 0.1));
  c.lr.warmup_epochs = f.f64("warmup-epochs", 0);
  c.lr.min_lr = static_cast<float>(f.f64("min-lr", 0));
  c.lr.step_size = f.i64("step-size", 30);
  c.lr.milestones = f.i64_list("milestones");
  c.lr.gamma = static_cast<float>(f.f64("gamma", 0.1));
  c.optimizer = f.str("opt", c.optimizer);
  c.momentum = static_cast<float>(f.f64("momentum", c.momentum));
  c.nesterov = f.on("nesterov", c.nesterov);
  c.weight_decay = static_cast<float>(f.f64("weight-decay", c.weight_decay));
  c.clip_grad = static_cast<float>(f.f64("clip-grad", 0));
  c.amp = f.on("amp", false);
  c.tf32 = f.on("tf32", false);
  c.ema = f.on("ema", false);
  c.ema_decay = static_cast<float>(f.f64("ema-decay", c.ema_decay));
  c.eval_every = f.i64("eval-every", 1);
  c.early_stop = f.i64("early-stop", 0);
  c.stop_after_epochs = f.i64("stop-after-epochs", 0);
  c.output = f.str("output", c.output);
  c.resume = f.str("resume");
  c.init_from = f.str("init-from");
  c.seed = static_cast<uint64_t>(int_flag(f, "seed", 0, 0, INT64_MAX));
  // The trainer refuses more workers than the machine can use; this only keeps the cast exact.
  c.workers = static_cast<int>(int_flag(f, "workers", default_loader_workers(), INT32_MIN, INT32_MAX));
  c.decode = parse_decode_where(f.str("decode", "auto"));
  c.input_u8 = f.on("input-u8", true);
  c.device = f.str("device", c.device);
  c.hflip = f.on("hflip", c.hflip);
  c.crop_padding = static_cast<int>(int_flag(f, "crop-padding", 0, 0, 1 << 16));
  c.random_resized_crop = f.on("random-resized-crop", false);
  c.image_size = f.i64("image-size", 0);
  c.num_classes = f.i64("num-classes", 0);
  c.max_steps_per_epoch = f.i64("max-steps", 0);
  c.synthetic_size = f.i64("synthetic-size", 0);
  c.max_image_pixels = f.i64("max-image-pixels", c.max_image_pixels);
  c.progress = f.str("progress", c.progress);
  c.fusion = f.on("fusion", true);
  c.profile = f.on("profile", false);
  c.distributed = f.on("distributed", false);
  c.sync_bn = f.on("sync-bn", true);
  if (c.optimizer == "sgd" && c.momentum == 0.0f) c.nesterov = false;
  return c;
}

}  // namespace

int cmd_train(int argc, char** argv) {
  Flags f("train", "[flags]", train_flags());
  if (!f.parse(argc, argv, 2)) return 0;
  KILN_CHECK(f.positional().empty(), InvalidArgument, "kiln train takes no positional argument ('",
             f.positional().empty() ? "" : f.positional()[0], "'); use --model NAME");
  const TrainConfig c = to_config(f);
  const TrainSummary s = train(c);
  dist::finalize();  // S27: every process ends together; one prints the summary
  if (!dist::is_root()) return 0;
  std::printf("done: %lld epochs, %lld steps, test top-1 %.2f%% (best %.2f%%), top-5 %.2f%%", static_cast<long long>(s.epochs_run),
              static_cast<long long>(s.steps), s.final_top1, s.best_top1, s.final_top5);
  if (s.ema_top1 >= 0) std::printf(", EMA top-1 %.2f%%", s.ema_top1);
  std::printf("\ntraining time %.1fs (%.0f images/s)\n", s.train_seconds, s.images_per_second);
  std::printf("metrics:    %s\n            %s\ncheckpoint: %s\nsummary:    %s/summary.json\n", s.metrics_csv.c_str(),
              s.metrics_jsonl.c_str(), s.checkpoint.c_str(), c.output.c_str());
  return 0;
}

// Training-only flags: kiln eval refuses them (as unknown flags, listing its own) rather than
// accepting and ignoring them.
bool eval_uses(const std::string& name) {
  static const char* const kTrainingOnly[] = {
      "epochs",      "lr",          "sched",     "warmup-epochs",     "min-lr",         "step-size",
      "milestones",  "gamma",       "opt",       "momentum",          "nesterov",       "weight-decay",
      "clip-grad",   "ema",         "ema-decay", "eval-every",        "early-stop",     "stop-after-epochs",
      "output",      "resume",      "init-from", "hflip",             "crop-padding",   "random-resized-crop",
      "max-steps",   "profile"};
  for (const char* t : kTrainingOnly) {
    if (name == t) return false;
  }
  return true;
}

int cmd_eval(int argc, char** argv) {
  std::vector<FlagSpec> specs;
  for (const FlagSpec& s : train_flags()) {
    if (eval_uses(s.name)) specs.push_back(s);
  }
  specs.push_back({"weights", "checkpoint or torchvision-named weights to evaluate", "", false});
  Flags f("eval", "--model NAME --weights FILE [flags]", specs);
  if (!f.parse(argc, argv, 2)) return 0;
  TrainConfig c = to_config(f);
  KILN_CHECK(f.has("weights"), InvalidArgument, "kiln eval needs --weights FILE (a checkpoint or exported weights)");
  // Evaluation is a zero-epoch run that starts from the weights.
  c.init_from = f.str("weights");
  c.epochs = 1;
  c.max_steps_per_epoch = 0;
  const TrainSummary s = evaluate(c);
  dist::finalize();
  if (!dist::is_root()) return 0;
  std::printf("test top-1 %.2f%%, top-5 %.2f%%, loss %.4f\n", s.final_top1, s.final_top5, s.final_loss);
  return 0;
}

int cmd_export(int argc, char** argv) {
  Flags f("export", "--model NAME --checkpoint FILE --output FILE",
          {{"model", "model the checkpoint was trained as", "", false},
           {"checkpoint", "kiln checkpoint to read", "", false},
           {"output", "safetensors file to write (torchvision names and layouts)", "", false},
           {"num-classes", "classes (0 = the form's default)", "0", false},
           {"image-size", "input size (0 = the form's default)", "0", false}});
  if (!f.parse(argc, argv, 2)) return 0;
  KILN_CHECK(f.has("model") && f.has("checkpoint") && f.has("output"), InvalidArgument,
             "kiln export needs --model, --checkpoint and --output");
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  EngineOptions eo;
  eo.device = "cpu";
  eo.compile.batch = 1;
  Engine engine(make_model(f.str("model"), zo), eo);
  engine.lock_memory();
  engine.compile();
  import_weights(engine, f.str("checkpoint"));
  export_weights(engine, f.str("output"));
  std::printf("wrote %s\n", f.str("output").c_str());
  return 0;
}

}  // namespace kiln::cli
