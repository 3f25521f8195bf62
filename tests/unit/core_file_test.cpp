// Atomic writes (the old file survives every failure, no temp file is left) and the JSON text
// helpers every kiln writer shares.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "io/json_cursor.h"
#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/io/json.h"
#include "unit/io_test_util.h"

namespace kiln {
namespace {

// Runs `write` (expected to fail) and checks the failure is Error(Io) naming `path`, that the
// old content is still there and that nothing but the old file is in the folder.
template <typename F>
void expect_failed_write_keeps_old(const test::ScratchDir& dir, const std::string& path,
                                   const std::string& old_text, F&& write) {
  try {
    write();
    ADD_FAILURE() << "the write succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("cannot write '" + path + "'"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(test::slurp(path), old_text);
  EXPECT_FALSE(std::filesystem::exists(atomic_temp_path(path)));
}

TEST(CoreFile, WriteTextAtomicCreatesAndReplaces) {
  test::ScratchDir dir;
  const std::string path = dir.file("summary.json");
  write_text_atomic(path, "first");
  EXPECT_EQ(test::slurp(path), "first");
  write_text_atomic(path, "second, longer");
  EXPECT_EQ(test::slurp(path), "second, longer");
  write_text_atomic(path, "");
  EXPECT_EQ(test::slurp(path), "");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"summary.json"});
  EXPECT_EQ(atomic_temp_path(path), path + ".tmp." + std::to_string(getpid()));
}

TEST(CoreFile, WriteFileAtomicConcatenatesPieces) {
  test::ScratchDir dir;
  const std::vector<uint8_t> a = {1, 2, 3}, b = {}, c = {4, 5};
  const std::vector<std::span<const uint8_t>> pieces = {a, b, c};
  write_file_atomic(dir.file("x"), pieces);
  EXPECT_EQ(read_file_bytes(dir.file("x")), (std::vector<uint8_t>{1, 2, 3, 4, 5}));
}

TEST(CoreFile, DiskFullDuringWriteKeepsTheOldFile) {
  test::ScratchDir dir;
  const std::string path = dir.file("metrics.json");
  write_text_atomic(path, "old");
  expect_failed_write_keeps_old(dir, path, "old", [&] {
    test::FileSizeLimit limit(1000);
    write_text_atomic(path, std::string(100000, 'x'));
  });
}

TEST(CoreFile, FailedRenameRemovesTheTempFile) {
  test::ScratchDir dir;
  // The target is a non-empty folder: the data is written and synced, then rename() fails.
  const std::string path = dir.file("busy");
  std::filesystem::create_directory(path);
  test::spit(path + "/keep", "k");
  try {
    write_text_atomic(path, "data");
    FAIL() << "renamed a file over a non-empty folder";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("renaming"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::slurp(path + "/keep"), "k");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"busy"});
}

TEST(CoreFile, MissingFolderIsAClearError) {
  test::ScratchDir dir;
  const std::string path = dir.file("no/such/folder/out.txt");
  try {
    write_text_atomic(path, "x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("check that the folder exists and is writable"),
              std::string::npos)
        << e.what();
  }
}

TEST(CoreFile, ReadOnlyFolderKeepsTheOldFile) {
  if (geteuid() == 0) GTEST_SKIP() << "root writes into read-only folders; DiskFull covers this";
  test::ScratchDir dir;
  const std::string path = dir.file("ckpt");
  write_text_atomic(path, "old");
  ASSERT_EQ(chmod(dir.path().c_str(), 0555), 0);
  expect_failed_write_keeps_old(dir, path, "old", [&] { write_text_atomic(path, "new"); });
  chmod(dir.path().c_str(), 0755);
}

TEST(CoreFile, ReadFileBytesNamesAMissingFile) {
  try {
    read_file_bytes("/nonexistent/kiln/file.bin");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kiln/file.bin"), std::string::npos);
  }
}

TEST(IoJson, EscapesAsSerdeJsonDoes) {
  // serde_json (the safetensors writer) escapes quote, backslash and control characters only;
  // \u00XX in lowercase hex; '/', DEL and non-ASCII are left as they are.
  EXPECT_EQ(json_escape("plain"), "plain");
  EXPECT_EQ(json_escape("a\"b\\c"), "a\\\"b\\\\c");
  EXPECT_EQ(json_escape("\b\f\n\r\t"), "\\b\\f\\n\\r\\t");
  EXPECT_EQ(json_escape(std::string("\x01/\x1f\x7f", 4)), "\\u0001/\\u001f\x7f");
  EXPECT_EQ(json_escape(std::string("nul\0x", 5)), "nul\\u0000x");
  EXPECT_EQ(json_escape("é\u2028😀"), "é\u2028😀");
  EXPECT_EQ(json_string("say \"hi\""), "\"say \\\"hi\\\"\"");
}

TEST(IoJson, FindsInvalidUtf8) {
  using detail::find_invalid_utf8;
  constexpr size_t kValid = std::string_view::npos;
  EXPECT_EQ(find_invalid_utf8("ascii é € 😀"), kValid);
  EXPECT_EQ(find_invalid_utf8("ab\x80"), 2u);                // a continuation byte first
  EXPECT_EQ(find_invalid_utf8("a\xc0\x80"), 1u);             // overlong NUL
  EXPECT_EQ(find_invalid_utf8("\xe0\x80\xaf"), 0u);          // overlong '/'
  EXPECT_EQ(find_invalid_utf8("x\xed\xa0\x80"), 1u);         // U+D800, a surrogate
  EXPECT_EQ(find_invalid_utf8("\xf4\x90\x80\x80"), 0u);      // past U+10FFFF
  EXPECT_EQ(find_invalid_utf8("ok\xe2\x82"), 2u);            // cut short
  EXPECT_EQ(find_invalid_utf8("\xf4\x8f\xbf\xbf"), kValid);  // U+10FFFF itself
}

TEST(IoJson, NumbersRoundTripFloats) {
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(0.1f), "0.100000001");  // the float nearest 0.1, all 9 digits
  EXPECT_EQ(json_number(3), "3");
  EXPECT_EQ(json_number(-2.5e-5), "-2.5e-05");
  EXPECT_EQ(json_number(1e30), "1e+30");
  EXPECT_EQ(json_number(NAN), "null");
  EXPECT_EQ(json_number(-INFINITY), "null");
  EXPECT_EQ(format_number(NAN), "nan");
  EXPECT_EQ(format_number(INFINITY), "inf");
  EXPECT_EQ(format_number(-INFINITY), "-inf");
  // Nine significant digits read back as the same float (that is why %.9g).
  for (float f :
       {1.0f / 3.0f, 3.14159274f, 1e-38f, 3.4028235e38f, 16777217.0f, 0.7f, -1.17549435e-38f}) {
    EXPECT_EQ(std::strtof(json_number(f).c_str(), nullptr), f) << json_number(f);
  }
}

}  // namespace
}  // namespace kiln
