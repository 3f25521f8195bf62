// The C++ side of python/tests/test_engine.py's bit-identity check: trains a zoo model with
// kiln::Engine on batches the test wrote (float32 NHWC images, int32 labels) and prints each
// step's loss as a hexadecimal float, which the test compares with kiln.Engine's. With
// EMA_DECAY and CHECKPOINT it trains with EMA on and saves a checkpoint (test_weights.py
// compares its EMA and optimizer state with what kiln.Engine gives).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"

template <typename T>
std::vector<T> read_all(const char* path, size_t count) {
  std::vector<T> v(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(T)));
  if (!in) {
    std::fprintf(stderr, "engine_reference: cannot read %zu values from %s\n", count, path);
    std::exit(1);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 8 && argc != 10) {
    std::fprintf(stderr,
                 "usage: engine_reference MODEL BATCH STEPS LR SEED IMAGES.f32 LABELS.i32 "
                 "[EMA_DECAY CHECKPOINT]\n");
    return 2;
  }
  const kiln::BluePrint model = kiln::make_model(argv[1]);
  const int64_t batch = std::atoll(argv[2]), steps = std::atoll(argv[3]);
  const float lr = std::strtof(argv[4], nullptr);
  const uint64_t seed = std::strtoull(argv[5], nullptr, 10);
  const int64_t per = int64_t{model.input.height} * model.input.width * model.input.channels;
  const auto images = read_all<float>(argv[6], static_cast<size_t>(steps * batch * per));
  const auto labels = read_all<int32_t>(argv[7], static_cast<size_t>(steps * batch));
  kiln::EngineOptions o;
  o.device = "cpu";
  o.compile.batch = batch;
  o.compile.dropout_seed = seed;
  if (argc == 10) {
    o.compile.ema = true;
    o.compile.ema_decay = std::strtof(argv[8], nullptr);
  }
  kiln::Engine engine(model, o);
  engine.lock_memory();
  engine.compile(seed);
  for (int64_t s = 0; s < steps; ++s) {
    const kiln::StepStats st =
        engine.train_step(images.data() + s * batch * per, labels.data() + s * batch, lr);
    std::printf("%a %lld\n", static_cast<double>(st.loss), static_cast<long long>(st.top1));
  }
  if (argc == 10) {
    kiln::TrainState state;
    state.step = steps;
    kiln::save_checkpoint(engine, argv[9], state);
  }
  return 0;
}
