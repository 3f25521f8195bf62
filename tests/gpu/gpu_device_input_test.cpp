// Batches already in device memory (Backend::stage_batch_device, the path of a CUDA tensor fed
// from Python): staged from the GPU, a step sees exactly the bytes the host form stages (the
// same losses and weights, bit for bit, in float32 and uint8), and the copy waits for the stream
// that writes the buffer while that stream is still held up behind a slow host callback.
#include <gtest/gtest.h>

#if defined(KILN_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"

namespace kiln::test {
namespace {

#define CUDA_OK(call)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_); \
  } while (0)

constexpr int64_t kBatch = 16;
constexpr int kSteps = 4;
// The producer's host callback holds its stream until the test has enqueued the step, so the
// step's copy can only get the producer's bytes by waiting for it. A timed hold failed under
// load (the first step's module loads outlasted it); the deadline only keeps a broken wait from
// hanging the test.
constexpr auto kGateDeadline = std::chrono::seconds(120);

std::unique_ptr<Engine> make_engine(const BluePrint& bp) {
  EngineOptions o;
  o.switches.deterministic = true;  // two engines: the same kernels, the same bits
  o.device = "cuda";
  o.compile.batch = kBatch;
  o.compile.momentum = 0.9f;
  auto e = std::make_unique<Engine>(bp, o);
  e->lock_memory();
  e->compile(11);
  return e;
}

std::vector<std::vector<float>> params(Engine& e) {
  std::vector<std::vector<float>> out;
  for (const ParamDesc& d : e.program().params) out.push_back(e.read_param(d.name));
  return out;
}

void hold_until_open(void* gate) {
  const auto until = std::chrono::steady_clock::now() + kGateDeadline;
  auto* open = static_cast<std::atomic<bool>*>(gate);
  while (!open->load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Two batches, alternated over the steps (so each step must see new bytes), as float32 NHWC
// and as uint8 pixels; labels as int64, as torch gives them.
struct Batches {
  std::vector<float> f32[2];
  std::vector<uint8_t> u8[2];
  std::vector<int32_t> labels[2];
  std::vector<int64_t> labels64[2];
};

Batches make_batches(const BluePrint& bp) {
  Batches b;
  for (int k = 0; k < 2; ++k) {
    LearnableBatch lb = learnable_batch(bp, kBatch, 40 + static_cast<uint64_t>(k), 1 + k);
    b.f32[k] = lb.images;
    b.u8[k].resize(lb.images.size());
    for (size_t i = 0; i < lb.images.size(); ++i) {
      const float v = std::min(255.0f, std::max(0.0f, 128.0f + 40.0f * lb.images[i]));
      b.u8[k][i] = static_cast<uint8_t>(v);
    }
    b.labels[k] = lb.labels;
    b.labels64[k].assign(lb.labels.begin(), lb.labels.end());
  }
  return b;
}

// kSteps steps from the host (the reference) and from a device buffer that a producer stream
// writes once the step is enqueued; losses and weights compared bit for bit. `u8`: uint8 pixels
// normalised on the device; else float32. `device_labels`: int64 labels on the device, else
// int32 labels from the host.
void device_equals_host(bool u8, bool device_labels) {
  const BluePrint bp = make_model("cnn");
  const Batches b = make_batches(bp);
  InputNormalization norm;
  norm.mean = {0.45f};
  norm.std = {0.22f};
  const size_t img_bytes = u8 ? b.u8[0].size() : b.f32[0].size() * sizeof(float);
  const size_t lab_bytes = kBatch * sizeof(int64_t);

  auto host = make_engine(bp);
  std::vector<float> host_loss;
  for (int s = 0; s < kSteps; ++s) {
    InputView in;
    if (u8)
      in.u8 = b.u8[s % 2].data();
    else
      in.f32 = b.f32[s % 2].data();
    in.labels = b.labels[s % 2].data();
    in.norm = &norm;
    host->train_step_async(in, 0.05f);
    host_loss.push_back(host->pending_stats()->loss);
  }

  auto dev = make_engine(bp);
  void *d_img = nullptr, *d_lab = nullptr, *h_img = nullptr, *h_lab = nullptr;
  cudaStream_t producer = nullptr;
  CUDA_OK(cudaMalloc(&d_img, img_bytes));
  CUDA_OK(cudaMalloc(&d_lab, lab_bytes));
  CUDA_OK(cudaMallocHost(&h_img, img_bytes));  // pinned: the async copies stay in stream order
  CUDA_OK(cudaMallocHost(&h_lab, lab_bytes));
  CUDA_OK(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking));
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  std::vector<float> dev_loss;
  for (int s = 0; s < kSteps; ++s) {
    // Poison first (0xFF bytes are NaN as float32, 255 as uint8, label -1): a copy that does
    // not wait for the producer reads these.
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemset(d_img, 0xFF, img_bytes));
    CUDA_OK(cudaMemset(d_lab, 0xFF, lab_bytes));
    CUDA_OK(cudaDeviceSynchronize());
    if (u8)
      std::memcpy(h_img, b.u8[s % 2].data(), img_bytes);
    else
      std::memcpy(h_img, b.f32[s % 2].data(), img_bytes);
    std::memcpy(h_lab, b.labels64[s % 2].data(), lab_bytes);
    // Step 0 is not held: its first launches load their kernels' modules, which may wait for
    // every stream of the device, the held producer's too (seen on the H200 with float32 input).
    // Steps 1 on test the wait.
    std::atomic<bool> gate{s == 0};
    CUDA_OK(cudaLaunchHostFunc(producer, hold_until_open, &gate));
    CUDA_OK(cudaMemcpyAsync(d_img, h_img, img_bytes, cudaMemcpyHostToDevice, producer));
    CUDA_OK(cudaMemcpyAsync(d_lab, h_lab, lab_bytes, cudaMemcpyHostToDevice, producer));

    DeviceBatch d;
    d.images = d_img;
    d.dtype = u8 ? DType::U8 : DType::F32;
    d.device = device;
    d.stream = reinterpret_cast<uintptr_t>(producer);
    if (device_labels) {
      d.labels = d_lab;
      d.label_dtype = DType::I64;
      d.labels_on_device = true;
    } else {
      d.labels = b.labels[s % 2].data();
    }
    InputView in;
    in.device = &d;
    in.norm = &norm;
    dev->train_step_async(in, 0.05f);
    if (s > 0)
      EXPECT_EQ(cudaStreamQuery(producer), cudaErrorNotReady)
          << "step " << s
          << ": the producer stream finished before the step was enqueued, so the wait was not "
             "tested";
    gate.store(true);
    dev_loss.push_back(dev->pending_stats()->loss);
    CUDA_OK(cudaStreamSynchronize(producer));  // the callback reads `gate` before it goes
  }
  CUDA_OK(cudaStreamSynchronize(producer));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(std::memcmp(&dev_loss[static_cast<size_t>(s)], &host_loss[static_cast<size_t>(s)],
                          sizeof(float)),
              0)
        << "step " << s << ": loss from device memory " << dev_loss[static_cast<size_t>(s)]
        << ", from the host " << host_loss[static_cast<size_t>(s)]
        << " (NaN: the copy read the poisoned buffer before the producer wrote it)";
  }
  const auto hp = params(*host), dp = params(*dev);
  ASSERT_EQ(hp.size(), dp.size());
  for (size_t i = 0; i < hp.size(); ++i) {
    EXPECT_TRUE(hp[i] == dp[i]) << "parameter " << host->program().params[i].name
                                << " differs after " << kSteps
                                << " steps (device-staged vs host-staged)";
  }

