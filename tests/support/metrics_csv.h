// The trainer's metrics.csv as the tests read it: each row by column name, the header's names
// (the one reader for every test that checks what a run reported).
#pragma once
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace kiln::test {

using MetricsRow = std::map<std::string, std::string>;

// Every row of a metrics CSV after its header; empty when the file is missing or has no rows.
inline std::vector<MetricsRow> metrics_rows(const std::string& path) {
  auto split = [](const std::string& line) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
    return cells;
  };
  std::ifstream in(path);
  std::string header, line;
  std::getline(in, header);
  const std::vector<std::string> names = split(header);
  std::vector<MetricsRow> rows;
  while (std::getline(in, line)) {
    const std::vector<std::string> cells = split(line);
    MetricsRow row;
    for (size_t i = 0; i < names.size() && i < cells.size(); ++i) row[names[i]] = cells[i];
    rows.push_back(row);
  }
  return rows;
}

// The last row of a metrics CSV; empty when it has none.
inline MetricsRow last_metrics_row(const std::string& path) {
  std::vector<MetricsRow> rows = metrics_rows(path);
  return rows.empty() ? MetricsRow{} : rows.back();
}

}  // namespace kiln::test
