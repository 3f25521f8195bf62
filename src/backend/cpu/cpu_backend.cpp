// CpuBackend: one aligned buffer per region, one prepared kernel per node, phases run in
// order on the calling thread (oneDNN uses its own threads inside a primitive).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_kernel.h"
#include "kiln/backend/backend.h"
#include "kiln/core/error.h"

namespace kiln {

namespace {

using KernelFactory = cpu::KernelPtr (*)(const Node&, cpu::Context&);
constexpr KernelFactory kFactories[] = {
#define KILN_OP(name, category, doc) &cpu::make_##name,
#include "kiln/graph/ops.def"
#undef KILN_OP
};
static_assert(sizeof(kFactories) / sizeof(kFactories[0]) == kOpCount,
              "every op of ops.def needs a CPU factory");

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(bool profile_switch) : profile_switch_(profile_switch) {}
  const char* name() const override { return "cpu"; }
  BackendCaps caps() const override {
    BackendCaps c;
    c.device = "cpu (oneDNN)";
    // Fused CBR and BN+add+ReLU in FP32: compositions of the unfused kernels (cpu/fused.cpp)
    // that skip the BN-output and ReLU passes and keep a bit mask instead of the ReLU output.
    c.fused_cbr = c.fused_cbr_pool = c.fused_bn_add_relu = c.fused_fp32 = c.fused_grad_sum = true;
    c.fused_overlapping_pool = c.fused_residual_bn = true;
    return c;
  }
  bool supports(OpKind op, DType feature_dtype) const override {
    return feature_dtype == DType::F32 && cpu::cpu_supports(op);
  }

  ~CpuBackend() override {
    // Switches::profile set by a program that never asked for the report: print it here.
    if (profiling_ && profile_switch_ && !reported_) std::fputs(profile_report().c_str(), stderr);
  }

  void set_profiling(bool on) override { profiling_ = on; }

  // Time per op kind since profiling started, largest first.
  std::string profile_report() override {
    reported_ = true;
    if (profile_.empty()) return {};
    std::vector<std::pair<double, std::string>> rows;
    double total = 0;
    for (const auto& [op, s] : profile_) {
      rows.push_back({s, op});
      total += s;
    }
    std::sort(rows.rbegin(), rows.rend());
    std::string out;
    char line[160];
    std::snprintf(line, sizeof line, "cpu profile: %.3f s in kernels\n", total);
    out += line;
    for (const auto& [s, op] : rows) {
      std::snprintf(line, sizeof line, "  %-18s %9.3f s  %5.1f%%\n", op.c_str(), s,
                    100 * s / total);
      out += line;
    }
    return out;
  }

