#include "kiln/task/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <thread>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/core/log.h"
#include "kiln/data/auto_augment.h"
#include "kiln/data/dataset.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/loader.h"
#include "kiln/data/transforms.h"
#include "kiln/io/json.h"
#include "kiln/io/metrics.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/distributed.h"
#include "task/divergence_watch.h"
#include "task/progress.h"
#include "task/run_folder.h"

namespace kiln {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Loader threads beyond this only contend for the cores (and 100000 threads cannot start).
int64_t max_workers() {
  const int64_t cores = std::max<unsigned>(std::thread::hardware_concurrency(), 1u);
  return std::min<int64_t>(1024, std::max<int64_t>(16, 4 * cores));
}

// The largest side kiln compiles for: a 8192^2 RGB batch of one is already 800 MB of FP32
// input; past this an allocation fails deep inside the memory plan with no name.
constexpr int64_t kMaxImageSize = 8192;
// No schedule needs more; epochs x steps must not overflow int64 (the LR schedule's length).
constexpr int64_t kMaxEpochs = 1000000;

void check_config(const TrainConfig& c) {
  KILN_CHECK(c.epochs > 0 && c.epochs <= kMaxEpochs, InvalidArgument, "--epochs must be in 1..",
             kMaxEpochs, ", got ", c.epochs);
  KILN_CHECK(c.batch_size > 0, InvalidArgument, "--batch-size must be > 0, got ", c.batch_size);
  KILN_CHECK(c.workers >= 0 && c.workers <= max_workers(), InvalidArgument, "--workers ", c.workers,
             " is outside 0..", max_workers(), " (", std::thread::hardware_concurrency(),
             " cores here; more loader threads than 4 per core only contend); give at most ",
             max_workers());
  KILN_CHECK(c.eval_every > 0, InvalidArgument, "--eval-every must be > 0 epochs");
  KILN_CHECK(c.stop_after_epochs >= 0, InvalidArgument, "--stop-after-epochs must be >= 0");
  KILN_CHECK(c.stop_after_steps >= 0, InvalidArgument, "--stop-after-steps must be >= 0, got ",
             c.stop_after_steps);
  KILN_CHECK(c.save_every_steps >= 0, InvalidArgument,
             "--save-every-steps must be >= 0 (0 = off), got ", c.save_every_steps);
  KILN_CHECK(c.save_every_minutes >= 0 && std::isfinite(c.save_every_minutes), InvalidArgument,
             "--save-every-minutes must be a finite number >= 0 (0 = off), got ",
             c.save_every_minutes);
  KILN_CHECK(c.momentum >= 0 && c.momentum < 1, InvalidArgument, "--momentum must be in [0, 1)");
  KILN_CHECK(c.weight_decay >= 0 && std::isfinite(c.weight_decay), InvalidArgument,
             "--weight-decay must be a finite number >= 0, got ", c.weight_decay);
  KILN_CHECK(c.clip_grad >= 0 && std::isfinite(c.clip_grad), InvalidArgument,
             "--clip-grad must be a finite number >= 0 (0 = off), got ", c.clip_grad);
  KILN_CHECK(c.clip_grad_norm >= 0 && std::isfinite(c.clip_grad_norm), InvalidArgument,
             "--clip-grad-norm must be a finite number >= 0 (0 = off), got ", c.clip_grad_norm);
  KILN_CHECK(c.label_smoothing >= 0 && c.label_smoothing < 1, InvalidArgument,
             "--label-smoothing must be in [0, 1) (0 = off), got ", c.label_smoothing);
  check_mix_options(c.mix);
  KILN_CHECK(c.keep_last >= 0 && c.keep_last <= kMaxEpochs, InvalidArgument,
             "--keep-last must be in 0..", kMaxEpochs, " (0 = no epoch checkpoints), got ",
             c.keep_last);
  const auto& cj = c.color_jitter;
  KILN_CHECK(cj[0] >= 0 && cj[1] >= 0 && cj[2] >= 0 && cj[3] >= 0 && cj[3] <= 0.5f, InvalidArgument,
             "--color-jitter ", cj[0], ",", cj[1], ",", cj[2], ",", cj[3],
             ": brightness, contrast and saturation must be >= 0 and hue in [0, 0.5]");
  KILN_CHECK(c.random_erase >= 0 && c.random_erase <= 1, InvalidArgument,
             "--random-erase is a probability in [0, 1] (0 = off), got ", c.random_erase);
  if (!c.auto_augment.empty()) {
    parse_auto_augment(c.auto_augment);  // names the policies when it is not one
    KILN_CHECK(c.ra_num_ops >= 0 && c.ra_num_ops <= 64, InvalidArgument,
               "--ra-num-ops must be in 0..64, got ", c.ra_num_ops);
    KILN_CHECK(c.ra_magnitude >= 0 && c.ra_magnitude < 31, InvalidArgument,
               "--ra-magnitude is a bin of 31 (torchvision's num_magnitude_bins): 0..30, got ",
               c.ra_magnitude);
  }
  KILN_CHECK(c.ema_decay > 0 && c.ema_decay < 1, InvalidArgument, "--ema-decay must be in (0, 1)");
  KILN_CHECK(c.num_classes >= 0 && c.num_classes <= (int64_t{1} << 24), InvalidArgument,
             "--num-classes must be in 0..", int64_t{1} << 24, " (0 = the dataset's), got ",
             c.num_classes);
  KILN_CHECK(c.max_steps_per_epoch >= 0, InvalidArgument,
             "--max-steps must be >= 0 (0 = the whole epoch), got ", c.max_steps_per_epoch);
  KILN_CHECK(c.image_size >= 0 && c.image_size <= kMaxImageSize, InvalidArgument,
             "--image-size must be in 0..", kMaxImageSize, " (0 = the model's default), got ",
             c.image_size);
  KILN_CHECK(c.val_resize_size >= 0 && c.val_resize_size <= kMaxImageSize, InvalidArgument,
             "--val-resize-size must be in 0..", kMaxImageSize,
             " (0 = 8/7 of the input size), got ", c.val_resize_size);
  KILN_CHECK(c.max_image_pixels > 0, InvalidArgument, "--max-image-pixels must be > 0, got ",
             c.max_image_pixels);
  KILN_CHECK(c.resume.empty() || c.init_from.empty(), InvalidArgument, "--resume ", c.resume,
             " continues a run with its own weights, which would replace those of --init-from ",
             c.init_from, "; give one of the two");
  KILN_CHECK(
      c.progress == "auto" || c.progress == "bar" || c.progress == "plain" || c.progress == "none",
      InvalidArgument, "--progress must be auto, bar, plain or none");
  KILN_CHECK(!c.output.empty(), InvalidArgument, "--output must name a folder");
  check_schedule(c.lr, c.epochs);
}

DatasetSpec dataset_spec(const TrainConfig& c, bool train, int64_t h, int64_t w, int64_t ch,
                         int64_t classes) {
  DatasetSpec s;
  s.kind = c.data;
  s.root = c.data_dir;
  s.split = train ? "train" : "test";
  s.samples = c.synthetic_size > 0 ? c.synthetic_size : 50 * c.batch_size;
  if (!train) s.samples = std::max<int64_t>(s.samples / 5, 1);
  s.height = h;
  s.width = w;
  s.channels = ch;
  s.classes = classes;
  s.seed = c.seed + (train ? 0 : 1);
  s.max_image_pixels = c.max_image_pixels;
  return s;
}

}  // namespace

