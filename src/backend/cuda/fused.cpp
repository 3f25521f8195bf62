// Fused ops (CBR, BN+add+ReLU; SPEC S12-S15) are not implemented on CUDA yet:
// cuda_supports() says no, so the plan keeps the unfused conv / bn / relu / add ops, and a
// factory called anyway throws rather than silently doing nothing.
#include "backend/cuda/cuda_common.h"

namespace kiln::cuda {

namespace {
[[noreturn]] void unsupported(const Node& n) {
  KILN_FAIL(Unsupported, "the CUDA backend has no fused ", op_name(n.op), " kernel yet (node '", n.label,
            "'); plan the model without fusion (KILN_FUSION=0) so it uses conv, bn, relu and add ops");
}
}  // namespace

KernelPtr make_cbr_fwd(const Node& n, Context&, int) { unsupported(n); }
KernelPtr make_cbr_bwd(const Node& n, Context&, int) { unsupported(n); }
KernelPtr make_bn_add_relu_fwd(const Node& n, Context&, int) { unsupported(n); }
KernelPtr make_bn_add_relu_bwd(const Node& n, Context&, int) { unsupported(n); }

}  // namespace kiln::cuda
