// Builds a model with the BluePrint DSL, compiles it on the CPU and trains a few steps.
#include <kiln/kiln.h>

#include <cstdio>
#include <vector>

int main() {
  using namespace kiln;
  BluePrint net{"tiny", {8, 8, 3}, 4, seq(cbr(8, 3, 1, 1), maxpool(2, 2), flatten(), fc(4))};
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 4;
  Engine engine(net, o);
  engine.lock_memory();
  engine.compile(1);
  std::vector<float> images(4 * 8 * 8 * 3, 0.5f);
  std::vector<int32_t> labels{0, 1, 2, 3};
  for (int i = 0; i < 4; ++i) images[static_cast<size_t>(i * 8 * 8 * 3 + i)] = 3.0f;
  float first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    const StepStats s = engine.train_step(images.data(), labels.data(), 0.1f);
    if (step == 0) first = s.loss;
    last = s.loss;
  }
  std::printf("consumer: loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
