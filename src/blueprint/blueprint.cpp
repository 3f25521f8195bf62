#include "kiln/blueprint/blueprint.h"

namespace kiln {

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::Conv: return "conv";
    case LayerKind::BatchNorm: return "bn2d";
    case LayerKind::ReLU: return "relu";
    case LayerKind::MaxPool: return "maxpool";
    case LayerKind::AvgPool: return "avgpool";
    case LayerKind::AdaptiveAvgPool: return "adaptive_avgpool";
    case LayerKind::GlobalAvgPool: return "gap";
    case LayerKind::Flatten: return "flatten";
    case LayerKind::FC: return "fc";
    case LayerKind::Dropout: return "dropout";
    case LayerKind::Identity: return "identity";
    case LayerKind::Seq: return "seq";
    case LayerKind::Residual: return "residual";
  }
  return "?";
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

Layer relu() { return make(LayerKind::ReLU); }

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

Layer gap() { return make(LayerKind::GlobalAvgPool); }
Layer flatten() { return make(LayerKind::Flatten); }

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

Layer identity() { return make(LayerKind::Identity); }

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
