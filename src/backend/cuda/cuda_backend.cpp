// CudaBackend: one cudaMalloc per region at prepare() (zero-filled), every node prepared
// there (cuDNN graphs, cuBLASLt algorithms, launch geometry), per-stream handles and
// workspaces; nothing allocated afterwards. run() enqueues each phase on its stream (compute,
// update, transfer), joined by events where consecutive phases change streams, and returns
// without waiting: the caller's one read() per step is the only host synchronisation.
//
// CUDA Graphs: a phase's first run is launched node by node (it loads modules and lets the
// libraries finish their lazy set-up); its second run is captured once and every later run
// replays the graph. KILN_CUDA_GRAPHS=0 keeps the node-by-node launches, KILN_STREAMS=1 puts
// every phase on one stream, KILN_TF32=1 allows TF32, KILN_PROFILE=1 times every phase.
//
#include "backend/cuda/cuda_backend.h"

#include <cuda_profiler_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <utility>

#include "backend/cuda/cuda_kernel.h"
#include "backend/cuda/fused_kernels.h"
#include "backend/cuda/graph_capture.h"
#include "backend/cuda/input_slots.h"
#include "backend/cuda/side_stream.h"
#include "backend/sm90_conv_rule.h"
#include "kiln/core/log.h"

namespace kiln {

namespace cuda {
namespace {

using Factory = KernelPtr (*)(const Node&, Context&, int);
constexpr Factory kFactories[] = {
#define KILN_OP(name, category, doc) &make_##name,
#include "kiln/graph/ops.def"
#undef KILN_OP
};
static_assert(sizeof(kFactories) / sizeof(kFactories[0]) == kOpCount,
              "every op of ops.def needs a CUDA factory");

struct PhaseExec {
  std::string name;
  PhaseKind kind = PhaseKind::forward_backward;
  int stream = 0;
  std::array<bool, 2> reads_slot{false, false};  // reads staged input A / B
  std::vector<KernelPtr> kernels;
  std::vector<OpKind> ops;  // per kernel, for the per-op profile
  // Per kernel, the bytes its node reads and writes: where side-stream work must join back.
  std::vector<std::vector<ByteRange>> node_reads, node_writes;
  std::vector<cudaEvent_t>
      node_events;  // KILN_PROFILE_OPS=1: one before each node, one after the last
  GraphExec graph;
  int runs = 0;
  cudaEvent_t done = nullptr;              // joins
  cudaEvent_t t0 = nullptr, t1 = nullptr;  // profiling
};

class CudaBackend final : public CudaBackendApi {
 public:
  explicit CudaBackend(const Switches& switches) {
    ctx_.opts = options_from_switches(switches);
    env_tf32_ = ctx_.opts.tf32;
    profile_ = ctx_.opts.profile;
    profile_ops_ = ctx_.opts.profile_ops;
  }
  ~CudaBackend() override { release(); }

  const char* name() const override { return "cuda"; }
  BackendCaps caps() const override {
    BackendCaps c;
    cudaDeviceProp prop{};
    c.device = cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? prop.name : "cuda";
    c.fp16 = true;
    // Fused CBR and BN+add+ReLU (fused.cpp), in FP32 too by default: the same bits as the
    // unfused chain (GpuFusedStep.*Fp32), and faster (bench/RESULTS.md).
    c.fused_cbr = c.fused_cbr_pool = c.fused_bn_add_relu = c.fused_fp32 = c.fp32_fusion_default =
        true;
    // ResNet's stem pool (3x3 / 2, padding 1) in BatchNorm's passes (bn.cu's overlapping form);
    // Engine leaves it to KILN_FUSE_OVERLAPPING_POOL.
    c.fused_overlapping_pool = true;
    // A downsampling shortcut's BatchNorm applied inside BN+add+ReLU's apply pass (bn.cu); Engine
    // leaves it to KILN_FUSE_RESIDUAL_BN.
    c.fused_residual_bn = true;
    // The gradient-sum fusion (bn_add_relu_bwd's dy2), faster too (bench/RESULTS.md); Engine
    // turns it off with KILN_FUSE_GRAD_SUM=0.
    c.fused_grad_sum = true;
    return c;
  }
  bool supports(OpKind op, DType feature_dtype) const override {
    return cuda_supports(op, feature_dtype);
  }

