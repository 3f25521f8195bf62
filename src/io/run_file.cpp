// Run-file parsing on top of yaml-cpp. yaml-cpp reads JSON too (JSON is, near enough, YAML
// flow style), so one parser serves both; every yaml-cpp exception is turned into one
// Error(Config) naming the file and the line, so no library exception reaches the user.
#include "kiln/io/run_file.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <map>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/file.h"

namespace kiln {
namespace {

[[noreturn]] void fail(const std::string& what, const YAML::Mark& mark,
                       const std::string& problem) {
  // yaml-cpp counts lines and columns from 0; editors count from 1.
  if (mark.is_null() || mark.line < 0) KILN_FAIL(Config, "run file '", what, "': ", problem);
  KILN_FAIL(Config, "run file '", what, "', line ", mark.line + 1, ": ", problem);
}

// A syntax error: the column helps too, and the usual causes are worth naming.
[[noreturn]] void fail_syntax(const std::string& what, const YAML::Mark& mark,
                              const std::string& problem) {
  const std::string column =
      mark.is_null() || mark.column < 0 ? "" : detail::concat(" (column ", mark.column + 1, ")");
  fail(what, mark,
       detail::concat("not valid YAML or JSON", column, ": ", problem,
                      "; check the indentation, quotes, brackets and commas there"));
}

const char* node_kind(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return "a scalar";
    case YAML::NodeType::Null:
      return "empty";
    case YAML::NodeType::Undefined:
      break;
  }
  return "undefined";
}

// "--batch_size" -> "batch-size": the spelling the command line uses.
std::string normalise_key(const std::string& what, const YAML::Node& key) {
  if (!key.IsScalar()) {
    fail(what, key.Mark(),
         detail::concat("an option name is ", node_kind(key),
                        "; option names are plain words such as 'batch-size'"));
  }
  std::string k = key.Scalar();
  size_t dashes = 0;
  while (dashes < 2 && dashes < k.size() && k[dashes] == '-') ++dashes;
  k.erase(0, dashes);
  for (char& c : k) {
    if (c == '_') c = '-';
  }
  bool ok = !k.empty() && k[0] != '-';
  for (char c : k) {
    const bool word = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    ok = ok && (word || c == '-' || c == '.');
  }
  if (!ok) {
    fail(
        what, key.Mark(),
        detail::concat("'", key.Scalar(), "' is not an option name; write the ",
                       "flag without its dashes, e.g. 'batch-size: 256' for ", "--batch-size 256"));
  }
  return k;
}

// `at` is where errors point: the option's key for its own value (a null value has no place of
// its own, and a nested mapping is best found by its name), the item for a list item.
std::string scalar_value(const std::string& what, const std::string& key, const YAML::Node& v,
                         const YAML::Mark& at) {
  if (v.IsNull()) {
    fail(what, at,
         detail::concat("option '", key, "' has no value; give one (e.g. '", key,
                        ": true' for a switch) or delete the line"));
  }
  if (v.IsMap()) {
    fail(what, at,
         detail::concat("option '", key, "' is a nested mapping; run files are flat, ",
                        "one option per line as on the command line (--", key,
                        " VALUE): give a scalar or a list of scalars"));
  }
  return v.Scalar();
}

std::string option_value(const std::string& what, const std::string& key, const YAML::Node& v,
                         const YAML::Mark& key_mark) {
  if (!v.IsSequence()) return scalar_value(what, key, v, key_mark);
  // A list becomes the comma-separated form the flag takes: [30, 60] -> "30,60".
  std::string joined;
  bool first = true;
  for (const YAML::Node& item : v) {
    if (item.IsSequence()) {
      fail(what, item.Mark(),
           detail::concat("option '", key, "' holds a list inside a list; ",
                          "give a flat list such as [30, 60]"));
    }
    const std::string s =
        scalar_value(what, key, item, item.Mark().is_null() ? key_mark : item.Mark());
    if (s.find(',') != std::string::npos) {
      fail(what, item.Mark(),
           detail::concat("list item '", s, "' of option '", key,
                          "' contains a comma, which would split it in two ",
                          "when the list is joined; remove the comma"));
    }
    if (!first) joined += ',';
    joined += s;
    first = false;
  }
  return joined;
}

// Counts documents without building them. yaml-cpp 0.7 leaves a token it cannot place (a
// stray ',' or ']' at the top level) unconsumed and starts a new empty document before it, so
// YAML::LoadAll loops forever on "," (found by tests/fuzz/fuzz_run_file.cpp) and YAML::Load
// silently returns an empty document. Walking the documents ourselves, stopping at the second,
// bounds the work and tells a real second document ('---') from a stray token.
class DocumentCounter : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override {
    ++count_;
    if (count_ == 2) second_ = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

  int count() const { return count_; }
  const YAML::Mark& second() const { return second_; }

 private:
  int count_ = 0;
  YAML::Mark second_;
};

// Throws unless `text` holds at most one YAML document and nothing after it.
void check_single_document(const std::string& text, const std::string& what) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentCounter counter;
  while (counter.count() < 2 && parser.HandleNextDocument(counter)) {
  }
  if (counter.count() < 2) return;
  const YAML::Mark& at = counter.second();
  const auto pos = static_cast<size_t>(at.pos);
  if (pos < text.size() && text.compare(pos, 3, "---") == 0) {
    fail(what, at,
         "holds more than one YAML document ('---'); keep one mapping of options per file");
  }
  fail_syntax(what, at,
              "unexpected '" + (pos < text.size() ? text.substr(pos, 1) : std::string()) +
                  "' after the end of the document");
}

}  // namespace

RunOptions parse_run_file(const std::string& text, const std::string& what) {
  try {
    check_single_document(text, what);
    const YAML::Node root = YAML::Load(text);
    if (root.IsNull()) return {};  // empty, or only comments
    if (!root.IsMap()) {
      fail(what, root.Mark(),
           detail::concat("the top level is ", node_kind(root),
                          "; a run file is a mapping of option: value, e.g. 'epochs: 90'"));
    }
    RunOptions out;
    std::map<std::string, int> line_of;  // normalised key -> line it was first given on
    for (auto it = root.begin(); it != root.end(); ++it) {
      const std::string key = normalise_key(what, it->first);
      const int line = it->first.Mark().line + 1;
      const auto [prev, fresh] = line_of.emplace(key, line);
      if (!fresh) {
        fail(what, it->first.Mark(),
             detail::concat("option '", key, "' is given again (first on line ", prev->second,
                            "; 'a_b' and 'a-b' are the same option); keep one"));
      }
      out.emplace_back(key, option_value(what, key, it->second, it->first.Mark()));
    }
    return out;
  } catch (const YAML::Exception& e) {
    fail_syntax(what, e.mark, e.msg);
  }
}

RunOptions read_run_file(const std::string& path) {
  std::string text;
  try {
    text = read_file_text(path);
  } catch (const Error& e) {
    KILN_FAIL(Config, "cannot read run file: ", e.what());
  }
  return parse_run_file(text, path);
}

}  // namespace kiln
