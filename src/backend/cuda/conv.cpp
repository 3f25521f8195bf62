// Convolution on the GPU through the cuDNN frontend graph API (conv_fprop, conv_dgrad,
// conv_wgrad) over kiln's layouts: features NHWC and weights KRSC, given to cuDNN as NCHW
// dims with NHWC strides. One graph per distinct shape, built and its plan chosen at
// compile time (cached by shape in the Context), executed at run time with the stream's
// handle and workspace. The bias (conv_fwd) and its gradient (conv_bwd_weight) are separate
// per-channel kernels (channel_ops.h).
//
// Numerics: FP32 graphs refuse engines that use tensor cores (TF32), down-convert inputs,
// reduce in lower precision, or use FFT / Winograd, unless --tf32 / KILN_TF32=1 allows TF32
// and KILN_FP32_WINOGRAD=1 FFT and Winograd (both of which PyTorch allows by default); FP16
// graphs compute in FP32 (compute_data_type FLOAT). KILN_DETERMINISTIC=1 refuses engines
// noted NONDETERMINISTIC in every dtype.
#include <cudnn_frontend.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>

#include "backend/channel_pad_rule.h"
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/conv_engines.h"
#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/timed_form.h"
#include "kiln/backend/engine_table.h"
#include "kiln/core/log.h"

