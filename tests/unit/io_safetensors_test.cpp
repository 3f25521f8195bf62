// safetensors: round trips of every dtype, byte-for-byte agreement with huggingface's Python
// library (a fixture it wrote, and headers it produced, hard-coded), and one test per way a
// file can be malformed, each of which must be Error(Checkpoint) naming the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kiln/core/dtype.h"
#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/io/safetensors.h"
#include "unit/io_test_util.h"

namespace kiln {
namespace {

const std::string kFixture = std::string(KILN_SOURCE_DIR) + "/tests/data/python_numpy.safetensors";

template <typename T>
std::vector<uint8_t> bytes_of(std::initializer_list<T> values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 37);
  return out;
}

// A file with this exact header text (no padding added) and `data_size` data bytes.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_size) {
  std::vector<uint8_t> out(8);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  const auto data = pattern(data_size, 3);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::string header_of(const std::vector<uint8_t>& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[static_cast<size_t>(i)];
  return std::string(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
}

void expect_equal(const StFile& a, const StFile& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    SCOPED_TRACE(name);
    ASSERT_EQ(b.tensors.count(name), 1u);
    const StTensor& u = b.tensors.at(name);
    EXPECT_EQ(t.dtype, u.dtype);
    EXPECT_EQ(t.shape, u.shape);
    EXPECT_EQ(t.data, u.data);
  }
}

// What the fixture holds, built by hand from the values in make_safetensors_fixture.py.
StFile fixture_content() {
  StFile f;
  f.metadata["epoch"] = "7";
  f.tensors["conv1.weight"] = {
      DType::F32, {2, 3}, bytes_of<float>({0.0f, 1.5f, -2.25f, 1e-8f, 3.4e38f, -0.0f})};
  // 1, 0.5, 65504 (largest half) and 6e-8, which rounds to the smallest subnormal half.
  f.tensors["bn1.running_var"] = {
      DType::F16, {4}, bytes_of<uint16_t>({0x3c00, 0x3800, 0x7bff, 0x0001})};
  f.tensors["step"] = {DType::I64, {}, bytes_of<int64_t>({123456789012})};
  f.tensors["labels"] = {DType::I32, {2}, bytes_of<int32_t>({-1, 7})};
  f.tensors["mask"] = {DType::U8, {3}, {0, 1, 255}};
  f.tensors["empty"] = {DType::F32, {0, 4}, {}};
  return f;
}

TEST(IoSafetensors, RoundTripsEveryDtype) {
  StFile f;
  f.tensors["f32"] = {DType::F32, {2, 3}, pattern(24, 1)};
  f.tensors["f16"] = {DType::F16, {3, 1, 2}, pattern(12, 2)};
  f.tensors["bf16"] = {DType::BF16, {5}, pattern(10, 3)};
  f.tensors["i32"] = {DType::I32, {1}, pattern(4, 4)};
  f.tensors["u8"] = {DType::U8, {7}, pattern(7, 5)};
  f.tensors["i64"] = {DType::I64, {}, pattern(8, 6)};  // a scalar
  f.tensors["zero"] = {DType::F16, {0}, {}};
  f.metadata["rng"] = "state \"quoted\" \\ tab\t newline\n \x01 é 😀";
  f.metadata["epoch"] = "12";

  const std::vector<uint8_t> bytes = serialize_safetensors(f);
  EXPECT_EQ(header_of(bytes).size() % 8, 0u) << "the header is padded to a multiple of 8";
  expect_equal(f, parse_safetensors(bytes.data(), bytes.size(), "memory"));

  test::ScratchDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  write_safetensors(path, f);
  expect_equal(f, read_safetensors(path));
  EXPECT_EQ(read_file_bytes(path), bytes)
      << "write_safetensors writes what serialize_safetensors returns";
}

TEST(IoSafetensors, RoundTripsAnEmptyFile) {
  const StFile f;
  const auto bytes = serialize_safetensors(f);
  const StFile g = parse_safetensors(bytes.data(), bytes.size(), "memory");
  EXPECT_TRUE(g.tensors.empty());
  EXPECT_TRUE(g.metadata.empty());
}

TEST(IoSafetensors, ReadsTheFileThePythonLibraryWrote) {
  const StFile f = read_safetensors(kFixture);
  expect_equal(fixture_content(), f);
  // The same values decoded, so that a mistake in fixture_content() cannot hide one here.
  const StTensor& w = f.tensors.at("conv1.weight");
  float v[6];
  std::memcpy(v, w.data.data(), sizeof(v));
  EXPECT_EQ(v[1], 1.5f);
  EXPECT_EQ(v[2], -2.25f);
  EXPECT_EQ(v[4], 3.4e38f);
  EXPECT_TRUE(std::signbit(v[5]) && v[5] == 0.0f) << "-0.0 keeps its sign";
  const StTensor& h = f.tensors.at("bn1.running_var");
  uint16_t hv[4];
  std::memcpy(hv, h.data.data(), sizeof(hv));
  EXPECT_EQ(half_to_float(hv[2]), 65504.0f);
  EXPECT_EQ(hv[3], float_to_half(6e-8f));
  int64_t step;
  std::memcpy(&step, f.tensors.at("step").data.data(), 8);
  EXPECT_EQ(step, 123456789012);
  EXPECT_TRUE(f.tensors.at("step").shape.empty());
  EXPECT_EQ(f.tensors.at("empty").shape, (std::vector<int64_t>{0, 4}));
}

TEST(IoSafetensors, WritesTheSameBytesAsThePythonLibrary) {
  const std::vector<uint8_t> python = read_file_bytes(kFixture);
  EXPECT_EQ(serialize_safetensors(fixture_content()), python);
  test::ScratchDir dir;
  write_safetensors(dir.file("k.safetensors"), fixture_content());
  EXPECT_EQ(read_file_bytes(dir.file("k.safetensors")), python);
}

TEST(IoSafetensors, OrdersTensorsByDtypeThenNameLikePython) {
  // The header the Python library (0.8.0) wrote for these seven tensors, one of each dtype
  // and two F32s, named so that name order and dtype order disagree.
  const std::string python =
      "{\"t9_I64\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]},"
      "\"a_F32\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
      "\"t8_F32\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]},"
      "\"t7_I32\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[16,20]},"
      "\"t6_BF16\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[20,22]},"
      "\"t5_F16\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[22,24]},"
      "\"t4_U8\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[24,25]}}       ";
  StFile f;
  f.tensors["t9_I64"] = {DType::I64, {1}, pattern(8, 0)};
  f.tensors["t8_F32"] = {DType::F32, {1}, pattern(4, 0)};
  f.tensors["t7_I32"] = {DType::I32, {1}, pattern(4, 0)};
  f.tensors["t6_BF16"] = {DType::BF16, {1}, pattern(2, 0)};
  f.tensors["t5_F16"] = {DType::F16, {1}, pattern(2, 0)};
  f.tensors["t4_U8"] = {DType::U8, {1}, pattern(1, 0)};
  f.tensors["a_F32"] = {DType::F32, {1}, pattern(4, 9)};
  const auto bytes = serialize_safetensors(f);
  EXPECT_EQ(header_of(bytes), python);
  // Data follows the header order: a_F32's bytes come right after t9_I64's.
  const size_t data = 8 + python.size();
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin() + data + 8, bytes.begin() + data + 12),
            pattern(4, 9));
}

