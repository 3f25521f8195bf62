// Shape: dimensions of a tensor. Feature maps are NHWC, convolution weights KRSC
// (ARCHITECTURE.md, "Layout"); a Shape itself carries no layout.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kiln {

struct Shape {
  std::vector<int64_t> dims;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d) : dims(d) {}
  explicit Shape(std::vector<int64_t> d) : dims(std::move(d)) {}

  int rank() const { return static_cast<int>(dims.size()); }
  int64_t operator[](int i) const { return dims[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims[static_cast<size_t>(i)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
  bool operator==(const Shape& o) const { return dims == o.dims; }
  bool operator!=(const Shape& o) const { return dims != o.dims; }
  std::string str() const;  // "[256, 56, 56, 64]"
};

inline int64_t align_up(int64_t v, int64_t a) {
  return (v + a - 1) / a * a;
}

}  // namespace kiln