  void prepare(const Program& program) override {
    KILN_CHECK(program.memory.locked, State, "cuda backend: prepare() needs a locked memory plan; ",
               "run plan_memory (the lifecycle's MEMORY_LOCKED step) first");
    KILN_CHECK(program.feature_dtype == DType::F32 || program.feature_dtype == DType::F16,
               Unsupported, "cuda backend: features in ", dtype_name(program.feature_dtype),
               " are not supported yet; use ", "--amp (FP16) or FP32");
    release();
    ctx_.program = &program;
    ctx_.opts.tf32 = env_tf32_ || program.options.tf32;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    ctx_.sm_count = prop.multiProcessorCount;
    ctx_.cc_major = prop.major, ctx_.cc_minor = prop.minor;
    const Options& o = ctx_.opts;
    const Sm90Forms forms =
        sm90_forms({o.cutlass, o.cutlass_dgrad, o.cutlass_conv, o.cutlass_conv_dgrad,
                    o.cutlass_timed, o.deterministic},
                   cutlass_kernels_built(), prop.major, prop.minor, program.feature_dtype);
    ctx_.cutlass = forms.gemm, ctx_.cutlass_timed = forms.gemm_timed;
    ctx_.cutlass_dgrad = forms.dgrad, ctx_.cutlass_dgrad_timed = forms.dgrad_timed;
    ctx_.cutlass_conv = forms.conv, ctx_.cutlass_conv_timed = forms.conv_timed;
    ctx_.cutlass_conv_dgrad = forms.conv_dgrad;
    ctx_.cutlass_conv_dgrad_timed = forms.conv_dgrad_timed;
    if (ctx_.opts.cutlass == Auto::automatic && !ctx_.cutlass) {
      log_debug("KILN_CUTLASS=auto: every convolution keeps cuDNN (the SM90 CUTLASS GEMM ",
                cutlass_kernels_built() ? "is built" : "is not built", ", compute capability ",
                prop.major, ".", prop.minor, ", features ", dtype_name(program.feature_dtype), ")");
    }
    create_streams();
    for (int r = 0; r < kRegionCount; ++r) {
      const int64_t bytes = program.memory.region_bytes[static_cast<size_t>(r)];
      if (bytes == 0) continue;
      const auto& [shared, shared_bytes] = shared_[static_cast<size_t>(r)];
      if (shared) {  // another engine's weights: neither allocated nor zeroed here
        KILN_CHECK(bytes <= shared_bytes, Internal, "cuda backend: region ",
                   region_name(static_cast<Region>(r)), " needs ", bytes,
                   " bytes, the shared one has ", shared_bytes);
        ctx_.base[static_cast<size_t>(r)] = shared;
        continue;
      }
      const auto size = static_cast<size_t>(align_up(bytes, kAlignment));
      void* p = nullptr;
      CUDA_CHECK(cudaMalloc(&p, size));
      ctx_.base[static_cast<size_t>(r)] = static_cast<uint8_t*>(p);
      CUDA_CHECK(cudaMemset(p, 0, size));
    }
    set_workspace_cap();
    // Per-node profiling times nodes with events on their own stream: everything stays there.
    ctx_.side_wgrad = ctx_.opts.streams && ctx_.opts.side_wgrad && !profile_ops_;
    ctx_.side_pending.clear();
    ctx_.side_wgrads = 0;
    load_engine_table(prop.name);
    build(program.train, train_);
    build(program.eval, eval_);
    build(program.eval_ema, eval_ema_);
    build(program.init, init_);
    finish_engine_table(prop.name);
    for (StreamRes& s : unique_streams()) {
      if (s.workspace_bytes > 0) CUDA_CHECK(cudaMalloc(&s.workspace, s.workspace_bytes));
    }
    share_aliases();
    slots_.allocate(program);
    CUDA_CHECK(cudaHostAlloc(&small_.host, kSmallSlots * kSmallWrite, cudaHostAllocDefault));
    for (cudaEvent_t& e : small_.done)
      CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaHostAlloc(&late_.host, kLateReadSlots * kLateReadBytes, cudaHostAllocDefault));
    for (cudaEvent_t& e : late_.done)
      CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    late_.ticket.fill(~uint64_t{0});
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  uint8_t* region_memory(Region r) const override { return ctx_.base[static_cast<size_t>(r)]; }
  void share_region(Region r, uint8_t* memory, int64_t bytes) override {
    KILN_CHECK(ctx_.program == nullptr, State, "cuda backend: share_region() after prepare()");
    KILN_CHECK(memory != nullptr, InvalidArgument, "cuda backend: share_region(", region_name(r),
               ") of no memory");
    shared_[static_cast<size_t>(r)] = {memory, bytes};
  }

