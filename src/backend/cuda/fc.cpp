// Fully connected layers on the GPU through cuBLASLt. Row-major [N,K] x [O,K]^T products
// are column-major products of the transposes, so no data moves:
//   fwd       y[N,O]  = x w^T    : D(OxN)  = op_T(w: KxO) * x(KxN)
//   bwd data  dx[N,K] = dy w     : D(KxN)  = w(KxO) * dy(OxN)
//   bwd weight dw[O,K] = dy^T x  : D(KxO)  = x(KxN) * op_T(dy: OxN)
// Descriptors and the algorithm are chosen at compile time; run() is one cublasLtMatmul on
// the stream's handle and workspace. FP32 computes in FP32 (CUBLAS_COMPUTE_32F; TF32 only
// with KILN_TF32=1); under AMP the f16 operands accumulate in FP32 and fc_bwd_weight writes
// its FP32 dW directly. Bias and its gradient are per-channel kernels.
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/cuda_kernel.h"

namespace kiln::cuda {

namespace {

constexpr size_t kLtWorkspace = size_t{32} << 20;

cudaDataType_t cuda_type(const Node& n, DType d) {
  switch (d) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::F16:
      return CUDA_R_16F;
    case DType::BF16:
      return CUDA_R_16BF;
    default:
      KILN_FAIL(Unsupported, op_name(n.op), " node '", n.label, "': cuBLASLt takes no ",
                dtype_name(d));
  }
}

// One stored operand: a column-major rows x cols matrix with leading dimension rows.
struct Operand {
  const void* p;
  cudaDataType_t type;
  int64_t rows, cols;
  bool trans;
};

class MatmulKernel final : public Kernel {
 public:
  MatmulKernel(Context& ctx, const Node& n, int stream, Operand a, Operand b, void* d,
               cudaDataType_t d_type, int64_t m, int64_t nn)
      : Kernel(stream),
        a_(a.p),
        b_(b.p),
        d_(d),
        what_(std::string(op_name(n.op)) + " node '" + n.label + "'") {
    const bool fp32 = a.type == CUDA_R_32F && b.type == CUDA_R_32F;
    const cublasComputeType_t compute =
        fp32 && ctx.opts.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, compute, CUDA_R_32F));
    const cublasOperation_t ta = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                            tb = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la_, a.type, static_cast<uint64_t>(a.rows),
                                            static_cast<uint64_t>(a.cols), a.rows));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb_, b.type, static_cast<uint64_t>(b.rows),
                                            static_cast<uint64_t>(b.cols), b.rows));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld_, d_type, static_cast<uint64_t>(m),
                                            static_cast<uint64_t>(nn), m));
    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = kLtWorkspace;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(res(ctx).lt, op_, la_, lb_, ld_, ld_,
                                                             pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    KILN_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0, Backend, what_,
               ": cuBLASLt has no algorithm for this ", m, "x", nn, " product (status ",
               static_cast<int>(st), ")");
    algo_ = result.algo;
    ws_bytes_ = result.workspaceSize;
    ctx.need_workspace(stream, ws_bytes_);
  }
  ~MatmulKernel() override {
    if (la_) cublasLtMatrixLayoutDestroy(la_);
    if (lb_) cublasLtMatrixLayoutDestroy(lb_);
    if (ld_) cublasLtMatrixLayoutDestroy(ld_);
    if (op_) cublasLtMatmulDescDestroy(op_);
  }
  void set_bias_add(DType dt, const float* b, int64_t rows, int64_t c) {
    bias_ = {true, false, d_, dt, b, rows, c};
  }
  void set_bias_grad(const void* dy, DType dt, float* db, int64_t rows, int64_t c) {
    bias_ = {false, true, dy, dt, db, rows, c};
  }

  void run(Context& ctx) override {
    const StreamRes& r = res(ctx);
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(r.lt, op_, &one, a_, la_, b_, lb_, &zero, d_, ld_, d_, ld_, &algo_,
                                r.workspace, ws_bytes_, r.stream));
    if (bias_.add) {
      launch_bias_add(const_cast<void*>(bias_.t), bias_.dt, bias_.b, bias_.rows, bias_.c,
                      ctx.sm_count, r.stream);
    }
    if (bias_.grad) {
      launch_channel_sum(bias_.t, bias_.dt, const_cast<float*>(bias_.b), bias_.rows, bias_.c,
                         r.workspace, ctx.sm_count, r.stream);
    }
  }

 private:
  struct Bias {
    bool add = false, grad = false;
    const void* t = nullptr;
    DType dt = DType::F32;
    const float* b = nullptr;
    int64_t rows = 0, c = 0;
  };
  const void* a_;
  const void* b_;
  void* d_;
  std::string what_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  size_t ws_bytes_ = 0;
  Bias bias_;
};

}  // namespace

// "x [N,K], w [O,K], [b] -> y [N,O]"
KernelPtr make_fc_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), b = in_at(n, 2),
                 y = need_out(n, 0, "y");
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, y);
  expect_same_dtype(ctx, n, x, w);
  const FcGeom g = fc_geom(ctx, n, x, w, y);
  const cudaDataType_t t = cuda_type(n, dt);
  auto k = std::make_unique<MatmulKernel>(ctx, n, stream, Operand{ctx.ptr(w), t, g.k, g.o, true},
                                          Operand{ctx.ptr(x), t, g.k, g.n, false}, ctx.ptr(y), t,
                                          g.o, g.n);
  if (b != kNoTensor) {
    expect_dtype(ctx, n, b, DType::F32, "bias");
    expect_numel(ctx, n, b, g.o, "bias");
    k->set_bias_add(dt, ctx.ptr<float>(b), g.n, g.o);
  }
  return k;
}

// "dy, w -> dx"
KernelPtr make_fc_bwd_data(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), w = need_in(n, 1, "w"), dx = need_out(n, 0, "dx");
  const DType dt = expect_float(ctx, n, dy, "dy");
  expect_same_dtype(ctx, n, dy, dx);
  expect_same_dtype(ctx, n, dy, w);
  const FcGeom g = fc_geom(ctx, n, dx, w, dy);
  const cudaDataType_t t = cuda_type(n, dt);
  return std::make_unique<MatmulKernel>(ctx, n, stream, Operand{ctx.ptr(w), t, g.k, g.o, false},
                                        Operand{ctx.ptr(dy), t, g.o, g.n, false}, ctx.ptr(dx), t,
                                        g.k, g.n);
}

// "x, dy -> dw (f32), [db (f32)]"
KernelPtr make_fc_bwd_weight(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), dw = need_out(n, 0, "dw"),
                 db = out_at(n, 1);
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, dy);
  const DType wdt = expect_float(ctx, n, dw, "dw");
  const FcGeom g = fc_geom(ctx, n, x, dw, dy);
  const cudaDataType_t t = cuda_type(n, dt);
  auto k = std::make_unique<MatmulKernel>(ctx, n, stream, Operand{ctx.ptr(x), t, g.k, g.n, false},
                                          Operand{ctx.ptr(dy), t, g.o, g.n, true}, ctx.ptr(dw),
                                          cuda_type(n, wdt), g.k, g.o);
  if (db != kNoTensor) {
    expect_dtype(ctx, n, db, DType::F32, "db");
    expect_numel(ctx, n, db, g.o, "db");
    ctx.need_workspace(stream, channel_sum_workspace(g.n, g.o, ctx.sm_count));
    k->set_bias_grad(ctx.ptr(dy), dt, ctx.ptr<float>(db), g.n, g.o);
  }
  return k;
}

}  // namespace kiln::cuda
