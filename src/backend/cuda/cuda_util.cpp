// Helpers shared by the CUDA kernels: error reporting, node checks, environment switches.
#include <cublas_api.h>

#include <algorithm>
#include <cctype>

#include "backend/cuda/cuda_common.h"
#include "kiln/core/env.h"

namespace kiln::cuda {

void throw_cuda(const char* call, cudaError_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") at ", file, ":", line);
}
void throw_cudnn(const char* call, cudnnStatus_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: ", cudnnGetErrorString(e), " at ", file, ":", line);
}
void throw_cublas(const char* call, cublasStatus_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: cuBLAS status ", static_cast<int>(e), " (", cublasGetStatusString(e), ") at ",
            file, ":", line);
}

Options options_from_env() {
  Options o;
  o.graphs = env_flag("KILN_CUDA_GRAPHS", true);
  // KILN_STREAMS is a count: 1 puts every phase on one stream.
  o.streams = env_int("KILN_STREAMS", kStreams) > 1;
  o.tf32 = env_flag("KILN_TF32", false);
  // A switch like the others (1/on/true/yes, 0/off/false/no), or "only".
  const std::string winograd_env = env_string("KILN_FP32_WINOGRAD", "1");
  std::string winograd = winograd_env;
  std::transform(winograd.begin(), winograd.end(), winograd.begin(), ::tolower);
  const bool on = winograd == "1" || winograd == "on" || winograd == "true" || winograd == "yes";
  const bool off = winograd == "0" || winograd == "off" || winograd == "false" || winograd == "no";
  KILN_CHECK(on || off || winograd == "only", InvalidArgument, "KILN_FP32_WINOGRAD=", winograd_env,
             " is not a choice; use 0 (no Winograd or FFT in FP32), 1 (allowed) or only");
  o.fp32_winograd = on ? Fp32Winograd::allowed : off ? Fp32Winograd::off : Fp32Winograd::only;
  o.side_wgrad = env_flag("KILN_SIDE_WGRAD", false);
  o.profile = env_flag("KILN_PROFILE", false);
  o.vector_kernels = env_flag("KILN_VECTOR_KERNELS", true);
  o.pad_channels = env_flag("KILN_PAD_CHANNELS", false);
  const std::string form = env_string("KILN_CBR_FORM", "kiln");
  KILN_CHECK(form == "kiln" || form == "genstats", InvalidArgument, "KILN_CBR_FORM=", form,
             " is not a CBR form; use kiln (the default) or genstats");
  o.cbr_genstats = form == "genstats";
  o.deterministic = env_flag("KILN_DETERMINISTIC", false);
  const std::string table = env_string("KILN_ENGINE_TABLE", "");
  o.engine_table = table != "0" && table != "off" && table != "false";
  if (o.engine_table) o.engine_table_path = table;
  o.tune_path = env_string("KILN_TUNE", "");
  o.autotune = env_flag("KILN_AUTOTUNE", !o.deterministic);
  o.autotune_cache = o.autotune ? autotune_cache_dir(env_string("KILN_AUTOTUNE_CACHE", "")) : "";
  o.nvjpeg = env_flag("KILN_NVJPEG", true);
  o.nvjpeg_hardware = env_flag("KILN_NVJPEG_HARDWARE", true);
  o.nvjpeg_roi = env_flag("KILN_NVJPEG_ROI", true);
  o.nvjpeg_cache = env_flag("KILN_NVJPEG_CACHE", true);
  return o;
}

bool cuda_supports(OpKind op, DType feature_dtype) {
  (void)op;  // every op, the fused ones included (fused.cpp)
  return feature_dtype == DType::F32 || feature_dtype == DType::F16;
}

TensorId need_in(const Node& n, size_t i, const char* role) {
  const TensorId id = in_at(n, i);
  KILN_CHECK(id != kNoTensor, InvalidArgument, op_name(n.op), " node '", n.label, "': input ", i, " (", role,
             ") is missing; ops.def says: ", op_signature(n.op));
  return id;
}

