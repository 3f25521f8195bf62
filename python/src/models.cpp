// Models from Python: the BluePrint DSL with C++'s keyword arguments and defaults, and the zoo.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <sstream>

#include "bind.h"
#include "kiln/blueprint/blueprint.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"

namespace kiln::py {

using namespace nb::literals;

namespace {

// One line per layer, children indented, as torch.nn.Module's repr reads.
void describe(std::ostringstream& os, const Layer& l, int depth) {
  os << std::string(static_cast<size_t>(depth) * 2, ' ');
  if (!l.name.empty()) os << "(" << l.name << "): ";
  os << layer_kind_name(l.kind);
  switch (l.kind) {
    case LayerKind::Conv:
      os << "(out=" << l.out << ", k=" << l.k << ", stride=" << l.stride << ", pad=" << l.pad
         << (l.bias ? ", bias=True" : "") << ")";
      break;
    case LayerKind::FC:
      os << "(out=" << l.out << (l.bias ? "" : ", bias=False") << ")";
      break;
    case LayerKind::MaxPool:
    case LayerKind::AvgPool:
      os << "(k=" << l.k << ", stride=" << l.stride << ", pad=" << l.pad << ")";
      break;
    case LayerKind::AdaptiveAvgPool:
      os << "(out_size=" << l.out << ")";
      break;
    case LayerKind::BatchNorm:
      os << "(eps=" << l.eps << ", momentum=" << l.momentum << ")";
      break;
    case LayerKind::Dropout:
      os << "(p=" << l.p << ")";
      break;
    default:
      break;
  }
  if (!l.children.empty()) {
    os << "(\n";
    for (const Layer& c : l.children) describe(os, c, depth + 1);
    os << std::string(static_cast<size_t>(depth) * 2, ' ') << ")";
  }
  os << "\n";
}

std::string layer_repr(const Layer& l) {
  std::ostringstream os;
  describe(os, l, 0);
  std::string s = os.str();
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

std::vector<Layer> layers_of(const nb::args& args) {
  std::vector<Layer> out;
  for (nb::handle h : args) {
    KILN_CHECK(nb::isinstance<Layer>(h), InvalidArgument, "kiln.seq takes layers, got ",
               nb::cast<std::string>(nb::str(h.type())));
    out.push_back(nb::cast<Layer>(h));
  }
  return out;
}

}  // namespace

void bind_models(nb::module_& m) {
  nb::class_<Layer>(m, "Layer", "A node of a model: a layer, or a Seq / Residual of layers.")
      .def_prop_ro("kind", [](const Layer& l) { return std::string(layer_kind_name(l.kind)); })
      .def_ro("name", &Layer::name)
      .def_ro("out", &Layer::out)
      .def_ro("k", &Layer::k)
      .def_ro("stride", &Layer::stride)
      .def_ro("pad", &Layer::pad)
      .def_ro("bias", &Layer::bias)
      .def_ro("children", &Layer::children)
      .def("named", &Layer::named, "name"_a,
           "A copy of this layer under another path segment (parameter names).")
      .def("__repr__", &layer_repr);

  nb::class_<BluePrint>(m, "BluePrint",
                        "A model: its input (height, width, channels), its classes and its layers.")
      .def(
          "__init__",
          [](BluePrint* self, std::string name, std::tuple<int, int, int> input, int num_classes,
             Layer root) {
            new (self) BluePrint{std::move(name),
                                 {std::get<0>(input), std::get<1>(input), std::get<2>(input)},
                                 num_classes,
                                 std::move(root)};
          },
          "name"_a, "input"_a, "num_classes"_a, "root"_a,
          "name: the model's name; input: (height, width, channels); root: a layer (usually "
          "kiln.seq(...)).")
      .def_ro("name", &BluePrint::name)
      .def_prop_ro("input",
                   [](const BluePrint& b) {
                     return std::make_tuple(b.input.height, b.input.width, b.input.channels);
                   })
      .def_ro("num_classes", &BluePrint::num_classes)
      .def_ro("root", &BluePrint::root)
      .def("__repr__", [](const BluePrint& b) {
        std::ostringstream os;
        os << "BluePrint(" << b.name << ", input=" << b.input.height << "x" << b.input.width << "x"
           << b.input.channels << ", classes=" << b.num_classes << ")\n"
           << layer_repr(b.root);
        return os.str();
      });

  m.def("conv", &conv, "out"_a, "k"_a, "stride"_a = 1, "pad"_a = 0, "bias"_a = false,
        "A 2-d convolution (NHWC).");
  m.def("bn2d", &bn2d, "eps"_a = 1e-5f, "momentum"_a = 0.1f, "BatchNorm2d.");
  m.def("relu", &relu, "ReLU.");
  m.def("silu", &silu, "SiLU (swish): x * sigmoid(x), as torch.nn.SiLU.");
  m.def("hardswish", &hardswish, "Hardswish: x * relu6(x + 3) / 6, as torch.nn.Hardswish.");
  m.def("cbr", &cbr, "out"_a, "k"_a, "stride"_a = 1, "pad"_a = 0,
        "Conv -> BatchNorm -> ReLU, named '<name>.conv' and '<name>.bn'.");
  m.def("maxpool", &maxpool, "k"_a, "stride"_a, "pad"_a = 0, "Max pooling.");
  m.def("avgpool", &avgpool, "k"_a, "stride"_a, "pad"_a = 0, "Average pooling.");
  m.def("adaptive_avgpool", &adaptive_avgpool, "out_size"_a,
        "Adaptive average pooling to out_size x out_size.");
  m.def("gap", &gap, "Global average pooling to [N, C].");
  m.def("flatten", &flatten, "Flatten to [N, H*W*C].");
  m.def("fc", &fc, "out"_a, "bias"_a = true, "A fully connected layer.");
  m.def("dropout", &dropout, "p"_a, "Dropout with probability p.");
  m.def("identity", &identity, "The identity.");
  m.def(
      "seq", [](nb::args layers) { return seq(layers_of(layers)); }, "layers"_a,
      "Layers in order; unnamed children are named by their index, as torch.nn.Sequential.");
  m.def("residual", &residual, "main"_a, "shortcut"_a = identity(),
        "relu(main(x) + shortcut(x)), torchvision's BasicBlock form.");

  m.def(
      "zoo",
      [](const std::string& name, int num_classes, nb::object small, int image_size,
         int in_channels) {
        ZooOptions o;
        if (!small.is_none()) o.form = nb::cast<bool>(small) ? "small" : "imagenet";
        o.num_classes = num_classes;
        o.image_size = image_size;
        o.in_channels = in_channels;
        return make_model(name, o);
      },
      "name"_a, "num_classes"_a = 0, "small"_a = nb::none(), "image_size"_a = 0,
      "in_channels"_a = 0,
      "A model of the zoo (kiln.zoo_names()). small: the 28x28x1 / 32x32x3 form (a name ending in "
      "_small picks it);\n"
      "0 keeps the form's default for num_classes, image_size and in_channels.");
  m.def("zoo_names", &zoo_model_names, "The zoo's model names.");
}

}  // namespace kiln::py
