// kiln train / eval / export.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "cli.h"
#include "flags.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/data/loader.h"
#include "kiln/io/safetensors.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/trainer.h"
#include "task/run_folder.h"

namespace kiln::cli {

std::vector<FlagSpec> train_flags() {
  return {
      {"model", "model from the zoo (kiln plan --help lists them)", "cnn", false},
      {"data", "dataset: fashion-mnist, mnist, cifar10, cifar100, folder, synthetic",
       "fashion-mnist", false},
      {"data-dir", "dataset location (fashion-mnist: /usr/share/datasets/fashion-mnist)", "",
       false},
      {"epochs", "epochs to train", "5", false},
      {"batch-size", "batch size", "128", false, 'b'},
      {"lr", "peak learning rate", "0.1", false},
      {"sched", "schedule: onecycle, cosine, step, multistep, poly, constant", "onecycle", false},
      {"warmup-epochs",
       "linear warm-up epochs; with onecycle, its rising phase (PyTorch's pct_start = warmup / "
       "epochs; 0: 30% of the run)",
       "0", false},
      {"min-lr", "cosine floor", "0", false},
      {"step-size", "step schedule: epochs between decays", "30", false},
      {"milestones", "multistep schedule (only): epochs, comma-separated", "", false},
      {"gamma", "step/multistep decay factor", "0.1", false},
      {"opt", "optimizer: sgd, adamw, lars", "sgd", false},
      {"momentum", "SGD/LARS momentum", "0.9", false},
      {"nesterov", "Nesterov momentum", "on", true},
      {"weight-decay", "weight decay (not applied to BatchNorm and biases)", "5e-4", false},
      {"clip-grad", "clip each |gradient| to this value (0 = off)", "0", false},
      {"clip-grad-norm",
       "scale the gradients so that their global L2 norm is at most this (0 = off)", "0", false},
      {"label-smoothing", "cross-entropy label smoothing in [0, 1) (0 = off)", "0", false},
      {"mixup-alpha",
       "mixup of the training batches, lambda ~ Beta(A, A) (0 = off; torchvision 0.2)", "0", false,
       0, "mixup"},
      {"cutmix-alpha", "cutmix of the training batches, box area from Beta(A, A) (0 = off; 1.0)",
       "0", false, 0, "cutmix"},
      {"mixup-prob", "share of the training steps that are mixed, in [0, 1] (timm's --mixup-prob)",
       "1", false},
      {"mixup-switch-prob",
       "with both mixup and cutmix on, the share of cutmix steps, in [0, 1] (torchvision 0.5)",
       "0.5", false},
      {"amp", "FP16 mixed precision (GPU)", "off", true},
      {"tf32", "FP32 convolutions and matmuls may use TF32 (GPU; PyTorch's cuDNN default)", "off",
       true},
      {"ema", "keep an EMA of the weights and evaluate it too", "off", true},
      {"ema-decay", "EMA decay per step", "0.999", false},
      {"eval-every", "evaluate every N epochs", "1", false},
      {"early-stop", "stop after N epochs without a better test top-1 (0 = never)", "0", false},
      {"stop-after-epochs",
       "end this run after N epochs, leaving a checkpoint to --resume (0 = never)", "0", false},
      {"stop-after-steps",
       "end this run after N steps, leaving a mid-epoch checkpoint to --resume (0 = never)", "0",
       false},
      {"save-every-steps", "also write last.safetensors every N steps, mid-epoch (0 = off)", "0",
       false},
      {"save-every-minutes",
       "also write last.safetensors every M minutes of training, mid-epoch, so a kill loses "
       "minutes, not an epoch (0 = off)",
       "10", false},
      {"output", "folder for metrics.csv, metrics.jsonl, last.safetensors, summary.json",
       "runs/default", false},
      {"keep-last", "also keep the last K epochs' checkpoints as epoch-N.safetensors (0 = none)",
       "0", false},
      {"resume", "continue from this checkpoint, with its seed, batch size and schedule", "",
       false},
      {"resume-override",
       "with --resume, let flags change the checkpoint's seed, batch size or schedule", "off",
       true},
      {"init-from", "start from torchvision-named weights (safetensors)", "", false},
      {"seed", "seed for weights, shuffling and augmentation", "0", false},
      {"workers", "data loader threads",
       std::to_string(default_loader_workers()) + ", the machine's cores", false},
      {"decode",
       "where image files are decoded: auto (on the GPU when the build and device can), gpu or cpu",
       "auto", false},
      {"input-u8",
       "uint8 pixels to the device, normalised there (--no-input-u8: float32 from the host)", "on",
       true},
      {"device", "auto, cpu or cuda", "auto", false},
      {"hflip", "random horizontal flips", "on", true},
      {"crop-padding", "random crop with this much zero padding (0 = off)", "0", false},
      {"random-resized-crop", "ImageNet-style RandomResizedCrop (image folders)", "off", true},
      {"color-jitter",
       "ColorJitter on training images after the crop and flip: one value for brightness, contrast "
       "and saturation "
       "(timm's 0.4), or B,C,S[,H]. Not a crop-and-resize, so batches go to the device as float32 "
       "(no uint8 or GPU "
       "decode path)",
       "", false},
      {"interpolation",
       "image folders: the training RandomResizedCrop's and the evaluation Resize's filter, "
       "bilinear or bicubic "
       "(antialiased when shrinking, as PIL and torchvision)",
       "bilinear", false},
      {"auto-augment",
       "ra (RandAugment) or ta_wide (TrivialAugmentWide) on training images after the crop and "
       "flip, as torchvision's; applied where the batch lands (on the GPU with --decode gpu or "
       "uint8 input)",
       "", false},
      {"ra-magnitude", "with --auto-augment ra: the magnitude bin, 0..30", "9", false},
      {"ra-num-ops", "with --auto-augment ra: ops per image", "2", false},
      {"random-erase",
       "torchvision's RandomErasing on the normalised training images with this probability (0 = "
       "off); applied where the batch lands (on the GPU with --decode gpu or uint8 input)",
       "0", false},
      {"image-size", "input size (0 = the model's default)", "0", false},
      {"train-crop-size",
       "torchvision's name for --image-size: the training crop and the model's "
       "input (0 = the model's default)",
       "0", false},
      {"val-crop-size",
       "image folders' evaluation: the centre crop and the evaluation's input (0 = the training "
       "crop); another size than the training crop evaluates with a program compiled for it "
       "that shares the training weights (globally pooled models: resnet*, vgg*_bn)",
       "0", false},
      {"val-resize-size",
       "image folders' evaluation: the shorter side resized to this before the centre crop (0 = "
       "8/7 "
       "of the input size, 256 for 224)",
       "0", false},
      {"num-classes", "classes (0 = the dataset's)", "0", false},
      {"max-steps", "at most this many steps per epoch (0 = all)", "0", false},
      {"max-image-pixels", "image folders: a larger image is skipped as corrupt (width x height)",
       "67108864", false},
      {"synthetic-size", "samples in the synthetic dataset", "0", false},
      {"progress", "auto, bar, plain or none", "auto", false},
      {"fusion", "fused ops where the device has them", "on", true},
      {"deterministic",
       "refuse cuDNN engines that are not bitwise reproducible (KILN_DETERMINISTIC)", "off", true},
      {"profile", "print time per phase (GPU)", "off", true},
      {"distributed",
       "data parallel over MPI even when no launcher variables say so (mpirun and srun are "
       "detected)",
       "off", true},
      {"sync-bn",
       "with several processes, BatchNorm statistics over the global batch (--no-sync-bn: per "
       "process)",
       "on", true},
  };
}

namespace {

// An integer flag that must fit its field; the range check comes before the narrowing cast.
int64_t int_flag(const Flags& f, const std::string& name, int64_t fallback, int64_t lo,
                 int64_t hi) {
  const int64_t v = f.i64(name, fallback);
  KILN_CHECK(v >= lo && v <= hi, InvalidArgument, "--", name, " must be in ", lo, "..", hi,
             ", got ", v);
  return v;
}

// --color-jitter V (brightness, contrast and saturation V, as timm's) or B,C,S[,H].
std::array<float, 4> color_jitter_flag(const Flags& f) {
  std::array<float, 4> out{};
  if (!f.has("color-jitter")) return out;
  const std::string text = f.str("color-jitter");
  std::vector<float> v;
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const float x = std::strtof(item.c_str(), &end);
    KILN_CHECK(
        !item.empty() && end && *end == '\0' && std::isfinite(x), InvalidArgument,
        "--color-jitter '", text, "': '", item,
        "' is not a number; give one value (e.g. 0.4) or brightness,contrast,saturation[,hue]");
    v.push_back(x);
    at = comma + 1;
  }
  KILN_CHECK(v.size() == 1 || v.size() == 3 || v.size() == 4, InvalidArgument, "--color-jitter '",
             text, "' has ", v.size(),
             " values; give one (brightness, contrast and saturation alike) or B,C,S[,H]");
  if (v.size() == 1) v = {v[0], v[0], v[0]};
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i];
  return out;
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
  c.clip_grad_norm = static_cast<float>(f.f64("clip-grad-norm", 0));
  c.label_smoothing = static_cast<float>(f.f64("label-smoothing", 0));
  c.mix.mixup_alpha = f.f64("mixup-alpha", 0);
  c.mix.cutmix_alpha = f.f64("cutmix-alpha", 0);
  c.mix.prob = f.f64("mixup-prob", 1);
  c.mix.switch_prob = f.f64("mixup-switch-prob", 0.5);
  c.keep_last = f.i64("keep-last", 0);
  c.amp = f.on("amp", false);
  c.ema = f.on("ema", false);
  c.ema_decay = static_cast<float>(f.f64("ema-decay", c.ema_decay));
  c.eval_every = f.i64("eval-every", 1);
  c.early_stop = f.i64("early-stop", 0);
  c.stop_after_epochs = f.i64("stop-after-epochs", 0);
  c.stop_after_steps = f.i64("stop-after-steps", 0);
  c.save_every_steps = f.i64("save-every-steps", 0);
  c.save_every_minutes = f.f64("save-every-minutes", c.save_every_minutes);
  c.output = f.str("output", c.output);
  c.resume = f.str("resume");
  c.init_from = f.str("init-from");
  c.seed = static_cast<uint64_t>(int_flag(f, "seed", 0, 0, INT64_MAX));
  // The trainer refuses more workers than the machine can use; this only keeps the cast exact.
  c.workers =
      static_cast<int>(int_flag(f, "workers", default_loader_workers(), INT32_MIN, INT32_MAX));
  c.decode = parse_decode_where(f.str("decode", "auto"));
  c.input_u8 = f.on("input-u8", true);
  c.device = f.str("device", c.device);
  c.hflip = f.on("hflip", c.hflip);
  c.crop_padding = static_cast<int>(int_flag(f, "crop-padding", 0, 0, 1 << 16));
  c.random_resized_crop = f.on("random-resized-crop", false);
  c.color_jitter = color_jitter_flag(f);
  c.interpolation = parse_filter(f.str("interpolation", "bilinear"));
  c.random_erase = static_cast<float>(f.f64("random-erase", 0));
  c.auto_augment = f.str("auto-augment");
  c.ra_num_ops = static_cast<int>(int_flag(f, "ra-num-ops", 2, 0, 64));
  c.ra_magnitude = static_cast<int>(int_flag(f, "ra-magnitude", 9, 0, 30));
  KILN_CHECK(c.auto_augment == "ra" || !(f.has("ra-num-ops") || f.has("ra-magnitude")),
             InvalidArgument,
             "--ra-num-ops and --ra-magnitude set RandAugment; add --auto-augment ra");
  c.image_size = f.i64("image-size", 0);
  if (f.has("train-crop-size")) {
    const int64_t crop = f.i64("train-crop-size", 0);
    KILN_CHECK(!f.has("image-size") || crop == c.image_size, InvalidArgument, "--train-crop-size ",
               crop, " and --image-size ", c.image_size,
               " name the same thing (the model's input size); give one of them");
    c.image_size = crop;
  }
  c.val_crop_size = f.i64("val-crop-size", 0);
  c.val_resize_size = f.i64("val-resize-size", 0);
  c.num_classes = f.i64("num-classes", 0);
  c.max_steps_per_epoch = f.i64("max-steps", 0);
  c.synthetic_size = f.i64("synthetic-size", 0);
  c.max_image_pixels = f.i64("max-image-pixels", c.max_image_pixels);
  c.progress = f.str("progress", c.progress);
  c.switches = switches_from(f);  // --fusion, --tf32, --profile, --deterministic over KILN_*
  c.distributed = f.on("distributed", false);
  c.sync_bn = f.on("sync-bn", true);
  if (c.optimizer == "sgd" && c.momentum == 0.0f) c.nesterov = false;
  return c;
}

