// kiln.train: the trainer with the CLI's flags. Keywords become `kiln train` arguments, parsed
// by the CLI's own parser against its one flag table (tools/kiln/cmd_train.cpp), so the two
// cannot drift; the summary comes back as a dict.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "bind.h"
#include "cli.h"
#include "flags.h"
#include "kiln/core/error.h"
#include "kiln/task/trainer.h"

namespace kiln::py {

using namespace nb::literals;

namespace {

nb::dict summary_dict(const TrainSummary& s, const TrainConfig& c) {
  nb::dict d;
  d["final_top1"] = s.final_top1;
  d["final_top5"] = s.final_top5;
  d["best_top1"] = s.best_top1;
  d["final_loss"] = s.final_loss;
  d["ema_top1"] = s.ema_top1 >= 0 ? nb::cast(s.ema_top1) : nb::none();
  d["epochs_run"] = s.epochs_run;
  d["steps"] = s.steps;
  d["train_seconds"] = s.train_seconds;
  d["epoch_seconds"] = s.epoch_seconds;
  d["images_per_second"] = s.images_per_second;
  d["input"] = s.input;
  d["loader_images_per_second"] = s.loader_images_per_second;
  d["input_wait_fraction"] = s.input_wait_fraction;
  d["eval_images_per_second"] = s.eval_images_per_second;
  d["skipped_images"] = s.skipped_images;
  d["train_crop_size"] = s.train_crop_size;
  d["eval_crop_size"] = s.eval_crop_size;
  d["metrics_csv"] = s.metrics_csv;
  d["metrics_jsonl"] = s.metrics_jsonl;
  d["checkpoint"] = s.checkpoint;
  d["output"] = c.output;
  d["stop_signal"] = s.stop_signal;
  d["stopped_early"] = s.stopped_early;
  d["complete"] = s.complete;
  d["saved_at"] = s.saved_at;
  return d;
}

}  // namespace

void bind_train(nb::module_& m) {
  m.def(
      "train_flags",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string, bool>> out;
        for (const cli::FlagSpec& s : cli::train_flags())
          out.emplace_back(s.name, s.help, s.fallback, s.is_switch);
        return out;
      },
      "kiln train's flags: (name, help, default, is_switch), the table kiln.train's keywords come "
      "from.");
  m.def(
      "_train",
      [](std::vector<std::string> args, nb::object on_epoch) -> nb::object {
        std::vector<std::string> words = {"kiln", "train"};
        words.insert(words.end(), args.begin(), args.end());
        std::vector<char*> argv;
        for (std::string& w : words) argv.push_back(w.data());
        cli::Flags f("train", "[flags]", cli::train_flags());
        if (!f.parse(static_cast<int>(argv.size()), argv.data(), 2))
          return nb::none();  // help printed
        TrainConfig c = cli::train_config(f);
        // The callback's own exception, kept (with the GIL held) to be raised again as it was.
        std::optional<nb::python_error> raised;
        if (!on_epoch.is_none()) {
          c.on_epoch = [&on_epoch, &raised](const MetricsRow& row) {
            std::string js = "{";
            for (size_t i = 0; i < row.size(); ++i) {
              js += (i ? ",\"" : "\"") + row[i].first + "\":" + row[i].second.json();
            }
            js += "}";
            nb::gil_scoped_acquire held;
            try {
              on_epoch(js);
            } catch (nb::python_error& e) {
              raised.emplace(std::move(e));
              KILN_FAIL(InvalidArgument, "kiln.train's callback raised an exception");
            }
          };
        }
        TrainSummary s;
        try {
          nb::gil_scoped_release unlocked;
          s = train(c);
        } catch (...) {
          if (raised) throw std::move(*raised);  // the GIL is held again here
          throw;
        }
        return summary_dict(s, c);
      },
      "args"_a, "on_epoch"_a = nb::none(),
      "Runs `kiln train ARGS...` in this process; the summary as a dict. on_epoch(row_json) is "
      "called "
      "after each epoch.");
}

}  // namespace kiln::py
