// Trainer: epochs over a dataset with a learning-rate schedule, evaluation every
// N epochs (top-1/top-5, and the EMA weights when on), a progress line with images/s and
// ETA, metrics to CSV and JSON lines, checkpoints, early stop, deterministic seeds.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kiln/algo/lr_schedule.h"
#include "kiln/core/switches.h"
#include "kiln/data/mixup.h"
#include "kiln/data/sample_geometry.h"
#include "kiln/io/metrics.h"
#include "kiln/task/engine.h"

namespace kiln {

class Pipeline;

struct TrainConfig {
  std::string model = "cnn";
  std::string data = "fashion-mnist";  // fashion-mnist, mnist, cifar10, cifar100, folder, synthetic
  std::string data_dir;                // empty: the dataset's default location
  int64_t epochs = 5;
  int64_t batch_size = 128;
  LrSchedule lr;
  std::string optimizer = "sgd";
  float momentum = 0.9f;
  float weight_decay = 5e-4f;
  bool nesterov = true;
  bool amp = false;
  bool ema = false;
  float ema_decay = 0.999f;
  int64_t eval_every = 1;         // epochs
  int64_t early_stop = 0;         // epochs without a better top-1 before stopping; 0 = never
  int64_t stop_after_epochs = 0;  // end after this many epochs of this run, as if interrupted
                                  // (the schedule still spans `epochs`); 0 = run to the end
  int64_t stop_after_steps = 0;   // the same after this many steps of this run, mid-epoch
  // Mid-epoch checkpoints (last.safetensors, as at an epoch's end): every N steps, and every M
  // minutes of training; 0 turns either off. Ten minutes bound what a kill loses on a long
  // epoch while a checkpoint's few seconds stay a small share of the time.
  int64_t save_every_steps = 0;
  double save_every_minutes = 10;
  std::string output = "runs/default";
  std::string resume;     // checkpoint to continue from
  std::string init_from;  // torchvision-named weights to start from
  uint64_t seed = 0;
  int workers = 2;                              // the CLI's default: default_loader_workers()
  DecodeWhere decode = DecodeWhere::automatic;  // where image files are decoded (--decode)
  bool input_u8 = true;  // uint8 pixels to the device where the pipeline allows;
                         // false: float32 from the host (the reference path)
  std::string device = "auto";
  bool hflip = true;                 // random horizontal flip
  int crop_padding = 0;              // random crop with this padding (0 = off)
  bool random_resized_crop = false;  // ImageNet-style training crop
  // ColorJitter on training images after the crop and flip: brightness, contrast, saturation,
  // hue (all 0 = off). Not a crop-and-resize, so the training batches take the float32 path.
  std::array<float, 4> color_jitter{};
  // Image folders: the filter of the training RandomResizedCrop and the evaluation Resize
  // (torchvision's --interpolation), antialiased when shrinking.
  ResampleFilter interpolation = ResampleFilter::bilinear;
  // torchvision's RandomErasing on the normalised training images with this probability (0 =
  // off), and RandAugment ("ra": ra_num_ops ops of bin ra_magnitude of 31) or TrivialAugmentWide
  // ("ta_wide") after the crop and flip ("" = off). Neither is a crop-and-resize, so training
  // batches take the float32 path.
  float random_erase = 0.0f;
  std::string auto_augment;
  int ra_num_ops = 2;
  int ra_magnitude = 9;
  int64_t image_size = 0;           // 0 = the model's default
  int64_t num_classes = 0;          // 0 = the dataset's
  int64_t max_steps_per_epoch = 0;  // 0 = the whole epoch (for quick runs and tests)
  int64_t synthetic_size = 0;       // synthetic dataset length (0 = 50 batches)
  int64_t max_image_pixels = int64_t{1}
                             << 26;  // image folders: larger images are skipped as corrupt
  std::string progress = "auto";     // auto, bar, plain, none
  float clip_grad = 0.0f;
  float clip_grad_norm = 0.0f;   // global L2 norm cap of the gradients (0 = off)
  float label_smoothing = 0.0f;  // cross-entropy target smoothing in [0, 1)
  // Mixup / CutMix of the training batches (kiln/data/mixup.h; both alphas 0 = off): alphas,
  // the share of mixed steps and cutmix's share when both are on (torchvision's RandomChoice
  // is 0.5). Evaluation is unmixed.
  MixOptions mix;
  // Image folders' evaluation: the shorter side resized to this before the centre crop (0 = 8/7
  // of the input size, 256 for 224, as torchvision's reference).
  int64_t val_resize_size = 0;
  // The evaluation's centre crop (0: the training crop). kiln compiles one input size for both,
  // so another value is refused.
  int64_t val_crop_size = 0;
  // Epoch checkpoints epoch-N.safetensors kept beside last and best (0 = none).
  int64_t keep_last = 0;
  // fusion, tf32, profile and every other switch (switches.def): the process's KILN_*
  // variables unless a field is set (kiln train's --fusion, --tf32 and --profile set them).
  Switches switches = Switches::from_environment();
  // Data parallel: several processes (mpirun, srun) are detected from the launcher's
  // environment; `distributed` starts MPI even without it. batch_size is the global batch.
  bool distributed = false;
  bool sync_bn = true;  // BatchNorm statistics over every rank's batch (SyncBN)
  // Called on rank 0 with each epoch's metrics row once the row is written and the epoch
  // saved (kiln.train's callback); an exception from it ends the run, that epoch kept.
  std::function<void(const MetricsRow&)> on_epoch;
};

struct TrainSummary {
  double final_top1 = 0, final_top5 = 0, best_top1 = 0, final_loss = 0;
  double ema_top1 = -1;
  int64_t epochs_run = 0, steps = 0;
  double train_seconds = 0;           // wall time of the training epochs (without evaluation)
  std::vector<double> epoch_seconds;  // per epoch, training only
  double images_per_second = 0;
  std::string input;                    // the loader's output: encoded, uint8 or float32
  double loader_images_per_second = 0;  // the training loader's own rate (LoaderStats::rate)
  double input_wait_fraction = 0;       // share of training time the step waited for a batch
  double eval_images_per_second =
      0;                       // the last evaluation pass's (all ranks' images, its wall time)
  int64_t skipped_images = 0;  // corrupt files replaced (both splits)
  // The input sizes the run compiled: training's (kiln eval: 0) and evaluation's, which differ
  // with --val-crop-size (an evaluation variant, Engine::eval_variant).
  int64_t train_crop_size = 0, eval_crop_size = 0;
  std::string metrics_csv, metrics_jsonl, checkpoint;
  int stop_signal = 0;         // SIGINT, SIGTERM or SIGHUP stopped the run between two steps
  bool stopped_early = false;  // --stop-after-epochs or --stop-after-steps ended it
  bool complete = false;       // --resume of a run that had done all its epochs: nothing ran
  std::string saved_at;        // where the checkpoint on disk stands ("after epoch 2", "at step 7
                               // (...)"); "" if none
};

// Validates the configuration (clear errors naming the flag) and runs it.
TrainSummary train(const TrainConfig& config);

// Evaluates the weights given by config.init_from on the test split (no training).
TrainSummary evaluate(const TrainConfig& config);

// The host transforms of the training (train) or test split's samples, for a model whose input
// is size x size x channels.
Pipeline input_pipeline(const TrainConfig& config, bool train, int64_t size, int64_t channels);

// The run's options as JSON (stored in checkpoints and the summary).
std::string config_json(const TrainConfig& config);

}  // namespace kiln
