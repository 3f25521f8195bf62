#include "kiln/graph/tensor.h"

namespace kiln {

namespace {
struct RegionInfo {
  const char* name;
  const char* doc;
};
constexpr RegionInfo kRegions[] = {
#define KILN_REGION_INFO(name, doc) {#name, doc},
    KILN_REGIONS(KILN_REGION_INFO)
#undef KILN_REGION_INFO
};
}  // namespace

const char* region_name(Region r) {
  return kRegions[static_cast<int>(r)].name;
}
const char* region_doc(Region r) {
  return kRegions[static_cast<int>(r)].doc;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Flat:
      return "flat";
    case Layout::NHWC:
      return "NHWC";
    case Layout::NC:
      return "NC";
    case Layout::KRSC:
      return "KRSC";
    case Layout::OI:
      return "OI";
  }
  return "?";
}

}  // namespace kiln