Pipeline input_pipeline(const TrainConfig& c, bool train, int64_t size, int64_t channels) {
  Pipeline p;
  p.add<ToFloat>();
  if (c.data == "folder") {
    if (train && c.random_resized_crop) {
      p.add<RandomResizedCrop>(size, std::array<float, 2>{0.08f, 1.0f},
                               std::array<float, 2>{3.0f / 4.0f, 4.0f / 3.0f}, c.interpolation);
    } else {
      // 256 for 224 by default
      p.add<Resize>(c.val_resize_size > 0 ? c.val_resize_size : size * 8 / 7, c.interpolation);
      p.add<CenterCrop>(size);
    }
  }
  if (train && c.crop_padding > 0) p.add<RandomCrop>(size, static_cast<int64_t>(c.crop_padding));
  if (train && c.hflip) p.add<RandomHorizontalFlip>(0.5f);
  if (train && !c.auto_augment.empty()) {
    p.add<AutoAugment>(parse_auto_augment(c.auto_augment), c.ra_num_ops, c.ra_magnitude);
  }
  const auto& cj = c.color_jitter;
  if (train && (cj[0] > 0 || cj[1] > 0 || cj[2] > 0 || cj[3] > 0))
    p.add<ColorJitter>(cj[0], cj[1], cj[2], cj[3]);
  const Normalization norm = normalization_for(c.data, channels);
  p.add<Normalize>(norm.mean, norm.std);
  if (train && c.random_erase > 0) p.add<RandomErasing>(c.random_erase);
  return p;
}

std::string config_json(const TrainConfig& c) {
  std::string milestones;  // a string, so that every value is one flat token
  for (int64_t m : c.lr.milestones)
    milestones += (milestones.empty() ? "" : ",") + std::to_string(m);
  std::string color_jitter;
  for (float v : c.color_jitter) color_jitter += (color_jitter.empty() ? "" : ",") + json_number(v);
  std::ostringstream os;
  os << "{\"model\":" << json_string(c.model) << ",\"data\":" << json_string(c.data)
     << ",\"epochs\":" << c.epochs << ",\"batch_size\":" << c.batch_size
     << ",\"lr\":" << json_number(c.lr.base_lr) << ",\"sched\":" << json_string(c.lr.kind)
     << ",\"opt\":" << json_string(c.optimizer) << ",\"momentum\":" << json_number(c.momentum)
     << ",\"weight_decay\":" << json_number(c.weight_decay)
     << ",\"nesterov\":" << (c.nesterov ? "true" : "false")
     << ",\"amp\":" << (c.amp ? "true" : "false")
     << ",\"tf32\":" << (c.switches.tf32 ? "true" : "false")
     << ",\"ema\":" << (c.ema ? "true" : "false") << ",\"seed\":" << c.seed
     << ",\"device\":" << json_string(c.device)
     << ",\"warmup_epochs\":" << json_number(c.lr.warmup_epochs)
     << ",\"min_lr\":" << json_number(c.lr.min_lr) << ",\"step_size\":" << c.lr.step_size
     << ",\"milestones\":" << json_string(milestones) << ",\"gamma\":" << json_number(c.lr.gamma)
     << ",\"max_steps\":" << c.max_steps_per_epoch
     << ",\"color_jitter\":" << json_string(color_jitter)
     << ",\"clip_grad\":" << json_number(c.clip_grad)
     << ",\"clip_grad_norm\":" << json_number(c.clip_grad_norm)
     << ",\"label_smoothing\":" << json_number(c.label_smoothing)
     << ",\"mixup_alpha\":" << json_number(c.mix.mixup_alpha)
     << ",\"cutmix_alpha\":" << json_number(c.mix.cutmix_alpha)
     << ",\"mixup_prob\":" << json_number(c.mix.prob)
     << ",\"mixup_switch_prob\":" << json_number(c.mix.switch_prob)
     << ",\"val_resize_size\":" << c.val_resize_size
     << ",\"interpolation\":" << json_string(filter_name(c.interpolation))
     << ",\"random_erase\":" << json_number(c.random_erase)
     << ",\"auto_augment\":" << json_string(c.auto_augment) << ",\"ra_num_ops\":" << c.ra_num_ops
     << ",\"ra_magnitude\":" << c.ra_magnitude << "}";
  return os.str();
}