TEST(IoSafetensors, EmptyFilesMatchThePythonLibrary) {
  // From safetensors' own tests (tensor.rs, test_empty): no tensors, without and with metadata.
  EXPECT_EQ(serialize_safetensors(StFile{}),
            (std::vector<uint8_t>{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '}));
  StFile f;
  f.metadata["framework"] = "pt";
  EXPECT_EQ(header_of(serialize_safetensors(f)), "{\"__metadata__\":{\"framework\":\"pt\"}}     ");
}

TEST(IoSafetensors, AcceptsWhatOtherWritersProduce) {
  // Whitespace between tokens, no padding, tensors listed out of offset order, escapes in
  // names: all valid JSON that the Python library reads, so kiln reads it too.
  const std::string header =
      "{\n  \"b\" : {\"shape\": [1], \"data_offsets\": [4, 8], \"dtype\": \"F32\"},\n"
      "  \"caf\\u00e9 \\ud83d\\ude00\\/\\n\": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": "
      "[8, 9]},\n"
      "  \"__metadata__\": {\"k\": \"v\"},\n"
      "  \"a\": {\"dtype\": \"I32\", \"shape\": [1], \"data_offsets\": [0, 4]}\n}\r\n\t ";
  const auto file = raw_file(header, 9);
  const StFile f = parse_safetensors(file.data(), file.size(), "pretty");
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors.count("café 😀/\n"), 1u);
  // The data section is the last 9 bytes: a [0, 4), b [4, 8), the U8 scalar [8, 9).
  EXPECT_EQ(f.tensors.at("a").data, std::vector<uint8_t>(file.end() - 9, file.end() - 5));
  EXPECT_EQ(f.tensors.at("b").data, std::vector<uint8_t>(file.end() - 5, file.end() - 1));
  EXPECT_EQ(f.tensors.at("café 😀/\n").data, std::vector<uint8_t>(file.end() - 1, file.end()));
  EXPECT_EQ(f.metadata.at("k"), "v");
}

struct BadHeader {
  const char* label;
  std::string header;
  size_t data_size;
  const char* problem;  // a piece of the message that says what is wrong
};

const std::string kT = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

std::vector<BadHeader> bad_headers() {
  return {
      {"not an object", "[1]", 0, "does not start with '{'"},
      {"missing colon", "{\"a\" " + kT + "}", 8, "expected ':' after an object key"},
      {"unterminated string", "{\"a", 0, "unterminated string"},
      {"unterminated object", R"({"a":{"dtype":"F32")", 0, "found the end of the header"},
      {"trailing comma", "{\"a\":" + kT + ",}", 8, "expected a string as an object key"},
      {"trailing garbage", "{\"a\":" + kT + "} x", 8, "after the header's closing '}'"},
      {"second object", "{\"a\":" + kT + "}{}", 8, "after the header's closing '}'"},
      {"tensor not an object", R"({"a":"x"})", 0, "expected '{' for the value of tensor 'a'"},
      {"metadata null", R"({"__metadata__":null})", 0, "expected '{' for __metadata__"},
      {"nested dtype", R"({"a":{"dtype":{"x":1},"shape":[],"data_offsets":[0,0]}})", 0,
       "expected a string as the dtype"},
      {"unknown dtype", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
       "dtype 'F64'"},
      {"duplicate tensor", "{\"a\":" + kT + ",\"a\":" + kT + "}", 8,
       "tensor name 'a' appears twice"},
      {"duplicate metadata key", R"({"__metadata__":{"k":"1","k":"2"}})", 0,
       "metadata key 'k' appears twice"},
      {"two metadata", R"({"__metadata__":{},"__metadata__":{}})", 0, "two \"__metadata__\""},
      {"metadata not a string", R"({"__metadata__":{"epoch":7}})", 0,
       "expected a string as a metadata value"},
      {"duplicate field", R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "two \"dtype\" fields"},
      {"missing shape", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, "lacks \"shape\""},
      {"unknown field", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"foo":[]}})", 8,
       "unknown field \"foo\""},
      {"three offsets", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8,
       "has 3 data_offsets"},
      {"negative dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
       "negative number in the shape"},
      {"fractional dim", R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8,
       "fractional number"},
      {"exponent offset", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8e0]}})", 8,
       "fractional number"},
      {"leading zero", R"({"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}})", 8,
       "leading zero"},
      {"integer past int64",
       R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8,
       "larger than 9223372036854775807"},
      {"shape overflow",
       R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8,
       "too large to address"},
      {"bad escape", R"({"a\x":{}})", 0, "invalid escape"},
      {"lone surrogate", R"({"a\udc00":{}})", 0, "lone low surrogate"},
      {"unpaired high surrogate", R"({"a\ud83dx":{}})", 0, "not followed by a low surrogate"},
      {"raw control char", "{\"a\tb\":{}}", 0, "raw control character"},
      {"invalid utf-8", "{\"a\xff\":{}}", 0, "not valid UTF-8"},
      {"offsets reversed", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8,
       "end before they begin"},
      {"offsets out of range", "{\"a\":" + kT + "}", 4,
       "past the end of the data (4 bytes): the file is truncated"},
      {"size mismatch", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       "F32 [3] (12 bytes) but its data_offsets [0, 8] hold 8 bytes"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "overlaps tensor 'a'"},
      {"same bytes twice",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "overlaps tensor"},
      {"gap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20, "gap of 4 bytes before tensor 'b'"},
      {"trailing data", "{\"a\":" + kT + "}", 12, "4 bytes after the last tensor's data"},
      {"data without tensors", "{}", 4, "4 bytes after the last tensor's data"},
  };
}

