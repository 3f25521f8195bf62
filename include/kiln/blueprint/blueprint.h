// BluePrint: the C++ DSL in which a model is written. A model is a tree of
// Layers; names along the tree give torchvision's parameter names ("layer1.0.conv1.weight").
//
//   BluePrint net{"tiny", {28, 28, 1}, 10,
//                 seq(cbr(32, 3, 1, 1), maxpool(2, 2), flatten(), fc(10))};
//
// A Seq names each unnamed child by its index, as torch.nn.Sequential does; a child marked
// transparent() adds no segment to the path (a residual block's main branch).
#pragma once
#include <string>
#include <vector>

namespace kiln {

// layers.def's roles as selectors: KILN_IN_DSL_<role>(x) is x where the row is a DSL layer,
// KILN_IN_PLAN_<role>(x) where it is a plan op (PlanOp, arch_plan.h).
#define KILN_IN_DSL_Both(...) __VA_ARGS__
#define KILN_IN_DSL_Dsl(...) __VA_ARGS__
#define KILN_IN_DSL_Plan(...)
#define KILN_IN_PLAN_Both(...) __VA_ARGS__
#define KILN_IN_PLAN_Dsl(...)
#define KILN_IN_PLAN_Plan(...) __VA_ARGS__
// KILN_POINTWISE_<pointwise>(x) is x where the row is an element-wise layer.
#define KILN_POINTWISE_0(...)
#define KILN_POINTWISE_x(...) __VA_ARGS__
#define KILN_POINTWISE_y(...) __VA_ARGS__

// The layers a BluePrint is written in (layers.def's rows with role Both or Dsl).
enum class LayerKind {
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_DSL_##role(e, )
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
};
inline constexpr int kLayerKindCount = 0
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_DSL_##role(+1)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
    ;
const char* layer_kind_name(LayerKind k);
// Whether the layer has a kernel, stride and padding (layers.def's window column).
bool layer_kind_has_window(LayerKind k);

struct Layer {
  LayerKind kind = LayerKind::Identity;
  std::string name;          // path segment; empty inside a Seq = its index
  bool transparent = false;  // adds no path segment
  // Conv / FC / pooling.
  int out = 0;  // output channels (conv) or features (fc); adaptive pool output size
  int k = 1, stride = 1, pad = 0;
  bool bias = false;
  // BatchNorm.
  float eps = 1e-5f, momentum = 0.1f;
  // Dropout.
  float p = 0.0f;
  // Seq: the layers in order. Residual: {main, shortcut}.
  std::vector<Layer> children;

  Layer named(std::string n) const {
    Layer l = *this;
    l.name = std::move(n);
    return l;
  }
  Layer as_transparent() const {
    Layer l = *this;
    l.transparent = true;
    return l;
  }
};

Layer conv(int out, int k, int stride = 1, int pad = 0, bool bias = false);
Layer bn2d(float eps = 1e-5f, float momentum = 0.1f);
// The element-wise layers of layers.def (pointwise rows): relu().
#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_POINTWISE_##pointwise(Layer name();)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
// Conv → BatchNorm → ReLU, named "<name>.conv" and "<name>.bn" (the DSL's cbr).
Layer cbr(int out, int k, int stride = 1, int pad = 0);
Layer maxpool(int k, int stride, int pad = 0);
Layer avgpool(int k, int stride, int pad = 0);
Layer adaptive_avgpool(int out_size);  // identity when the map is already that size
Layer gap();                           // global average pool to [N, C]
Layer flatten();
Layer fc(int out, bool bias = true);
Layer dropout(float p);
Layer identity();
Layer seq(std::vector<Layer> layers);
template <typename... L>
Layer seq(L... layers) {
  return seq(std::vector<Layer>{layers...});
}
// relu(main(x) + shortcut(x)); the main branch is transparent (torchvision's BasicBlock).
Layer residual(Layer main, Layer shortcut = identity());
// n copies made by make(i), in a Seq.
template <typename F>
Layer repeat(int n, F make) {
  std::vector<Layer> ls;
  for (int i = 0; i < n; ++i) ls.push_back(make(i));
  return seq(std::move(ls));
}

struct InputSpec {
  int height = 28, width = 28, channels = 1;
};

struct BluePrint {
  std::string name;
  InputSpec input;
  int num_classes = 10;
  Layer root;
};

}  // namespace kiln