// One value of config_json's flat object as its JSON text (a string with its quotes); "" when
// the key is absent (a checkpoint from before it was recorded).
std::string config_value(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const size_t at = json.find(needle);
  if (at == std::string::npos) return "";
  size_t i = at + needle.size();
  if (i < json.size() && json[i] == '"') {
    for (size_t j = i + 1; j < json.size(); ++j) {
      if (json[j] == '\\')
        ++j;
      else if (json[j] == '"')
        return json.substr(i, j + 1 - i);
    }
    return "";
  }
  const size_t end = json.find_first_of(",}", i);
  return end == std::string::npos ? "" : json.substr(i, end - i);
}

std::string unquoted(const std::string& v) {
  return v.size() >= 2 && v.front() == '"' ? v.substr(1, v.size() - 2) : v;
}

// What --resume takes from the checkpoint's run: a different value changes the data order,
// the batches or the learning rate of the steps still to come.
struct ResumedSetting {
  const char* flag;
  const char* key;  // in config_json
  void (*set)(TrainConfig&, const std::string&);
};

const ResumedSetting kResumed[] = {
    {"seed", "seed", [](TrainConfig& c, const std::string& v) { c.seed = std::stoull(v); }},
    {"batch-size", "batch_size",
     [](TrainConfig& c, const std::string& v) { c.batch_size = std::stoll(v); }},
    {"epochs", "epochs", [](TrainConfig& c, const std::string& v) { c.epochs = std::stoll(v); }},
    {"max-steps", "max_steps",
     [](TrainConfig& c, const std::string& v) { c.max_steps_per_epoch = std::stoll(v); }},
    {"sched", "sched", [](TrainConfig& c, const std::string& v) { c.lr.kind = unquoted(v); }},
    {"lr", "lr", [](TrainConfig& c, const std::string& v) { c.lr.base_lr = std::stof(v); }},
    {"warmup-epochs", "warmup_epochs",
     [](TrainConfig& c, const std::string& v) { c.lr.warmup_epochs = std::stod(v); }},
    {"min-lr", "min_lr", [](TrainConfig& c, const std::string& v) { c.lr.min_lr = std::stof(v); }},
    {"step-size", "step_size",
     [](TrainConfig& c, const std::string& v) { c.lr.step_size = std::stoll(v); }},
    {"gamma", "gamma", [](TrainConfig& c, const std::string& v) { c.lr.gamma = std::stof(v); }},
    // A step's mix follows these (kiln/data/mixup.h): a resumed run keeps them.
    {"mixup-alpha", "mixup_alpha",
     [](TrainConfig& c, const std::string& v) { c.mix.mixup_alpha = std::stod(v); }},
    {"cutmix-alpha", "cutmix_alpha",
     [](TrainConfig& c, const std::string& v) { c.mix.cutmix_alpha = std::stod(v); }},
    {"mixup-prob", "mixup_prob",
     [](TrainConfig& c, const std::string& v) { c.mix.prob = std::stod(v); }},
    {"mixup-switch-prob", "mixup_switch_prob",
     [](TrainConfig& c, const std::string& v) { c.mix.switch_prob = std::stod(v); }},
    {"milestones", "milestones",
     [](TrainConfig& c, const std::string& v) {
       c.lr.milestones.clear();
       const std::string list = unquoted(v);
       for (size_t at = 0; at < list.size();) {
         const size_t comma = std::min(list.find(',', at), list.size());
         c.lr.milestones.push_back(std::stoll(list.substr(at, comma - at)));
         at = comma + 1;
       }
     }},
};

