// The engine experience table's file format and lookup (SPEC S16): written and read back
// unchanged, entries found by binary search, at most three choices kept fastest first, a
// newer measurement replacing an older one, and every malformed file refused with its name,
// the line and the fix.
#include "kiln/backend/engine_table.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/file.h"

namespace kiln {
namespace {

EngineEntry entry(const std::string& key, std::initializer_list<EngineChoice> choices) {
  EngineEntry e;
  e.key = key;
  e.choices = choices;
  return e;
}

EngineTable sample() {
  EngineTable t;
  t.gpu = "NVIDIA H200";
  t.cudnn = 91400;
  t.put(entry("fprop:256,56,56,64:64,1,1:1,1,0,0:f16,f16,f16",
              {{"eng0_k2=1", 0, 0.25}, {"eng3", 4096, 0.31}}));
  t.put(entry("dgrad:256,56,56,64:64,3,3:1,1,1,1:f16,f16,f16", {{"eng7_k5=2", 1 << 20, 0.5}}));
  t.put(entry("wgrad:256,7,7,512:2048,1,1:1,1,0,0:f16,f16,f16",
              {{"b", 0, 0.9}, {"a", 0, 0.7}, {"d", 0, 1.5}, {"c", 0, 1.1}}));
  return t;
}

TEST(EngineTable, RoundTripsThroughItsText) {
  const EngineTable t = sample();
  const EngineTable u = EngineTable::parse(t.to_text(), "memory");
  EXPECT_EQ(u.gpu, "NVIDIA H200");
  EXPECT_EQ(u.cudnn, 91400);
  ASSERT_EQ(u.entries().size(), 3u);
  EXPECT_EQ(u.to_text(), t.to_text());
  const EngineEntry* e = u.find("fprop:256,56,56,64:64,1,1:1,1,0,0:f16,f16,f16");
  ASSERT_NE(e, nullptr);
  ASSERT_EQ(e->choices.size(), 2u);
  EXPECT_EQ(e->choices[1].engine, "eng3");
  EXPECT_EQ(e->choices[1].workspace, 4096);
  EXPECT_NEAR(e->choices[1].ms, 0.31, 1e-9);
}

TEST(EngineTable, KeepsTheThreeFastestInOrder) {
  const EngineTable t = sample();
  const EngineEntry* e = t.find("wgrad:256,7,7,512:2048,1,1:1,1,0,0:f16,f16,f16");
  ASSERT_NE(e, nullptr);
  ASSERT_EQ(e->choices.size(), 3u);
  EXPECT_EQ(e->choices[0].engine, "a");
  EXPECT_EQ(e->choices[1].engine, "b");
  EXPECT_EQ(e->choices[2].engine, "c");
}

TEST(EngineTable, BinarySearchFindsEveryKeyAndOnlyThose) {
  EngineTable t;
  for (int i = 999; i >= 0; --i)
    t.put(entry("k" + std::to_string(i), {{"e" + std::to_string(i), 0, 1.0}}));
  ASSERT_EQ(t.entries().size(), 1000u);
  for (size_t i = 1; i < t.entries().size(); ++i)
    EXPECT_LT(t.entries()[i - 1].key, t.entries()[i].key);
  for (int i = 0; i < 1000; ++i) {
    const EngineEntry* e = t.find("k" + std::to_string(i));
    ASSERT_NE(e, nullptr) << i;
    EXPECT_EQ(e->choices[0].engine, "e" + std::to_string(i));
  }
  EXPECT_EQ(t.find("k1000"), nullptr);
  EXPECT_EQ(t.find(""), nullptr);
  EXPECT_EQ(t.find("k"), nullptr);
}

TEST(EngineTable, NewerMeasurementsReplaceOlderOnes) {
  EngineTable t = sample();
  EngineTable newer;
  newer.put(entry("dgrad:256,56,56,64:64,3,3:1,1,1,1:f16,f16,f16", {{"eng1", 0, 0.4}}));
  newer.put(entry("fprop:1,2,3,4:5,1,1:1,1,0,0:f32,f32,f32", {{"eng2", 0, 0.1}}));
  t.merge(newer);
  EXPECT_EQ(t.entries().size(), 4u);
  EXPECT_EQ(t.find("dgrad:256,56,56,64:64,3,3:1,1,1,1:f16,f16,f16")->choices[0].engine, "eng1");
}

TEST(EngineTable, SavesAtomicallyAndLoads) {
  const std::string path = ::testing::TempDir() + "/kiln_engine_table_test.tsv";
  sample().save(path);
  EXPECT_FALSE(std::filesystem::exists(atomic_temp_path(path)));
  EXPECT_EQ(EngineTable::load(path).to_text(), sample().to_text());
  std::remove(path.c_str());
}

TEST(EngineTable, FileNameSaysGpuAndCudnn) {
  EXPECT_EQ(engine_table_file("configs/engines", "NVIDIA H200", 91400),
            "configs/engines/nvidia-h200_cudnn91400.tsv");
  EXPECT_EQ(engine_table_file("d", "NVIDIA GeForce RTX 4090 ", 90100),
            "d/nvidia-geforce-rtx-4090_cudnn90100.tsv");
  EXPECT_EQ(engine_table_file("d", "", 1), "d/gpu_cudnn1.tsv");
}

// The source tree's tables while it exists, else the installed copy.
TEST(EngineTable, TablesComeFromTheSourcesElseTheInstalledCopy) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(::testing::TempDir()) / "kiln_engine_dirs";
  fs::remove_all(root);
  const fs::path src = root / "configs/engines", inst = root / "prefix/share/kiln/engines";
  fs::create_directories(inst);
  EXPECT_EQ(engine_table_dir(src.string(), inst.string()), inst.string())
      << "sources gone: the installed copy";
  fs::create_directories(src);
  EXPECT_EQ(engine_table_dir(src.string(), inst.string()), src.string())
      << "a build tree: its own sources";
  EXPECT_EQ(engine_table_dir("", inst.string()), inst.string());
  fs::remove_all(root);
}

// The installed copy is found from the folder the library was loaded from (here the build
// tree, where libkiln sits at the top), so an install under any --prefix finds its tables.
TEST(EngineTable, InstalledCopyIsFoundBesideTheLibrary) {
  namespace fs = std::filesystem;
  const fs::path got = installed_engine_table_dir("../share/kiln/engines");
  const fs::path want = fs::path(KILN_BINARY_DIR).parent_path() / "share/kiln/engines";
  EXPECT_EQ(fs::weakly_canonical(got), fs::weakly_canonical(want));
}

void expect_refused(const std::string& text, const std::string& needle) {
  try {
    EngineTable::parse(text, "t.tsv");
    ADD_FAILURE() << "accepted: " << text;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("t.tsv"), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
    EXPECT_NE(what.find("kiln tune"), std::string::npos) << what;
  }
}

// KILN_AUTOTUNE_CACHE: a folder as given; "0" / "off" none; unset, $XDG_CACHE_HOME/kiln, else
// ~/.cache/kiln; neither variable set, none.
TEST(EngineTable, AutotuneCacheFolder) {
  EXPECT_EQ(autotune_cache_dir("/tmp/mine"), "/tmp/mine");
  EXPECT_EQ(autotune_cache_dir("0"), "");
  EXPECT_EQ(autotune_cache_dir("off"), "");
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string saved_xdg = xdg ? xdg : "", saved_home = home ? home : "";
  setenv("XDG_CACHE_HOME", "/x/cache", 1);
  setenv("HOME", "/h", 1);
  EXPECT_EQ(autotune_cache_dir(""), "/x/cache/kiln");
  unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(autotune_cache_dir(""), "/h/.cache/kiln");
  unsetenv("HOME");
  EXPECT_EQ(autotune_cache_dir(""), "");
  if (xdg) setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
  if (home) setenv("HOME", saved_home.c_str(), 1);
}

// Every committed table loads, sits under the name its own header gives (a table copied to the
// wrong GPU's name would steer that GPU), and holds the AMP graphs of the two models the
// benchmarks run, stem included: `gpu-check.sh tune` once wrote an FP32-only table by default.
TEST(EngineTable, CommittedTablesAreNamedForTheirGpuAndCoverTheBenchmarks) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(KILN_SOURCE_DIR) / "configs/engines";
  int tables = 0;
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".tsv") continue;
    ++tables;
    const EngineTable t = EngineTable::load(f.path().string());
    EXPECT_EQ(engine_table_file(dir.string(), t.gpu, t.cudnn), f.path().string());
    for (const char* key :
         {"fprop:256,224,224,3:64,7,7:2,2,3,3:f16,f16,f16",  // ResNet-50's stem
          "wgrad:256,224,224,3:64,7,7:2,2,3,3:f16,f16,f16",
          "fprop:256,224,224,3:64,3,3:1,1,1,1:f16,f16,f16",      // VGG16-BN's first
          "dgrad:256,14,14,512:512,3,3:1,1,1,1:f16,f16,f16"}) {  // VGG16-BN block 5
      EXPECT_NE(t.find(key), nullptr) << f.path() << " lacks " << key;
    }
  }
  EXPECT_GE(tables, 2) << "the H200's and the H100's tables";
}