TensorId need_out(const Node& n, size_t i, const char* role) {
  const TensorId id = out_at(n, i);
  KILN_CHECK(id != kNoTensor, InvalidArgument, op_name(n.op), " node '", n.label, "': output ", i, " (", role,
             ") is missing; ops.def says: ", op_signature(n.op));
  return id;
}

void expect_dtype(const Context& ctx, const Node& n, TensorId id, DType dtype, const char* role) {
  const DTensor& t = ctx.tensor(id);
  KILN_CHECK(t.dtype == dtype, Unsupported, op_name(n.op), " node '", n.label, "': ", role, " '", t.name, "' is ",
             dtype_name(t.dtype), "; the CUDA kernel needs ", dtype_name(dtype));
}

DType expect_float(const Context& ctx, const Node& n, TensorId id, const char* role) {
  const DTensor& t = ctx.tensor(id);
  KILN_CHECK(t.dtype == DType::F32 || t.dtype == DType::F16 || t.dtype == DType::BF16, Unsupported, op_name(n.op),
             " node '", n.label, "': ", role, " '", t.name, "' is ", dtype_name(t.dtype),
             "; the CUDA kernel takes f32, f16 or bf16");
  return t.dtype;
}

void expect_same_dtype(const Context& ctx, const Node& n, TensorId a, TensorId b) {
  KILN_CHECK(ctx.tensor(a).dtype == ctx.tensor(b).dtype, Unsupported, op_name(n.op), " node '", n.label, "': '",
             ctx.tensor(a).name, "' is ", dtype_name(ctx.tensor(a).dtype), " but '", ctx.tensor(b).name, "' is ",
             dtype_name(ctx.tensor(b).dtype), "; they must match");
}

void expect_numel(const Context& ctx, const Node& n, TensorId id, int64_t numel, const char* role) {
  const DTensor& t = ctx.tensor(id);
  KILN_CHECK(t.numel() == numel, Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
             "' has shape ", t.shape.str(), " (", t.numel(), " elements), expected ", numel, " elements");
}

void expect_rank(const Context& ctx, const Node& n, TensorId id, int rank, const char* role) {
  const DTensor& t = ctx.tensor(id);
  KILN_CHECK(t.shape.rank() == rank, Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
             "' has shape ", t.shape.str(), ", expected rank ", rank);
}

void reject_accumulate(const Node& n) {
  KILN_CHECK(!n.attrs.accumulate, Unsupported, op_name(n.op), " node '", n.label,
             "': the CUDA backend accumulates (attrs.accumulate) only in add and check_clip; ",
             "emit an add node to sum gradients");
}

Nhwc nhwc_of(const Context& ctx, const Node& n, TensorId id, const char* role) {
  const DTensor& t = ctx.tensor(id);
  Nhwc s;
  if (t.shape.rank() == 4) {
    s = {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
  } else if (t.shape.rank() == 2) {
    s = {t.shape[0], 1, 1, t.shape[1]};
  } else {
    KILN_FAIL(Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name, "' has shape ", t.shape.str(),
              "; expected [N, H, W, C] (or [N, C])");
  }
  KILN_CHECK(s.numel() > 0, Shape, op_name(n.op), " node '", n.label, "': ", role, " '", t.name, "' is empty");
  return s;
}

DevScalar dev_scalar(const Context& ctx, const Node& n, TensorId id, const char* role) {
  DevScalar s;
  if (id == kNoTensor) return s;
  const DTensor& t = ctx.tensor(id);
  switch (t.dtype) {
    case DType::F32: s.kind = 1; break;
    case DType::I32: s.kind = 2; break;
    case DType::I64: s.kind = 3; break;
    default:
      KILN_FAIL(InvalidArgument, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
                "' must be an f32, i32 or i64 scalar; it is ", dtype_name(t.dtype));
  }
  KILN_CHECK(t.numel() >= 1, InvalidArgument, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
             "' is empty");
  s.p = ctx.ptr(id);
  return s;
}

}  // namespace kiln::cuda