// --resume continues the checkpoint's run: a setting of kResumed that is not given takes the
// checkpoint's value; one given that contradicts it is refused, or with --resume-override taken
// and logged.
void adopt_checkpoint_config(const Flags& f, TrainConfig& c) {
  const StFile ck = read_safetensors(c.resume);
  const auto it = ck.metadata.find("config");
  if (it == ck.metadata.end()) return;  // not a kiln checkpoint: load_checkpoint says so
  const bool override_ok = f.on("resume-override", false);
  for (const ResumedSetting& s : kResumed) {
    const std::string was = config_value(it->second, s.key);
    const std::string now = config_value(config_json(c), s.key);
    if (was.empty() || was == "null" || was == now) continue;
    if (!f.has(s.flag)) {
      try {
        s.set(c, was);
      } catch (const std::logic_error&) {
        KILN_FAIL(Checkpoint, "'", c.resume, "': its config's '", s.key, "' = ", was,
                  " is not a valid --", s.flag);
      }
      continue;
    }
    KILN_CHECK(override_ok, InvalidArgument, "--", s.flag, " ", unquoted(now),
               " contradicts the checkpoint '", c.resume, "', whose run has --", s.flag, " ",
               unquoted(was), "; drop --", s.flag,
               " to continue with the checkpoint's, or add --resume-override to change it");
    log_warn("--resume-override: --", s.flag, " ", unquoted(now), " replaces the checkpoint's ",
             unquoted(was));
  }
}

