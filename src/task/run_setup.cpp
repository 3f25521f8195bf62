// A run's set-up (setup_run, run_setup.h): the configuration's checks, the datasets and their
// input pipelines, the loaders and the compiled engine.
#include "task/run_setup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/data/auto_augment.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/transforms.h"
#include "kiln/io/json.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/distributed.h"

namespace kiln {

namespace {

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

}  // namespace

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
  KILN_CHECK(c.val_crop_size >= 0 && c.val_crop_size <= kMaxImageSize, InvalidArgument,
             "--val-crop-size must be in 0..", kMaxImageSize, " (0 = the training crop), got ",
             c.val_crop_size);
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
     << ",\"val_resize_size\":" << c.val_resize_size << ",\"val_crop_size\":" << c.val_crop_size
     << ",\"interpolation\":" << json_string(filter_name(c.interpolation))
     << ",\"random_erase\":" << json_number(c.random_erase)
     << ",\"auto_augment\":" << json_string(c.auto_augment) << ",\"ra_num_ops\":" << c.ra_num_ops
     << ",\"ra_magnitude\":" << c.ra_magnitude << "}";
  return os.str();
}

RunSetup setup_run(const TrainConfig& c, bool training) {
  check_config(c);
  dist::init(c.distributed,
             c.switches.dist_timeout);  // MPI when started as several processes (mpirun, srun)
  RunSetup r;
  ZooOptions zo;
  zo.num_classes = static_cast<int>(c.num_classes);
  // kiln eval compiles at the evaluation's crop; kiln train at the training crop, with an
  // evaluation variant at the evaluation's crop when the two differ (Engine::eval_variant).
  zo.image_size =
      static_cast<int>(!training && c.val_crop_size > 0 ? c.val_crop_size : c.image_size);
  const BluePrint probe = make_model(c.model, zo);
  const int64_t size = probe.input.height;
  const int64_t val_size = c.val_crop_size > 0 ? c.val_crop_size : size;
  if (training) {
    r.train_set = open_dataset(dataset_spec(c, true, probe.input.height, probe.input.width,
                                            probe.input.channels, probe.num_classes));
  }
  // Generated test images are made at the evaluation's size (other data is read, or resized
  // and cropped to it by the pipeline).
  r.test_set = open_dataset(dataset_spec(c, false, c.data == "synthetic" ? val_size : size,
                                         c.data == "synthetic" ? val_size : size,
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
  // IDX and CIFAR images are evaluated as they are: no crop to take.
  KILN_CHECK(val_size == size || c.data == "folder" || c.data == "synthetic", InvalidArgument,
             "--val-crop-size ", c.val_crop_size, " has no effect on ", c.data,
             " data, whose images are not resized or cropped; drop --val-crop-size");
  LoaderOptions lo;
  lo.batch_size = dist::split_batch(c.batch_size);  // this rank's share of the global batch
  lo.workers = c.workers;
  lo.seed = c.seed;
  lo.rank = dist::rank();
  lo.world = dist::world();
  apply_loader_switches(lo, c.switches);
  const Pipeline train_p = input_pipeline(c, true, size, probe.input.channels);
  const Pipeline test_p = input_pipeline(c, false, val_size, probe.input.channels);
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
  // Every batch buffer is sized for the shape its program was compiled for: a test split of
  // another shape would be written past its end (each Loader takes its shape from its sample 0).
  const std::array<int64_t, 3> want_test{val_size == size ? r.hwc[0] : val_size,
                                         val_size == size ? r.hwc[1] : val_size, r.hwc[2]};
  KILN_CHECK(test_hwc == want_test, Data, "the test split (", r.test_set->describe(), ") has ",
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
  BluePrint eval_bp;
  if (training && val_size != size) {
    ZooOptions vo = zo;
    vo.image_size = static_cast<int>(val_size);
    eval_bp = make_model(c.model, vo);
    // Refused before the (possibly long) compile, naming the flags.
    const std::string mismatch = r.engine->eval_variant_mismatch(eval_bp);
    KILN_CHECK(mismatch.empty(), InvalidArgument, "--val-crop-size ", val_size, ": model '",
               c.model, "' trains at ", size, "x", size, " and cannot evaluate at ", val_size, "x",
               val_size, " with those weights: ", mismatch, "; leave --val-crop-size out (or give ",
               size, "), or use a globally pooled model (resnet18_small, resnet50)");
  }
  r.engine->compile(c.seed);
  if (training && val_size != size) {
    r.eval_engine = r.engine->eval_variant(eval_bp);
    if (dist::is_root()) {
      std::printf(
          "evaluation at %lldx%lld (training at %lldx%lld): an evaluation-only program "
          "sharing the training weights\n",
          static_cast<long long>(val_size), static_cast<long long>(val_size),
          static_cast<long long>(size), static_cast<long long>(size));
    }
  }
  log_info("model ", c.model, " on ", r.engine->backend().caps().device, ": ",
           training ? r.train_set->size() : 0, " training and ", r.test_set->size(),
           " test samples, batch ", c.batch_size);
  return r;
}

}  // namespace kiln
