#include "kiln/backend/backend.h"

#include "kiln/core/error.h"

namespace kiln {

std::unique_ptr<Backend> make_cpu_backend(const Switches& switches);
#if defined(KILN_HAVE_CUDA)
std::unique_ptr<Backend> make_cuda_backend(const Switches& switches);
bool cuda_device_present();
void cuda_bind_rank_device();  // src/backend/cuda/dist.cu: one GPU per process
#endif

bool cuda_available() {
#if defined(KILN_HAVE_CUDA)
  return cuda_device_present();
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& device, const Switches& switches) {
  if (device == "cpu") return make_cpu_backend(switches);
  if (device == "cuda" || device == "gpu") {
#if defined(KILN_HAVE_CUDA)
    KILN_CHECK(cuda_device_present(), InvalidArgument,
               "--device cuda: no CUDA GPU is visible; use --device cpu");
    cuda_bind_rank_device();
    return make_cuda_backend(switches);
#else
    KILN_FAIL(InvalidArgument, "--device cuda: this kiln was built without the CUDA backend ",
              "(configure with a CUDA toolkit and KILN_CUDA=ON); use --device cpu");
#endif
  }
  if (device == "auto") return make_backend(cuda_available() ? "cuda" : "cpu", switches);
  KILN_FAIL(InvalidArgument, "unknown device '", device, "'; use auto, cpu or cuda");
}

namespace {

// normalize_u8 for C channels: the same multiply and add per value, over 16 pixels at a time
// with the per-channel constants laid out to match, so that the loop vectorises (no gather).
template <int C>
void normalize_channels(const uint8_t* in, int64_t pixels, const float* scale, const float* shift,
                        float* out) {
  constexpr int kBlock = 16 * C;
  float s[kBlock], h[kBlock];
  for (int j = 0; j < kBlock; ++j) s[j] = scale[j % C], h[j] = shift[j % C];
  const int64_t n = pixels * C;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int j = 0; j < kBlock; ++j) out[i + j] = static_cast<float>(in[i + j]) * s[j] + h[j];
  }
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]) * s[i % C] + h[i % C];
}

}  // namespace

void normalize_u8(const uint8_t* in, int64_t pixels, const InputNormalization& norm, float* out) {
  const size_t c = norm.mean.size();
  KILN_CHECK(c > 0 && norm.std.size() == c, InvalidArgument,
             "uint8 input needs one mean and one std per channel, got ", c, " and ",
             norm.std.size());
  float scale[8], shift[8];
  KILN_CHECK(c <= 8, InvalidArgument, "uint8 input of ", c, " channels; at most 8 are supported");
  for (size_t k = 0; k < c; ++k) {
    KILN_CHECK(norm.std[k] > 0, InvalidArgument, "input std of channel ", k, " must be > 0, got ",
               norm.std[k]);
    scale[k] = 1.0f / (255.0f * norm.std[k]);
    shift[k] = -norm.mean[k] / norm.std[k];
  }
  if (c == 3) return normalize_channels<3>(in, pixels, scale, shift, out);
  if (c == 1) return normalize_channels<1>(in, pixels, scale, shift, out);
  for (int64_t p = 0; p < pixels; ++p) {
    for (size_t k = 0; k < c; ++k) out[k] = static_cast<float>(in[k]) * scale[k] + shift[k];
    in += c;
    out += c;
  }
}

std::vector<float> read_floats(Backend& backend, const DTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::F32) {
    backend.read(t, out.data());
    return out;
  }
  KILN_CHECK(t.dtype == DType::F16 || t.dtype == DType::BF16 || t.dtype == DType::I32,
             InvalidArgument, "read_floats: tensor '", t.name, "' is ", dtype_name(t.dtype));
  if (t.dtype == DType::I32) {
    std::vector<int32_t> raw(out.size());
    backend.read(t, raw.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(raw[i]);
    return out;
  }
  std::vector<uint16_t> raw(out.size());
  backend.read(t, raw.data());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = t.dtype == DType::F16 ? half_to_float(raw[i]) : bf16_to_float(raw[i]);
  }
  return out;
}

void write_floats(Backend& backend, const DTensor& t, const std::vector<float>& values) {
  KILN_CHECK(static_cast<int64_t>(values.size()) == t.numel(), InvalidArgument,
             "write_floats: ", values.size(), " values for tensor '", t.name, "' of ", t.numel(),
             " elements");
  if (t.dtype == DType::F32) {
    backend.write(t, values.data());
    return;
  }
  KILN_CHECK(t.dtype == DType::F16 || t.dtype == DType::BF16, InvalidArgument,
             "write_floats: tensor '", t.name, "' is ", dtype_name(t.dtype));
  std::vector<uint16_t> raw(values.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    raw[i] = t.dtype == DType::F16 ? float_to_half(values[i]) : float_to_bf16(values[i]);
  }
  backend.write(t, raw.data());
}

}  // namespace kiln
