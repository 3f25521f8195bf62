// Helpers shared by the CPU kernels, and cpu_supports().
#include "backend/cpu/cpu_util.h"

#include <cstdlib>
#include <map>
#include <mutex>

namespace kiln::cpu {

bool cpu_supports(OpKind op) {
  (void)op;
  return true;  // every op of ops.def; the fused ones are compositions (cpu/fused.cpp)
}

dnnl::memory make_memory(Context& ctx, TensorId id, const dims& d, tag t) {
  return dnnl::memory({d, dt::f32, t}, ctx.engine, ctx.ptr<float>(id));
}

dnnl::memory make_memory(Context& ctx, void* p, const dims& d, tag t) {
  return dnnl::memory({d, dt::f32, t}, ctx.engine, p);
}

void Buffer::Free::operator()(void* p) const {
  std::free(p);
}

void Buffer::reserve(size_t bytes) {
  if (bytes <= size_) return;
  const size_t size = (bytes + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, size);
  KILN_CHECK(p != nullptr, Backend, "cpu backend: cannot allocate a ", size, "-byte buffer");
  p_.reset(p);
  size_ = size;
}

std::shared_ptr<Buffer> scratchpad_for(const Context& ctx) {
  // Keyed by the Context (one per backend); weak, so the buffer dies with the backend's kernels.
  static std::mutex mu;
  static std::map<const Context*, std::weak_ptr<Buffer>> pads;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = pads.begin(); it != pads.end();)
    it = it->second.expired() ? pads.erase(it) : std::next(it);
  auto& weak = pads[&ctx];
  std::shared_ptr<Buffer> pad = weak.lock();
  if (!pad) {
    pad = std::make_shared<Buffer>();
    weak = pad;
  }
  return pad;
}

dnnl::primitive_attr user_scratchpad_attr() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

DnnlCall::DnnlCall(const Node& n, Context& ctx, dnnl::primitive prim,
                   const dnnl::primitive_desc_base& pd, std::unordered_map<int, dnnl::memory> args)
    : prim_(std::move(prim)),
      args_(std::move(args)),
      what_(std::string(op_name(n.op)) + " node '" + n.label + "'") {
  const dnnl::memory::desc sd = pd.scratchpad_desc();
  if (sd.get_size() > 0) {
    scratch_ = scratchpad_for(ctx);
    scratch_->reserve(sd.get_size());
    scratch_mem_ = dnnl::memory(sd, ctx.engine, scratch_->data());
    args_[DNNL_ARG_SCRATCHPAD] = scratch_mem_;
    has_scratch_ = true;
  }
}

void DnnlCall::operator()(Context& ctx) {
  // The shared buffer may have been reallocated by a kernel built after this one.
  if (has_scratch_ && scratch_mem_.get_data_handle() != scratch_->data()) {
    scratch_mem_.set_data_handle(scratch_->data());
  }
  try {
    prim_.execute(ctx.stream, args_);
  } catch (const dnnl::error& e) {
    KILN_FAIL(Backend, what_, ": oneDNN failed to execute (", e.what(), ", status ",
              static_cast<int>(e.status), ")");
  }
}

void rethrow_dnnl(const Node& n, const dnnl::error& e) {
  KILN_FAIL(Backend, op_name(n.op), " node '", n.label, "': oneDNN could not build the primitive (",
            e.what(), ", status ", static_cast<int>(e.status), ")");
}

double read_scalar(const Context& ctx, TensorId id, double absent) {
  if (id == kNoTensor) return absent;
  const DTensor& t = ctx.tensor(id);
  switch (t.dtype) {
    case DType::F32:
      return *ctx.ptr<float>(id);
    case DType::I32:
      return *ctx.ptr<int32_t>(id);
    case DType::I64:
      return static_cast<double>(*ctx.ptr<int64_t>(id));
    default:
      break;
  }
  KILN_FAIL(Internal, "scalar '", t.name, "' has dtype ", dtype_name(t.dtype));
}

void write_scalar(const Context& ctx, TensorId id, double v) {
  const DTensor& t = ctx.tensor(id);
  switch (t.dtype) {
    case DType::F32:
      *ctx.ptr<float>(id) = static_cast<float>(v);
      return;
    case DType::I32:
      *ctx.ptr<int32_t>(id) = static_cast<int32_t>(v);
      return;
    case DType::I64:
      *ctx.ptr<int64_t>(id) = static_cast<int64_t>(v);
      return;
    default:
      break;
  }
  KILN_FAIL(Internal, "scalar '", t.name, "' has dtype ", dtype_name(t.dtype));
}

void expect_scalar(const Context& ctx, const Node& n, TensorId id, const char* role) {
  if (id == kNoTensor) return;
  const DTensor& t = ctx.tensor(id);
  KILN_CHECK(
      t.numel() >= 1 && (t.dtype == DType::F32 || t.dtype == DType::I32 || t.dtype == DType::I64),
      InvalidArgument, op_name(n.op), " node '", n.label, "': ", role, " '", t.name,
      "' must be an f32, i32 or i64 scalar; it is ", dtype_name(t.dtype), " ", t.shape.str());
}

}  // namespace kiln::cpu