  void run(Schedule schedule, int slot) override {
    KILN_CHECK(ctx_.program != nullptr, State, "cuda backend: run() before prepare()");
    KILN_CHECK(slot == 0 || slot == 1, InvalidArgument,
               "cuda backend: slot must be 0 (A) or 1 (B), is ", slot);
    std::vector<PhaseExec>* phases = nullptr;
    switch (schedule) {
      case Schedule::train:
        phases = &train_;
        break;
      case Schedule::eval:
        phases = &eval_;
        break;
      case Schedule::eval_ema:
        phases = &eval_ema_;
        break;
      case Schedule::init:
        phases = &init_;
        break;
    }
    if (profile_) collect_profile();
    last_run_.clear();
    for (PhaseExec& ph : *phases) {
      if (ph.kind == PhaseKind::transfer && ph.name != (slot == 0 ? "transfer_a" : "transfer_b"))
        continue;
      launch_phase(ph);
      last_run_.push_back(&ph);
    }
    profile_pending_ = profile_;
  }

  // Synchronous, on the compute stream after every stream has drained: a plain cudaMemcpy
  // runs on the legacy stream, which does not order with kiln's non-blocking streams (and a
  // pageable host-to-device copy may return before it lands).
  void write(const DTensor& t, const void* host) override {
    if (t.bytes() <= kSmallWrite && small_.host) {
      write_small(t, host);
      return;
    }
    synchronize();
    cudaStream_t s = ctx_.streams[0].stream;
    CUDA_CHECK(cudaMemcpyAsync(address(t), host, static_cast<size_t>(t.bytes()),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void read(const DTensor& t, void* host) override {
    synchronize();
    cudaStream_t s = ctx_.streams[0].stream;
    CUDA_CHECK(cudaMemcpyAsync(host, address(t), static_cast<size_t>(t.bytes()),
                               cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void stage_batch(int slot, const float* images, const int32_t* labels) override {
    slots_.stage_batch(slot, images, labels);
  }
  void stage_batch_u8(int slot, const uint8_t* images, const int32_t* labels,
                      const InputNormalization& norm,
                      const SampleAugment* augments = nullptr) override {
    slots_.stage_batch_u8(slot, images, labels, norm, augments);
  }
  void stage_batch_device(int slot, const DeviceBatch& b, const InputNormalization* norm) override {
    slots_.stage_batch_device(slot, b, norm);
  }
  DeviceStaging device_staging() const override { return slots_.device_staging(); }
  bool decodes_jpeg(std::string* why_not) const override { return slots_.decodes_jpeg(why_not); }
  void stage_batch_encoded(int slot, const EncodedBatch& batch,
                           const InputNormalization& norm) override {
    slots_.stage_batch_encoded(slot, batch, norm);
  }
  DecodeCounters decode_counters() const override { return slots_.decode_counters(); }

  void synchronize() override {
    for (StreamRes& s : unique_streams()) CUDA_CHECK(cudaStreamSynchronize(s.stream));
  }

  void set_profiling(bool on) override {
    if (profile_ && !on) collect_profile();
    profile_ = on;
  }

  // GPU time per phase (and, with KILN_PROFILE_OPS=1, per op kind: nodes then launch one by
  // one between events) since profiling started, largest first.
  std::string profile_report() override {
    collect_profile();
    std::string out;
    char line[256];
    for (const auto* table : {&phase_ms_, &op_ms_}) {
      if (table->empty()) continue;
      std::vector<std::pair<double, std::string>> rows;
      double total = 0;
      for (const auto& [k, ms] : *table) {
        rows.push_back({ms, k});
        total += ms;
      }
      std::sort(rows.rbegin(), rows.rend());
      std::snprintf(line, sizeof line, "cuda profile (%s): %.3f ms of GPU time over %lld runs\n",
                    table == &phase_ms_ ? "phases" : "ops", total,
                    static_cast<long long>(profiled_runs_));
      out += line;
      for (const auto& [ms, k] : rows) {
        std::snprintf(line, sizeof line, "  %-20s %10.3f ms  %5.1f%%\n", k.c_str(), ms,
                      total > 0 ? 100 * ms / total : 0.0);
        out += line;
      }
    }
    return out;
  }

  // A late read is write_small's mirror: the copy goes on the compute stream after every
  // phase and write enqueued so far, into a pinned ring slot with its own event.
  uint64_t read_later(const DTensor& t) override {
    KILN_CHECK(t.bytes() <= kLateReadBytes, InvalidArgument, "read_later: '", t.name, "' has ",
               t.bytes(), " bytes; at most ", kLateReadBytes, " (use read())");
    KILN_CHECK(late_.host != nullptr, State, "cuda backend: read_later() before prepare()");
    const uint64_t ticket = late_.next++;
    const size_t i = ticket % kLateReadSlots;
    CUDA_CHECK(cudaEventSynchronize(late_.done[i]));  // the slot's previous copy
    late_.ticket[i] = ticket;
    late_.bytes[i] = static_cast<size_t>(t.bytes());
    cudaStream_t s = ctx_.streams[0].stream;
    if (last_done_ && last_stream_ != 0) CUDA_CHECK(cudaStreamWaitEvent(s, last_done_, 0));
    CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(late_.host) + i * kLateReadBytes, address(t),
                               late_.bytes[i], cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaEventRecord(late_.done[i], s));
    last_done_ = late_.done[i];
    last_stream_ = 0;
    return ticket;
  }
  void collect(uint64_t ticket, void* host) override {
    const size_t i = ticket % kLateReadSlots;
    KILN_CHECK(ticket < late_.next && late_.ticket[i] == ticket, InvalidArgument,
               "collect: ticket ", ticket,
               " was never issued, is collected, or was overwritten by ", kLateReadSlots,
               " newer reads");
    CUDA_CHECK(cudaEventSynchronize(late_.done[i]));
    std::memcpy(host, static_cast<uint8_t*>(late_.host) + i * kLateReadBytes, late_.bytes[i]);
    late_.ticket[i] = ~uint64_t{0};
  }

  // A small write (a scalar: the learning rate, the step counter) does not stop the device:
  // the value goes through a pinned ring slot and is copied on the compute stream after every
  // phase enqueued so far, and before any phase enqueued later. To the caller it behaves as
  // a synchronous write (the host buffer may be reused at once; run() and read() see it).
  void write_small(const DTensor& t, const void* host) {
    const size_t i = small_.next++ % kSmallSlots;
    CUDA_CHECK(cudaEventSynchronize(small_.done[i]));  // the slot's previous copy (long done)
    uint8_t* slot = static_cast<uint8_t*>(small_.host) + i * kSmallWrite;
    std::memcpy(slot, host, static_cast<size_t>(t.bytes()));
    cudaStream_t s = ctx_.streams[0].stream;
    if (last_done_ && last_stream_ != 0) CUDA_CHECK(cudaStreamWaitEvent(s, last_done_, 0));
    CUDA_CHECK(cudaMemcpyAsync(address(t), slot, static_cast<size_t>(t.bytes()),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(small_.done[i], s));
    last_done_ = small_.done[i];
    last_stream_ = 0;
  }

  std::vector<std::pair<std::string, float>> phase_times() override {
    std::vector<std::pair<std::string, float>> out;
    if (!profile_) return out;
    for (PhaseExec* ph : last_run_) {
      if (!ph->t0) continue;
      CUDA_CHECK(cudaEventSynchronize(ph->t1));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ph->t0, ph->t1));
      out.emplace_back(ph->name, ms);
    }
    return out;
  }

 private:
  static constexpr int64_t kSmallWrite = 64;
  static constexpr size_t kSmallSlots = 64;
  struct LateReads {
    void* host = nullptr;  // kLateReadSlots pinned slots of kLateReadBytes
    std::array<cudaEvent_t, kLateReadSlots> done{};
    std::array<uint64_t, kLateReadSlots> ticket{};
    std::array<size_t, kLateReadSlots> bytes{};
    uint64_t next = 0;
  };
  bool env_tf32_ = false;  // Switches::tf32; a program's CompileOptions::tf32 also allows it
  struct SmallWrites {
    void* host = nullptr;
    std::array<cudaEvent_t, kSmallSlots> done{};
    size_t next = 0;
  };

  bool has_profiler_range() const override { return true; }
  void profiler_range(bool on) override {
    synchronize();  // the range holds exactly the work enqueued inside it
    if (on) {
      CUDA_CHECK(cudaProfilerStart());
    } else {
      CUDA_CHECK(cudaProfilerStop());
    }
  }
  CbrForms cbr_forms() const override {
    return {ctx_.cbr_genstats, ctx_.cbr_genstats_fallbacks, ctx_.cbr_cutlass,
            ctx_.cbr_cutlass_fallbacks};
  }
  int side_stream_wgrads() const override { return ctx_.side_wgrads; }
  int fp32_transformed_plans() const override { return ctx_.fp32_transformed; }
  EngineTableUse engine_table_use() const override {
    return {ctx_.table_hits, ctx_.table_misses, ctx_.autotuned, ctx_.autotune_remembered,
            ctx_.opts.tune_path.empty() ? table_path_ : tune_path()};
  }
  CompileReport compile_report() const override {
    const EngineTableUse use = engine_table_use();
    CompileReport r;
    r.chooses_engines = true;
    r.from_table = use.from_table, r.heuristics = use.heuristics, r.autotuned = use.autotuned;
    r.remembered = use.remembered, r.table = use.table;
    r.cbr_genstats = ctx_.cbr_genstats, r.cbr_fallbacks = ctx_.cbr_genstats_fallbacks;
    r.cbr_cutlass = ctx_.cbr_cutlass, r.cbr_cutlass_fallbacks = ctx_.cbr_cutlass_fallbacks;
    r.cbr_cutlass_conv = ctx_.cbr_cutlass_conv;
    r.conv_cutlass = ctx_.conv_cutlass, r.conv_cutlass_fallbacks = ctx_.conv_cutlass_fallbacks;
    r.dgrad_cutlass = ctx_.dgrad_cutlass, r.dgrad_cutlass_fallbacks = ctx_.dgrad_cutlass_fallbacks;
    r.dgrad_cutlass_conv = ctx_.dgrad_cutlass_conv, r.dgrad_cutlass_wide = ctx_.dgrad_cutlass_wide;
    r.dgrad_cutlass_pingpong = ctx_.dgrad_cutlass_pingpong;
    r.sm90_timed = ctx_.sm90_timed, r.sm90_timed_today = ctx_.sm90_timed_today;
    r.sm90_timed_now = ctx_.sm90_timed_now;
    r.convs_padded = ctx_.convs_padded, r.pad_timed = ctx_.pad_timed;
    r.pad_copies_shared = ctx_.pad_copies_shared;
    r.fixed_channels_convs = ctx_.fixed_channels_convs;
    r.first_layer_convs = ctx_.first_layer_convs;
    r.first_layer_wgrads = ctx_.first_layer_wgrads;
    r.first_layer_bn_folds = ctx_.first_layer_bn_folds;
    r.side_stream_wgrads = ctx_.side_wgrads;
    r.residual_bn_sums_in_dx = ctx_.residual_bn_sums_in_dx;
    r.fp32_transformed_plans = ctx_.fp32_transformed;
    return r;
  }
  std::string tune_path() const {
    if (ctx_.opts.tune_path != "auto") return ctx_.opts.tune_path;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    return engine_table_file(table_dir(), prop.name, static_cast<int64_t>(cudnnGetVersion()));
  }

  static std::string table_dir() {
    return engine_table_dir(KILN_ENGINE_TABLE_DIR,
                            installed_engine_table_dir(KILN_ENGINES_FROM_LIB));
  }

  // Each stream's workspace is the largest any of its nodes asks for, and the streams do not
  // share one: an engine may take an eighth of what is free after the regions (at least
  // 256 MiB, at most 16 GiB), which leaves room for the workspaces of every stream, the
  // pinned buffers, cuBLASLt, NCCL and tuning's temporary workspaces.
  void set_workspace_cap() {
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const int64_t mib = int64_t{1} << 20;
    ctx_.workspace_cap = std::clamp(static_cast<int64_t>(free / 8), 256 * mib, 16384 * mib);
    log_debug("convolution workspace cap ", ctx_.workspace_cap / mib, " MiB (", free / mib,
              " MiB free of ", total / mib, ")");
  }

  // The experience table for this GPU and cuDNN version (see engine_table.h).
  void load_engine_table(const std::string& gpu) {
    ctx_.engine_table = EngineTable{};
    ctx_.tuned = EngineTable{};
    ctx_.table_hits = ctx_.table_misses = ctx_.autotuned = ctx_.autotune_remembered = 0;
    ctx_.plan_seconds = ctx_.autotune_seconds = 0;
    ctx_.autotune_report_at = kAutotuneReportSeconds;
    ctx_.cbr_genstats = ctx_.cbr_genstats_fallbacks = 0;
    ctx_.cbr_cutlass = ctx_.cbr_cutlass_fallbacks = ctx_.cbr_cutlass_conv = 0;
    ctx_.conv_cutlass = ctx_.conv_cutlass_fallbacks = 0;
    ctx_.bn_add_relu_sums.clear();
    ctx_.bn_add_relu_residual_sums.clear();
    ctx_.dgrad_cutlass = ctx_.dgrad_cutlass_fallbacks = ctx_.dgrad_cutlass_conv = 0;
    ctx_.dgrad_cutlass_wide = ctx_.dgrad_cutlass_pingpong = 0;
    ctx_.sm90_timed = ctx_.sm90_timed_today = ctx_.sm90_timed_now = 0;
    ctx_.convs_padded = ctx_.pad_timed = ctx_.pad_copies_shared = ctx_.fixed_channels_convs = 0;
    ctx_.first_layer_convs = ctx_.first_layer_wgrads = ctx_.first_layer_bn_folds = 0;
    ctx_.padded_inputs.clear();
    ctx_.dgrad_bn_sums.clear();
    ctx_.residual_bn_partials.clear();
    ctx_.residual_bn_sums_in_dx = 0;
    ctx_.extra_bytes.clear();
    ctx_.fp32_transformed = 0;
    table_path_.clear();
    if (const std::string cache = autotune_cache_file(gpu); !cache.empty()) {
      autotune_cache_load(cache, gpu, static_cast<int64_t>(cudnnGetVersion()));
    }
    if (!ctx_.opts.engine_table || !ctx_.opts.tune_path.empty()) return;
    const auto cudnn = static_cast<int64_t>(cudnnGetVersion());
    std::string path = ctx_.opts.engine_table_path;
    if (path.empty()) {
      path = engine_table_file(table_dir(), gpu, cudnn);
      if (!std::ifstream(path).good()) {
        log_info("engine table: none for ", gpu, " with cuDNN ", cudnn, " (", path,
                 "); convolutions take cuDNN's heuristic choice. `kiln tune` writes one.");
        return;
      }
    }
    ctx_.engine_table = EngineTable::load(path);
    if (ctx_.engine_table.gpu != gpu || ctx_.engine_table.cudnn != cudnn) {
      log_warn("engine table ", path, " was tuned on ", ctx_.engine_table.gpu, " with cuDNN ",
               ctx_.engine_table.cudnn, ", this is ", gpu, " with cuDNN ", cudnn,
               "; its engines are tried anyway (each falls back to the heuristics if it does not "
               "build)");
    }
    table_path_ = path;
  }
  void finish_engine_table(const std::string& gpu) {
    const int plans = ctx_.table_hits + ctx_.table_misses + ctx_.autotuned;
    if (!ctx_.opts.tune_path.empty()) {
      // Merge into what the file holds (other models' shapes), newest measurement winning.
      const std::string path = tune_path();
      EngineTable merged;
      if (std::ifstream(path).good()) merged = EngineTable::load(path);
      merged.gpu = gpu;
      merged.cudnn = static_cast<int64_t>(cudnnGetVersion());
      merged.merge(ctx_.tuned);
      merged.save(path);
      log_info("engine table: tuned ", ctx_.tuned.entries().size(), " convolution graphs into ",
               path, " (", merged.entries().size(), " entries in all)");
    } else if (!table_path_.empty()) {
      log_info("engine table: ", ctx_.table_hits, " of ", plans, " convolution plans from ",
               table_path_);
    }
    if (ctx_.autotuned > 0) {
      log_info("autotune: ", ctx_.autotuned, " of ", plans,
               " convolution plans chosen by timing a few engines",
               " (KILN_AUTOTUNE=0: cuDNN's heuristic choice)");
    }
    log_info("convolution plans: ", plans, " built in ", ctx_.plan_seconds, " s, ",
             ctx_.autotune_seconds, " s of it autotuning");
    if (const std::string cache = autotune_cache_file(gpu); !cache.empty()) {
      autotune_cache_save(cache, gpu, static_cast<int64_t>(cudnnGetVersion()));
    }
  }
  // The autotune cache's file for this GPU and cuDNN; empty when autotuning or its cache is
  // off, or while `kiln tune` measures every engine instead.
  std::string autotune_cache_file(const std::string& gpu) const {
    if (!ctx_.opts.autotune || ctx_.opts.autotune_cache.empty() || !ctx_.opts.tune_path.empty())
      return "";
    return engine_table_file(ctx_.opts.autotune_cache, gpu,
                             static_cast<int64_t>(cudnnGetVersion()));
  }

  int stream_of(const Phase& ph) const {
    if (!ctx_.opts.streams) return 0;
    return ph.stream >= 0 && ph.stream < kStreams ? ph.stream : 0;
  }

  void create_streams() {
    const int n = ctx_.opts.streams ? kStreams : 1;
    for (int i = 0; i < n; ++i) {
      StreamRes& s = ctx_.streams[static_cast<size_t>(i)];
      CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
      CUDNN_CHECK(cudnnCreate(&s.cudnn));
      CUDNN_CHECK(cudnnSetStream(s.cudnn, s.stream));
      CUBLAS_CHECK(cublasLtCreate(&s.lt));
    }
    owned_streams_ = n;
    share_aliases();
  }
  // With one stream, indices 1 and 2 alias stream 0 (its handles and workspace too).
  void share_aliases() {
    for (int i = owned_streams_; i < kStreams; ++i)
      ctx_.streams[static_cast<size_t>(i)] = ctx_.streams[0];
  }
  std::vector<std::reference_wrapper<StreamRes>> unique_streams() {
    std::vector<std::reference_wrapper<StreamRes>> v;
    for (int i = 0; i < owned_streams_; ++i) v.emplace_back(ctx_.streams[static_cast<size_t>(i)]);
    return v;
  }

  void build(const std::vector<Phase>& phases, std::vector<PhaseExec>& out) {
    out.clear();
    out.reserve(phases.size());
    ctx_.padded_inputs.clear();  // a forward's padded copy serves its own schedule's wgrads
    for (const Phase& ph : phases) {
      PhaseExec& e = out.emplace_back();
      e.name = ph.name;
      e.kind = ph.kind;
      e.stream = stream_of(ph);
      for (const Node& n : ph.nodes) {
        KILN_CHECK(cuda_supports(n.op, ctx_.program->feature_dtype), Unsupported,
                   "the CUDA backend has no kernel for ", op_name(n.op), " (node '", n.label,
                   "'); turn fusion off (KILN_FUSION=0)");
        for (TensorId id : n.in) note_slot_read(e, id);
        auto make = [&](int stream) { return kFactories[static_cast<int>(n.op)](n, ctx_, stream); };
        e.kernels.push_back(n.op == OpKind::conv_bwd_weight
                                ? maybe_on_side_stream(ctx_, e.stream, n.in, n.out, make)
                                : make(e.stream));
        e.ops.push_back(n.op);
        e.node_reads.push_back(byte_ranges(ctx_, n.in));
        e.node_writes.push_back(byte_ranges(ctx_, n.out));
        if (const auto extra = ctx_.extra_bytes.find(&n); extra != ctx_.extra_bytes.end()) {
          const auto& [reads, writes] = extra->second;
          e.node_reads.back().insert(e.node_reads.back().end(), reads.begin(), reads.end());
          e.node_writes.back().insert(e.node_writes.back().end(), writes.begin(), writes.end());
        }
      }
      if (profile_ops_) {
        e.node_events.resize(e.kernels.size() + 1);
        for (cudaEvent_t& ev : e.node_events) CUDA_CHECK(cudaEventCreate(&ev));
      }
      CUDA_CHECK(cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreate(&e.t0));
      CUDA_CHECK(cudaEventCreate(&e.t1));
    }
  }
  void note_slot_read(PhaseExec& e, TensorId id) {
    if (id == kNoTensor) return;
    const Region r = ctx_.program->storage(id).region;
    if (r == Region::input_a) e.reads_slot[0] = true;
    if (r == Region::input_b) e.reads_slot[1] = true;
  }

  void launch_phase(PhaseExec& ph) {
    cudaStream_t s = ctx_.streams[static_cast<size_t>(ph.stream)].stream;
    // Join: wait for the phase enqueued before this one when it ran on another stream (the
    // schedule's order is the order of the CPU executor; same-stream order is implicit).
    if (last_done_ && last_stream_ != ph.stream) CUDA_CHECK(cudaStreamWaitEvent(s, last_done_, 0));
    slots_.wait_for_copies(s, ph.reads_slot);
    if (profile_) CUDA_CHECK(cudaEventRecord(ph.t0, s));
    if (!ph.kernels.empty()) {
      if (profile_ && !ph.node_events.empty()) {
        for (size_t i = 0; i < ph.kernels.size(); ++i) {
          CUDA_CHECK(cudaEventRecord(ph.node_events[i], s));
          ph.kernels[i]->run(ctx_);
        }
        CUDA_CHECK(cudaEventRecord(ph.node_events.back(), s));
      } else if (ctx_.opts.graphs && ph.runs >= 1) {
        if (!ph.graph.ready()) {
          CaptureGuard guard(s);
          run_nodes(ph, s);
          ph.graph.instantiate(guard.end());
        }
        ph.graph.launch(s);
      } else {
        run_nodes(ph, s);
      }
    }
    ++ph.runs;
    if (profile_) CUDA_CHECK(cudaEventRecord(ph.t1, s));
    CUDA_CHECK(cudaEventRecord(ph.done, s));
    slots_.record_reads(s, ph.reads_slot);
    last_done_ = ph.done;
    last_stream_ = ph.stream;
  }

  // The phase's kernels in order; work forked to the side stream joins back before the first
  // node that touches its bytes, and all of it before the phase ends (side_stream.h).
  void run_nodes(PhaseExec& ph, cudaStream_t s) {
    for (size_t i = 0; i < ph.kernels.size(); ++i) {
      if (!ctx_.side_pending.empty()) join_side_work(ctx_, s, ph.node_reads[i], ph.node_writes[i]);
      ph.kernels[i]->run(ctx_);
    }
    join_all_side_work(ctx_, s);
  }

  // Adds the last run's event timings to the totals (waits for that run to finish).
  void collect_profile() {
    if (!profile_pending_) return;
    profile_pending_ = false;
    ++profiled_runs_;
    for (PhaseExec* ph : last_run_) {
      CUDA_CHECK(cudaEventSynchronize(ph->t1));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ph->t0, ph->t1));
      phase_ms_[ph->name] += ms;
      if (ph->node_events.empty() || ph->kernels.empty()) continue;
      for (size_t i = 0; i < ph->kernels.size(); ++i) {
        CUDA_CHECK(cudaEventElapsedTime(&ms, ph->node_events[i], ph->node_events[i + 1]));
        op_ms_[op_name(ph->ops[i])] += ms;
      }
    }
  }

  uint8_t* address(const DTensor& t) { return ctx_.address(t); }

  void release() {
    if (owned_streams_ > 0) {
      for (int i = 0; i < owned_streams_; ++i)
        warn("cudaStreamSynchronize",
             cudaStreamSynchronize(ctx_.streams[static_cast<size_t>(i)].stream));
    }
    last_run_.clear();
    last_done_ = nullptr;
    for (auto* list : {&train_, &eval_, &eval_ema_, &init_}) {
      for (PhaseExec& e : *list) {
        for (cudaEvent_t ev : {e.done, e.t0, e.t1}) {
          if (ev) warn("cudaEventDestroy", cudaEventDestroy(ev));
        }
        for (cudaEvent_t ev : e.node_events) warn("cudaEventDestroy", cudaEventDestroy(ev));
      }
      list->clear();  // kernels and graphs go before the handles and buffers they use
    }
    slots_.release();
    if (small_.host) warn("cudaFreeHost", cudaFreeHost(small_.host));
    for (cudaEvent_t ev : small_.done) {
      if (ev) warn("cudaEventDestroy", cudaEventDestroy(ev));
    }
    small_ = SmallWrites{};
    if (late_.host) warn("cudaFreeHost", cudaFreeHost(late_.host));
    for (cudaEvent_t ev : late_.done) {
      if (ev) warn("cudaEventDestroy", cudaEventDestroy(ev));
    }
    late_ = LateReads{};
    for (int i = 0; i < owned_streams_; ++i) {
      StreamRes& s = ctx_.streams[static_cast<size_t>(i)];
      if (s.workspace) warn("cudaFree", cudaFree(s.workspace));
      if (s.lt) cublasLtDestroy(s.lt);
      if (s.cudnn) cudnnDestroy(s.cudnn);
      if (s.stream) warn("cudaStreamDestroy", cudaStreamDestroy(s.stream));
    }
    ctx_.streams = {};
    owned_streams_ = 0;
    ctx_.plan_cache.clear();
    for (size_t r = 0; r < ctx_.base.size(); ++r) {
      if (ctx_.base[r] && !shared_[r].first) warn("cudaFree", cudaFree(ctx_.base[r]));
      ctx_.base[r] = nullptr;
    }
    ctx_.program = nullptr;
  }

  Context ctx_;
  InputSlots slots_{ctx_};
  int owned_streams_ = 0;
  std::string table_path_;  // the experience table this prepare() used, if any
  bool profile_ = false, profile_ops_ = false, profile_pending_ = false;
  std::map<std::string, double> phase_ms_, op_ms_;
  int64_t profiled_runs_ = 0;
  std::vector<PhaseExec> train_, eval_, eval_ema_, init_;
  std::vector<PhaseExec*> last_run_;
  cudaEvent_t last_done_ = nullptr;
  int last_stream_ = 0;
  SmallWrites small_;
  LateReads late_;
  std::array<std::pair<uint8_t*, int64_t>, kRegionCount> shared_{};  // another backend's regions
};

// More hardware work queues than CUDA's default 8, set when the library loads, before anything
// initialises CUDA. nvJPEG's batched hardware decode enqueues on 14 streams of its own; with 8
// queues some of them share one with the step's CUDA graph, so the decode's copies and kernels
// wait behind the whole step and its host thread with them (bench/RESULTS.md).
// A value the user exported wins (CUDA_DEVICE_MAX_CONNECTIONS=8 restores CUDA's default).
[[maybe_unused]] const bool kMoreConnections = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  return true;
}();

}  // namespace
}  // namespace cuda

bool cuda_device_present() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::unique_ptr<Backend> make_cuda_backend(const Switches& switches) {
  return std::make_unique<cuda::CudaBackend>(switches);
}

}  // namespace kiln