  // Evaluation of a partial batch from device memory: padded on the device, the same stats.
  const int64_t valid = 5;
  CUDA_OK(cudaDeviceSynchronize());
  DeviceBatch d;
  d.images = d_img;
  d.dtype = u8 ? DType::U8 : DType::F32;
  d.device = device;
  d.labels = b.labels[(kSteps - 1) % 2].data();
  d.stream = reinterpret_cast<uintptr_t>(producer);
  InputView din;
  din.device = &d;
  din.norm = &norm;
  InputView hin;
  if (u8)
    hin.u8 = b.u8[(kSteps - 1) % 2].data();
  else
    hin.f32 = b.f32[(kSteps - 1) % 2].data();
  hin.labels = b.labels[(kSteps - 1) % 2].data();
  hin.norm = &norm;
  const StepStats he = host->eval_batch(hin, valid), de = dev->eval_batch(din, valid);
  EXPECT_EQ(std::memcmp(&he.loss, &de.loss, sizeof(float)), 0)
      << "partial evaluation batch: loss from device memory " << de.loss << ", from the host "
      << he.loss;
  EXPECT_EQ(he.top1, de.top1);

  // A batch on another GPU is refused, naming both devices.
  d.device = device + 1;
  try {
    dev->eval_batch(din, valid);
    ADD_FAILURE() << "a batch on cuda:" << device + 1
                  << " was accepted by an engine on cuda:" << device;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda:" + std::to_string(device + 1)), std::string::npos) << what;
    EXPECT_NE(what.find("runs on cuda:" + std::to_string(device)), std::string::npos) << what;
  }
  CUDA_OK(cudaStreamDestroy(producer));
  CUDA_OK(cudaFreeHost(h_img));
  CUDA_OK(cudaFreeHost(h_lab));
  CUDA_OK(cudaFree(d_img));
  CUDA_OK(cudaFree(d_lab));
}

TEST(GpuDeviceInput, Float32FromDeviceEqualsHostAndWaitsForTheProducer) {
  KILN_REQUIRE_GPU();
  device_equals_host(/*u8=*/false, /*device_labels=*/true);
}

TEST(GpuDeviceInput, Uint8FromDeviceEqualsHostAndWaitsForTheProducer) {
  KILN_REQUIRE_GPU();
  device_equals_host(/*u8=*/true, /*device_labels=*/false);
}

TEST(GpuDeviceInput, Uint8WithDeviceLabels) {
  KILN_REQUIRE_GPU();
  device_equals_host(/*u8=*/true, /*device_labels=*/true);
}

}  // namespace
}  // namespace kiln::test
#endif  // KILN_HAVE_CUDA
