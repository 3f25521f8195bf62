// kiln's C++ API in one include.
//
//   #include <kiln/kiln.h>
//   kiln::EngineOptions o;  o.device = "auto";  o.compile.batch = 128;
//   kiln::Engine engine(kiln::make_model("cnn"), o);
//   engine.lock_memory();                       // PLANNING → MEMORY_LOCKED
//   engine.compile(/*seed=*/0);                 // MEMORY_LOCKED → COMPILED
//   kiln::StepStats s = engine.train_step(images, labels, /*lr=*/0.05f);
//
// or the whole training task: kiln::train(kiln::TrainConfig{...}).
#pragma once

#include "kiln/algo/lr_schedule.h"
#include "kiln/backend/backend.h"
#include "kiln/blueprint/blueprint.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/dtype.h"
#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/core/shape.h"
#include "kiln/core/switches.h"
#include "kiln/graph/compiler.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/graph/program.h"
#include "kiln/io/safetensors.h"
#include "kiln/plan/arch_plan.h"
#include "kiln/process_group/process_group.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/distributed.h"
#include "kiln/task/engine.h"
#include "kiln/task/trainer.h"