namespace kiln::cuda {

namespace {

// fprop_genstats: the MLPerf-style CBR convolution, one graph whose output is also reduced
// per channel (sum and sum of squares, FP32) for BatchNorm (make_conv_fwd_genstats).
enum class ConvKind { fprop, dgrad, wgrad, fprop_genstats };
enum : int64_t { kUidX = 1, kUidW = 2, kUidY = 3, kUidSum = 4, kUidSqSum = 5 };

fe::DataType_t fe_type(DType d) {
  switch (d) {
    case DType::F32:
      return fe::DataType_t::FLOAT;
    case DType::F16:
      return fe::DataType_t::HALF;
    case DType::BF16:
      return fe::DataType_t::BFLOAT16;
    default:
      KILN_FAIL(Unsupported, "cuDNN convolution: dtype ", dtype_name(d), " is not a float type");
  }
}

// NCHW dims with NHWC strides (cuDNN's way of saying channels-last).
std::vector<int64_t> nchw_dims(const Nhwc& t) {
  return {t.n, t.c, t.h, t.w};
}
std::vector<int64_t> nhwc_strides(const Nhwc& t) {
  return {t.h * t.w * t.c, 1, t.w * t.c, t.c};
}

// fe::graph::Graph with each engine's numerical notes readable by index (the frontend keeps
// them in a protected member): which engines transform their sums (Winograd, FFT) decides
// KILN_FP32_WINOGRAD=only's candidates and what kiln reports it took.
class NotedGraph : public fe::graph::Graph {
 public:
  // Winograd (any tile) or FFT: sums formed in a transformed domain, rounded differently.
  bool transforms_sums(int64_t i) const {
    if (i < 0 || i >= static_cast<int64_t>(plans.numeric_notes.size())) return false;
    for (fe::NumericalNote_t note : plans.numeric_notes[static_cast<size_t>(i)]) {
      if (is_transform(note)) return true;
    }
    return false;
  }
  int64_t heuristic_candidate() const { return plans.candidate; }
  static bool is_transform(fe::NumericalNote_t note) {
    return note == fe::NumericalNote_t::FFT || note == fe::NumericalNote_t::WINOGRAD ||
           note == fe::NumericalNote_t::WINOGRAD_TILE_4x4 ||
           note == fe::NumericalNote_t::WINOGRAD_TILE_6x6 ||
           note == fe::NumericalNote_t::WINOGRAD_TILE_13x13;
  }
};

struct ConvPlan {
  std::shared_ptr<NotedGraph> graph;
  int64_t workspace = 0;
  int64_t index =
      -1;  // the engine config chosen from the table or by tuning; -1: heuristics' choice
};

#define FE_CHECK(expr, what)                                                                    \
  do {                                                                                          \
    auto kiln_fe_ = (expr);                                                                     \
    if (kiln_fe_.is_bad()) {                                                                    \
      KILN_FAIL(Backend, what, ": cuDNN frontend ", #expr, " failed: ", kiln_fe_.get_message(), \
                " at ", __FILE__, ":", __LINE__);                                               \
    }                                                                                           \
  } while (0)

struct ConvPointers {
  void *x, *w, *y;
  float* sums = nullptr;  // fprop_genstats: [sum (K); sum of squares (K)]
};

constexpr const char* kConvKindName[] = {"fprop", "dgrad", "wgrad", "fprop+genstats"};

std::shared_ptr<ConvPlan> build_plan(Context& ctx, const Node& n, int stream, ConvKind kind,
                                     const ConvGeom& g, DType x_dt, DType w_dt, DType y_dt,
                                     ConvPointers ptrs) {
  const bool fp32 = x_dt == DType::F32 && w_dt == DType::F32 && y_dt == DType::F32;
  const bool tf32 = fp32 && ctx.opts.tf32;
  // The experience-table key: op kind, shape, geometry, dtypes and the numerics switches that
  // change which engines are allowed (the same key on every stream).
  std::ostringstream key;
  key << kConvKindName[static_cast<int>(kind)] << ":" << g.x.n << "," << g.x.h << "," << g.x.w
      << "," << g.x.c << ":" << g.k << "," << g.r << "," << g.s << ":" << g.sh << "," << g.sw << ","
      << g.ph << "," << g.pw << ":" << dtype_name(x_dt) << "," << dtype_name(w_dt) << ","
      << dtype_name(y_dt) << (tf32 ? ":tf32" : "")
      << (fp32 && ctx.opts.fp32_winograd == Fp32Winograd::allowed ? ":winograd" : "")
      << (fp32 && ctx.opts.fp32_winograd == Fp32Winograd::only ? ":winograd-only" : "")
      << (ctx.opts.deterministic ? ":det" : "");
  const std::string table_key = key.str();
  auto& slot = ctx.plan_cache[table_key + ":s" + std::to_string(stream)];
  if (slot) return std::static_pointer_cast<ConvPlan>(slot);

  const std::string what = std::string(op_name(n.op)) + " node '" + n.label + "'";
  const auto started = std::chrono::steady_clock::now();
  cudnnHandle_t handle = ctx.streams[static_cast<size_t>(stream)].cudnn;
  // The operation graph with its engine candidates filtered by the numerics switches.
  // winograd_only (KILN_FP32_WINOGRAD=only, FP32): Winograd engines alone; returns null when
  // cuDNN has none for this graph, so the caller builds the graph again without that filter.
  auto make_graph = [&](bool winograd_only) -> std::shared_ptr<NotedGraph> {
    auto graph = std::make_shared<NotedGraph>();
    graph->set_io_data_type(fe_type(y_dt))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const std::vector<int64_t> w_dims{g.k, g.x.c, g.r, g.s},
        w_strides{g.r * g.s * g.x.c, 1, g.s * g.x.c, g.x.c};
    const std::vector<int64_t> pad{g.ph, g.pw}, stride{g.sh, g.sw}, dil{1, 1};
    auto X = fe::graph::Tensor_attributes()
                 .set_name("X")
                 .set_dim(nchw_dims(g.x))
                 .set_stride(nhwc_strides(g.x))
                 .set_data_type(fe_type(x_dt));
    auto W = fe::graph::Tensor_attributes()
                 .set_name("W")
                 .set_dim(w_dims)
                 .set_stride(w_strides)
                 .set_data_type(fe_type(w_dt));
    auto Y = fe::graph::Tensor_attributes()
                 .set_name("Y")
                 .set_dim(nchw_dims(g.y))
                 .set_stride(nhwc_strides(g.y))
                 .set_data_type(fe_type(y_dt));
    switch (kind) {
      case ConvKind::fprop:
      case ConvKind::fprop_genstats: {
        auto x = graph->tensor(X.set_uid(kUidX));
        auto w = graph->tensor(W.set_uid(kUidW));
        auto y = graph->conv_fprop(
            x, w,
            fe::graph::Conv_fprop_attributes().set_padding(pad).set_stride(stride).set_dilation(
                dil));
        y->set_output(true)
            .set_uid(kUidY)
            .set_dim(nchw_dims(g.y))
            .set_stride(nhwc_strides(g.y))
            .set_data_type(fe_type(y_dt));
        if (kind == ConvKind::fprop) break;
        // z is written and also reduced per channel, in FP32.
        auto [sum, sq_sum] = graph->genstats(
            y, fe::graph::Genstats_attributes().set_compute_data_type(fe::DataType_t::FLOAT));
        const std::vector<int64_t> cdims{1, g.k, 1, 1}, cstrides{g.k, 1, g.k, g.k};
        sum->set_output(true).set_uid(kUidSum).set_dim(cdims).set_stride(cstrides).set_data_type(
            fe::DataType_t::FLOAT);
        sq_sum->set_output(true)
            .set_uid(kUidSqSum)
            .set_dim(cdims)
            .set_stride(cstrides)
            .set_data_type(fe::DataType_t::FLOAT);
        break;
      }
      case ConvKind::dgrad: {  // Y is dy, X is dx
        auto dy = graph->tensor(Y.set_uid(kUidY));
        auto w = graph->tensor(W.set_uid(kUidW));
        auto dx = graph->conv_dgrad(
            dy, w,
            fe::graph::Conv_dgrad_attributes().set_padding(pad).set_stride(stride).set_dilation(
                dil));
        dx->set_output(true)
            .set_uid(kUidX)
            .set_dim(nchw_dims(g.x))
            .set_stride(nhwc_strides(g.x))
            .set_data_type(fe_type(x_dt));
        break;
      }
      case ConvKind::wgrad: {  // Y is dy, W is dw
        auto dy = graph->tensor(Y.set_uid(kUidY));
        auto x = graph->tensor(X.set_uid(kUidX));
        auto dw = graph->conv_wgrad(
            dy, x,
            fe::graph::Conv_wgrad_attributes().set_padding(pad).set_stride(stride).set_dilation(
                dil));
        dw->set_output(true).set_uid(kUidW).set_dim(w_dims).set_stride(w_strides).set_data_type(
            fe_type(w_dt));
        break;
      }
    }
    FE_CHECK(graph->validate(), what);
    FE_CHECK(graph->build_operation_graph(handle), what);
    FE_CHECK(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), what);
    std::vector<fe::NumericalNote_t> bad;
    if (fp32) {
      bad = {fe::NumericalNote_t::DOWN_CONVERT_INPUTS,
             fe::NumericalNote_t::REDUCED_PRECISION_REDUCTION};
      if (ctx.opts.fp32_winograd == Fp32Winograd::off) {
        for (fe::NumericalNote_t note :
             {fe::NumericalNote_t::FFT, fe::NumericalNote_t::WINOGRAD,
              fe::NumericalNote_t::WINOGRAD_TILE_4x4, fe::NumericalNote_t::WINOGRAD_TILE_6x6,
              fe::NumericalNote_t::WINOGRAD_TILE_13x13}) {
          bad.push_back(note);
        }
      }
      if (!tf32) bad.push_back(fe::NumericalNote_t::TENSOR_CORE);
    }
    if (ctx.opts.deterministic) bad.push_back(fe::NumericalNote_t::NONDETERMINISTIC);
    if (!bad.empty()) graph->deselect_numeric_notes(bad);
    graph->deselect_workspace_greater_than(ctx.workspace_cap);
    // Tuning times precompiled engines only: a runtime-compiled one takes ~1 s of NVRTC to
    // build, and a model has ~100 convolution graphs.
    // (Fused graphs such as conv+genstats have runtime-compiled engines only.)
    if (!ctx.opts.tune_path.empty() && kind != ConvKind::fprop_genstats) {
      graph->deselect_behavior_notes({fe::BehaviorNote_t::RUNTIME_COMPILATION});
    }
    if (winograd_only) {
      // The frontend's select_numeric_notes keeps engines holding *every* note listed, and a
      // Winograd engine carries a tile note or the plain one: the others are barred by name.
      // The frontend bars every engine whose name contains a barred one ("eng1" bars "eng17"
      // too), so a transformed engine may be lost with them: acceptable for a test mode.
      std::vector<std::string> direct;
      for (int64_t i = 0; i < graph->get_execution_plan_count(); ++i) {
        std::string name;
        if (!graph->transforms_sums(i) && graph->get_plan_name_at_index(i, name).is_good())
          direct.push_back(name);
      }
      if (static_cast<int64_t>(direct.size()) == graph->get_execution_plan_count()) return nullptr;
      graph->deselect_engines(direct);
      if (graph->check_support(handle).is_bad()) return nullptr;
      return graph;
    }
    FE_CHECK(graph->check_support(handle), what);
    return graph;
  };
  std::shared_ptr<NotedGraph> graph;
  if (fp32 && ctx.opts.fp32_winograd == Fp32Winograd::only) {
    graph = make_graph(true);
    if (!graph)
      log_info(what, ": cuDNN has no Winograd or FFT engine for ", table_key,
               "; its other FP32 engines are used");
  }
  if (!graph) graph = make_graph(false);
  auto plan = std::make_shared<ConvPlan>();
  plan->graph = graph;
  std::unordered_map<int64_t, void*> pack{{kUidX, ptrs.x}, {kUidW, ptrs.w}, {kUidY, ptrs.y}};
  if (kind == ConvKind::fprop_genstats) {
    pack[kUidSum] = ptrs.sums;
    pack[kUidSqSum] = ptrs.sums + g.k;
  }
  cudaStream_t cu_stream = ctx.streams[static_cast<size_t>(stream)].stream;
  bool autotuned = false;
  if (!ctx.opts.tune_path.empty()) {
    plan->index = tune_engines(ctx, *graph, handle, cu_stream, pack, table_key);
  } else if (const EngineEntry* entry =
                 ctx.opts.engine_table ? ctx.engine_table.find(table_key) : nullptr) {
    plan->index = pick_from_table(*graph, *entry);
    if (plan->index < 0) {
      log_warn("engine table: none of the ", entry->choices.size(), " engines listed for ",
               table_key, " builds here; ",
               ctx.opts.autotune ? "timing a few engines instead" : "using cuDNN's heuristics",
               " (re-run kiln tune)");
    }
  }
  if (plan->index < 0 && ctx.opts.autotune && ctx.opts.tune_path.empty()) {
    const auto tune_start = std::chrono::steady_clock::now();
    plan->index = autotune_engines(
        ctx, *graph, kind == ConvKind::fprop_genstats ? kAutotuneFusedRule : kAutotuneRule, handle,
        cu_stream, pack, table_key);
    autotuned = plan->index >= 0;
    ctx.autotune_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - tune_start).count();
    if (ctx.autotune_seconds >= ctx.autotune_report_at) {
      log_info(
          "autotuning convolution engines: ", ctx.autotuned + (autotuned ? 1 : 0),
          " graphs timed in ", static_cast<int>(ctx.autotune_seconds),
          " s so far (once per shape on this GPU and cuDNN",
          ctx.opts.autotune_cache.empty() ? "" : "; later runs take them from the autotune cache",
          "; KILN_AUTOTUNE=0 skips it)");
      ctx.autotune_report_at = ctx.autotune_seconds + kAutotuneReportSeconds;
    }
  }
  if (autotuned) {
    ++ctx.autotuned;
  } else if (plan->index >= 0) {
    ++ctx.table_hits;
  } else {
    ++ctx.table_misses;
  }
  if (plan->index >= 0) {
    FE_CHECK(graph->get_workspace_size_plan_at_index(plan->index, plan->workspace), what);
  } else {
    FE_CHECK(graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), what);
    FE_CHECK(graph->get_workspace_size(plan->workspace), what);
  }
  if (fp32 &&
      graph->transforms_sums(plan->index >= 0 ? plan->index : graph->heuristic_candidate())) {
    ++ctx.fp32_transformed;
    log_debug(what, ": FP32 on a Winograd / FFT engine (KILN_FP32_WINOGRAD=0 refuses them)");
  }
  ctx.plan_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  slot = plan;
  return plan;
}