namespace {

struct RunSetup {
  std::shared_ptr<Dataset> train_set, test_set;
  std::unique_ptr<Loader> train_loader, test_loader;
  std::unique_ptr<Engine> engine;
  std::array<int64_t, 3> hwc{};
  InputNormalization train_norm, test_norm;  // the pipelines' Normalize, applied on the device
};

// How batches reach the device: the files' bytes for the device's JPEG decoder, uint8 pixels
// decoded and cropped on the host (a quarter of float32's bytes), or float32 where the
// pipeline is not one crop-and-resize (or --no-input-u8 asks for the reference path).
LoaderOutput choose_input(const TrainConfig& c, const Pipeline& p, const Backend& b) {
  std::string why;
  const bool geometric = p.geometric_with_augments(&why);
  const bool folder = c.data == "folder";
  if (c.decode == DecodeWhere::gpu) {
    KILN_CHECK(folder, InvalidArgument, "--decode gpu decodes image files; --data ", c.data,
               " holds none (use --decode auto or cpu)");
    KILN_CHECK(geometric, InvalidArgument,
               "--decode gpu runs the transforms as one crop-and-resize per sample: ", why,
               "; use --decode cpu");
    std::string no_jpeg;
    KILN_CHECK(b.decodes_jpeg(&no_jpeg), InvalidArgument, "--decode gpu: ", no_jpeg,
               "; use --decode cpu");
  }
  if (!geometric || !c.input_u8) return LoaderOutput::float32;
  if (folder && c.decode != DecodeWhere::cpu && b.decodes_jpeg()) return LoaderOutput::encoded;
  return LoaderOutput::uint8;
}

std::string input_line(LoaderOutput o, const TrainConfig& c, int workers) {
  const std::string w = std::to_string(workers) + " worker" + (workers == 1 ? "" : "s");
  switch (o) {
    case LoaderOutput::encoded:
      return "input: " + c.data + " decoded on the GPU (nvJPEG), " + w + " read files";
    case LoaderOutput::uint8:
      return "input: decoded on the host by " + w + ", uint8 to the device";
    case LoaderOutput::float32:
      break;
  }
  return "input: decoded and transformed on the host by " + w + ", float32 to the device" +
         (c.input_u8 ? " (the pipeline is not one crop-and-resize)" : " (--no-input-u8)");
}

// One batch in the loader's output form, and the view the engine stages from. Encoded batches
// alternate between two buffers: the device may still read the previous one's bytes.
class InputBuffers {
 public:
  InputBuffers(const Loader& l, int64_t batch, InputNormalization norm) : norm_(std::move(norm)) {
    const auto hwc = l.sample_hwc();
    const size_t per = static_cast<size_t>(batch * hwc[0] * hwc[1] * hwc[2]);
    if (l.output() == LoaderOutput::float32) f32_.resize(per);
    if (l.output() == LoaderOutput::uint8) u8_.resize(per);
    labels_.resize(static_cast<size_t>(batch));
  }
  int64_t next(Loader& l) {
    if (l.output() == LoaderOutput::float32) return l.next(f32_.data(), labels_.data());
    if (l.output() == LoaderOutput::uint8) {
      return l.next_u8(u8_, labels_.data(), l.has_augments() ? &augments_ : nullptr);
    }
    cur_ ^= 1;
    return l.next_encoded(enc_[cur_]);
  }
  InputView view() const {
    InputView v;
    v.norm = &norm_;
    v.labels = labels_.data();
    if (!f32_.empty()) {
      v.f32 = f32_.data();
    } else if (!u8_.empty()) {
      v.u8 = u8_.data();
      if (!augments_.empty()) v.augments = augments_.data();
    } else {
      v.encoded = &enc_[cur_];
    }
    return v;
  }

 private:
  InputNormalization norm_;
  std::vector<float> f32_;
  std::vector<uint8_t> u8_;
  std::vector<SampleAugment> augments_;  // uint8 with AutoAugment / RandomErasing
  std::vector<int32_t> labels_;
  EncodedBatch enc_[2];
  int cur_ = 0;
};

std::string hwc_str(const std::array<int64_t, 3>& s) {
  return std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" + std::to_string(s[2]);
}

std::string join_names(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "'" : ", '") + x + "'";
  return s.empty() ? "none" : s;
}

// The training split decides the class set; the evaluation split must use the same one, or
// its labels mean other classes (an image folder's labels are positions in its own sorted
// folder list, so one missing folder shifts every later label).
void check_same_classes(const Dataset& train, const Dataset& test) {
  const auto* tf = dynamic_cast<const ImageFolderDataset*>(&train);
  const auto* ef = dynamic_cast<const ImageFolderDataset*>(&test);
  if (tf && ef) {
    std::vector<std::string> missing, extra;
    for (const std::string& k : tf->classes()) {
      if (!std::binary_search(ef->classes().begin(), ef->classes().end(), k)) missing.push_back(k);
    }
    for (const std::string& k : ef->classes()) {
      if (!std::binary_search(tf->classes().begin(), tf->classes().end(), k)) extra.push_back(k);
    }
    KILN_CHECK(missing.empty() && extra.empty(), Data, "the class folders of '", ef->dir(),
               "' differ from the training split's '", tf->dir(), "': missing ",
               join_names(missing), ", extra ", join_names(extra),
               "; labels are positions in the sorted folder list, so every split needs the same "
               "class folders "
               "(add the missing class folders with their images, or remove the extra ones)");
    return;
  }
  KILN_CHECK(test.num_classes() <= train.num_classes(), Data, test.describe(), " has labels up to ",
             test.num_classes() - 1, " but the training split (", train.describe(), ") has ",
             train.num_classes(), " classes; the two splits must come from the same dataset");
}

