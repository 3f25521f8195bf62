// The engine experience table: for one GPU model and cuDNN version, the measured
// fastest cuDNN engines of each convolution graph kiln builds, keyed by op kind and shape.
// `kiln tune` measures every engine the heuristics and the fallback list offer and writes the
// table; at compile time the CUDA backend looks each graph up (binary search) and tries the
// winner, then the two backups, then falls back to cuDNN's heuristic choice. Pure C++ (no
// CUDA), so the format and the lookup are tested on any machine.
//
// The file is text, one entry per line, fields separated by tabs:
//   # comment lines
//   kiln-engine-table<TAB>1
//   gpu<TAB>NVIDIA H200
//   cudnn<TAB>91400
//   <key><TAB><engine><TAB><workspace bytes><TAB><ms>   (one to three triples, fastest first)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

struct EngineChoice {
  std::string engine;     // cuDNN's engine-config name, e.g. "eng0_k2=1_k3=0"
  int64_t workspace = 0;  // bytes
  double ms = 0.0;        // median execution time when tuned
};

struct EngineEntry {
  std::string key;                    // op kind and shape, as the CUDA backend spells them
  std::vector<EngineChoice> choices;  // winner first, then up to two backups
};

class EngineTable {
 public:
  std::string gpu;    // cudaDeviceProp::name
  int64_t cudnn = 0;  // cudnnGetVersion()

  // Reads a table; a malformed file is an Error(Data) naming the file, the line and the fix.
  static EngineTable load(const std::string& path);
  // Writes atomically (temporary name, then rename).
  void save(const std::string& path) const;
  std::string to_text() const;
  static EngineTable parse(const std::string& text, const std::string& source);

  // Binary search over the sorted entries; nullptr when the key is not there.
  const EngineEntry* find(const std::string& key) const;
  // Inserts or replaces the entry with this key (entries stay sorted). At most three choices
  // are kept, fastest first.
  void put(EngineEntry entry);
  // Every entry of `other` replaces ours (a newer tuning run wins).
  void merge(const EngineTable& other);
  const std::vector<EngineEntry>& entries() const { return entries_; }

 private:
  std::vector<EngineEntry> entries_;  // sorted by key
};

// The table file for a GPU and cuDNN version under `dir`: "<dir>/<gpu slug>_cudnn<version>.tsv",
// e.g. "configs/engines/nvidia-h200_cudnn91400.tsv".
std::string engine_table_file(const std::string& dir, const std::string& gpu, int64_t cudnn);

// Where the committed tables are read from: the source tree's configs/engines while it exists
// (a build tree; `kiln tune` writes beside the sources), else the installed copy, so an
// installed kiln keeps its tables when the sources are gone. An empty source_dir is skipped.
std::string engine_table_dir(const std::string& source_dir, const std::string& installed_dir);

// Where compile-time autotuning keeps what it measured, so that the next process compiling the
// same convolutions on the same GPU and cuDNN takes those engines without timing them again.
// `setting` is KILN_AUTOTUNE_CACHE's value: empty for the default place ($XDG_CACHE_HOME/kiln,
// else $HOME/.cache/kiln), "0" or "off" for none (returns ""), anything else a folder.
std::string autotune_cache_dir(const std::string& setting);

// The installed copy: `from_lib` (e.g. "../share/kiln/engines", fixed at configure time from
// the install layout) resolved against the folder libkiln was loaded from, so that
// `cmake --install --prefix P` anywhere finds P/share/kiln/engines.
std::string installed_engine_table_dir(const std::string& from_lib);

}  // namespace kiln
