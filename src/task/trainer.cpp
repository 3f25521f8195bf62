#include "kiln/task/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/core/log.h"
#include "kiln/data/dataset.h"
#include "kiln/data/loader.h"
#include "kiln/io/json.h"
#include "kiln/io/metrics.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/distributed.h"
#include "task/divergence_watch.h"
#include "task/progress.h"
#include "task/run_folder.h"
#include "task/run_setup.h"

namespace kiln {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
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

// A fresh run that stops before its first metrics row (a divergence, a data error in the
// first epoch) leaves no empty metrics files and no empty output folder behind.
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
  reduce_eval_sums(loss, t1, t5, count);  // over the ranks' shards
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
  const dist::FailureGuard failure_guard;  // an error on one rank stops every rank
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
  s.eval_crop_size = r.engine->blueprint().input.height;
  s.final_loss = e.loss;
  s.final_top1 = s.best_top1 = e.top1;
  s.final_top5 = e.top5;
  s.eval_images_per_second = e.images_per_second;
  return s;
}

TrainSummary train(const TrainConfig& c) {
  namespace fs = std::filesystem;
  const dist::FailureGuard failure_guard;  // an error on one rank stops every rank
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
  // Evaluation at --val-crop-size runs on the variant compiled for it, over the same weights.
  Engine& eval_engine = r.eval_engine ? *r.eval_engine : engine;
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
  sum.train_crop_size = engine.blueprint().input.height;
  sum.eval_crop_size = eval_engine.blueprint().input.height;
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
  const int64_t n = dist::split_batch(c.batch_size);  // per rank
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
    if (!dist::is_root()) return;  // rank 0 writes
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
      if (s->overflow) return;  // the step changed nothing
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
                      es.hits);                        // the epoch over every rank
    if (!c.sync_bn) average_bn_running_stats(engine);  // per-rank BN, before eval and save
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
        const EvalResult e = run_eval(eval_engine, test_loader, pass == 1, test_input);
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
     << ",\"train_crop_size\":" << sum.train_crop_size
     << ",\"eval_crop_size\":" << sum.eval_crop_size << ",\"skipped_images\":" << sum.skipped_images
     << ",\"decoded\":{\"hardware\":" << dc.hardware << ",\"gpu_hybrid\":" << dc.gpu_hybrid
     << ",\"host\":" << dc.host << "}"
     << ",\"checkpoint\":" << json_string(sum.checkpoint) << ",\"config\":" << config_json(c)
     << "}\n";
  if (dist::is_root()) write_text_atomic((fs::path(c.output) / "summary.json").string(), js.str());
  return sum;
}

}  // namespace kiln