  void prepare(const Program& program) override {
    profiling_ = profiling_ || profile_switch_;
    KILN_CHECK(program.memory.locked, State, "cpu backend: prepare() needs a locked memory plan; ",
               "run plan_memory (the lifecycle's MEMORY_LOCKED step) first");
    KILN_CHECK(!program.options.amp, Unsupported, "the CPU backend runs FP32 only; drop --amp ",
               "or use --device cuda");
    ctx_.program = &program;
    for (int r = 0; r < kRegionCount; ++r) {
      const int64_t bytes = program.memory.region_bytes[static_cast<size_t>(r)];
      if (bytes == 0) continue;
      const auto& [shared, shared_bytes] = shared_[static_cast<size_t>(r)];
      if (shared) {
        KILN_CHECK(bytes <= shared_bytes, Internal, "cpu backend: region ",
                   region_name(static_cast<Region>(r)), " needs ", bytes,
                   " bytes, the shared one has ", shared_bytes);
        ctx_.base[static_cast<size_t>(r)] = shared;
        continue;
      }
      const size_t size = static_cast<size_t>(align_up(bytes, kAlignment));
      auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, size));
      KILN_CHECK(p != nullptr, Backend, "cpu backend: cannot allocate ", size, " bytes for region ",
                 region_name(static_cast<Region>(r)));
      std::memset(p, 0, size);
      regions_[static_cast<size_t>(r)].reset(p);
      ctx_.base[static_cast<size_t>(r)] = p;
    }
    auto build = [&](const std::vector<Phase>& phases,
                     std::vector<std::vector<cpu::KernelPtr>>& out) {
      out.clear();
      for (const Phase& ph : phases) {
        std::vector<cpu::KernelPtr> ks;
        for (const Node& n : ph.nodes) {
          KILN_CHECK(cpu::cpu_supports(n.op), Unsupported, "the CPU backend has no kernel for ",
                     op_name(n.op), " (node '", n.label, "'); turn fusion off (KILN_FUSION=0) ",
                     "or use --device cuda");
          ks.push_back(kFactories[static_cast<int>(n.op)](n, ctx_));
          ops_.push_back(op_name(n.op));
        }
        out.push_back(std::move(ks));
      }
    };
    build(program.train, train_);
    build(program.eval, eval_);
    build(program.eval_ema, eval_ema_);
    build(program.init, init_);
    size_t i = 0;
    for (auto* lists : {&train_, &eval_, &eval_ema_, &init_}) {
      for (auto& ks : *lists) {
        for (auto& k : ks) kernel_op_[k.get()] = ops_[i++];
      }
    }
  }

  uint8_t* region_memory(Region r) const override { return ctx_.base[static_cast<size_t>(r)]; }
  void share_region(Region r, uint8_t* memory, int64_t bytes) override {
    KILN_CHECK(ctx_.program == nullptr, State, "cpu backend: share_region() after prepare()");
    KILN_CHECK(memory != nullptr, InvalidArgument, "cpu backend: share_region(", region_name(r),
               ") of no memory");
    shared_[static_cast<size_t>(r)] = {memory, bytes};
  }

  void run(Schedule schedule, int slot) override {
    KILN_CHECK(ctx_.program != nullptr, State, "cpu backend: run() before prepare()");
    const Program& p = *ctx_.program;
    switch (schedule) {
      case Schedule::train:
        for (size_t i = 0; i < p.train.size(); ++i) {
          const Phase& ph = p.train[i];
          // Of the two transfer phases, run the one for the slot that holds this batch.
          if (ph.kind == PhaseKind::transfer &&
              ph.name != (slot == 0 ? "transfer_a" : "transfer_b"))
            continue;
          run_list(train_[i]);
        }
        break;
      case Schedule::eval:
        for (auto& ks : eval_) run_list(ks);
        break;
      case Schedule::eval_ema:
        for (auto& ks : eval_ema_) run_list(ks);
        break;
      case Schedule::init:
        for (auto& ks : init_) run_list(ks);
        break;
    }
  }

  void write(const DTensor& t, const void* host) override {
    std::memcpy(address(t), host, static_cast<size_t>(t.bytes()));
  }
  void read(const DTensor& t, void* host) override {
    std::memcpy(host, address(t), static_cast<size_t>(t.bytes()));
  }
  // Every run() has finished when it returns: a late read reads at once.
  uint64_t read_later(const DTensor& t) override {
    KILN_CHECK(t.bytes() <= kLateReadBytes, InvalidArgument, "read_later: '", t.name, "' has ",
               t.bytes(), " bytes; at most ", kLateReadBytes, " (use read())");
    const uint64_t ticket = late_next_++;
    std::vector<uint8_t>& bytes = late_[ticket];
    bytes.resize(static_cast<size_t>(t.bytes()));
    read(t, bytes.data());
    return ticket;
  }
  void collect(uint64_t ticket, void* host) override {
    auto it = late_.find(ticket);
    KILN_CHECK(it != late_.end(), InvalidArgument, "collect: ticket ", ticket,
               " was never issued or is collected");
    std::memcpy(host, it->second.data(), it->second.size());
    late_.erase(it);
  }
  void stage_batch(int slot, const float* images, const int32_t* labels) override {
    const Program& p = *ctx_.program;
    KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch: slot must be 0 or 1");
    write(p.tensor(p.io.staged_images[static_cast<size_t>(slot)]), images);
    write(p.tensor(p.io.staged_labels[static_cast<size_t>(slot)]), labels);
  }
  // The last host pass: bytes to normalised floats straight into the slot.
  void stage_batch_u8(int slot, const uint8_t* images, const int32_t* labels,
                      const InputNormalization& norm,
                      const SampleAugment* augments = nullptr) override {
    const Program& p = *ctx_.program;
    KILN_CHECK(slot == 0 || slot == 1, InvalidArgument, "stage_batch_u8: slot must be 0 or 1");
    const DTensor& t = p.tensor(p.io.staged_images[static_cast<size_t>(slot)]);
    KILN_CHECK(t.dtype == DType::F32, Internal, "staged images are ", dtype_name(t.dtype),
               ", not F32");
    const int64_t channels = static_cast<int64_t>(norm.mean.size());
    KILN_CHECK(channels > 0 && t.numel() % channels == 0, InvalidArgument,
               "stage_batch_u8: ", channels, " channel statistics for an input of ", t.numel(),
               " values");
    float* out = reinterpret_cast<float*>(address(t));
    if (augments) {
      KILN_CHECK(t.shape.rank() == 4 && t.shape[3] == channels, InvalidArgument,
                 "stage_batch_u8: augmented samples need an NHWC input of ", channels, " channels");
      augment_normalize_u8(images, t.shape[0], t.shape[1], t.shape[2], channels, augments, norm,
                           out);
    } else {
      normalize_u8(images, t.numel() / channels, norm, out);
    }
    write(p.tensor(p.io.staged_labels[static_cast<size_t>(slot)]), labels);
  }
  void synchronize() override {}

 private:
  uint8_t* address(const DTensor& t) {
    KILN_CHECK(ctx_.program != nullptr, State, "cpu backend: tensor access before prepare()");
    uint8_t* base = ctx_.base[static_cast<size_t>(t.region)];
    KILN_CHECK(base != nullptr && t.offset >= 0, Internal, "tensor '", t.name, "' is not placed");
    return base + t.offset;
  }
  void run_list(std::vector<cpu::KernelPtr>& ks) {
    if (profiling_) {
      for (auto& k : ks) {
        const auto t0 = std::chrono::steady_clock::now();
        k->run(ctx_);
        ctx_.stream.wait();
        profile_[kernel_op_.at(k.get())] +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      return;
    }
    for (auto& k : ks) k->run(ctx_);
    ctx_.stream.wait();
  }

  cpu::Context ctx_;
  std::array<std::unique_ptr<uint8_t, AlignedFree>, kRegionCount> regions_;
  std::array<std::pair<uint8_t*, int64_t>, kRegionCount> shared_{};  // another backend's regions
  std::vector<std::vector<cpu::KernelPtr>> train_, eval_, eval_ema_, init_;
  bool profiling_ = false;
  bool profile_switch_ = false, reported_ = false;
  std::vector<std::string> ops_;
  std::map<const cpu::Kernel*, std::string> kernel_op_;
  std::map<std::string, double> profile_;
  std::map<uint64_t, std::vector<uint8_t>> late_;  // read_later's bytes, by ticket
  uint64_t late_next_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const Switches& switches) {
  return std::make_unique<CpuBackend>(switches.profile);
}

}  // namespace kiln
