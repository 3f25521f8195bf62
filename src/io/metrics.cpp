#include "kiln/io/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/io/json.h"

namespace kiln {
namespace {

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';  // RFC 4180: a quote inside a quoted field is doubled
    out += c;
  }
  return out + "\"";
}

// The fields of the first record of a CSV text (RFC 4180 quoting).
std::vector<std::string> csv_first_record(const std::string& text) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c == '\n' || c == '\r') {
      break;
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

void write_all(int fd, const std::string& text, const std::string& path) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n >= 0, Io, "writing metrics to '", path, "' failed: ", std::strerror(errno),
               "; check free disk space");
    p += n;
    left -= static_cast<size_t>(n);
  }
}

int open_output(const std::string& path, MetricsWriter::Mode mode) {
  const int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC |
                    (mode == MetricsWriter::Mode::Truncate ? O_TRUNC : 0);
  const int fd = ::open(path.c_str(), flags, 0666);
  KILN_CHECK(fd >= 0, Io, "cannot open metrics file '", path, "': ", std::strerror(errno),
             "; check that the output folder exists and is writable");
  return fd;
}

// A file cut short mid-row (a full disk, a crash) would glue the next row onto the broken one;
// start the next row on a line of its own instead.
void end_partial_line(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size == 0) return;
  char last = '\n';
  const int rfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (rfd < 0) return;
  if (::pread(rfd, &last, 1, st.st_size - 1) == 1 && last != '\n') write_all(fd, "\n", path);
  ::close(rfd);
}

}  // namespace

std::string MetricValue::csv() const {
  switch (kind_) {
    case Kind::Int:
      return std::to_string(int_);
    case Kind::Number:
      return format_number(number_);
    case Kind::Text:
      return csv_field(text_);
  }
  return "";
}

std::string MetricValue::json() const {
  switch (kind_) {
    case Kind::Int:
      return std::to_string(int_);
    case Kind::Number:
      return json_number(number_);
    case Kind::Text:
      return json_string(text_);
  }
  return "null";
}

MetricsWriter::MetricsWriter(const std::string& csv_path, const std::string& jsonl_path, Mode mode)
    : csv_path_(csv_path), jsonl_path_(jsonl_path) {
  try {
    if (!csv_path_.empty()) {
      if (mode == Mode::Append && ::access(csv_path_.c_str(), F_OK) == 0) {
        const std::string existing = read_file_text(csv_path_);
        if (!existing.empty()) {
          columns_ = csv_first_record(existing);
          header_written_ = true;
        }
      }
      csv_fd_ = open_output(csv_path_, mode);
      if (mode == Mode::Append) end_partial_line(csv_fd_, csv_path_);
    }
    if (!jsonl_path_.empty()) {
      jsonl_fd_ = open_output(jsonl_path_, mode);
      if (mode == Mode::Append) end_partial_line(jsonl_fd_, jsonl_path_);
    }
  } catch (...) {
    close_files();
    throw;
  }
}

MetricsWriter::~MetricsWriter() {
  close_files();
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : csv_path_(std::move(other.csv_path_)),
      jsonl_path_(std::move(other.jsonl_path_)),
      csv_fd_(std::exchange(other.csv_fd_, -1)),
      jsonl_fd_(std::exchange(other.jsonl_fd_, -1)),
      columns_(std::move(other.columns_)),
      header_written_(other.header_written_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    close_files();
    csv_path_ = std::move(other.csv_path_);
    jsonl_path_ = std::move(other.jsonl_path_);
    csv_fd_ = std::exchange(other.csv_fd_, -1);
    jsonl_fd_ = std::exchange(other.jsonl_fd_, -1);
    columns_ = std::move(other.columns_);
    header_written_ = other.header_written_;
  }
  return *this;
}

void MetricsWriter::close_files() {
  if (csv_fd_ >= 0) ::close(csv_fd_);
  if (jsonl_fd_ >= 0) ::close(jsonl_fd_);
  csv_fd_ = jsonl_fd_ = -1;
}

void MetricsWriter::declare_columns(std::vector<std::string> columns) {
  KILN_CHECK(!columns.empty(), InvalidArgument, "declare_columns needs at least one column");
  std::set<std::string> keys;
  for (const std::string& k : columns) {
    KILN_CHECK(!k.empty() && keys.insert(k).second, InvalidArgument, "metric column '", k,
               "' is empty or declared twice");
  }
  if (header_written_) {
    std::string have, want;
    for (const auto& k : columns_) have += (have.empty() ? "" : ",") + k;
    for (const auto& k : columns) want += (want.empty() ? "" : ",") + k;
    KILN_CHECK(columns == columns_, InvalidArgument, "'", csv_path_, "' has the columns ", have,
               " but this run writes ", want,
               "; resume with the flags of the first run (e.g. the same --ema), or write to a new "
               "--output");
    return;
  }
  columns_ = std::move(columns);
}

