// torchvision's architectures, written in the BluePrint DSL. The "small" forms follow the
// usual CIFAR adaptations: a 3x3 stride-1 stem without max-pool for ResNet, and a single
// classifier layer for VGG (the ImageNet classifier would be 119M parameters on a 1x1 map).
#include "kiln/blueprint/zoo.h"

#include <algorithm>

#include "kiln/core/error.h"

namespace kiln {

namespace {

struct Form {
  bool small = false;
  int size = 224, channels = 3, classes = 1000;
};

Layer basic_block(int in, int out, int stride) {
  Layer main = seq(conv(out, 3, stride, 1).named("conv1"), bn2d().named("bn1"),
                   relu().named("relu"), conv(out, 3, 1, 1).named("conv2"), bn2d().named("bn2"));
  if (stride != 1 || in != out) {
    return residual(main, seq(conv(out, 1, stride, 0), bn2d()).named("downsample"));
  }
  return residual(main);
}

Layer bottleneck(int in, int width, int stride) {
  const int out = width * 4;
  Layer main = seq(conv(width, 1, 1, 0).named("conv1"), bn2d().named("bn1"), relu().named("relu"),
                   conv(width, 3, stride, 1).named("conv2"), bn2d().named("bn2"),
                   relu().named("relu2"), conv(out, 1, 1, 0).named("conv3"), bn2d().named("bn3"));
  if (stride != 1 || in != out) {
    return residual(main, seq(conv(out, 1, stride, 0), bn2d()).named("downsample"));
  }
  return residual(main);
}

Layer resnet(const std::vector<int>& blocks, bool bottle, const Form& f) {
  std::vector<Layer> root;
  if (f.small) {
    root = {conv(64, 3, 1, 1).named("conv1"), bn2d().named("bn1"), relu().named("relu")};
  } else {
    root = {conv(64, 7, 2, 3).named("conv1"), bn2d().named("bn1"), relu().named("relu"),
            maxpool(3, 2, 1).named("maxpool")};
  }
  int in = 64;
  const int widths[4] = {64, 128, 256, 512};
  for (int s = 0; s < 4; ++s) {
    std::vector<Layer> stage;
    for (int b = 0; b < blocks[static_cast<size_t>(s)]; ++b) {
      const int stride = (b == 0 && s > 0) ? 2 : 1;
      if (bottle) {
        stage.push_back(bottleneck(in, widths[s], stride));
        in = widths[s] * 4;
      } else {
        stage.push_back(basic_block(in, widths[s], stride));
        in = widths[s];
      }
    }
    root.push_back(seq(std::move(stage)).named("layer" + std::to_string(s + 1)));
  }
  root.push_back(gap().named("avgpool"));
  root.push_back(fc(f.classes).named("fc"));
  return seq(std::move(root));
}

Layer vgg(const std::vector<int>& cfg, const Form& f) {
  std::vector<Layer> features;
  for (int v : cfg) {
    if (v == 0) {
      features.push_back(maxpool(2, 2));
    } else {
      features.push_back(conv(v, 3, 1, 1, /*bias=*/true));
      features.push_back(bn2d());
      features.push_back(relu());
    }
  }
  std::vector<Layer> root{seq(std::move(features)).named("features")};
  if (f.small) {
    root.push_back(flatten().named("flatten"));
    root.push_back(fc(f.classes).named("classifier"));
  } else {
    root.push_back(adaptive_avgpool(7).named("avgpool"));
    root.push_back(flatten().named("flatten"));
    root.push_back(
        seq(fc(4096), relu(), dropout(0.5f), fc(4096), relu(), dropout(0.5f), fc(f.classes))
            .named("classifier"));
  }
  return seq(std::move(root));
}

}  // namespace

std::vector<std::string> zoo_model_names() {
  return {"mlp", "lenet", "cnn", "resnet18", "resnet34", "resnet50", "vgg11_bn", "vgg16_bn"};
}

BluePrint make_model(const std::string& requested, const ZooOptions& options) {
  std::string name = requested;
  std::string form = options.form;
  const std::string suffix = "_small";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    name = name.substr(0, name.size() - suffix.size());
    form = "small";
  }
  const auto names = zoo_model_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    KILN_FAIL(Model, "unknown model '", requested, "'; the zoo has ", list,
              " (each also as NAME_small for 28x28/32x32 inputs)");
  }
  const bool mnist_like = name == "mlp" || name == "lenet" || name == "cnn";
  if (form.empty()) form = mnist_like ? "small" : "imagenet";
  KILN_CHECK(form == "small" || form == "imagenet", Model, "unknown model form '", form, "' for ",
             requested, "; use small or imagenet");
  Form f;
  f.small = form == "small";
  if (f.small) {
    f.size = mnist_like ? 28 : 32;
    f.channels = mnist_like ? 1 : 3;
    f.classes = 10;
  }
  if (options.num_classes > 0) f.classes = options.num_classes;
  if (options.image_size > 0) f.size = options.image_size;
  if (options.in_channels > 0) f.channels = options.in_channels;

  BluePrint bp;
  bp.name = requested;
  bp.input = {f.size, f.size, f.channels};
  bp.num_classes = f.classes;
  if (name == "mlp") {
    bp.root = seq(flatten().named("flatten"), fc(512).named("fc1"), relu(), fc(256).named("fc2"),
                  relu(), fc(f.classes).named("fc3"));
  } else if (name == "lenet") {
    // LeNet-5 with ReLU and max-pooling, BatchNorm after each convolution.
    bp.root =
        seq(cbr(6, 5, 1, 2).named("c1"), maxpool(2, 2).named("s2"), cbr(16, 5, 1, 0).named("c3"),
            maxpool(2, 2).named("s4"), flatten().named("flatten"), fc(120).named("f5"), relu(),
            fc(84).named("f6"), relu(), fc(f.classes).named("f7"));
  } else if (name == "cnn") {
    // The Fashion-MNIST default: four 3x3 Conv+BN+ReLU (32, 32, 64, 64),
    // two 2x2 max-pools, one fc.
    bp.root = seq(cbr(32, 3, 1, 1).named("block1"), cbr(32, 3, 1, 1).named("block2"),
                  maxpool(2, 2).named("pool1"), cbr(64, 3, 1, 1).named("block3"),
                  cbr(64, 3, 1, 1).named("block4"), maxpool(2, 2).named("pool2"),
                  flatten().named("flatten"), fc(f.classes).named("fc"));
  } else if (name == "resnet18") {
    bp.root = resnet({2, 2, 2, 2}, false, f);
  } else if (name == "resnet34") {
    bp.root = resnet({3, 4, 6, 3}, false, f);
  } else if (name == "resnet50") {
    bp.root = resnet({3, 4, 6, 3}, true, f);
  } else if (name == "vgg11_bn") {
    bp.root = vgg({64, 0, 128, 0, 256, 256, 0, 512, 512, 0, 512, 512, 0}, f);
  } else if (name == "vgg16_bn") {
    bp.root =
        vgg({64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0}, f);
  }
  return bp;
}

}  // namespace kiln
