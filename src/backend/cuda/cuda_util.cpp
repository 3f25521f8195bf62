// Helpers shared by the CUDA kernels: error reporting, node checks, the switches as Options.
#include <cublas_api.h>

#include <algorithm>

#include "backend/cuda/cuda_common.h"

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

Options options_from_switches(const Switches& sw) {
  Options o;
  o.graphs = sw.cuda_graphs;
  o.streams = sw.streams_on();
  o.tf32 = sw.tf32;
  o.fp32_winograd = sw.fp32_winograd == "1" ? Fp32Winograd::allowed
                    : sw.fp32_winograd == "0" ? Fp32Winograd::off : Fp32Winograd::only;
  o.side_wgrad = sw.side_wgrad;
  o.profile = sw.profile;
  o.profile_ops = sw.profile_ops;
  o.vector_kernels = sw.vector_kernels;
  o.pad_channels = sw.pad_channels;
  o.cbr_genstats = sw.cbr_form == "genstats";
  o.deterministic = sw.deterministic;
  const std::string& table = sw.engine_table;
  o.engine_table = table != "0" && table != "off" && table != "false";
  if (o.engine_table) o.engine_table_path = table;
  o.tune_path = sw.tune;
  o.autotune = resolve(sw.autotune, !o.deterministic);
  o.autotune_cache = o.autotune ? autotune_cache_dir(sw.autotune_cache) : "";
  o.nvjpeg = sw.nvjpeg;
  o.nvjpeg_hardware = sw.nvjpeg_hardware;
  o.nvjpeg_roi = sw.nvjpeg_roi;
  o.nvjpeg_cache = sw.nvjpeg_cache;
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