TEST(EngineTable, MalformedFilesAreRefusedWithTheLine) {
  expect_refused("", "no 'kiln-engine-table' header");
  expect_refused("# only a comment\n", "no 'kiln-engine-table' header");
  expect_refused("gpu\tx\n", "line 1");
  expect_refused("kiln-engine-table\t2\n", "version 2");
  expect_refused("kiln-engine-table\t1\ncudnn\tnine\n", "line 2");
  expect_refused("kiln-engine-table\t1\nkey\teng\t0\n", "line 2");
  expect_refused("kiln-engine-table\t1\nkey\teng\t-1\t0.5\n", "workspace >= 0");
  expect_refused("kiln-engine-table\t1\nkey\teng\t0\tfast\n", "line 2");
  expect_refused("kiln-engine-table\t1\nkey\ta\t0\t1\tb\t0\t1\tc\t0\t1\td\t0\t1\n", "one to three");
  expect_refused("kiln-engine-table\t1\nk\ta\t0\t1\nk\tb\t0\t1\n", "appears twice");
  expect_refused("kiln-engine-table\t1\n\ta\t0\t1\n", "empty key");
}

TEST(EngineTable, RefusesNamesThatWouldBreakTheFormat) {
  EngineTable t;
  EXPECT_THROW(t.put(entry("k", {{"a\tb", 0, 1.0}})), Error);
  EXPECT_THROW(t.put(entry("k\n", {{"a", 0, 1.0}})), Error);
  EXPECT_THROW(t.put(entry("k", {})), Error);
}

}  // namespace
}  // namespace kiln