// Datasets, loaders and the compiled engine for a run. The model's input follows the data.
// Without `training` (kiln eval) the training split is not opened: the test split alone
// decides the shape and the class count, so a dataset with only a test split evaluates.
RunSetup setup_run(const TrainConfig& c, bool training) {
  check_config(c);
  dist::init(c.distributed,
             c.switches.dist_timeout);  // S27: MPI when started as several processes (mpirun, srun)
  RunSetup r;
  ZooOptions zo;
  zo.num_classes = static_cast<int>(c.num_classes);
  zo.image_size = static_cast<int>(c.image_size);
  const BluePrint probe = make_model(c.model, zo);
  if (training) {
    r.train_set = open_dataset(dataset_spec(c, true, probe.input.height, probe.input.width,
                                            probe.input.channels, probe.num_classes));
  }
  r.test_set = open_dataset(dataset_spec(c, false, probe.input.height, probe.input.width,
                                         probe.input.channels, probe.num_classes));
  const Dataset& ref = training ? *r.train_set : *r.test_set;  // decides the classes and the shape
  if (training) check_same_classes(*r.train_set, *r.test_set);
  KILN_CHECK(c.num_classes == 0 || c.num_classes >= ref.num_classes(), Data, "--num-classes ",
             c.num_classes, " is fewer than the ", ref.num_classes(), " classes of ",
             ref.describe(), "; drop --num-classes (0 takes the dataset's) or give at least ",
             ref.num_classes());
  if (ref.num_classes() == 1) {
    log_warn(ref.describe(),
             " has one class: every prediction is right, so loss and accuracy say nothing");
  }
  if (zo.num_classes == 0) zo.num_classes = static_cast<int>(ref.num_classes());
  // Folders are normalised with ImageNet's three-channel statistics; say which model wants what
  // rather than that the statistics disagree with a request the user never made.
  KILN_CHECK(c.data != "folder" || probe.input.channels == 3, InvalidArgument, "model '", c.model,
             "' takes ", probe.input.channels,
             "-channel images but an image folder gives 3-channel (RGB) ones; use a model "
             "built for RGB input, e.g. --model resnet18_small or vgg11_bn_small for small images");
  const int64_t size = probe.input.height;
  LoaderOptions lo;
  lo.batch_size = dist::split_batch(c.batch_size);  // this rank's share of the global batch (S27)
  lo.workers = c.workers;
  lo.seed = c.seed;
  lo.rank = dist::rank();
  lo.world = dist::world();
  lo.decode.resample = c.switches.resample_vertical_first ? ResampleOrder::vertical_first
                                                          : ResampleOrder::horizontal_first;
  lo.decode.math = c.switches.resample_fixed_point ? ResampleMath::fixed16 : ResampleMath::float32;
  lo.decode.tight_margin = c.switches.jpeg_tight_margin;
  lo.decode.batch_rows = c.switches.jpeg_batch_rows;
  lo.decode.progressive_stop = c.switches.jpeg_progressive_stop;
  lo.swap_u8 = c.switches.loader_swap;
  const Pipeline train_p = input_pipeline(c, true, size, probe.input.channels);
  const Pipeline test_p = input_pipeline(c, false, size, probe.input.channels);
  LoaderOptions eo = lo;
  eo.shuffle = false;
  eo.drop_last = false;
  // The sample shape (which the model's input follows) does not depend on the output form;
  // the encoded form needs the backend, so the loaders start in a host form and are remade below.
  auto make_loaders = [&](LoaderOutput train_out, LoaderOutput test_out) {
    lo.output = train_out;
    eo.output = test_out;
    r.train_loader.reset();
    r.test_loader.reset();
    if (training) r.train_loader = std::make_unique<Loader>(r.train_set, train_p, lo);
    r.test_loader = std::make_unique<Loader>(r.test_set, test_p, eo);
  };
  auto host_form = [&](const Pipeline& p) {
    return p.geometric_with_augments() && c.input_u8 ? LoaderOutput::uint8 : LoaderOutput::float32;
  };
  make_loaders(host_form(train_p), host_form(test_p));
  const auto test_hwc = r.test_loader->sample_hwc();
  r.hwc = training ? r.train_loader->sample_hwc() : test_hwc;
  // Every batch buffer is sized for the training shape: a test split of another shape would
  // be written past its end (each Loader takes its shape from its own sample 0).
  KILN_CHECK(test_hwc == r.hwc, Data, "the test split (", r.test_set->describe(), ") has ",
             hwc_str(test_hwc), " samples but the training split (", ref.describe(), ") has ",
             hwc_str(r.hwc), "; both splits must have images of one shape, check the test files");
  // IDX and CIFAR images are used at their own size (no resize in the pipeline).
  KILN_CHECK(
      c.image_size == 0 || c.image_size == r.hwc[0] || c.data == "folder" || c.data == "synthetic",
      InvalidArgument, "--image-size ", c.image_size, " has no effect on ", c.data,
      " data, whose images are ", hwc_str(r.hwc), " and are not resized; drop --image-size");
  r.train_norm = train_p.normalization(r.hwc[2]);
  r.test_norm = test_p.normalization(r.hwc[2]);
  zo.in_channels = static_cast<int>(r.hwc[2]);
  zo.image_size = static_cast<int>(r.hwc[0]);
  const BluePrint bp = make_model(c.model, zo);
  // With a training split the test split was checked against it above; for kiln eval this is
  // the test split's own check against the model.
  KILN_CHECK(
      r.hwc[0] == bp.input.height && r.hwc[1] == bp.input.width && r.hwc[2] == bp.input.channels,
      Data, "the dataset (", ref.describe(), ") gives ", hwc_str(r.hwc), " samples but model '",
      c.model, "' takes ", bp.input.height, "x", bp.input.width, "x", bp.input.channels,
      "; pass --image-size or another --model");
  EngineOptions eopt;
  eopt.device = c.device;
  eopt.switches = c.switches;
  CompileOptions& co = eopt.compile;
  co.batch = lo.batch_size;
  co.amp = c.amp;
  co.tf32 = c.switches.tf32;
  co.ema = c.ema;
  co.ema_decay = c.ema_decay;
  co.optimizer = c.optimizer;
  co.momentum = c.momentum;
  co.weight_decay = c.weight_decay;
  co.nesterov = c.nesterov;
  co.clip_grad = c.clip_grad;
  co.clip_grad_norm = c.clip_grad_norm;
  co.label_smoothing = c.label_smoothing;
  co.mix = c.mix.enabled();
  co.dropout_seed = c.seed + static_cast<uint64_t>(dist::rank());  // each rank its own masks
  co.world = dist::world();
  co.sync_bn = c.sync_bn;
  r.engine = std::make_unique<Engine>(bp, eopt);
  if (c.switches.tf32 && std::string(r.engine->backend().name()) == "cpu") {
    log_warn("--tf32 has no effect on the CPU (its FP32 convolutions and matmuls are FP32)");
  }
  const LoaderOutput train_out = choose_input(c, train_p, r.engine->backend());
  const LoaderOutput test_out = choose_input(c, test_p, r.engine->backend());
  if ((training && train_out != r.train_loader->output()) || test_out != r.test_loader->output()) {
    make_loaders(train_out, test_out);
  }
  if (dist::is_root())
    std::printf("%s\n", input_line(training ? train_out : test_out, c, c.workers).c_str());
  r.engine->lock_memory();
  r.engine->compile(c.seed);
  log_info("model ", c.model, " on ", r.engine->backend().caps().device, ": ",
           training ? r.train_set->size() : 0, " training and ", r.test_set->size(),
           " test samples, batch ", c.batch_size);
  return r;
}