// FP16 / BF16 convolutions whose input channel count is neither 4 nor a multiple of 8 (the first
// layer's 3) take no fast tensor-core engine: cuDNN runs them at a few TFLOPS (VGG16-BN's
// first layer, 3 > 64 channels at 224x224, 1.6 ms a forward on an H100). KILN_PAD_CHANNELS runs
// them on copies with zero channels up to padded_channel_count (channel_pad_rule.h): the zeros
// add nothing to any sum, and the padding's own weight and input gradients are dropped.
struct ChannelPad {
  bool on = false;
  int64_t c = 0, cp = 0;
};

// Whether padding changes a convolution over c input channels in dtype dt.
bool paddable(DType dt, int64_t c) {
  return dt != DType::F32 && padded_channel_count(c) != c;
}

ChannelPad channel_pad(bool pad, DType dt, int64_t c) {
  ChannelPad p;
  p.on = pad && paddable(dt, c);
  p.c = c;
  p.cp = padded_channel_count(c);
  return p;
}

class ConvKernel final : public Kernel {
 public:
  ConvKernel(int stream, std::string what) : Kernel(stream), what_(std::move(what)) {}
  // Channel padding: `before` copies run before the convolution (into its padded operands),
  // `after` ones after it (out of its padded result); the kernel owns the padded buffers.
  struct PadCopy {
    const void* src;
    void* dst;
    DType dt;
    int64_t rows, c, cp;
    bool unpad;
  };
  // sum / sq_sum: the genstats outputs of a fprop_genstats plan.
  void set_plan(std::shared_ptr<ConvPlan> plan, void* x, void* w, void* y, float* sum = nullptr,
                float* sq_sum = nullptr) {
    plan_ = std::move(plan);
    pack_ = {{kUidX, x}, {kUidW, w}, {kUidY, y}};
    if (sum) pack_[kUidSum] = sum;
    if (sq_sum) pack_[kUidSqSum] = sq_sum;
  }
  // Another convolution in place of the cuDNN plan (the fixed-channels CUTLASS unit), run
  // between the same padding copies.
  void set_runner(std::function<void(cudaStream_t)> run) { runner_ = std::move(run); }
  void pad_before(PadCopy c) { before_.push_back(c); }
  void pad_after(PadCopy c) { after_.push_back(c); }
  void own(std::shared_ptr<DeviceBuffer> s) { scratch_.push_back(std::move(s)); }
  // Optional per-channel step after the convolution: bias add (fwd) or bias gradient (wgrad).
  void set_bias_add(void* y, DType dt, const float* b, int64_t rows, int64_t c) {
    bias_ = {true, false, y, dt, const_cast<float*>(b), rows, c};
  }
  void set_bias_grad(const void* dy, DType dt, float* db, int64_t rows, int64_t c) {
    bias_ = {false, true, const_cast<void*>(dy), dt, db, rows, c};
  }

