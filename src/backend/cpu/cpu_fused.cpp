// Fused ops (CBR, BN+add+ReLU) are CUDA-only, under AMP (SPEC S12-S15). The CPU backend
// runs their unfused equivalents instead: cpu_supports() says no, so the plan never merges
// them on the CPU, and a factory called anyway throws rather than silently doing nothing.
#include "backend/cpu/cpu_util.h"

namespace kiln::cpu {

namespace {
[[noreturn]] void unsupported(const Node& n) {
  KILN_FAIL(Unsupported, "the CPU backend has no fused ", op_name(n.op), " kernel (node '", n.label,
            "'); fused ops run on CUDA under AMP. Plan the model without fusion (KILN_FUSION=0) ",
            "so it uses conv, bn and relu ops, or use --device cuda");
}
}  // namespace

KernelPtr make_cbr_fwd(const Node& n, Context&) {
  unsupported(n);
}
KernelPtr make_cbr_bwd(const Node& n, Context&) {
  unsupported(n);
}
KernelPtr make_bn_add_relu_fwd(const Node& n, Context&) {
  unsupported(n);
}
KernelPtr make_bn_add_relu_bwd(const Node& n, Context&) {
  unsupported(n);
}

}  // namespace kiln::cpu