// A fresh run that stops before its first metrics row (a divergence, a data error in the
// first epoch) leaves no empty metrics files and no empty output folder behind (SPEC Q1).
struct EmptyRunCleanup {
  std::filesystem::path output;
  bool made_output = false, fresh = false;
  int64_t rows = 0;
  ~EmptyRunCleanup() {
    if (!fresh || rows > 0) return;
    std::error_code ec;
    for (const char* f : {"metrics.csv", "metrics.jsonl"}) {
      if (std::filesystem::file_size(output / f, ec) == 0 && !ec)
        std::filesystem::remove(output / f, ec);
    }
    if (made_output && std::filesystem::is_empty(output, ec) && !ec)
      std::filesystem::remove(output, ec);
  }
};

struct EvalResult {
  double loss = 0, top1 = 0, top5 = 0;
  double images_per_second = 0;  // the pass's wall time, loader start included
};

EvalResult run_eval(Engine& engine, Loader& loader, bool ema, InputBuffers& input) {
  const auto t0 = Clock::now();
  loader.start_epoch(0);
  double loss = 0;
  int64_t t1 = 0, t5 = 0, count = 0;
  while (true) {
    const int64_t got = input.next(loader);
    if (got == 0) break;
    const StepStats s = engine.eval_batch(input.view(), got, ema);
    loss += static_cast<double>(s.loss) * static_cast<double>(got);
    t1 += s.top1;
    t5 += s.top5;
    count += got;
  }
  reduce_eval_sums(loss, t1, t5, count);  // over the ranks' shards (S27)
  const double n = static_cast<double>(std::max<int64_t>(count, 1));
  return {loss / n, 100.0 * static_cast<double>(t1) / n, 100.0 * static_cast<double>(t5) / n,
          static_cast<double>(count) / std::max(seconds_since(t0), 1e-9)};
}

// Whether a checkpoint's weights are finite: a step can turn them NaN while its own loss (taken
// before the update) is still finite, and a NaN checkpoint would replace the last good one.
bool all_finite(Engine& engine) {
  for (const ParamDesc& d : engine.program().params) {
    for (float v : engine.read_param(d.name)) {
      if (!std::isfinite(v)) return false;
    }
  }
  return true;
}

std::string position(const TrainState& s, int64_t steps_per_epoch) {
  if (s.step_in_epoch == 0) return "after epoch " + std::to_string(s.epoch);
  return "at step " + std::to_string(s.step) + " (epoch " + std::to_string(s.epoch + 1) +
         ", step " + std::to_string(s.step_in_epoch) + " of " + std::to_string(steps_per_epoch) +
         ")";
}

}  // namespace

TrainSummary evaluate(const TrainConfig& c) {
  const dist::FailureGuard failure_guard;  // S27: an error on one rank stops every rank
  RunSetup r = setup_run(c, false);
  if (!c.init_from.empty()) import_weights(*r.engine, c.init_from);
  if (c.ema) {  // kiln eval --ema: the checkpoint's EMA weights and EMA BatchNorm statistics
    KILN_CHECK(!c.init_from.empty(), InvalidArgument, "kiln eval --ema needs --weights CHECKPOINT");
    const StFile f = read_safetensors(c.init_from);
    import_ema_state_dict(*r.engine, ema_state_of_checkpoint(r.engine->program(), f, c.init_from),
                          c.init_from);
  }
  InputBuffers test_input(*r.test_loader, dist::split_batch(c.batch_size), r.test_norm);
  const EvalResult e = run_eval(*r.engine, *r.test_loader, c.ema, test_input);
  TrainSummary s;
  s.final_loss = e.loss;
  s.final_top1 = s.best_top1 = e.top1;
  s.final_top5 = e.top5;
  s.eval_images_per_second = e.images_per_second;
  return s;
}