TEST(IoSafetensors, RejectsEachMalformedHeaderNamingTheFile) {
  const std::string what = "runs/exp1/bad.safetensors";
  for (const BadHeader& c : bad_headers()) {
    SCOPED_TRACE(c.label);
    const auto file = raw_file(c.header, c.data_size);
    try {
      parse_safetensors(file.data(), file.size(), what);
      ADD_FAILURE() << "accepted a malformed file";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Checkpoint);
      const std::string msg = e.what();
      EXPECT_NE(msg.find("checkpoint '" + what + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.problem), std::string::npos) << msg;
      EXPECT_NE(msg.find("write it again, or check the path"), std::string::npos) << msg;
    }
  }
}

void expect_checkpoint_error(const std::vector<uint8_t>& file, const char* problem) {
  try {
    parse_safetensors(file.data(), file.size(), "x.safetensors");
    ADD_FAILURE() << "accepted a malformed file";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Checkpoint);
    EXPECT_NE(std::string(e.what()).find("checkpoint 'x.safetensors'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
  }
}

TEST(IoSafetensors, RejectsBadHeaderLengths) {
  expect_checkpoint_error({}, "the file has 0 bytes, fewer than the 8-byte header length");
  expect_checkpoint_error({1, 0, 0}, "the file has 3 bytes");
  auto file = raw_file("{}", 0);
  file[0] = 11;  // claims 11 header bytes; the file has 2 after the length
  expect_checkpoint_error(file, "header length 11 is larger than the file (10 bytes)");
  file[0] = 0;
  file[4] = 1;  // 2^32
  expect_checkpoint_error(file, "header length 4294967296 is larger than the 100 MB");
  file[4] = 0;
  file[7] = 0x80;  // 2^63: must not wrap around when 8 is added
  expect_checkpoint_error(file, "is larger than the 100 MB");
  expect_checkpoint_error(raw_file("", 2), "too short for a JSON object");
}

TEST(IoSafetensors, RejectsTruncatedFilesOnDisk) {
  const std::vector<uint8_t> good = read_file_bytes(kFixture);
  test::ScratchDir dir;
  const std::string path = dir.file("truncated.safetensors");
  for (size_t keep : {size_t{0}, size_t{5}, size_t{100}, good.size() - 1}) {
    SCOPED_TRACE(keep);
    test::spit(path, std::string(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep)));
    try {
      read_safetensors(path);
      ADD_FAILURE() << "accepted a truncated file";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Checkpoint);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
}

TEST(IoSafetensors, MissingFileIsAnIoErrorNamingThePath) {
  test::ScratchDir dir;
  const std::string path = dir.file("nope.safetensors");
  try {
    read_safetensors(path);
    FAIL() << "read a file that does not exist";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_safetensors(dir.path()), Error) << "a folder is not a checkpoint";
}

TEST(IoSafetensors, RefusesToWriteInconsistentTensors) {
  StFile f;
  f.tensors["w"] = {DType::F32, {2, 2}, pattern(12, 0)};
  try {
    serialize_safetensors(f);
    FAIL() << "wrote a tensor whose data disagrees with its shape";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'w': F32 [2, 2] needs 16 bytes but its data has 12"),
              std::string::npos)
        << e.what();
  }
  f.tensors["w"] = {DType::F32, {-1}, {}};
  EXPECT_THROW(serialize_safetensors(f), Error);
  f.tensors.clear();
  f.tensors["__metadata__"] = {DType::U8, {0}, {}};
  EXPECT_THROW(serialize_safetensors(f), Error);
  f.tensors.clear();
  f.tensors["bad\xff"] = {DType::U8, {0}, {}};
  EXPECT_THROW(serialize_safetensors(f), Error) << "a name that is not UTF-8";
  f.tensors.clear();
  f.metadata["k"] = "\xc0\x80";  // an overlong NUL
  EXPECT_THROW(serialize_safetensors(f), Error) << "metadata that is not UTF-8";
}

TEST(IoSafetensors, FailedWriteLeavesTheOldCheckpointIntact) {
  test::ScratchDir dir;
  const std::string path = dir.file("last.safetensors");
  StFile old_file;
  old_file.tensors["w"] = {DType::F32, {4}, pattern(16, 1)};
  write_safetensors(path, old_file);
  const std::vector<uint8_t> before = read_file_bytes(path);

  StFile big;
  big.tensors["w"] = {DType::F32, {1 << 16}, pattern(1 << 18, 2)};
  try {
    test::FileSizeLimit limit(4096);  // a "disk" that fills up after 4 KB
    write_safetensors(path, big);
    ADD_FAILURE() << "the write past the size limit succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("left unchanged"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file_bytes(path), before);
  expect_equal(old_file, read_safetensors(path));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"last.safetensors"})
      << "the temp file was removed";
}

}  // namespace
}  // namespace kiln