  void run(Context& ctx) override {
    const StreamRes& r = res(ctx);
    for (const PadCopy& c : before_) copy(ctx, c, r.stream);
    if (runner_) {
      runner_(r.stream);
    } else {
      auto status = plan_->index >= 0 ? plan_->graph->execute_plan_at_index(
                                            r.cudnn, pack_, r.workspace, plan_->index)
                                      : plan_->graph->execute(r.cudnn, pack_, r.workspace);
      if (status.is_bad())
        KILN_FAIL(Backend, what_, ": cuDNN execute failed: ", status.get_message());
    }
    KILN_LAUNCH_CHECK(what_.c_str());
    for (const PadCopy& c : after_) copy(ctx, c, r.stream);
    if (bias_.add)
      launch_bias_add(bias_.t, bias_.dt, bias_.b, bias_.rows, bias_.c, ctx.sm_count, r.stream);
    if (bias_.grad) {
      launch_channel_sum(bias_.t, bias_.dt, bias_.b, bias_.rows, bias_.c, r.workspace, ctx.sm_count,
                         r.stream);
    }
  }

 private:
  struct Bias {
    bool add = false, grad = false;
    void* t = nullptr;
    DType dt = DType::F32;
    float* b = nullptr;
    int64_t rows = 0, c = 0;
  };
  static void copy(const Context& ctx, const PadCopy& c, cudaStream_t s) {
    if (c.unpad) {
      launch_unpad_channels(c.src, c.dst, c.dt, c.rows, c.cp, c.c, ctx.sm_count, s);
    } else {
      launch_pad_channels(c.src, c.dst, c.dt, c.rows, c.c, c.cp, ctx.sm_count, s);
    }
  }

