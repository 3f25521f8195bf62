#include "kiln/graph/program.h"

#include <sstream>

#include "kiln/core/error.h"

namespace kiln {

namespace {
struct PhaseInfo {
  const char* name;
  const char* doc;
};
constexpr PhaseInfo kPhases[] = {
#define KILN_PHASE_INFO(name, doc) {#name, doc},
    KILN_PHASES(KILN_PHASE_INFO)
#undef KILN_PHASE_INFO
};
}  // namespace

const char* phase_name(PhaseKind k) {
  return kPhases[static_cast<int>(k)].name;
}
const char* phase_doc(PhaseKind k) {
  return kPhases[static_cast<int>(k)].doc;
}

const char* param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::ConvWeight:
      return "conv weight";
    case ParamKind::FcWeight:
      return "fc weight";
    case ParamKind::BnWeight:
      return "bn weight";
    case ParamKind::BnBias:
      return "bn bias";
    case ParamKind::Bias:
      return "bias";
  }
  return "?";
}

const ParamDesc* Program::find_param(const std::string& name) const {
  for (const ParamDesc& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const DTensor& Program::storage(TensorId id) const {
  const DTensor* t = &tensor(id);
  while (t->view_of != kNoTensor) t = &tensor(t->view_of);
  return *t;
}

// Which dtypes a region may hold. The AMP gate: FP16 regions exist only with AMP
// on, and features are FP16 exactly when AMP is on.
static bool dtype_allowed(const Program& p, Region r, DType d) {
  const bool amp = p.options.amp;
  switch (r) {
    case Region::params_f16:
    case Region::grads_f16:
    case Region::ema_f16:
      return amp && d == p.options.amp_dtype;
    case Region::features:
      return d == p.feature_dtype;
    case Region::aux:
      return d == DType::U8 || d == DType::I32;
    case Region::scalars:
      return d == DType::F32 || d == DType::I32;
    case Region::input_a:
    case Region::input_b:
      return d == DType::F32 || d == DType::I32;
    default:
      return d == DType::F32;
  }
}

static void validate_tensor(const Program& p, const DTensor& t, const std::string& where) {
  const std::string what = where + " tensor '" + t.name + "'";
  KILN_CHECK(p.memory.locked, State, "validate_program: the memory plan of '", p.model,
             "' is not locked yet; call plan_memory first");
  KILN_CHECK(t.offset >= 0, Memory, what, " was never placed by the memory plan");
  KILN_CHECK(t.offset % kAlignment == 0, Memory, what, " starts at byte ", t.offset, " of region ",
             region_name(t.region), ", not on a ", kAlignment, "-byte boundary");
  KILN_CHECK(dtype_allowed(p, t.region, t.dtype), Memory, what, " is ", dtype_name(t.dtype),
             " in region ", region_name(t.region), ", which ",
             p.options.amp ? "under AMP" : "with AMP off", " does not hold that dtype",
             (t.region == Region::features
                  ? std::string("; features are ") + dtype_name(p.feature_dtype) +
                        (p.options.amp ? " with AMP on" : " with AMP off (use --amp for FP16)")
                  : std::string()));
  for (int64_t d : t.shape.dims) {
    KILN_CHECK(d > 0, Memory, what, " has an empty dimension in ", t.shape.str());
  }
  const int64_t region_size = p.memory.region_bytes[static_cast<int>(t.region)];
  KILN_CHECK(t.offset + t.bytes() <= region_size, Memory, what, " (", t.bytes(), " bytes at ",
             t.offset, ") runs past the end of region ", region_name(t.region), " (", region_size,
             " bytes)");
  if (t.view_of != kNoTensor) {
    const DTensor& root = p.storage(t.id);
    KILN_CHECK(t.region == root.region && t.dtype == root.dtype && t.bytes() <= root.bytes(),
               Memory, what, " is a view larger than (or of another region or dtype than) '",
               root.name, "'");
  }
}

void validate_program(const Program& p) {
  for (const auto* list : {&p.train, &p.eval, &p.eval_ema, &p.init}) {
    for (const Phase& ph : *list) {
      for (const Node& n : ph.nodes) {
        const std::string where =
            "phase " + ph.name + ", node '" + n.label + "' (" + op_name(n.op) + ")";
        for (const auto* ids : {&n.in, &n.out}) {
          for (TensorId id : *ids) {
            if (id == kNoTensor) continue;
            KILN_CHECK(id >= 0 && static_cast<size_t>(id) < p.tensors.size(), Internal, where,
                       " names tensor ", id, " which does not exist");
            validate_tensor(p, p.tensor(id), where);
          }
        }
      }
    }
  }
}

std::string describe_program(const Program& p, bool with_tensors) {
  std::ostringstream os;
  auto tensor_text = [&](TensorId id) {
    if (id == kNoTensor) return std::string("-");
    const DTensor& t = p.tensor(id);
    std::ostringstream s;
    s << t.name;
    if (with_tensors) {
      s << "{" << region_name(t.region) << "+" << t.offset << " " << dtype_name(t.dtype)
        << t.shape.str() << "}";
    }
    return s.str();
  };
  auto list = [&](const char* title, const std::vector<Phase>& phases) {
    if (phases.empty()) return;
    os << title << ":\n";
    for (const Phase& ph : phases) {
      os << "  phase " << ph.name << " (stream " << ph.stream << ", " << ph.nodes.size()
         << " nodes)\n";
      for (const Node& n : ph.nodes) {
        os << "    " << op_name(n.op) << "  " << n.label << "  (";
        for (size_t i = 0; i < n.in.size(); ++i) os << (i ? ", " : "") << tensor_text(n.in[i]);
        os << ") -> (";
        for (size_t i = 0; i < n.out.size(); ++i) os << (i ? ", " : "") << tensor_text(n.out[i]);
        os << ")\n";
      }
    }
  };
  os << "program of " << p.model << " (batch " << p.options.batch << ", "
     << (p.options.amp ? "AMP" : "FP32") << ", optimizer " << p.options.optimizer << ")\n";
  list("training step", p.train);
  list("evaluation", p.eval);
  list("evaluation (EMA weights)", p.eval_ema);
  list("initialisation", p.init);
  return os.str();
}

}  // namespace kiln
