// The model zoo. Parameter names and counts equal torchvision's for the ImageNet
// forms, so weights move both ways.
#pragma once
#include <string>
#include <vector>

#include "kiln/blueprint/blueprint.h"

namespace kiln {

struct ZooOptions {
  // "imagenet" (224x224x3, 1000 classes) or "small" (28x28x1 for mlp/lenet/cnn,
  // 32x32x3 otherwise; 10 classes). A model name ending in "_small" picks "small".
  std::string form;
  int num_classes = 0;  // 0 = the form's default
  int image_size = 0;   // 0 = the form's default
  int in_channels = 0;  // 0 = the form's default
};

// Names: mlp, lenet, cnn (four 3x3 Conv+BN+ReLU, two max-pools, one fc: the Fashion-MNIST
// default), resnet18, resnet34, resnet50, vgg11_bn, vgg16_bn; each also as NAME_small.
BluePrint make_model(const std::string& name, const ZooOptions& options = {});
std::vector<std::string> zoo_model_names();

}  // namespace kiln