  std::shared_ptr<ConvPlan> plan_;
  std::function<void(cudaStream_t)> runner_;
  std::unordered_map<int64_t, void*> pack_;
  std::string what_;
  Bias bias_;
  std::vector<PadCopy> before_, after_;
  std::vector<std::shared_ptr<DeviceBuffer>> scratch_;
};

// What the convolution reads or writes in place of tensor t ([rows, pad.c] in dtype dt): t
// itself, or with padding on a padded copy owned by k - filled before the convolution for an
// input, emptied into t after it for an output. `filled`: an input's padded copy that another
// kernel fills each step before this one runs (KILN_PAD_INPUT_ONCE), shared and not copied again.
// `copy`, where given, receives the padded buffer.
void* padded(ConvKernel& k, const ChannelPad& pad, void* t, DType dt, int64_t rows, bool output,
             std::shared_ptr<DeviceBuffer> filled = nullptr,
             std::shared_ptr<DeviceBuffer>* copy = nullptr) {
  if (!pad.on) return t;
  if (filled && !output) {
    void* p = filled->get();
    k.own(std::move(filled));
    return p;
  }
  auto buf = std::make_shared<DeviceBuffer>(static_cast<size_t>(rows * pad.cp) * dtype_size(dt));
  void* p = buf->get();
  if (copy) *copy = buf;
  k.own(std::move(buf));
  if (output) {
    k.pad_after({p, t, dt, rows, pad.c, pad.cp, true});
  } else {
    k.pad_before({t, p, dt, rows, pad.c, pad.cp, false});
  }
  return p;
}

// A convolution kernel over (a, w): the operands as cuDNN reads or writes them (channel-padded
// copies where channel_pad asks for them; an output's copy is written back after each run)
// and the geometry with the padded channel count.
// `a_filled`: a's padded copy, filled each step by another kernel (padded()); `a_copy` receives
// the padded copy of a where one is made.
struct ConvOperands {
  std::unique_ptr<ConvKernel> k;
  void *a = nullptr, *w = nullptr;
  ConvGeom g;
  std::shared_ptr<DeviceBuffer> a_copy;
};
ConvOperands conv_operands(bool pad_channels, int stream, const std::string& what,
                           const ConvGeom& g, DType dt, void* a, bool a_out, DType wdt, void* w,
                           bool w_out, std::shared_ptr<DeviceBuffer> a_filled = nullptr) {
  const ChannelPad pad = channel_pad(pad_channels, dt, g.x.c);
  ConvOperands o;
  o.k = std::make_unique<ConvKernel>(stream, what);
  o.a = padded(*o.k, pad, a, dt, g.x_rows(), a_out, std::move(a_filled), &o.a_copy);
  o.w = padded(*o.k, pad, w, wdt, g.w_rows(), w_out);
  o.g = g.with_channels(pad.on ? pad.cp : g.x.c);
  return o;
}

