// The Program of every zoo model, pinned: a canonical text of each program (tensors and their
// placement, parameters, phases, nodes with every attribute) is hashed and compared with
// tests/data/program_hashes.txt, so that a change to the Compiler that alters any program shows
// up here. On a mismatch the canonical text is written under the build folder; diff it against
// the same file written by the revision before the change.
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "kiln/blueprint/zoo.h"
#include "kiln/graph/compiler.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

// Floats as their bits: the text must differ whenever the program does.
std::string bits(float v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", std::bit_cast<uint32_t>(v));
  return buf;
}

void put_ids(std::ostream& os, const std::vector<TensorId>& ids) {
  os << "[";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? "," : "") << ids[i];
  os << "]";
}

void put_attrs(std::ostream& os, const Attrs& a) {
  os << " k" << a.kh << "," << a.kw << " s" << a.sh << "," << a.sw << " p" << a.ph << "," << a.pw
     << " cip" << a.count_include_pad << " eps" << bits(a.eps) << " bnm" << bits(a.bn_momentum)
     << " p" << bits(a.p) << " seed" << a.seed << " v" << bits(a.value) << " clip" << bits(a.clip)
     << " mn" << bits(a.max_norm) << " ls" << bits(a.label_smoothing) << " gi" << a.growth_interval
     << " m" << bits(a.momentum) << " wd" << bits(a.weight_decay) << " nest" << a.nesterov << " b"
     << bits(a.beta1) << "," << bits(a.beta2) << "," << bits(a.adam_eps) << " eta"
     << bits(a.lars_eta) << " ema" << bits(a.ema_decay) << " acc" << a.accumulate << " first"
     << a.first_layer << " pool" << a.pool << " rmax" << a.reduce_max << " world" << a.world
     << " avg" << bits(a.grad_average);
  // A merged pool whose windows overlap (only such nodes print it: older programs keep their
  // text).
  if (a.pool_stride || a.pool_pad) os << " pool_s" << a.pool_stride << " pool_p" << a.pool_pad;
  // A folded residual BatchNorm's settings, where they are not the defaults.
  if (a.eps2 != 1e-5f || a.bn_momentum2 != 0.1f)
    os << " eps2" << bits(a.eps2) << " bnm2" << bits(a.bn_momentum2);
}

void put_phases(std::ostream& os, const char* what, const std::vector<Phase>& phases) {
  for (const Phase& ph : phases) {
    os << what << " phase " << phase_name(ph.kind) << " " << ph.name << " stream " << ph.stream
       << "\n";
    for (const Node& n : ph.nodes) {
      os << "  " << op_name(n.op) << " '" << n.label << "' s" << n.stream << " in";
      put_ids(os, n.in);
      os << " out";
      put_ids(os, n.out);
      put_attrs(os, n.attrs);
      os << "\n";
    }
  }
}

