// Run files: a YAML or JSON mapping of option -> value that stands in for command
// line flags, so a run can be written down, versioned and repeated:
//   model: resnet50
//   batch_size: 256          # same as --batch-size 256
//   milestones: [30, 60, 80] # same as --milestones 30,60,80
// Keys are flag names without the leading dashes; underscores are accepted and turned into
// dashes. Values are scalars (kept as written: "1e-4" stays "1e-4") or lists of scalars (joined
// with commas). Anything else (nested mappings, lists of lists, empty values, two spellings of
// one option) is Error(Config) naming the file, the line and the fix.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace kiln {

// (option, value) pairs in the order the file gives them.
using RunOptions = std::vector<std::pair<std::string, std::string>>;

// Reads `path`; a file that cannot be read is Error(Config) naming it.
RunOptions read_run_file(const std::string& path);

// Parses YAML or JSON text; `what` names it in errors (usually the path).
RunOptions parse_run_file(const std::string& text, const std::string& what);

}  // namespace kiln