// The plan's workspace reserved on the stream, and the kernel set to run it over (a, w, b).
void use_plan(ConvOperands& o, Context& ctx, int stream, std::shared_ptr<ConvPlan> plan, void* b) {
  ctx.need_workspace(stream, static_cast<size_t>(plan->workspace));
  o.k->set_plan(plan, o.a, o.w, b);
}

std::string describe(const Node& n) {
  return std::string(op_name(n.op)) + " node '" + n.label + "'";
}

// A cuDNN convolution kernel, build(pad), padded as KILN_PAD_CHANNELS says: 1 pads and 0 does
// not; auto keeps the faster of the two forms (the padding copies included), timed while
// compiling where cuDNN's engines are (autotuning, `kiln tune`) and kept with them, or found
// in the engine table or the autotune cache. Without timing (KILN_AUTOTUNE=0, or
// KILN_DETERMINISTIC) only the engine table decides, so that such a run does not depend on
// what its process timed before; else unpadded. Both forms are built either way: a program
// then builds the same convolution graphs with autotuning on or off. `pass` names the
// convolution's direction in the choice's key.
KernelPtr padded_as_switched(const Node& n, Context& ctx, int stream, const char* pass,
                             const ConvGeom& g, DType dt,
                             const std::function<KernelPtr(bool pad)>& build) {
  if (!paddable(dt, g.x.c) || ctx.opts.pad_channels == Auto::off) return build(false);
  if (ctx.opts.pad_channels == Auto::on) {
    ++ctx.convs_padded;
    return build(true);
  }
  KernelPtr plain = build(false), pad = build(true);
  const std::string key = timed_form_key(pass, g, dt, "", "padv1");
  FormChoice c;
  if (ctx.opts.autotune || !ctx.opts.tune_path.empty()) {
    c = choose_faster_form(ctx, stream, key, {"padded", {pad.get()}}, {"unpadded", {plain.get()}},
                           {}, true);
  } else if (const EngineEntry* e = ctx.opts.engine_table ? ctx.engine_table.find(key) : nullptr) {
    c = form_choice_from(*e, "padded", "unpadded");
  }
  if (c.found) ++ctx.pad_timed;
  log_debug(describe(n), " (", pass, "): ", g.x.c, " channels padded to ",
            padded_channel_count(g.x.c), " ", c.first_ms, " ms, unpadded ", c.second_ms, " ms (",
            !c.found         ? "not timed: autotuning is off"
            : c.measured_now ? "timed now"
                             : "timed before",
            "): keeps ", c.found && c.first ? "the padded form" : "the unpadded form");
  if (!(c.found && c.first)) return plain;
  ++ctx.convs_padded;
  return pad;
}

void expect_weight_dtype(const Context& ctx, const Node& n, TensorId feature, TensorId w) {
  // AMP: f16 features with f16 compute weights; FP32: both f32.
  expect_same_dtype(ctx, n, feature, w);
}

}  // namespace