std::string canonical(const Program& p) {
  std::ostringstream os;
  os << "model " << p.model << " classes " << p.num_classes << " feature "
     << dtype_name(p.feature_dtype) << " param_elems " << p.param_elems << "\n";
  for (const DTensor& t : p.tensors) {
    os << "t" << t.id << " " << t.name << " " << region_name(t.region) << "@" << t.offset << " "
       << t.shape.str() << " " << dtype_name(t.dtype) << " " << layout_name(t.layout) << " view_of "
       << t.view_of << "\n";
  }
  for (const ParamDesc& d : p.params) {
    os << "param " << d.name << " " << param_kind_name(d.kind) << " " << d.shape.str() << " "
       << d.torch_shape.str() << " decay " << d.decay << " copy " << d.compute_copy << " slot "
       << d.slot << "+" << d.slot_elems << " chw " << d.fc_input_chw[0] << "," << d.fc_input_chw[1]
       << "," << d.fc_input_chw[2] << " tensors";
    for (TensorId id : d.tensor) os << " " << id;
    os << "\n";
  }
  for (const BufferDesc& b : p.buffers) os << "buffer " << b.name << " " << b.tensor << "\n";
  os << "memory";
  for (int64_t b : p.memory.region_bytes) os << " " << b;
  os << " without_reuse " << p.memory.features_without_reuse << " " << p.memory.aux_without_reuse
     << " locked " << p.memory.locked << "\n";
  const ProgramIO& io = p.io;
  os << "io " << io.input << " " << io.labels << " " << io.staged_images[0] << " "
     << io.staged_images[1] << " " << io.staged_labels[0] << " " << io.staged_labels[1] << " "
     << io.logits << " " << io.loss << " " << io.correct << " " << io.loss_scale << " "
     << io.overflow << " " << io.good_steps << " " << io.lr << " " << io.step << " "
     << io.optimizer_steps << " " << io.clip_coef << "\n";
  put_phases(os, "train", p.train);
  put_phases(os, "eval", p.eval);
  put_phases(os, "eval_ema", p.eval_ema);
  put_phases(os, "init", p.init);
  return os.str();
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Every layer kind the zoo leaves out: a plain avg-pool, a padded max-pool, a biased conv
// without BatchNorm, an fc after a flattened map, dropout, SiLU and hardswish.
BluePrint every_kind() {
  return BluePrint{
      "kinds",
      {16, 16, 3},
      10,
      seq(conv(16, 3, 1, 1, /*bias=*/true), relu(), maxpool(3, 2, 1), cbr(16, 3, 1, 1),
          residual(seq(conv(16, 3, 1, 1), bn2d(), relu(), conv(16, 3, 1, 1), bn2d())),
          avgpool(2, 2), hardswish(), flatten(), dropout(0.25f), fc(32), silu(), fc(10))};
}

struct Config {
  std::string model;
  bool amp = false;
  // off; amp: every fused form under AMP only (the CPU's default); all: in FP32 too (CUDA's);
  // nopool: CBR and BN+add+ReLU in FP32 too, without the pool and gradient-sum forms.
  std::string fusion = "off";
  CompileOptions o;
};

std::vector<Config> configs() {
  std::vector<Config> v;
  std::vector<std::string> models;
  for (const std::string& m : zoo_model_names()) {
    models.push_back(m);
    models.push_back(m + "_small");
  }
  models.push_back("kinds");
  for (const std::string& m : models) {
    for (bool amp : {false, true}) {
      for (const char* fusion : {"off", "amp", "all", "nopool"}) {
        Config c;
        c.model = m;
        c.amp = amp;
        c.fusion = fusion;
        c.o.batch = 2;
        c.o.amp = amp;
        v.push_back(c);
      }
    }
  }
  // The optimizer, evaluation and data-parallel paths of the driver.
  auto extra = [&](const std::string& m, bool amp, const std::string& fusion, auto edit) {
    Config c;
    c.model = m;
    c.amp = amp;
    c.fusion = fusion;
    c.o.batch = 2;
    c.o.amp = amp;
    edit(c.o);
    v.push_back(c);
  };
  extra("resnet18_small", true, "all", [](CompileOptions& o) {
    o.optimizer = "adamw";
    o.ema = true;
    o.clip_grad_norm = 1.0f;
    o.label_smoothing = 0.1f;
    o.weight_decay = 0.05f;
  });
  extra("vgg11_bn_small", false, "nopool", [](CompileOptions& o) {
    o.optimizer = "lars";
    o.clip_grad = 2.0f;
    o.nesterov = true;
    o.weight_decay = 1e-4f;
    o.dropout_seed = 7;
  });
  extra("kinds", true, "amp", [](CompileOptions& o) {
    o.momentum = 0.0f;
    o.ema = true;
    o.memory_reuse = false;
    o.amp_dtype = DType::BF16;
  });
  extra("resnet18_small", false, "off", [](CompileOptions& o) { o.world = 2; });
  extra("resnet50_small", true, "all", [](CompileOptions& o) {
    o.world = 2;
    o.sync_bn = false;
  });
  return v;
}

std::string config_name(const Config& c, size_t index) {
  return c.model + (c.amp ? "_amp" : "_fp32") + "_fuse-" + c.fusion +
         (index ? "_x" + std::to_string(index) : "");
}

Program compile(const Config& c) {
  PlanOptions po;
  po.amp = c.amp;
  po.fusion = c.fusion != "off";
  po.backend_fuses_cbr = po.backend_fuses_bn_add_relu = true;
  po.backend_fuses_cbr_pool = c.fusion != "nopool";
  // "all" is CUDA's fusion with KILN_FUSE_OVERLAPPING_POOL and KILN_FUSE_RESIDUAL_BN on
  // (ResNet's stem pool merged, the shortcuts' BatchNorms folded into BN+add+ReLU).
  po.backend_fuses_overlapping_pool = po.backend_fuses_residual_bn = c.fusion == "all";
  po.backend_fuses_fp32 = c.fusion == "all" || c.fusion == "nopool";
  CompileOptions o = c.o;
  o.fuse_grad_sum = c.fusion != "nopool" && c.fusion != "off";
  const BluePrint bp = c.model == "kinds" ? every_kind() : make_model(c.model);
  Program p = lower_program(make_plan(bp, po), o);
  p.model = bp.name;
  plan_memory(p);
  validate_program(p);
  return p;
}

TEST(ProgramGolden, EveryZooProgramIsUnchanged) {
  std::map<std::string, std::string> expected;
  {
    std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/data/program_hashes.txt");
    std::string name, hash;
    while (in >> name >> hash) expected[name] = hash;
  }
  const std::filesystem::path dumps = std::filesystem::path(KILN_BINARY_DIR) / "program_dumps";
  std::map<std::string, int> seen;
  for (const Config& c : configs()) {
    const std::string base = config_name(c, 0);
    const std::string name = config_name(c, static_cast<size_t>(seen[base]++));
    const std::string text = canonical(compile(c));
    char hash[20];
    std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(fnv1a(text)));
    auto it = expected.find(name);
    if (it != expected.end() && it->second == hash) continue;
    std::filesystem::create_directories(dumps);
    std::ofstream(dumps / (name + ".txt")) << text;
    ADD_FAILURE() << "program " << name << " hashes to " << hash
                  << " but tests/data/program_hashes.txt says "
                  << (it == expected.end() ? "nothing" : it->second) << "; its text is in "
                  << (dumps / (name + ".txt")).string() << "\n"
                  << name << " " << hash;
  }
}

}  // namespace
}  // namespace kiln
