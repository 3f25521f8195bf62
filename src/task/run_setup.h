// A training or evaluation run's set-up, shared by train() and evaluate() (trainer.cpp): the
// configuration checked, the datasets opened, their loaders and the compiled engine.
#pragma once
#include <array>
#include <cstdint>
#include <memory>

#include "kiln/data/dataset.h"
#include "kiln/data/loader.h"
#include "kiln/task/engine.h"
#include "kiln/task/trainer.h"

namespace kiln {

struct RunSetup {
  std::shared_ptr<Dataset> train_set, test_set;
  std::unique_ptr<Loader> train_loader, test_loader;
  std::unique_ptr<Engine> engine;
  // The evaluation variant at --val-crop-size when it differs from the training crop (null
  // otherwise): declared after `engine`, so it goes first, as Engine::eval_variant requires.
  std::unique_ptr<Engine> eval_engine;
  std::array<int64_t, 3> hwc{};
  InputNormalization train_norm, test_norm;  // the pipelines' Normalize, applied on the device
};

// One clear error for a configuration kiln cannot run (a flag out of range, flags that
// contradict each other), before anything is opened.
void check_config(const TrainConfig& c);

// Datasets, loaders and the compiled engine for a run. The model's input follows the data.
// Without `training` (kiln eval) the training split is not opened: the test split alone
// decides the shape and the class count, so a dataset with only a test split evaluates.
RunSetup setup_run(const TrainConfig& c, bool training);

}  // namespace kiln
