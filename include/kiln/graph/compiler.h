// The Compiler lowers an ArchPlan to a Program — parameter slots, tensors, and the nodes of
// every phase of the training step, evaluation and initialisation. The memory is
// placed afterwards by plan_memory (MEMORY_LOCKED) and checked by validate_program.
#pragma once
#include "kiln/graph/program.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {

Program lower_program(const ArchPlan& plan, const CompileOptions& options);

}  // namespace kiln
