// MetricsWriter: exact CSV and JSON-lines content, escaping, fixed columns, appending after a
// resume, and rows on disk as soon as write() returns.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/error.h"
#include "kiln/io/metrics.h"
#include "unit/io_test_util.h"

namespace kiln {
namespace {

TEST(IoMetrics, WritesCsvAndJsonLines) {
  test::ScratchDir dir;
  const std::string csv = dir.file("metrics.csv"), jsonl = dir.file("metrics.jsonl");
  MetricsWriter w(csv, jsonl);
  w.write({{"epoch", 1}, {"loss", 2.5}, {"top1", 0.1f}, {"phase", "train"}});
  // Rows are on disk as soon as write() returns, while the writer is still open.
  EXPECT_EQ(test::slurp(csv), "epoch,loss,top1,phase\n1,2.5,0.100000001,train\n");
  w.write({{"epoch", int64_t{2}}, {"loss", 1.0 / 3.0}, {"top1", 0.75}, {"phase", "eval"}});
  EXPECT_EQ(test::slurp(csv),
            "epoch,loss,top1,phase\n"
            "1,2.5,0.100000001,train\n"
            "2,0.333333333,0.75,eval\n");
  EXPECT_EQ(test::slurp(jsonl),
            "{\"epoch\":1,\"loss\":2.5,\"top1\":0.100000001,\"phase\":\"train\"}\n"
            "{\"epoch\":2,\"loss\":0.333333333,\"top1\":0.75,\"phase\":\"eval\"}\n");
  EXPECT_EQ(w.columns(), (std::vector<std::string>{"epoch", "loss", "top1", "phase"}));
}

TEST(IoMetrics, EscapesStringsAndNonFiniteNumbers) {
  test::ScratchDir dir;
  MetricsWriter w(dir.file("m.csv"), dir.file("m.jsonl"));
  w.write(
      {{"note", "a,b \"q\"\nnext"}, {"loss", NAN}, {"grad", -INFINITY}, {"big", int64_t{1} << 40}});
  EXPECT_EQ(test::slurp(dir.file("m.csv")),
            "note,loss,grad,big\n\"a,b \"\"q\"\"\nnext\",nan,-inf,1099511627776\n");
  // JSON has no NaN: null keeps each line parseable by strict readers (jq, JSON.parse).
  EXPECT_EQ(
      test::slurp(dir.file("m.jsonl")),
      "{\"note\":\"a,b \\\"q\\\"\\nnext\",\"loss\":null,\"grad\":null,\"big\":1099511627776}\n");
}

TEST(IoMetrics, ColumnsAreFixedByTheFirstRow) {
  test::ScratchDir dir;
  MetricsWriter w(dir.file("m.csv"), dir.file("m.jsonl"));
  w.write({{"epoch", 1}, {"train_loss", 0.5}, {"val_top1", 0.25}});
  // A row may leave a column out (evaluation every N epochs) and list keys in another order.
  w.write({{"train_loss", 0.25}, {"epoch", 2}});
  try {
    w.write({{"epoch", 3}, {"lr", 0.1}});
    FAIL() << "accepted a column the first row did not have";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(
        std::string(e.what()).find("metric 'lr' is not a column of '" + dir.file("m.csv") + "'"),
        std::string::npos)
        << e.what();
  }
  EXPECT_THROW(w.write({{"epoch", 3}, {"epoch", 4}}), Error);
  EXPECT_THROW(w.write({}), Error);
  // The rejected rows reached neither file.
  EXPECT_EQ(test::slurp(dir.file("m.csv")), "epoch,train_loss,val_top1\n1,0.5,0.25\n2,0.25,\n");
  EXPECT_EQ(
      test::slurp(dir.file("m.jsonl")),
      "{\"epoch\":1,\"train_loss\":0.5,\"val_top1\":0.25}\n{\"train_loss\":0.25,\"epoch\":2}\n");
}

TEST(IoMetrics, AppendContinuesAResumedRun) {
  test::ScratchDir dir;
  const std::string csv = dir.file("m.csv"), jsonl = dir.file("m.jsonl");
  { MetricsWriter(csv, jsonl).write({{"epoch", 1}, {"loss", 0.5}, {"note", "a,b"}}); }
  // The header is read back (quoted names included), not written again.
  test::spit(csv, "epoch,loss,\"note\"\n1,0.5,\"a,b\"\n2,0.4");  // cut short mid-row by a crash
  {
    MetricsWriter w(csv, jsonl, MetricsWriter::Mode::Append);
    EXPECT_EQ(w.columns(), (std::vector<std::string>{"epoch", "loss", "note"}));
    w.write({{"loss", 0.25}, {"epoch", 3}});
    EXPECT_THROW(w.write({{"epoch", 4}, {"acc", 1.0}}), Error);
  }
  EXPECT_EQ(test::slurp(csv), "epoch,loss,\"note\"\n1,0.5,\"a,b\"\n2,0.4\n3,0.25,\n");
  EXPECT_EQ(test::slurp(jsonl),
            "{\"epoch\":1,\"loss\":0.5,\"note\":\"a,b\"}\n{\"loss\":0.25,\"epoch\":3}\n");
  // Truncate (the default) starts afresh.
  MetricsWriter(csv, jsonl).write({{"step", 1}});
  EXPECT_EQ(test::slurp(csv), "step\n1\n");
  EXPECT_EQ(test::slurp(jsonl), "{\"step\":1}\n");
}

// Declared columns (the trainer's: test_* exist before the first evaluated epoch): a row
// without them leaves empty cells, a later row may fill them, and no header is written
// before the first row. Appending under a different header is refused before any write.
TEST(IoMetrics, DeclaredColumnsComeBeforeTheFirstRow) {
  test::ScratchDir dir;
  const std::string csv = dir.file("m.csv");
  {
    MetricsWriter w(csv, "");
    w.declare_columns({"epoch", "train_loss", "test_top1"});
    EXPECT_EQ(test::slurp(csv), "") << "no header before the first row";
    w.write({{"epoch", 1}, {"train_loss", 2.0}});
    w.write({{"epoch", 2}, {"train_loss", 1.5}, {"test_top1", 50.0}});
  }
  EXPECT_EQ(test::slurp(csv), "epoch,train_loss,test_top1\n1,2,\n2,1.5,50\n");
  {
    MetricsWriter w(csv, "", MetricsWriter::Mode::Append);
    w.declare_columns({"epoch", "train_loss", "test_top1"});
    w.write({{"epoch", 3}, {"train_loss", 1.0}});
  }
  EXPECT_EQ(test::slurp(csv), "epoch,train_loss,test_top1\n1,2,\n2,1.5,50\n3,1,\n");
  MetricsWriter w(csv, "", MetricsWriter::Mode::Append);
  try {
    w.declare_columns({"epoch", "train_loss", "test_top1", "ema_test_top1"});
    FAIL() << "expected Error(InvalidArgument)";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("m.csv"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ema_test_top1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::slurp(csv), "epoch,train_loss,test_top1\n1,2,\n2,1.5,50\n3,1,\n");
}

TEST(IoMetrics, AppendToAMissingFileStartsIt) {
  test::ScratchDir dir;
  MetricsWriter w(dir.file("m.csv"), "", MetricsWriter::Mode::Append);
  w.write({{"a", 1}});
  EXPECT_EQ(test::slurp(dir.file("m.csv")), "a\n1\n");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"m.csv"}) << "an empty path skips that format";
}

TEST(IoMetrics, JsonLinesOnlyAcceptsAnyKeys) {
  test::ScratchDir dir;
  MetricsWriter w("", dir.file("m.jsonl"));
  w.write({{"a", 1}});
  w.write({{"b", "x"}});
  EXPECT_EQ(test::slurp(dir.file("m.jsonl")), "{\"a\":1}\n{\"b\":\"x\"}\n");
}

TEST(IoMetrics, MovedWriterKeepsWriting) {
  test::ScratchDir dir;
  MetricsWriter a(dir.file("m.csv"), "");
  a.write({{"x", 1}});
  MetricsWriter b(std::move(a));
  b.write({{"x", 2}});
  EXPECT_EQ(test::slurp(dir.file("m.csv")), "x\n1\n2\n");
}

TEST(IoMetrics, UnopenableFileIsAnIoError) {
  test::ScratchDir dir;
  try {
    MetricsWriter w(dir.file("missing/m.csv"), "");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find(dir.file("missing/m.csv")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
