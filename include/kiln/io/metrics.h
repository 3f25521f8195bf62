// Metrics files: one row per call to a CSV file and to a JSON-lines file, written
// and handed to the kernel at once (a crash loses at most the row being written, and
// `tail -f` shows progress live). The CSV's columns are fixed by declare_columns(), or else by
// the first row, or by the header already in the file when appending after a resume.
#pragma once
#include <concepts>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

// A cell: an integer (written exactly), a number (written with 9 significant digits, enough to
// round-trip a float) or a string (quoted as CSV and JSON need).
class MetricValue {
 public:
  enum class Kind { Int, Number, Text };

  template <std::integral T>
  requires(!std::same_as<T, bool>) MetricValue(T v)
      : kind_(Kind::Int), int_(static_cast<int64_t>(v)) {}
  MetricValue(double v) : kind_(Kind::Number), number_(v) {}
  MetricValue(float v) : kind_(Kind::Number), number_(v) {}
  MetricValue(std::string v) : kind_(Kind::Text), text_(std::move(v)) {}
  MetricValue(const char* v) : kind_(Kind::Text), text_(v) {}

  Kind kind() const { return kind_; }
  std::string csv() const;   // a CSV field: quoted when it holds , " CR or LF
  std::string json() const;  // a JSON value: NaN and infinities become null

 private:
  Kind kind_;
  int64_t int_ = 0;
  double number_ = 0;
  std::string text_;
};

using MetricsRow = std::vector<std::pair<std::string, MetricValue>>;

class MetricsWriter {
 public:
  // Truncate starts both files afresh; Append continues them (a resumed run), keeping the
  // columns of the header already in the CSV.
  enum class Mode { Truncate, Append };

  // Either path may be empty to skip that format. Error(Io) when a file cannot be opened.
  MetricsWriter(const std::string& csv_path, const std::string& jsonl_path,
                Mode mode = Mode::Truncate);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Appends one row to each file. The first row written to a fresh CSV fixes its columns; a
  // later row may leave a column out (an empty cell) but may not add one: Error(InvalidArgument)
  // naming the key. The JSON line holds exactly the row's keys, in its order.
  void write(const MetricsRow& row);

  // The CSV and JSON lines write(row) appends (each with its newline, no header), without
  // writing them: a checkpoint keeps its epoch's row this way. The same checks as write().
  struct Lines {
    std::string csv, jsonl;
  };
  Lines format(const MetricsRow& row) const;
  // Appends lines made by format() (either may be empty to skip that file), after the header
  // when the CSV has none yet.
  void write_lines(const Lines& lines);

  // Fixes the CSV's columns before the first row, for rows that hold only some of them (an
  // epoch without evaluation). The header is written with the first row. When appending to a
  // file whose header differs, Error(InvalidArgument) naming the file and the columns.
  void declare_columns(std::vector<std::string> columns);

  // The CSV's columns (empty until fixed).
  const std::vector<std::string>& columns() const { return columns_; }

 private:
  void close_files();
  Lines format_with(const MetricsRow& row, std::vector<std::string>& columns) const;

  std::string csv_path_;
  std::string jsonl_path_;
  int csv_fd_ = -1;
  int jsonl_fd_ = -1;
  std::vector<std::string> columns_;
  bool header_written_ = false;  // columns_ may be declared before the header is in the file
};

// What truncate_metrics kept and removed.
struct MetricsTrim {
  int64_t removed_csv = 0, removed_jsonl = 0;
  bool csv_has_max = false, jsonl_has_max = false;  // a row whose key equals `max` was kept
};

// Keeps the header and the rows whose integer column `key` is at most `max` (a resumed run
// continues after its checkpoint's step, so later rows would be written twice), rewriting
// each file atomically when it changes; a row cut short (no final newline) is removed too.
// A missing file is left missing.
MetricsTrim truncate_metrics(const std::string& csv_path, const std::string& jsonl_path,
                             const std::string& key, int64_t max);

}  // namespace kiln
