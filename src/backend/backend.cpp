#include "kiln/backend/backend.h"

#include "kiln/core/error.h"

namespace kiln {

std::unique_ptr<Backend> make_cpu_backend();
#if defined(KILN_HAVE_CUDA)
std::unique_ptr<Backend> make_cuda_backend();
bool cuda_device_present();
void cuda_bind_rank_device();  // src/backend/cuda/dist.cu: one GPU per process (S27)
#endif

bool cuda_available() {
#if defined(KILN_HAVE_CUDA)
  return cuda_device_present();
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda" || device == "gpu") {
#if defined(KILN_HAVE_CUDA)
    KILN_CHECK(cuda_device_present(), InvalidArgument,
               "--device cuda: no CUDA GPU is visible; use --device cpu");
    cuda_bind_rank_device();
    return make_cuda_backend();
#else
    KILN_FAIL(InvalidArgument, "--device cuda: this kiln was built without the CUDA backend ",
              "(configure with a CUDA toolkit and KILN_CUDA=ON); use --device cpu");
#endif
  }
  if (device == "auto") return make_backend(cuda_available() ? "cuda" : "cpu");
  KILN_FAIL(InvalidArgument, "unknown device '", device, "'; use auto, cpu or cuda");
}

std::vector<float> read_floats(Backend& backend, const DTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::F32) {
    backend.read(t, out.data());
    return out;
  }
  KILN_CHECK(t.dtype == DType::F16 || t.dtype == DType::BF16 || t.dtype == DType::I32, InvalidArgument,
             "read_floats: tensor '", t.name, "' is ", dtype_name(t.dtype));
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
  KILN_CHECK(static_cast<int64_t>(values.size()) == t.numel(), InvalidArgument, "write_floats: ",
             values.size(), " values for tensor '", t.name, "' of ", t.numel(), " elements");
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