// The command line that continues this run: the same arguments, --resume naming `checkpoint`.
std::string resume_command(int argc, char** argv, const std::string& checkpoint) {
  auto quoted = [](const std::string& a) {
    if (!a.empty() &&
        a.find_first_not_of(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=./,:+@%") ==
            std::string::npos) {
      return a;
    }
    std::string q = "'";
    for (char ch : a) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
  };
  std::string cmd = quoted(argv[0]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--resume" && i + 1 < argc) {
      ++i;
      continue;
    }
    if (a.rfind("--resume=", 0) == 0) continue;
    cmd += " " + quoted(a);
  }
  return cmd + " --resume " + quoted(checkpoint);
}

}  // namespace

TrainConfig train_config(const Flags& f) {
  KILN_CHECK(f.positional().empty(), InvalidArgument, "kiln train takes no positional argument ('",
             f.positional().empty() ? "" : f.positional()[0], "'); use --model NAME");
  TrainConfig c = to_config(f);
  KILN_CHECK(!f.on("resume-override", false) || !c.resume.empty(), InvalidArgument,
             "--resume-override only applies with --resume CHECKPOINT");
  if (!c.resume.empty() && c.init_from.empty()) adopt_checkpoint_config(f, c);
  return c;
}

int cmd_train(int argc, char** argv) {
  Flags f("train", "[flags]", train_flags());
  if (!f.parse(argc, argv, 2)) return 0;
  const TrainConfig c = train_config(f);
  const TrainSummary s = train(c);
  dist::finalize();  // every process ends together; one prints the summary
  if (!dist::is_root()) return s.stop_signal ? 128 + s.stop_signal : 0;
  if (s.complete) return 0;
  if (s.stop_signal || s.stopped_early) {
    const std::string why = s.stop_signal ? std::string("stopped by ") + signal_name(s.stop_signal)
                                          : "stopped as asked";
    if (s.saved_at.empty()) {
      std::printf("%s before the first step of this run; nothing to save\n", why.c_str());
    } else {
      std::printf("%s; checkpoint %s: %s\nresume with: %s\n", why.c_str(), s.saved_at.c_str(),
                  s.checkpoint.c_str(), resume_command(argc, argv, s.checkpoint).c_str());
    }
    std::fflush(stdout);
    return s.stop_signal ? 128 + s.stop_signal : 0;
  }
  std::printf("done: %lld epochs, %lld steps, test top-1 %.2f%% (best %.2f%%), top-5 %.2f%%",
              static_cast<long long>(s.epochs_run), static_cast<long long>(s.steps), s.final_top1,
              s.best_top1, s.final_top5);
  if (s.ema_top1 >= 0) std::printf(", EMA top-1 %.2f%%", s.ema_top1);
  std::printf("\ntraining time %.1fs (%.0f images/s)\n", s.train_seconds, s.images_per_second);
  std::printf("metrics:    %s\n            %s\ncheckpoint: %s\nsummary:    %s/summary.json\n",
              s.metrics_csv.c_str(), s.metrics_jsonl.c_str(), s.checkpoint.c_str(),
              c.output.c_str());
  return 0;
}