namespace {

// A padded forward's other form (KILN_FIXED_CHANNELS_CONV): the same padding copies, then
// CUTLASS's fixed-channels implicit GEMM in place of cuDNN's plan, where it can take the layer
// and is the faster of the two (timed as the padding's choice is, kept under its own key);
// `o` becomes that form where it is.
void fixed_channels_instead(const Node& n, Context& ctx, int stream, const ConvGeom& g, DType dt,
                            DType wdt, TensorId x, TensorId w, TensorId b, TensorId y,
                            ConvOperands& o) {
  if (ctx.opts.fixed_channels_conv == Auto::off) return;
  ConvOperands f =
      conv_operands(true, stream, describe(n), g, dt, ctx.ptr(x), false, wdt, ctx.ptr(w), false);
  std::string why;
  auto run = fixed_channels_fwd(ctx, f.g, dt, f.a, f.w, ctx.ptr(y), &why);
  if (!run) {
    log_debug(describe(n), ": the padded forward keeps cuDNN; the fixed-channels CUTLASS unit ",
              why);
    return;
  }
  f.k->set_runner(std::move(run));
  if (b != kNoTensor) {
    f.k->set_bias_add(ctx.ptr(y), dt, ctx.ptr<float>(b), g.y.n * g.y.h * g.y.w, g.k);
  }
  const std::string key = timed_form_key("fprop", f.g, dt, "", "fixedv1");
  FormChoice c;
  if (ctx.opts.fixed_channels_conv == Auto::on) {
    c.found = c.first = true;
  } else if (ctx.opts.autotune || !ctx.opts.tune_path.empty()) {
    c = choose_faster_form(ctx, stream, key, {"cutlass", {f.k.get()}}, {"cudnn", {o.k.get()}}, {},
                           true);
  } else if (const EngineEntry* e = ctx.opts.engine_table ? ctx.engine_table.find(key) : nullptr) {
    c = form_choice_from(*e, "cutlass", "cudnn");
  }
  log_debug(describe(n), " (fprop, ", f.g.x.c, " channels): fixed-channels CUTLASS ", c.first_ms,
            " ms, cuDNN ", c.second_ms, " ms: keeps ", c.found && c.first ? "CUTLASS" : "cuDNN");
  if (!(c.found && c.first)) return;
  ++ctx.fixed_channels_convs;
  o = std::move(f);
}

// conv_fwd node n on cuDNN.
KernelPtr cudnn_conv_fwd(const Node& n, Context& ctx, int stream) {
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), b = in_at(n, 2),
                 y = need_out(n, 0, "y");
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, y);
  expect_weight_dtype(ctx, n, x, w);
  const ConvGeom g = conv_geom(ctx, n, x, w, y);
  const DType wdt = ctx.tensor(w).dtype;
  if (b != kNoTensor) {
    expect_dtype(ctx, n, b, DType::F32, "bias");
    expect_numel(ctx, n, b, g.k, "bias");
  }
  // The padded form's copy of x, for a weight gradient of x to read (KILN_PAD_INPUT_ONCE): held
  // weakly, so that it lives only while the padded form does (is kept, and so fills it).
  std::shared_ptr<DeviceBuffer> x_copy;
  KernelPtr k = padded_as_switched(n, ctx, stream, "fprop", g, dt, [&](bool pad) -> KernelPtr {
    ConvOperands o =
        conv_operands(pad, stream, describe(n), g, dt, ctx.ptr(x), false, wdt, ctx.ptr(w), false);
    use_plan(o, ctx, stream,
             build_plan(ctx, n, stream, ConvKind::fprop, o.g, dt, wdt, dt, {o.a, o.w, ctx.ptr(y)}),
             ctx.ptr(y));
    if (b != kNoTensor) {
      o.k->set_bias_add(ctx.ptr(y), dt, ctx.ptr<float>(b), g.y.n * g.y.h * g.y.w, g.k);
    }
    if (pad) fixed_channels_instead(n, ctx, stream, g, dt, wdt, x, w, b, y, o);
    if (o.a_copy) x_copy = o.a_copy;
    return std::move(o.k);
  });
  if (x_copy && ctx.opts.pad_input_once) ctx.padded_inputs[x] = x_copy;
  return k;
}

}  // namespace

// "x, w, [b] -> y"
KernelPtr make_conv_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  auto cudnn = [&] { return cudnn_conv_fwd(n, ctx, stream); };
  if (KernelPtr summed = make_conv_fwd_summed_for_bn(n, ctx, stream, cudnn)) return summed;
  return cudnn();
}

namespace {

// conv_bwd_data node n on cuDNN.
KernelPtr cudnn_conv_bwd_data(const Node& n, Context& ctx, int stream) {
  const TensorId dy = need_in(n, 0, "dy"), w = need_in(n, 1, "w"), dx = need_out(n, 0, "dx");
  const DType dt = ctx.tensor(dy).dtype;
  const ConvGeom g = conv_geom(ctx, n, dx, w, dy);
  const DType wdt = ctx.tensor(w).dtype;
  return padded_as_switched(n, ctx, stream, "dgrad", g, dt, [&](bool pad) -> KernelPtr {
    ConvOperands o =
        conv_operands(pad, stream, describe(n), g, dt, ctx.ptr(dx), true, wdt, ctx.ptr(w), false);
    use_plan(o, ctx, stream,
             build_plan(ctx, n, stream, ConvKind::dgrad, o.g, dt, wdt, dt, {o.a, o.w, ctx.ptr(dy)}),
             ctx.ptr(dy));
    return std::move(o.k);
  });
}

}  // namespace

// "dy, w -> dx"
KernelPtr make_conv_bwd_data(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), w = need_in(n, 1, "w"), dx = need_out(n, 0, "dx");
  expect_float(ctx, n, dy, "dy");
  expect_same_dtype(ctx, n, dy, dx);
  expect_weight_dtype(ctx, n, dy, w);
  // A bottleneck's conv3 before conv2's CBR backward, with KILN_CUTLASS_DGRAD: the SM90 data
  // gradient that also takes that BatchNorm backward's sums (cutlass_dgrad.cpp).
  auto cudnn = [&] { return cudnn_conv_bwd_data(n, ctx, stream); };
  if (KernelPtr fused = make_dgrad_for_bn(n, ctx, stream, dy, w, dx, cudnn)) return fused;
  return cudnn();
}

