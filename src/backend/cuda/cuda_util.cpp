// Helpers shared by the CUDA kernels: error reporting, the switches as Options, device scalars.
#include <cublas_api.h>

#include <algorithm>

#include "backend/cuda/cuda_kernel.h"
#include "backend/host_copy.h"

namespace kiln::cuda {

void throw_cuda(const char* call, cudaError_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") at ",
            file, ":", line);
}
void throw_cudnn(const char* call, cudnnStatus_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: ", cudnnGetErrorString(e), " at ", file, ":", line);
}
void throw_cublas(const char* call, cublasStatus_t e, const char* file, int line) {
  KILN_FAIL(Backend, call, " failed: cuBLAS status ", static_cast<int>(e), " (",
            cublasGetStatusString(e), ") at ", file, ":", line);
}

Options options_from_switches(const Switches& sw) {
  Options o;
  o.graphs = sw.cuda_graphs;
  o.streams = sw.streams_on();
  o.tf32 = sw.tf32;
  o.stage_copy_threads = stage_copy_threads(sw.stage_copy_threads);
  o.stage_in_pieces = sw.stage_in_pieces;
  o.fp32_winograd = sw.fp32_winograd == "1"   ? Fp32Winograd::allowed
                    : sw.fp32_winograd == "0" ? Fp32Winograd::off
                                              : Fp32Winograd::only;
  o.side_wgrad = sw.side_wgrad;
  o.profile = sw.profile;
  o.profile_ops = sw.profile_ops;
  o.vector_kernels = sw.vector_kernels;
  o.bn_fused_finalize = sw.bn_fused_finalize;
  o.sums_clear_kernel = sw.sums_clear_kernel;
  o.residual_bn_sums_in_dx = sw.residual_bn_sums_in_dx;
  o.pool_route_eager = sw.pool_route_eager;
  o.pool_group_apply = sw.pool_group_apply;
  o.bn_deep_loads = sw.bn_deep_loads;
  o.pad_channels = sw.pad_channels;
  o.pad_input_once = sw.pad_input_once;
  o.fixed_channels_conv = sw.fixed_channels_conv;
  o.first_layer_conv = sw.first_layer_conv;
  o.first_layer_wgrad = sw.first_layer_wgrad;
  o.first_layer_bn_fold = sw.first_layer_bn_fold;
  o.dgrad_no_dy2 = sw.dgrad_no_dy2;
  o.conv_dgrad_wide_tile = sw.conv_dgrad_wide_tile;
  o.conv_dgrad_pingpong = sw.conv_dgrad_pingpong;
  o.cbr_genstats = sw.cbr_form == "genstats";
  o.cutlass = sw.cutlass;                        // resolved per device and program in prepare()
  o.cutlass_dgrad = sw.cutlass_dgrad;            // likewise, after cutlass
  o.cutlass_conv = sw.cutlass_conv;              // likewise
  o.cutlass_conv_dgrad = sw.cutlass_conv_dgrad;  // likewise, after cutlass_dgrad
  o.cutlass_timed = sw.cutlass_timed;            // likewise, with deterministic
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

DevScalar dev_scalar(const Context& ctx, const Node& n, TensorId id, const char* role) {
  DevScalar s;
  if (id == kNoTensor) return s;
  const DTensor& t = ctx.tensor(id);
  switch (t.dtype) {
    case DType::F32:
      s.kind = 1;
      break;
    case DType::I32:
      s.kind = 2;
      break;
    case DType::I64:
      s.kind = 3;
      break;
    default:
      KILN_FAIL(InvalidArgument, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
                "' must be an f32, i32 or i64 scalar; it is ", dtype_name(t.dtype));
  }
  KILN_CHECK(t.numel() >= 1, InvalidArgument, op_name(n.op), " node '", n.label, "': ", role, " '",
             t.name, "' is empty");
  s.p = ctx.ptr(id);
  return s;
}

}  // namespace kiln::cuda