// Training-only flags: kiln eval refuses them (as unknown flags, listing its own) rather than
// accepting and ignoring them.
bool eval_uses(const std::string& name) {
  static const char* const kTrainingOnly[] = {"epochs",
                                              "lr",
                                              "sched",
                                              "warmup-epochs",
                                              "min-lr",
                                              "step-size",
                                              "milestones",
                                              "gamma",
                                              "opt",
                                              "momentum",
                                              "nesterov",
                                              "weight-decay",
                                              "clip-grad",
                                              "ema-decay",
                                              "eval-every",
                                              "early-stop",
                                              "stop-after-epochs",
                                              "output",
                                              "resume",
                                              "init-from",
                                              "hflip",
                                              "crop-padding",
                                              "random-resized-crop",
                                              "color-jitter",
                                              "clip-grad-norm",
                                              "keep-last",
                                              "random-erase",
                                              "auto-augment",
                                              "train-crop-size",
                                              "ra-magnitude",
                                              "ra-num-ops",
                                              "mixup-alpha",
                                              "cutmix-alpha",
                                              "mixup-prob",
                                              "mixup-switch-prob",
                                              "max-steps",
                                              "profile",
                                              "stop-after-steps",
                                              "save-every-steps",
                                              "save-every-minutes",
                                              "resume-override"};
  for (const char* t : kTrainingOnly) {
    if (name == t) return false;
  }
  return true;
}