// "x, dy -> dw, [db]": dw in the weight gradient's dtype (f16 under AMP, cast to f32 by the
// grad_cast phase); db f32.
KernelPtr make_conv_bwd_weight(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), dw = need_out(n, 0, "dw"),
                 db = out_at(n, 1);
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, dy);
  const DType wdt = expect_float(ctx, n, dw, "dw");
  const ConvGeom g = conv_geom(ctx, n, x, dw, dy);
  const int64_t rows = g.y.n * g.y.h * g.y.w;
  if (db != kNoTensor) {
    expect_dtype(ctx, n, db, DType::F32, "db");
    expect_numel(ctx, n, db, g.k, "db");
    ctx.need_workspace(stream, channel_sum_workspace(rows, g.k, ctx.sm_count));
  }
  // x's padded copy, where a forward kept on the padded form fills it each step before this
  // runs (the forward of x comes first in every step): one pad copy a step instead of two.
  const std::shared_ptr<DeviceBuffer> x_filled = padded_copy_of(ctx, x);
  const Kernel* padded_wgrad = nullptr;
  KernelPtr k = padded_as_switched(n, ctx, stream, "wgrad", g, dt, [&](bool pad) -> KernelPtr {
    ConvOperands o = conv_operands(pad, stream, describe(n), g, dt, ctx.ptr(x), false, wdt,
                                   ctx.ptr(dw), true, pad ? x_filled : nullptr);
    use_plan(o, ctx, stream,
             build_plan(ctx, n, stream, ConvKind::wgrad, o.g, dt, wdt, dt, {o.a, o.w, ctx.ptr(dy)}),
             ctx.ptr(dy));
    if (db != kNoTensor) o.k->set_bias_grad(ctx.ptr(dy), dt, ctx.ptr<float>(db), rows, g.k);
    if (pad && x_filled) padded_wgrad = o.k.get();
    return std::move(o.k);
  });
  // A first layer's weight gradient on the direct kernel (KILN_FIRST_LAYER_WGRAD): 1 takes it
  // wherever it can, auto keeps the faster of it and cuDNN's form above (timed per layer).
  KernelPtr direct;
  if (ctx.opts.first_layer_wgrad != Auto::off && db == kNoTensor)
    direct = make_first_layer_wgrad(n, ctx, stream, x, dy, dw, x_filled);
  bool take_direct = direct && ctx.opts.first_layer_wgrad == Auto::on;
  if (direct && !take_direct) {
    const FormChoice c = choose_faster_form(
        ctx, stream, timed_form_key(op_name(n.op), g, dt, "", "flwgv2"), {"direct", {direct.get()}},
        {"usual", {k.get()}}, {}, ctx.opts.autotune || !ctx.opts.tune_path.empty());
    log_debug(describe(n), ": the first layer's direct weight gradient ", c.first_ms,
              " ms, cuDNN's ", c.second_ms, " ms: keeps ",
              c.found && c.first ? "the direct one" : "cuDNN's");
    take_direct = c.found && c.first;
  }
  if (take_direct) {
    ++ctx.first_layer_wgrads;
    if (x_filled && g.x.c != kFirstLayerChannels) ++ctx.pad_copies_shared;
    return direct;
  }
  if (padded_wgrad && k.get() == padded_wgrad) ++ctx.pad_copies_shared;
  return k;
}

// cbr_fwd's convolution in the MLPerf-style form (KILN_CBR_FORM=genstats): one cuDNN graph,
// conv_fprop whose output z is also reduced per channel by genstats into sums[0, K) (the sum)
// and sums[K, 2K) (the sum of squares), FP32, so BatchNorm needs no statistics pass over z.
// nullptr, with one log line, when cuDNN has no engine for this graph here: the caller falls
// back to the plain convolution and kiln's statistics pass.
KernelPtr make_conv_fwd_genstats(const Node& n, Context& ctx, int stream, TensorId x, TensorId w,
                                 TensorId z, float* sums) {
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, z);
  expect_weight_dtype(ctx, n, x, w);
  const ConvGeom g = conv_geom(ctx, n, x, w, z);
  const DType wdt = ctx.tensor(w).dtype;
  // KILN_PAD_CHANNELS=auto leaves this opt-in form unpadded (its fallback is timed instead).
  ConvOperands o =
      conv_operands(ctx.opts.pad_channels == Auto::on, stream, describe(n) + " (conv+genstats)", g,
                    dt, ctx.ptr(x), false, wdt, ctx.ptr(w), false);
  std::shared_ptr<ConvPlan> plan;
  try {
    plan = build_plan(ctx, n, stream, ConvKind::fprop_genstats, o.g, dt, wdt, dt,
                      {o.a, o.w, ctx.ptr(z), sums});
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Backend) throw;
    log_info(
        describe(n),
        ": no cuDNN engine for conv+genstats here, so the convolution and kiln's statistics pass ",
        "run apart (", e.what(), ")");
    return nullptr;
  }
  ctx.need_workspace(stream, static_cast<size_t>(plan->workspace));
  o.k->set_plan(plan, o.a, o.w, ctx.ptr(z), sums, sums + g.k);
  return std::move(o.k);
}

}  // namespace kiln::cuda
