// Weight gradients on a side stream, beside the data gradient. A
// convolution's weight gradient and its data gradient both read dy, and nothing in the rest of
// the backward pass reads the weight gradient, so it can run beside the data gradient and the
// layers below it: small late-stage convolutions leave most of the GPU idle, and a second
// stream fills it.
//
// A SideKernel forks: it records an event on the node's stream (so its inputs are complete),
// makes the side stream wait for it, enqueues the wrapped kernel there (built for the side
// stream: its own cuDNN handle and workspace) and leaves a SideWork in Context::side_pending.
// The executor joins each pending work back before the first later node whose bytes overlap
// what it reads or writes (that node could overwrite its input under memory reuse, or read its
// output), and joins all of it before the phase ends, so the next phase (the optimizer reads
// the gradients) sees it complete. Both fit stream capture: the fork and join events become
// the CUDA Graph's edges. Opt-in (KILN_SIDE_WGRAD=1), as it measured no faster (bench/RESULTS.md);
// KILN_STREAMS=1 or KILN_PROFILE_OPS=1 keep every kernel on its node's stream regardless.
#pragma once
#include <vector>

#include "backend/cuda/cuda_kernel.h"

namespace kiln::cuda {

inline constexpr int kSideStream = 1;  // the update stream, idle while the backward pass runs

class SideKernel final : public Kernel {
 public:
  SideKernel(int stream, KernelPtr inner, std::vector<ByteRange> reads,
             std::vector<ByteRange> writes);
  ~SideKernel() override;
  void run(Context& ctx) override;

 private:
  KernelPtr inner_;
  std::vector<ByteRange> reads_, writes_;
  cudaEvent_t fork_ = nullptr, done_ = nullptr;
};

// The bytes of these tensors (kNoTensor skipped), each view as its base.
std::vector<ByteRange> byte_ranges(const Context& ctx, const std::vector<TensorId>& ids);

// Whether any of `a` overlaps any of `b`.
bool any_overlap(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b);

// Whether a node reading `reads` and writing `writes` must wait for side work `w`: the work
// writes what the node touches, or reads what the node writes (memory reuse may have given the
// node's output the bytes of the work's input).
inline bool must_join(const SideWork& w, const std::vector<ByteRange>& reads,
                      const std::vector<ByteRange>& writes) {
  return any_overlap(w.writes, reads) || any_overlap(w.writes, writes) ||
         any_overlap(w.reads, writes);
}

// Joins into `stream` every pending side work that a node reading `reads` and writing
// `writes` must wait for: it writes what the node touches, or reads what the node writes.
void join_side_work(Context& ctx, cudaStream_t stream, const std::vector<ByteRange>& reads,
                    const std::vector<ByteRange>& writes);
// Joins all pending side work into `stream` (a phase's end).
void join_all_side_work(Context& ctx, cudaStream_t stream);

// `make(stream)` forked to the side stream when ctx.side_wgrad allows it and the node's own
// stream is not the side stream; else `make(stream)` as it is.
template <typename Make>
KernelPtr maybe_on_side_stream(Context& ctx, int stream, const std::vector<TensorId>& reads,
                               const std::vector<TensorId>& writes, Make make) {
  if (!ctx.side_wgrad || stream == kSideStream) return make(stream);
  ++ctx.side_wgrads;
  return std::make_unique<SideKernel>(stream, make(kSideStream), byte_ranges(ctx, reads),
                                      byte_ranges(ctx, writes));
}

}  // namespace kiln::cuda