int cmd_eval(int argc, char** argv) {
  std::vector<FlagSpec> specs;
  for (const FlagSpec& s : train_flags()) {
    if (s.name == "ema") {
      specs.push_back({"ema",
                       "evaluate the checkpoint's EMA weights with their own BatchNorm statistics",
                       "off", true});
    } else if (eval_uses(s.name)) {
      specs.push_back(s);
    }
  }
  specs.push_back({"weights", "checkpoint or torchvision-named weights to evaluate", "", false});
  Flags f("eval", "--model NAME --weights FILE [flags]", specs);
  if (!f.parse(argc, argv, 2)) return 0;
  TrainConfig c = to_config(f);
  KILN_CHECK(f.has("weights"), InvalidArgument,
             "kiln eval needs --weights FILE (a checkpoint or exported weights)");
  // Evaluation is a zero-epoch run that starts from the weights.
  c.init_from = f.str("weights");
  c.epochs = 1;
  c.max_steps_per_epoch = 0;
  const TrainSummary s = evaluate(c);
  dist::finalize();
  if (!dist::is_root()) return 0;
  std::printf("test top-1 %.2f%%, top-5 %.2f%%, loss %.4f (%.0f images/s)\n", s.final_top1,
              s.final_top5, s.final_loss, s.eval_images_per_second);
  return 0;
}

int cmd_export(int argc, char** argv) {
  Flags f("export", "--model NAME --checkpoint FILE --output FILE",
          {{"model", "model the checkpoint was trained as", "", false},
           {"checkpoint", "kiln checkpoint to read", "", false},
           {"output", "safetensors file to write (torchvision names and layouts)", "", false},
           {"num-classes", "classes (0 = the form's default)", "0", false},
           {"image-size", "input size (0 = the form's default)", "0", false},
           {"ema", "write the EMA model: EMA weights and their own BatchNorm statistics", "off",
            true}});
  if (!f.parse(argc, argv, 2)) return 0;
  KILN_CHECK(f.has("model") && f.has("checkpoint") && f.has("output"), InvalidArgument,
             "kiln export needs --model, --checkpoint and --output");
  ZooOptions zo;
  zo.num_classes = static_cast<int>(f.i64("num-classes", 0));
  zo.image_size = static_cast<int>(f.i64("image-size", 0));
  EngineOptions eo;
  eo.device = "cpu";
  eo.compile.batch = 1;
  const bool ema = f.on("ema", false);
  eo.compile.ema = ema;
  Engine engine(make_model(f.str("model"), zo), eo);
  engine.lock_memory();
  engine.compile();
  // Writing the weights over the checkpoint would replace the training state (moments, loss
  // scale, position) with a file --resume refuses.
  std::error_code same_ec;
  KILN_CHECK(!std::filesystem::equivalent(f.str("checkpoint"), f.str("output"), same_ec),
             InvalidArgument, "kiln export --output '", f.str("output"), "' is the checkpoint '",
             f.str("checkpoint"),
             "' itself; writing the weights there would replace its training state. Give another "
             "--output");
  import_weights(engine, f.str("checkpoint"));
  const StFile ck = read_safetensors(f.str("checkpoint"));
  // num_batches_tracked: the steps the checkpoint's run took (a plain weights file has none).
  if (auto step = ck.metadata.find("step"); step != ck.metadata.end()) {
    engine.set_steps_done(std::atoll(step->second.c_str()));
  }
  if (ema) {
    import_ema_state_dict(engine,
                          ema_state_of_checkpoint(engine.program(), ck, f.str("checkpoint")),
                          f.str("checkpoint"));
  }
  export_weights(engine, f.str("output"), ema);
  std::printf("wrote %s\n", f.str("output").c_str());
  return 0;
}

}  // namespace kiln::cli
