#include "backend/cuda/side_stream.h"

#include <algorithm>

namespace kiln::cuda {

SideKernel::SideKernel(int stream, KernelPtr inner, std::vector<ByteRange> reads,
                       std::vector<ByteRange> writes)
    : Kernel(stream),
      inner_(std::move(inner)),
      reads_(std::move(reads)),
      writes_(std::move(writes)) {
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

SideKernel::~SideKernel() {
  // No throw from a destructor: a failure here leaves only an event behind.
  if (fork_) cudaEventDestroy(fork_);
  if (done_) cudaEventDestroy(done_);
}

void SideKernel::run(Context& ctx) {
  CUDA_CHECK(cudaEventRecord(fork_, stream(ctx)));
  cudaStream_t side = ctx.streams[static_cast<size_t>(kSideStream)].stream;
  CUDA_CHECK(cudaStreamWaitEvent(side, fork_, 0));
  inner_->run(ctx);
  CUDA_CHECK(cudaEventRecord(done_, side));
  ctx.side_pending.push_back({done_, reads_, writes_});
}

std::vector<ByteRange> byte_ranges(const Context& ctx, const std::vector<TensorId>& ids) {
  std::vector<ByteRange> out;
  for (TensorId id : ids) {
    if (id == kNoTensor) continue;
    const DTensor& t = ctx.program->storage(id);
    out.push_back({t.region, t.offset, t.offset + t.bytes()});
  }
  return out;
}

bool any_overlap(const std::vector<ByteRange>& a, const std::vector<ByteRange>& b) {
  for (const ByteRange& x : a) {
    for (const ByteRange& y : b) {
      if (overlaps(x, y)) return true;
    }
  }
  return false;
}

void join_side_work(Context& ctx, cudaStream_t stream, const std::vector<ByteRange>& reads,
                    const std::vector<ByteRange>& writes) {
  auto& pending = ctx.side_pending;
  auto must_wait = [&](const SideWork& w) { return must_join(w, reads, writes); };
  for (const SideWork& w : pending) {
    if (must_wait(w)) CUDA_CHECK(cudaStreamWaitEvent(stream, w.done, 0));
  }
  pending.erase(std::remove_if(pending.begin(), pending.end(), must_wait), pending.end());
}

void join_all_side_work(Context& ctx, cudaStream_t stream) {
  for (const SideWork& w : ctx.side_pending) CUDA_CHECK(cudaStreamWaitEvent(stream, w.done, 0));
  ctx.side_pending.clear();
}

}  // namespace kiln::cuda