TrainSummary train(const TrainConfig& c) {
  namespace fs = std::filesystem;
  const dist::FailureGuard failure_guard;  // S27: an error on one rank stops every rank
  check_config(c);
  // Declared before the lock, so that it runs after the lock is released (and its file gone).
  EmptyRunCleanup cleanup;
  cleanup.output = c.output;
  cleanup.made_output = !fs::exists(c.output);
  std::optional<StopSignals> signals(std::in_place);
  std::optional<RunFolderLock> lock;
  if (dist::launch_env().rank == 0) {
    fs::create_directories(c.output);
    lock.emplace(c.output);
    cleanup.fresh = c.resume.empty();  // only once the folder is ours: another run's files are not
    const std::vector<std::string> stale = remove_stale_temp_files(c.output);
    if (!stale.empty()) {
      std::string names;
      for (const std::string& s : stale) names += (names.empty() ? "" : ", ") + s;
      log_info("removed ", stale.size(), " temporary file(s) of runs that no longer exist from '",
               c.output, "': ", names);
    }
  }
  RunSetup r = setup_run(c, true);
  if (dist::world() > 1) {
    // The ranks would stop at different steps and wait for each other forever; a signal ends
    // a data-parallel run at once, as it did before.
    const int early = StopSignals::pending();
    signals.reset();
    if (early) std::raise(early);
  }
  Engine& engine = *r.engine;
  // Mixup / cutmix draws (one per step, from seed, epoch and step: kiln/data/mixup.h).
  const Shape& staged = engine.program().tensor(engine.program().io.staged_images[0]).shape;
  const int64_t input_h = staged[1], input_w = staged[2];
  engine.backend().set_profiling(c.switches.profile);
  Loader& train_loader = *r.train_loader;
  Loader& test_loader = *r.test_loader;
  const auto& train_set = r.train_set;
  TrainState state;
  state.seed = c.seed;
  state.config = config_json(c);
  if (!c.init_from.empty()) import_weights(engine, c.init_from);
  TrainSummary sum;
  sum.metrics_csv = (fs::path(c.output) / "metrics.csv").string();
  sum.metrics_jsonl = (fs::path(c.output) / "metrics.jsonl").string();
  sum.checkpoint = (fs::path(c.output) / "last.safetensors").string();
  const int64_t full = train_loader.batches_per_epoch();
  const int64_t steps_per_epoch =
      c.max_steps_per_epoch > 0 ? std::min(full, c.max_steps_per_epoch) : full;
  KILN_CHECK(steps_per_epoch > 0, Data, "the training set has ", train_set->size(),
             " samples, fewer than one batch of ", c.batch_size, "; use a smaller --batch-size");
  if (!c.resume.empty()) {
    state = load_checkpoint(engine, c.resume);
    state.config = config_json(c);
    KILN_CHECK(state.step_in_epoch < steps_per_epoch, Checkpoint, "'", c.resume,
               "' stopped at step ", state.step_in_epoch, " of epoch ", state.epoch + 1,
               " but this run's epochs have ", steps_per_epoch,
               " steps; resume with the first run's --batch-size, --max-steps and dataset");
    if (state.epoch >= c.epochs) {
      // Nothing to train: the summary, metrics and checkpoint stay as the finished run left them.
      if (dist::is_root()) {
        std::printf(
            "the run of '%s' is complete: %lld of %lld epochs done (step %lld); nothing changed. "
            "To train "
            "longer, give a larger --epochs with --resume-override\n",
            c.resume.c_str(), static_cast<long long>(state.epoch), static_cast<long long>(c.epochs),
            static_cast<long long>(state.step));
      }
      sum.complete = true;
      sum.steps = state.step;
      sum.best_top1 = state.best_top1;
      return sum;
    }
    log_info("resumed from ", c.resume, " ", position(state, steps_per_epoch));
  }
  check_replicas_agree(engine, state.step,
                       c.resume.empty() ? "initialisation" : "resuming");  // S27

  // A resumed run continues after the checkpoint's step: rows past it would be written twice,
  // and the epoch row the checkpoint holds is missing when the kill came between the two.
  MetricsTrim trim;
  if (!c.resume.empty() && dist::is_root()) {
    trim = truncate_metrics(sum.metrics_csv, sum.metrics_jsonl, "step", state.step);
    if (trim.removed_csv + trim.removed_jsonl > 0) {
      log_info("removed ", std::max(trim.removed_csv, trim.removed_jsonl),
               " metrics row(s) after step ", state.step,
               " (the checkpoint's); this run writes them again");
    }
  }
  MetricsWriter metrics(
      dist::is_root() ? sum.metrics_csv : "", dist::is_root() ? sum.metrics_jsonl : "",  // S27
      c.resume.empty() ? MetricsWriter::Mode::Truncate : MetricsWriter::Mode::Append);
  // Every column a row of this run can hold, before the first row: an epoch that is not
  // evaluated leaves the test columns empty, and a resumed run appends under the same header.
  std::vector<std::string> columns = {"epoch",
                                      "step",
                                      "lr",
                                      "train_loss",
                                      "train_top1",
                                      "epoch_seconds",
                                      "images_per_second",
                                      "overflow_steps",
                                      "test_loss",
                                      "test_top1",
                                      "test_top5"};
  if (c.ema) columns.insert(columns.end(), {"ema_test_top1", "ema_test_top5"});
  metrics.declare_columns(columns);
  if (!c.resume.empty() && dist::is_root() && state.step_in_epoch == 0) {
    metrics.write_lines(
        {trim.csv_has_max ? "" : state.row_csv, trim.jsonl_has_max ? "" : state.row_jsonl});
  }

  const int64_t total_steps = steps_per_epoch * c.epochs;
  const int64_t n = dist::split_batch(c.batch_size);  // per rank (S27)
  InputBuffers train_input(train_loader, n, r.train_norm), test_input(test_loader, n, r.test_norm);
  Progress progress(dist::is_root() ? c.progress : "none");
  DivergenceWatch divergence;
  std::string saved_at;             // where the checkpoint on disk stands, for messages
  int64_t saved_step = state.step;  // a resumed run's checkpoint is already on disk
  if (!c.resume.empty()) saved_at = position(state, steps_per_epoch);
  auto diverged = [&](int64_t epoch, const std::string& what) {
    const bool have = !saved_at.empty() && dist::is_root() && fs::exists(sum.checkpoint);
    KILN_FAIL(Numeric, "training diverged in epoch ", epoch + 1, " near step ", state.step, ": ",
              what,
              "; the weights are no longer finite, so nothing since the last checkpoint is saved. ",
              have ? "The last good checkpoint is '" + sum.checkpoint + "' (" + saved_at +
                         "); continue from it with --resume and "
                   : std::string("No checkpoint was written yet; "),
              "lower --lr (now ", c.lr.base_lr, "), --weight-decay (now ", c.weight_decay,
              ") or set --clip-grad");
  };
  auto save = [&](int64_t epoch) {
    if (!dist::is_root()) return;  // rank 0 writes (S27)
    if (!all_finite(engine))
      diverged(epoch, "the weights after step " + std::to_string(state.step) + " are not finite");
    save_checkpoint(engine, sum.checkpoint, state);
    saved_at = position(state, steps_per_epoch);
    saved_step = state.step;
  };
  auto last_save = Clock::now();
  const int64_t first_step = state.step;

  for (int64_t epoch = state.epoch; epoch < c.epochs && !sum.stop_signal; ++epoch) {
    const int64_t start = epoch == state.epoch ? state.step_in_epoch : 0;
    train_loader.start_epoch(epoch, start);
    const double wait_before = train_loader.stats().wait_seconds;
    const auto t0 = Clock::now();
    EpochSums es = start > 0 ? state.sums : EpochSums{};
    // Each step's statistics arrive one step late (Engine::train_step_async): the host loads
    // the next batch while the device runs this one, instead of waiting for it.
    auto account = [&](const std::optional<StepStats>& s) {
      if (!s) return;
      es.hits += s->top1;
      es.overflows += s->overflow ? 1 : 0;
      if (const std::string why = divergence.observe(*s); !why.empty()) diverged(epoch, why);
      if (s->overflow) return;  // the step changed nothing (S9)
      es.loss_sum += s->loss;
      ++es.loss_count;
    };
    // A mid-epoch checkpoint: the step's statistics are collected first, so that it holds
    // everything up to this step and the resumed epoch's row is the uninterrupted one's.
    auto save_mid_epoch = [&](int64_t steps_done) {
      account(engine.pending_stats());
      engine.backend().synchronize();
      state.step_in_epoch = steps_done;
      state.sums = es;
      state.row_csv.clear();
      state.row_jsonl.clear();
      save(epoch);
      last_save = Clock::now();
    };
    for (int64_t i = start; i < steps_per_epoch; ++i) {
      // Between steps: the step a signal interrupted has finished, the next has not begun.
      if (const int sig = signals ? StopSignals::pending() : 0) {
        progress.finish();
        if (state.step > saved_step) save_mid_epoch(i);
        sum.stop_signal = sig;
        break;
      }
      const int64_t got = train_input.next(train_loader);
      if (got < n) break;
      const float lr = lr_at(c.lr, state.step, total_steps, steps_per_epoch);
      if (c.mix.enabled()) engine.set_mix(draw_mix(c.mix, c.seed, epoch, i, input_h, input_w));
      account(engine.train_step_async(train_input.view(), lr));
      ++state.step;
      es.seen += n;
      const LoaderStats ls = train_loader.stats();
      progress.set_input(ls.rate(),
                         (ls.wait_seconds - wait_before) / std::max(seconds_since(t0), 1e-9));
      progress.update(epoch + 1, c.epochs, i + 1, steps_per_epoch,
                      es.loss_count ? es.loss_sum / static_cast<double>(es.loss_count) : NAN,
                      static_cast<double>(es.seen) / std::max(seconds_since(t0), 1e-9), lr,
                      seconds_since(t0));
      if (i + 1 == steps_per_epoch) break;  // the epoch's own checkpoint follows
      const bool by_steps = c.save_every_steps > 0 && state.step % c.save_every_steps == 0;
      const bool by_time =
          c.save_every_minutes > 0 && seconds_since(last_save) >= 60 * c.save_every_minutes;
      const bool stop_here =
          c.stop_after_steps > 0 && state.step - first_step >= c.stop_after_steps;
      if (by_steps || by_time || stop_here) {
        save_mid_epoch(i + 1);
        if (dist::is_root() && (by_steps || by_time))
          log_info("checkpoint ", saved_at, ": ", sum.checkpoint);
      }
      if (stop_here) {
        progress.finish();
        sum.stopped_early = true;
        break;
      }
    }
    if (sum.stop_signal || sum.stopped_early) break;
    account(engine.pending_stats());  // the epoch's last step
    engine.backend().synchronize();
    reduce_train_sums(es.loss_sum, es.loss_count, es.seen,
                      es.hits);                        // S27: the epoch over every rank
    if (!c.sync_bn) average_bn_running_stats(engine);  // S27: per-rank BN, before eval and save
    const double secs = seconds_since(t0);
    progress.finish();
    if (c.switches.profile) std::printf("%s", engine.backend().profile_report().c_str());
    sum.epoch_seconds.push_back(secs);
    sum.train_seconds += secs;
    sum.steps = state.step;
    MetricsRow row{
        {"epoch", epoch + 1},
        {"step", state.step},
        {"lr", static_cast<double>(lr_at(c.lr, std::max<int64_t>(state.step - 1, 0), total_steps,
                                         steps_per_epoch))},
        {"train_loss", es.loss_count ? es.loss_sum / static_cast<double>(es.loss_count) : NAN},
        {"train_top1",
         es.seen ? 100.0 * static_cast<double>(es.hits) / static_cast<double>(es.seen) : 0.0},
        {"epoch_seconds", secs},
        {"images_per_second", static_cast<double>(es.seen) / secs},
        {"overflow_steps", es.overflows}};
    const bool last = epoch + 1 == c.epochs;
    bool new_best = false;
    if ((epoch + 1) % c.eval_every == 0 || last) {
      for (int pass = 0; pass < (c.ema ? 2 : 1); ++pass) {
        const EvalResult e = run_eval(engine, test_loader, pass == 1, test_input);
        if (pass == 0) {
          row.push_back({"test_loss", e.loss});
          row.push_back({"test_top1", e.top1});
          row.push_back({"test_top5", e.top5});
          sum.final_top1 = e.top1;
          sum.eval_images_per_second = e.images_per_second;
          sum.final_top5 = e.top5;
          sum.final_loss = e.loss;
          // A tie with no best file yet (0% so far) is kept too: best.safetensors always exists.
          new_best =
              e.top1 > state.best_top1 ||
              (e.top1 == state.best_top1 && !fs::exists(fs::path(c.output) / "best.safetensors"));
          if (e.top1 > state.best_top1) {
            state.best_top1 = e.top1;
            state.stale_epochs = 0;
          } else {
            state.stale_epochs += c.eval_every;
          }
        } else {
          row.push_back({"ema_test_top1", e.top1});
          row.push_back({"ema_test_top5", e.top5});
          sum.ema_top1 = e.top1;
        }
      }
      progress.line(epoch + 1, c.epochs, secs, row);
    }
    // The checkpoint first, holding the row: a kill between the two leaves a checkpoint whose
    // row a resume writes, never a row whose epoch is not saved.
    state.epoch = epoch + 1;
    state.step_in_epoch = 0;
    state.sums = EpochSums{};
    const MetricsWriter::Lines lines = metrics.format(row);
    state.row_csv = lines.csv;
    state.row_jsonl = lines.jsonl;
    save(epoch);
    if (dist::is_root()) keep_epoch_copies(sum.checkpoint, epoch + 1, new_best, c.keep_last);
    last_save = Clock::now();
    metrics.write_lines(lines);
    ++cleanup.rows;
    ++sum.epochs_run;
    if (c.on_epoch && dist::is_root()) c.on_epoch(row);
    const bool steps_reached =
        c.stop_after_steps > 0 && state.step - first_step >= c.stop_after_steps;
    if ((steps_reached || (c.stop_after_epochs > 0 && sum.epochs_run >= c.stop_after_epochs)) &&
        epoch + 1 < c.epochs) {
      log_info("stopping after ", sum.epochs_run, " epoch(s) as asked");
      sum.stopped_early = true;
      break;
    }
    if (c.early_stop > 0 && state.stale_epochs >= c.early_stop) {
      log_info("early stop: no better test top-1 for ", state.stale_epochs, " epochs");
      break;
    }
    // A signal during the evaluation or the save: the epoch's checkpoint is the one to resume.
    if (const int sig = signals ? StopSignals::pending() : 0) {
      if (epoch + 1 < c.epochs) sum.stop_signal = sig;
    }
  }
  sum.steps = state.step;
  sum.saved_at = saved_at;
  if (sum.stop_signal || sum.stopped_early) {
    sum.best_top1 = state.best_top1;
    return sum;  // not finished: summary.json is the finished run's
  }
  sum.best_top1 = state.best_top1;
  double imgs = 0;
  for (size_t i = 0; i < sum.epoch_seconds.size(); ++i)
    imgs += static_cast<double>(steps_per_epoch * n * dist::world());
  sum.images_per_second = sum.train_seconds > 0 ? imgs / sum.train_seconds : 0;
  // Which side bounded the run: the step waiting for batches more than a tenth of the time
  // means a faster loader (more workers, --decode gpu) would speed it up.
  const LoaderStats ls = train_loader.stats();
  const DecodeCounters dc = engine.backend().decode_counters();
  sum.input = train_loader.output() == LoaderOutput::encoded ? "encoded"
              : train_loader.output() == LoaderOutput::uint8 ? "uint8"
                                                             : "float32";
  sum.loader_images_per_second = ls.rate();
  sum.input_wait_fraction = sum.train_seconds > 0 ? ls.wait_seconds / sum.train_seconds : 0;
  sum.skipped_images = train_set->corrupt_skipped() + r.test_set->corrupt_skipped();
  if (dist::is_root()) {
    std::printf(
        "%s: the step waited for the loader %.0f%% of the time (loader %.0f images/s with %d "
        "workers, "
        "training %.0f images/s)\n",
        sum.input_wait_fraction > 0.1 ? "input-bound" : "compute-bound",
        100 * sum.input_wait_fraction, sum.loader_images_per_second, ls.workers,
        sum.images_per_second);
  }
  std::ostringstream js;
  js << "{\"final_top1\":" << json_number(sum.final_top1)
     << ",\"final_top5\":" << json_number(sum.final_top5)
     << ",\"best_top1\":" << json_number(sum.best_top1) << ",\"epochs\":" << sum.epochs_run
     << ",\"steps\":" << sum.steps << ",\"train_seconds\":" << json_number(sum.train_seconds)
     << ",\"images_per_second\":" << json_number(sum.images_per_second)
     << ",\"input\":" << json_string(sum.input)
     << ",\"loader_images_per_second\":" << json_number(sum.loader_images_per_second)
     << ",\"input_wait_fraction\":" << json_number(sum.input_wait_fraction)
     << ",\"eval_images_per_second\":" << json_number(sum.eval_images_per_second)
     << ",\"skipped_images\":" << sum.skipped_images << ",\"decoded\":{\"hardware\":" << dc.hardware
     << ",\"gpu_hybrid\":" << dc.gpu_hybrid << ",\"host\":" << dc.host << "}"
     << ",\"checkpoint\":" << json_string(sum.checkpoint) << ",\"config\":" << config_json(c)
     << "}\n";
  if (dist::is_root()) write_text_atomic((fs::path(c.output) / "summary.json").string(), js.str());
  return sum;
}

}  // namespace kiln
