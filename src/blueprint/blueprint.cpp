#include "kiln/blueprint/blueprint.h"

#include <iterator>

namespace kiln {

namespace {
struct LayerKindInfo {
  const char* name;
  bool window;
};
constexpr LayerKindInfo kLayerKinds[] = {
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_DSL_##role({#name, window}, )
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
};
static_assert(std::size(kLayerKinds) == kLayerKindCount, "layers.def and LayerKind disagree");
}  // namespace

const char* layer_kind_name(LayerKind k) {
  const auto i = static_cast<size_t>(k);
  return i < std::size(kLayerKinds) ? kLayerKinds[i].name : "?";
}

bool layer_kind_has_window(LayerKind k) {
  return kLayerKinds[static_cast<size_t>(k)].window;
}

static Layer make(LayerKind kind) {
  Layer l;
  l.kind = kind;
  return l;
}

Layer conv(int out, int k, int stride, int pad, bool bias) {
  Layer l = make(LayerKind::Conv);
  l.out = out;
  l.k = k;
  l.stride = stride;
  l.pad = pad;
  l.bias = bias;
  return l;
}

Layer bn2d(float eps, float momentum) {
  Layer l = make(LayerKind::BatchNorm);
  l.eps = eps;
  l.momentum = momentum;
  return l;
}

#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_POINTWISE_##pointwise(Layer name() { return make(LayerKind::e); })
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER

Layer cbr(int out, int k, int stride, int pad) {
  return seq(conv(out, k, stride, pad).named("conv"), bn2d().named("bn"), relu().named("relu"));
}

Layer maxpool(int k, int stride, int pad) {
  Layer l = make(LayerKind::MaxPool);
  l.k = k;
  l.stride = stride;
  l.pad = pad;
  return l;
}

Layer avgpool(int k, int stride, int pad) {
  Layer l = make(LayerKind::AvgPool);
  l.k = k;
  l.stride = stride;
  l.pad = pad;
  return l;
}

Layer adaptive_avgpool(int out_size) {
  Layer l = make(LayerKind::AdaptiveAvgPool);
  l.out = out_size;
  return l;
}

Layer gap() {
  return make(LayerKind::GlobalAvgPool);
}
Layer flatten() {
  return make(LayerKind::Flatten);
}

Layer fc(int out, bool bias) {
  Layer l = make(LayerKind::FC);
  l.out = out;
  l.bias = bias;
  return l;
}

Layer dropout(float p) {
  Layer l = make(LayerKind::Dropout);
  l.p = p;
  return l;
}

Layer identity() {
  return make(LayerKind::Identity);
}

Layer seq(std::vector<Layer> layers) {
  Layer l = make(LayerKind::Seq);
  l.children = std::move(layers);
  return l;
}

Layer residual(Layer main, Layer shortcut) {
  Layer l = make(LayerKind::Residual);
  l.children = {main.as_transparent(), std::move(shortcut)};
  return l;
}

}  // namespace kiln