MetricsWriter::Lines MetricsWriter::format_with(const MetricsRow& row,
                                                std::vector<std::string>& columns) const {
  KILN_CHECK(!row.empty(), InvalidArgument, "a metrics row needs at least one value");
  std::set<std::string> keys;
  for (const auto& [key, value] : row) {
    KILN_CHECK(!key.empty(), InvalidArgument, "a metrics column needs a name");
    KILN_CHECK(keys.insert(key).second, InvalidArgument, "metric '", key,
               "' appears twice in one row; give each metric once");
  }
  Lines out;
  if (!csv_path_.empty()) {  // JSON lines alone take any keys
    if (columns.empty()) {
      for (const auto& kv : row) columns.push_back(kv.first);
    }
    for (const auto& kv : row) {
      KILN_CHECK(std::find(columns.begin(), columns.end(), kv.first) != columns.end(),
                 InvalidArgument, "metric '", kv.first, "' is not a column of '", csv_path_,
                 "' (a CSV's columns are fixed by its first row); include '", kv.first,
                 "' in the first row written");
    }
    for (size_t i = 0; i < columns.size(); ++i) {
      if (i) out.csv += ',';
      for (const auto& kv : row) {
        if (kv.first == columns[i]) out.csv += kv.second.csv();
      }
    }
    out.csv += '\n';
  }
  out.jsonl = "{";
  for (size_t i = 0; i < row.size(); ++i) {
    if (i) out.jsonl += ',';
    out.jsonl += json_string(row[i].first);
    out.jsonl += ':';
    out.jsonl += row[i].second.json();
  }
  out.jsonl += "}\n";
  return out;
}

MetricsWriter::Lines MetricsWriter::format(const MetricsRow& row) const {
  std::vector<std::string> columns = columns_;
  return format_with(row, columns);
}

void MetricsWriter::write(const MetricsRow& row) {
  // Check everything before writing anything, so a bad row reaches neither file; the columns
  // are kept only once the header that fixes them is written.
  std::vector<std::string> columns = columns_;
  const Lines lines = format_with(row, columns);
  columns_ = std::move(columns);
  write_lines(lines);
}

void MetricsWriter::write_lines(const Lines& lines) {
  // One write() per line: the kernel has the whole row at once (no stdio buffer to flush).
  if (csv_fd_ >= 0 && !lines.csv.empty()) {
    std::string csv;
    if (!header_written_) {
      KILN_CHECK(!columns_.empty(), InvalidArgument, "'", csv_path_,
                 "' has no header and no columns were declared; call declare_columns first");
      for (size_t i = 0; i < columns_.size(); ++i) {
        if (i) csv += ',';
        csv += csv_field(columns_[i]);
      }
      csv += '\n';
    }
    write_all(csv_fd_, csv + lines.csv, csv_path_);
    header_written_ = true;
  }
  if (jsonl_fd_ >= 0 && !lines.jsonl.empty()) write_all(jsonl_fd_, lines.jsonl, jsonl_path_);
}

namespace {

// The lines of `text` that end in a newline; a last line cut short is dropped.
std::vector<std::string> whole_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (size_t at = 0;;) {
    const size_t nl = text.find('\n', at);
    if (nl == std::string::npos) break;
    lines.push_back(text.substr(at, nl + 1 - at));
    at = nl + 1;
  }
  return lines;
}

bool parse_int(const std::string& s, int64_t& v) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || !end || *end != '\0') return false;
  v = x;
  return true;
}

}  // namespace

MetricsTrim truncate_metrics(const std::string& csv_path, const std::string& jsonl_path,
                             const std::string& key, int64_t max) {
  MetricsTrim t;
  if (!csv_path.empty() && ::access(csv_path.c_str(), F_OK) == 0) {
    const std::string text = read_file_text(csv_path);
    const std::vector<std::string> lines = whole_lines(text);
    if (!lines.empty()) {
      const std::vector<std::string> header = csv_first_record(lines[0]);
      const auto col = std::find(header.begin(), header.end(), key);
      KILN_CHECK(col != header.end(), InvalidArgument, "'", csv_path, "' has no column '", key,
                 "' to cut the rows after a checkpoint by; resume into the run's own folder or "
                 "give a new --output");
      std::string kept = lines[0];
      for (size_t i = 1; i < lines.size(); ++i) {
        const std::vector<std::string> f = csv_first_record(lines[i]);
        const size_t c = static_cast<size_t>(col - header.begin());
        int64_t v = 0;
        if (c < f.size() && parse_int(f[c], v) && v <= max) {
          kept += lines[i];
          t.csv_has_max |= v == max;
        } else {
          ++t.removed_csv;
        }
      }
      if (kept.size() != text.size()) write_text_atomic(csv_path, kept);
    }
  }
  if (!jsonl_path.empty() && ::access(jsonl_path.c_str(), F_OK) == 0) {
    const std::string text = read_file_text(jsonl_path);
    const std::string needle = json_string(key) + ":";
    std::string kept;
    for (const std::string& line : whole_lines(text)) {
      const size_t at = line.find(needle);
      int64_t v = 0;
      bool ok = false;
      if (at != std::string::npos) {
        const size_t from = at + needle.size();
        const size_t to = line.find_first_not_of("-0123456789", from);
        ok = parse_int(line.substr(from, to == std::string::npos ? std::string::npos : to - from),
                       v);
      }
      if (ok && v <= max) {
        kept += line;
        t.jsonl_has_max |= v == max;
      } else {
        ++t.removed_jsonl;
      }
    }
    if (kept.size() != text.size()) write_text_atomic(jsonl_path, kept);
  }
  return t;
}

}  // namespace kiln
