#include "kiln/graph/op.h"

namespace kiln {

namespace {
struct OpInfo {
  const char* name;
  OpCategory category;
  const char* signature;
};
constexpr OpInfo kOps[] = {
#define KILN_OP(name, category, doc) {#name, OpCategory::category, doc},
#include "kiln/graph/ops.def"
#undef KILN_OP
};
static_assert(sizeof(kOps) / sizeof(kOps[0]) == kOpCount, "ops.def and the op table disagree");
}  // namespace

const char* op_name(OpKind op) {
  return kOps[static_cast<int>(op)].name;
}
OpCategory op_category(OpKind op) {
  return kOps[static_cast<int>(op)].category;
}
const char* op_signature(OpKind op) {
  return kOps[static_cast<int>(op)].signature;
}

}  // namespace kiln
