#include "kiln/backend/engine_table.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/core/file.h"

namespace kiln {

namespace {

constexpr const char* kMagic = "kiln-engine-table";
constexpr int kVersion = 1;
constexpr size_t kMaxChoices = 3;

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t tab = line.find('\t', start);
    out.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) return out;
    start = tab + 1;
  }
}

int64_t parse_i64(const std::string& s, bool& ok) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  ok = ok && !s.empty() && end == s.c_str() + s.size() && errno == 0;
  return v;
}

double parse_f64(const std::string& s, bool& ok) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  ok = ok && !s.empty() && end == s.c_str() + s.size() && errno == 0 && v >= 0.0;
  return v;
}

}  // namespace

EngineTable EngineTable::parse(const std::string& text, const std::string& source) {
  EngineTable t;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  bool magic = false;
  auto bad = [&](const std::string& why) {
    KILN_FAIL(
        Data, "engine table ", source, " line ", number, ": ", why,
        "; re-run `kiln tune` to write it again, or set KILN_ENGINE_TABLE=0 to build without it");
  };
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> f = split_tabs(line);
    if (!magic) {
      if (f.size() != 2 || f[0] != kMagic)
        bad(std::string("expected the header '") + kMagic + "<TAB>1'");
      bool ok = true;
      if (parse_i64(f[1], ok) != kVersion || !ok) bad("format version " + f[1] + " is not 1");
      magic = true;
      continue;
    }
    if (f[0] == "gpu" && f.size() == 2) {
      t.gpu = f[1];
      continue;
    }
    if (f[0] == "cudnn" && f.size() == 2) {
      bool ok = true;
      t.cudnn = parse_i64(f[1], ok);
      if (!ok) bad("cudnn version '" + f[1] + "' is not a number");
      continue;
    }
    if (f.size() < 4 || (f.size() - 1) % 3 != 0 || (f.size() - 1) / 3 > kMaxChoices) {
      bad("an entry is a key and one to three (engine, workspace, ms) triples, tab-separated");
    }
    EngineEntry e;
    e.key = f[0];
    if (e.key.empty()) bad("empty key");
    for (size_t i = 1; i < f.size(); i += 3) {
      bool ok = !f[i].empty();
      EngineChoice c;
      c.engine = f[i];
      c.workspace = parse_i64(f[i + 1], ok);
      c.ms = parse_f64(f[i + 2], ok);
      if (!ok || c.workspace < 0)
        bad("choice '" + f[i] + "' needs a workspace >= 0 and a time >= 0");
      e.choices.push_back(std::move(c));
    }
    if (t.find(e.key) != nullptr) bad("key '" + e.key + "' appears twice");
    t.put(std::move(e));
  }
  if (!magic) {
    number = 0;
    bad(std::string("the file is empty or has no '") + kMagic + "' header");
  }
  return t;
}

EngineTable EngineTable::load(const std::string& path) {
  return parse(read_file_text(path), path);
}

std::string EngineTable::to_text() const {
  std::ostringstream o;
  o << "# kiln engine experience table (SPEC S16), written by `kiln tune`: for each convolution\n"
       "# graph, the fastest cuDNN engines measured on this GPU and cuDNN version (winner "
       "first).\n";
  o << kMagic << '\t' << kVersion << '\n' << "gpu\t" << gpu << '\n' << "cudnn\t" << cudnn << '\n';
  for (const EngineEntry& e : entries_) {
    o << e.key;
    for (const EngineChoice& c : e.choices) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.4f", c.ms);
      o << '\t' << c.engine << '\t' << c.workspace << '\t' << ms;
    }
    o << '\n';
  }
  return o.str();
}

void EngineTable::save(const std::string& path) const {
  write_text_atomic(path, to_text());
}

const EngineEntry* EngineTable::find(const std::string& key) const {
  const auto it =
      std::lower_bound(entries_.begin(), entries_.end(), key,
                       [](const EngineEntry& e, const std::string& k) { return e.key < k; });
  return it != entries_.end() && it->key == key ? &*it : nullptr;
}

void EngineTable::put(EngineEntry entry) {
  KILN_CHECK(!entry.key.empty() && !entry.choices.empty(), InvalidArgument,
             "engine table: an entry needs a key and at least one engine");
  for (const EngineChoice& c : entry.choices) {
    KILN_CHECK(c.engine.find_first_of("\t\n") == std::string::npos && !c.engine.empty() &&
                   entry.key.find_first_of("\t\n") == std::string::npos,
               InvalidArgument, "engine table: names may not hold tabs or newlines");
  }
  std::stable_sort(entry.choices.begin(), entry.choices.end(),
                   [](const EngineChoice& a, const EngineChoice& b) { return a.ms < b.ms; });
  if (entry.choices.size() > kMaxChoices) entry.choices.resize(kMaxChoices);
  const auto it =
      std::lower_bound(entries_.begin(), entries_.end(), entry.key,
                       [](const EngineEntry& e, const std::string& k) { return e.key < k; });
  if (it != entries_.end() && it->key == entry.key) {
    *it = std::move(entry);
  } else {
    entries_.insert(it, std::move(entry));
  }
}

void EngineTable::merge(const EngineTable& other) {
  for (const EngineEntry& e : other.entries_) put(e);
}

std::string installed_engine_table_dir(const std::string& from_lib) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&installed_engine_table_dir), &info) == 0 ||
      info.dli_fname == nullptr) {
    return from_lib;
  }
  const std::filesystem::path lib = std::filesystem::absolute(info.dli_fname).parent_path();
  return (lib / from_lib).lexically_normal().string();
}

std::string autotune_cache_dir(const std::string& setting) {
  if (setting == "0" || setting == "off" || setting == "false") return "";
  if (!setting.empty()) return setting;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] != '\0') {
    return (std::filesystem::path(xdg) / "kiln").string();
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0') {
    return (std::filesystem::path(home) / ".cache" / "kiln").string();
  }
  return "";
}

std::string engine_table_dir(const std::string& source_dir, const std::string& installed_dir) {
  std::error_code ec;
  if (!source_dir.empty() && std::filesystem::is_directory(source_dir, ec)) return source_dir;
  return installed_dir.empty() ? source_dir : installed_dir;
}

std::string engine_table_file(const std::string& dir, const std::string& gpu, int64_t cudnn) {
  std::string slug;
  for (char c : gpu) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      slug += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!slug.empty() && slug.back() != '-') {
      slug += '-';
    }
  }
  while (!slug.empty() && slug.back() == '-') slug.pop_back();
  if (slug.empty()) slug = "gpu";
  return dir + "/" + slug + "_cudnn" + std::to_string(cudnn) + ".tsv";
}

}  // namespace kiln
