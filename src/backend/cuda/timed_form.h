// A layer's choice between kiln's SM90 kernel (with the BatchNorm pass it removes) and today's
// form (cuDNN's convolution with kiln's own pass), timed on the node's own buffers while
// compiling, where KILN_CUTLASS_TIMED leaves an `auto` switch to it (sm90_forms,
// sm90_conv_rule.h). The SM90 kernels win on some layers and lose on others (bench/RESULTS.md:
// the implicit-GEMM convolution loses VGG16's wide layers and wins ResNet-50's deepest), so a
// fixed per-family default leaves time on either side. A choice is looked up first in the engine
// table (`kiln tune` records it there), then in what this process or the autotune cache timed
// before; otherwise both forms are timed now and the choice kept in both places.
#pragma once
#include <string>
#include <vector>

#include "backend/cuda/cuda_kernel.h"
#include "kiln/backend/engine_table.h"

namespace kiln::cuda {

struct TimedChoice {
  bool sm90 = false;          // the SM90 form is the faster
  bool measured_now = false;  // timed by this call (not found in the table or the cache)
  double sm90_ms = 0, today_ms = 0;
};

// One of two forms of the same work: a name (recorded in the table and the cache) and its
// kernels in order.
struct NamedForm {
  const char* name;
  std::vector<Kernel*> kernels;
};

// Which of two forms is the faster for `key`: found in the engine table (not while `kiln tune`
// runs), in what this process timed or the autotune cache; else, where `may_time`, both timed
// now on `stream` as time_sm90_against_today says and the choice kept in the same places.
struct FormChoice {
  bool found = false;         // false: nothing recorded and not timed (may_time off)
  bool first = false;         // the first form is the faster
  bool measured_now = false;  // timed by this call
  double first_ms = 0, second_ms = 0;
};
FormChoice choose_faster_form(Context& ctx, int stream, const std::string& key,
                              const NamedForm& first, const NamedForm& second,
                              const std::vector<TensorId>& keep, bool may_time);
// The choice a table entry records between the forms named `first` and `second`.
FormChoice form_choice_from(const EngineEntry& e, const char* first, const char* second);

// Each form is its kernels in order, built on `stream`. Both run on that stream: the same work
// (the same outputs), so timing them may overwrite their outputs but not `keep`: tensors they
// also update that must survive (BatchNorm's running statistics), copied aside and back. A
// temporary workspace stands in for the stream's, which is allocated only after every factory
// ran. The bytes the forms read hold whatever compiling left there (the regions start zeroed):
// their time does not depend on the values. A failure in either form throws, as it would in
// the step.
// Node n's choice is counted (Context::sm90_timed and _today) and logged at debug level.
TimedChoice time_sm90_against_today(const Node& n, Context& ctx, int stream, const std::string& key,
                                    const std::vector<Kernel*>& sm90,
                                    const std::vector<Kernel*>& today,
                                    const std::vector<TensorId>& keep);

// The key of a layer's choice: which SM90 form (e.g. "cbr_fwd.gemm"), the convolution's
// geometry and dtype, and what else changes the forms' work (a pool, a residual); "sm90v1"
// names the kernels' generation, so that choices timed on older kernels are not reused (and
// another kind of choice, such as conv.cpp's channel padding, names its own).
std::string timed_form_key(const std::string& form, const ConvGeom& g, DType dt,
                           const std::string& extra, const char* generation = "sm90v1");

}  // namespace kiln::cuda
