// Work lost and files left behind (issue 15): `kiln train` stopped by a signal, killed with
// SIGKILL, or stopped after a number of steps resumes to the same bytes as an uninterrupted
// run; two runs on one folder, a resumed finished run, flags that contradict a checkpoint and
// an export onto its own checkpoint are refused. The CLI runs as a child process whose output
// the test reads line by line (poll with a timeout), and signals are sent after a known line.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"
#include "support/cli_run.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kTimeout = 60;  // seconds: a step of these models takes milliseconds

// A `kiln` process with stdout and stderr on one pipe.
class Child {
 public:
  explicit Child(const std::string& args) {
    int fds[2];
    if (::pipe(fds) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      // The lines these tests wait for are info lines; the test main quiets logs to warn.
      ::setenv("KILN_LOG", "info", 1);
      const std::string cmd = "exec " + std::string(KILN_CLI_PATH) + " " + args;
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && code_ == kRunning) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (fd_ >= 0) ::close(fd_);
  }
  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }

  // Reads until the output holds `text` (true) or the process ends or the time is up (false).
  bool wait_for(const std::string& text) {
    const auto t0 = Clock::now();
    while (out_.find(text) == std::string::npos) {
      if (!read_some(t0)) return false;
    }
    return true;
  }
  // Reads to the end and reaps: the exit status, or 128 + the signal that killed it.
  int wait() {
    const auto t0 = Clock::now();
    while (read_some(t0)) {
    }
    int status = 0;
    if (code_ == kRunning && ::waitpid(pid_, &status, 0) == pid_) {
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return code_;
  }

 private:
  static constexpr int kRunning = -1000;
  bool read_some(Clock::time_point t0) {
    if (fd_ < 0) return false;
    const double left = kTimeout - std::chrono::duration<double>(Clock::now() - t0).count();
    if (left <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000)) <= 0) return false;
    std::array<char, 4096> buf{};
    const ssize_t n = ::read(fd_, buf.data(), buf.size());
    if (n <= 0) {
      ::close(fd_);
      fd_ = -1;
      return false;
    }
    out_.append(buf.data(), static_cast<size_t>(n));
    return true;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
  int code_ = kRunning;
  std::string out_;
};

struct Result {
  int code;
  std::string out;
};

Result kiln(const std::string& args) {
  Child c(args);
  const int code = c.wait();
  return {code, c.out()};
}

using kiln::test::idx_file;
using kiln::test::write_bytes;

// An MNIST-style split of n 28x28 images whose pixels depend on the label, so that the
// models learn something and the weights move every step.
void idx_split(const fs::path& dir, const std::string& prefix, uint32_t n) {
  std::vector<uint8_t> px(static_cast<size_t>(n) * 28 * 28), labels(n);
  for (uint32_t i = 0; i < n; ++i) {
    labels[i] = static_cast<uint8_t>(i % 10);
    for (size_t k = 0; k < 28 * 28; ++k) {
      px[i * 28 * 28 + k] = static_cast<uint8_t>((k * (labels[i] + 3) + i * 7) & 0xff);
    }
  }
  write_bytes(dir / (prefix + "-images-idx3-ubyte"), idx_file({n, 28, 28}, px));
  write_bytes(dir / (prefix + "-labels-idx1-ubyte"), idx_file({n}, labels));
}

// A folder with a training split of `train` images (64: 8 steps an epoch at batch 8).
fs::path scratch(const std::string& name, uint32_t train = 64) {
  const fs::path root = fs::path(testing::TempDir()) / ("kiln_lost_" + name);
  fs::remove_all(root);
  idx_split(root / "data", "train", train);
  idx_split(root / "data", "t10k", 16);
  return root;
}

// A small run: mlp, 3 epochs of 8 steps (24 steps), SGD with momentum and the one-cycle schedule.
std::string run_args(const fs::path& root, const fs::path& out, const std::string& model = "mlp") {
  return "train --model " + model + " --data mnist --data-dir " + (root / "data").string() +
         " --batch-size 8 --epochs 3 --workers 1 --progress none --device cpu --output " +
         out.string();
}

// Every tensor of a checkpoint (weights, BN statistics, optimizer moments, loss scale).
std::map<std::string, std::vector<uint8_t>> tensors(const fs::path& ckpt) {
  std::map<std::string, std::vector<uint8_t>> m;
  for (const auto& [name, t] : kiln::read_safetensors(ckpt.string()).tensors) m[name] = t.data;
  return m;
}

std::vector<std::string> lines(const fs::path& file) {
  std::vector<std::string> v;
  std::ifstream f(file);
  for (std::string l; std::getline(f, l);) v.push_back(l);
  return v;
}

// The metrics rows without the two timing columns (epoch_seconds, images_per_second), which
// no two runs share.
std::vector<std::string> metric_rows(const fs::path& out) {
  std::vector<std::string> rows;
  for (const std::string& l : lines(out / "metrics.csv")) {
    std::vector<std::string> f;
    std::stringstream ss(l);
    for (std::string x; std::getline(ss, x, ',');) f.push_back(x);
    if (f.size() > 6) f.erase(f.begin() + 5, f.begin() + 7);
    std::string joined;
    for (const auto& x : f) joined += x + ",";
    rows.push_back(joined);
  }
  return rows;
}

std::vector<std::string> temp_files(const fs::path& out) {
  std::vector<std::string> v;
  if (!fs::exists(out)) return v;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp.") != std::string::npos) v.push_back(n);
  }
  return v;
}

// The command a stopped run printed to continue it.
std::string resume_line(const std::string& out) {
  const std::string key = "resume with: ";
  const size_t at = out.rfind(key);
  if (at == std::string::npos) return "";
  const size_t end = out.find('\n', at);
  return out.substr(at + key.size(),
                    end == std::string::npos ? std::string::npos : end - at - key.size());
}

// Runs a command line as the user would paste it.
Result run_shell(const std::string& cmd) {
  const kiln::test::CliResult c = kiln::test::run_shell("KILN_LOG=info " + cmd);
  return {c.code, c.out};
}

// The uninterrupted run every interrupted one is compared with (made once per model).
struct Reference {
  std::map<std::string, std::vector<uint8_t>> weights;
  std::vector<std::string> rows;
};

const Reference& reference(const std::string& model, uint32_t train) {
  static std::map<std::string, Reference> refs;
  const std::string key = model + "_" + std::to_string(train);
  auto it = refs.find(key);
  if (it != refs.end()) return it->second;
  // Per process: ctest runs the tests that need it side by side.
  const fs::path root = scratch("reference_" + key + "_" + std::to_string(::getpid()), train);
  const Result r = kiln(run_args(root, root / "out", model));
  EXPECT_EQ(r.code, 0) << r.out;
  Reference ref{tensors(root / "out" / "last.safetensors"), metric_rows(root / "out")};
  EXPECT_EQ(ref.rows.size(), 4u) << "a header and three epochs";
  fs::remove_all(root);
  return refs[key] = ref;
}

void expect_same_as_reference(const fs::path& out, const std::string& model, uint32_t train = 64) {
  const Reference& ref = reference(model, train);
  const auto got = tensors(out / "last.safetensors");
  ASSERT_EQ(got.size(), ref.weights.size());
  for (const auto& [name, bytes] : ref.weights)
    EXPECT_TRUE(got.at(name) == bytes) << "tensor " << name << " differs";
  EXPECT_EQ(metric_rows(out), ref.rows);
}

// Stopped mid-epoch four times (steps 5, 10, 15, 20: in epochs 1, 2, 2 and 3), each time
// resumed by the command the run printed: the same bytes and metrics rows as one run.
TEST(CliLostWork, StopAfterStepsResumesBitIdentical) {
  const fs::path root = scratch("stop_steps"), out = root / "out";
  Result r = kiln(run_args(root, out) + " --stop-after-steps 5");
  for (int stop = 1; stop <= 4; ++stop) {
    ASSERT_EQ(r.code, 0) << r.out;
    ASSERT_NE(r.out.find("stopped as asked; checkpoint at step " + std::to_string(5 * stop)),
              std::string::npos)
        << r.out;
    const std::string cmd = resume_line(r.out);
    ASSERT_NE(cmd.find("--resume " + (out / "last.safetensors").string()), std::string::npos)
        << r.out;
    r = run_shell(cmd);
  }
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("done: 1 epochs"), std::string::npos) << r.out;
  expect_same_as_reference(out, "mlp");
  EXPECT_EQ(lines(out / "metrics.jsonl").size(), 3u);
  fs::remove_all(root);
}

// SIGINT, SIGTERM and SIGHUP mid-epoch: the step finishes, a checkpoint is written, the
// resume command is printed, the status is 128 + the signal; the resumed run equals the
// uninterrupted one. cnn (BatchNorm, convolutions) so that steps take long enough that the
// run is still in its first epoch when the signal lands.
TEST(CliLostWork, SignalsCheckpointAndResume) {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    const fs::path root = scratch("signal_" + std::to_string(sig)), out = root / "out";
    Child c(run_args(root, out, "cnn") + " --save-every-steps 1");
    ASSERT_TRUE(c.wait_for("checkpoint at step 2 ")) << c.out();
    ::kill(c.pid(), sig);
    const int code = c.wait();
    EXPECT_EQ(code, 128 + sig) << c.out();
    const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP";
    EXPECT_NE(c.out().find(std::string("stopped by ") + name + "; checkpoint at step"),
              std::string::npos)
        << c.out();
    const std::string cmd = resume_line(c.out());
    ASSERT_NE(cmd.find("--resume " + (out / "last.safetensors").string()), std::string::npos)
        << c.out();
    EXPECT_TRUE(temp_files(out).empty());
    EXPECT_FALSE(fs::exists(out / ".lock")) << "the lock is released on the way out";
    const Result r = run_shell(cmd);
    ASSERT_EQ(r.code, 0) << r.out;
    expect_same_as_reference(out, "cnn");
    fs::remove_all(root);
  }
}

// SIGKILL at 12 moments. Each run is killed after a delay drawn from a fixed seed below the
// interval between its last two checkpoint lines, so that the kill lands in the next step or in
// its save on a fast machine as on a loaded one. Each surviving checkpoint loads, the next start
// removes the dead run's temporary files, and the run resumes to the end with the uninterrupted
// run's bytes and rows. cnn on 128 images (16 steps an epoch, 48 in all): a kill moves the run two
// to four steps on, so twelve kills fit before the end.
TEST(CliLostWork, SigkillAtRandomMomentsLosesNothing) {
  constexpr uint32_t kTrain = 128;
  constexpr int64_t kStepsPerEpoch = kTrain / 8, kSteps = 3 * kStepsPerEpoch;
  const fs::path root = scratch("sigkill", kTrain), out = root / "out";
  const fs::path ckpt = out / "last.safetensors";
  // The next step whose checkpoint prints a line: an epoch's last step prints none.
  auto next_line_step = [](int64_t step) {
    return (step + 1) % kStepsPerEpoch == 0 ? step + 2 : step + 1;
  };
  std::mt19937 rng(15);
  int kills = 0;
  int64_t saved = 0;
  while (kills < 12 && saved < kSteps - 4) {
    Child c(run_args(root, out, "cnn") + " --save-every-steps 1" +
            (kills == 0 ? "" : " --resume " + ckpt.string()));
    auto wait_for_step = [&](int64_t step) {
      const bool seen = c.wait_for("checkpoint at step " + std::to_string(step) + " ");
      EXPECT_TRUE(seen) << "no checkpoint at step " << step << ":\n" << c.out();
      return seen;
    };
    int64_t target = next_line_step(saved);
    if (!wait_for_step(target)) break;
    const auto t0 = Clock::now();
    target = next_line_step(target);
    if (!wait_for_step(target)) break;
    const double period_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    // The dead run's files are gone once this run has started; its own may be mid-save.
    const std::string mine = ".tmp." + std::to_string(c.pid());
    for (const std::string& t : temp_files(out)) {
      EXPECT_NE(t.find(mine), std::string::npos) << "left by a killed run: " << t << "\n"
                                                 << c.out();
    }
    ::usleep(static_cast<useconds_t>(rng() % std::max<uint64_t>(1, uint64_t(period_us))));
    ::kill(c.pid(), SIGKILL);
    EXPECT_EQ(c.wait(), 128 + SIGKILL) << "the run ended before the kill:\n" << c.out();
    ++kills;
    // The checkpoint that survived loads and stands at or after the step the run said it saved.
    const kiln::StFile f = kiln::read_safetensors(ckpt.string());
    const int64_t step = std::stoll(f.metadata.at("step"));
    EXPECT_GE(step, target);
    saved = step;
  }
  EXPECT_EQ(kills, 12) << "the run reached step " << saved << " first";
  // A temporary file of a process that no longer exists (a reaped child's PID), as a kill in the
  // middle of a save leaves, is removed by the next start with one line naming it.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = "last.safetensors.tmp." + std::to_string(dead);
  write_bytes(out / stale, {1, 2, 3});
  const Result r = kiln(run_args(root, out, "cnn") + " --resume " + ckpt.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("temporary file(s) of runs that no longer exist"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(stale), std::string::npos) << r.out;
  EXPECT_TRUE(temp_files(out).empty());
  expect_same_as_reference(out, "cnn", kTrain);
  fs::remove_all(root);
}

// A second `kiln train` on the folder of a running one fails at once naming the first's PID,
// and writes nothing.
TEST(CliLostWork, OneRunPerFolder) {
  const fs::path root = scratch("lock"), out = root / "out";
  Child first(run_args(root, out, "cnn") + " --save-every-steps 1");
  ASSERT_TRUE(first.wait_for("checkpoint at step 1 ")) << first.out();
  // Stopped, the first run still holds its lock, and cannot end before the second has tried.
  ::kill(first.pid(), SIGSTOP);
  auto state = [&] {
    std::string s;
    for (const auto& e : fs::directory_iterator(out)) {
      s += e.path().filename().string() + ":" + std::to_string(fs::file_size(e.path())) + " ";
    }
    return s;
  };
  const std::string before = state();
  const Result second = kiln(run_args(root, out) + " --epochs 1");
  EXPECT_EQ(second.code, 2) << second.out;
  EXPECT_NE(
      second.out.find("is in use by another kiln train (PID " + std::to_string(first.pid()) + ","),
      std::string::npos)
      << second.out;
  EXPECT_NE(second.out.find(out.string()), std::string::npos) << second.out;
  EXPECT_EQ(state(), before) << "the second run wrote into the folder";
  ::kill(first.pid(), SIGTERM);
  ::kill(first.pid(), SIGCONT);
  EXPECT_EQ(first.wait(), 128 + SIGTERM) << first.out();
  fs::remove_all(root);
}

// Resuming a finished run says so and changes nothing; flags that contradict the
// checkpoint's seed, batch size or schedule are refused, or taken with --resume-override.
TEST(CliLostWork, ResumeOfAFinishedRunAndContradictingFlags) {
  const fs::path root = scratch("finished"), out = root / "out";
  ASSERT_EQ(kiln(run_args(root, out)).code, 0);
  const std::string ckpt = (out / "last.safetensors").string();
  auto bytes = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string summary = bytes(out / "summary.json"), csv = bytes(out / "metrics.csv"),
                    model = bytes(ckpt);
  const Result done = kiln(run_args(root, out) + " --resume " + ckpt);
  EXPECT_EQ(done.code, 0) << done.out;
  EXPECT_NE(done.out.find("is complete: 3 of 3 epochs done"), std::string::npos) << done.out;
  EXPECT_EQ(bytes(out / "summary.json"), summary);
  EXPECT_EQ(bytes(out / "metrics.csv"), csv);
  EXPECT_EQ(bytes(ckpt), model);

  const std::string base = "train --model mlp --data mnist --data-dir " + (root / "data").string() +
                           " --workers 1 --progress none --device cpu --output " + out.string() +
                           " --resume " + ckpt;
  // Without the flags the checkpoint's values are used (batch 8, 3 epochs): complete again.
  const Result bare = kiln(base);
  EXPECT_EQ(bare.code, 0) << bare.out;
  EXPECT_NE(bare.out.find("is complete: 3 of 3 epochs done"), std::string::npos) << bare.out;
  const Result seed = kiln(base + " --seed 7");
  EXPECT_EQ(seed.code, 2) << seed.out;
  EXPECT_NE(seed.out.find("--seed 7 contradicts the checkpoint"), std::string::npos) << seed.out;
  EXPECT_NE(seed.out.find("has --seed 0"), std::string::npos) << seed.out;
  const Result batch = kiln(base + " --batch-size 16");
  EXPECT_EQ(batch.code, 2) << batch.out;
  EXPECT_NE(batch.out.find("--batch-size 16 contradicts"), std::string::npos) << batch.out;
  EXPECT_NE(batch.out.find("has --batch-size 8"), std::string::npos) << batch.out;
  const Result sched = kiln(base + " --sched cosine");
  EXPECT_EQ(sched.code, 2) << sched.out;
  EXPECT_NE(sched.out.find("--sched cosine contradicts"), std::string::npos) << sched.out;
  EXPECT_NE(sched.out.find("has --sched onecycle"), std::string::npos) << sched.out;
  EXPECT_EQ(bytes(ckpt), model);
  // With --resume-override the change is logged and the run continues: one more epoch.
  const Result more = kiln(base + " --epochs 4 --resume-override");
  EXPECT_EQ(more.code, 0) << more.out;
  EXPECT_NE(more.out.find("--resume-override: --epochs 4 replaces the checkpoint's 3"),
            std::string::npos)
      << more.out;
  EXPECT_NE(more.out.find("done: 1 epochs"), std::string::npos) << more.out;
  EXPECT_EQ(lines(out / "metrics.csv").size(), 5u);
  fs::remove_all(root);
}

// A kill between an epoch's checkpoint and its metrics row, or after rows a checkpoint does
// not cover: the resumed run's metrics have each epoch once.
TEST(CliLostWork, ResumeTruncatesAndRestoresMetricsRows) {
  const fs::path root = scratch("metrics_rows"), out = root / "out";
  Result r = kiln(run_args(root, out) + " --stop-after-steps 12");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string ckpt = (out / "last.safetensors").string();
  // A row the checkpoint (step 12) does not cover, as a later run killed before its own save
  // would leave, and the epoch-1 row lost, as a kill between checkpoint and row would.
  std::vector<std::string> csv = lines(out / "metrics.csv");
  ASSERT_EQ(csv.size(), 2u);
  {
    std::ofstream f(out / "metrics.csv");
    f << csv[0] << "\n"
      << csv[1] << "\n"
      << "2,16,0.1,1,1,1,1,0,,,\n";
  }
  r = kiln(run_args(root, out) + " --resume " + ckpt);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("removed 1 metrics row(s) after step 12"), std::string::npos) << r.out;
  expect_same_as_reference(out, "mlp");

  // The epoch row kept in an epoch-end checkpoint comes back when the files lost it.
  const fs::path out2 = root / "out2";
  ASSERT_EQ(kiln(run_args(root, out2) + " --stop-after-epochs 1").code, 0);
  const std::vector<std::string> csv2 = lines(out2 / "metrics.csv");
  ASSERT_EQ(csv2.size(), 2u);
  std::ofstream(out2 / "metrics.csv") << csv2[0] << "\n";
  std::ofstream(out2 / "metrics.jsonl").flush();
  r = kiln(run_args(root, out2) + " --resume " + (out2 / "last.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_as_reference(out2, "mlp");
  EXPECT_EQ(lines(out2 / "metrics.jsonl").size(), 3u);
  fs::remove_all(root);
}

// kiln export onto its own checkpoint (the same file by another spelling) is refused.
TEST(CliLostWork, ExportOntoItsCheckpointIsRefused) {
  const fs::path root = scratch("export"), out = root / "out";
  ASSERT_EQ(kiln(run_args(root, out) + " --epochs 1").code, 0);
  const std::string ckpt = (out / "last.safetensors").string();
  const std::string before = tensors(ckpt).begin()->first;
  const Result r = kiln("export --model mlp --num-classes 10 --checkpoint " + ckpt + " --output " +
                        out.string() + "/./last.safetensors");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is the checkpoint"), std::string::npos) << r.out;
  EXPECT_EQ(kiln::read_safetensors(ckpt).metadata.at("format"), "kiln-checkpoint-1")
      << "the training state is kept";
  const Result ok = kiln("export --model mlp --num-classes 10 --checkpoint " + ckpt + " --output " +
                         (root / "w.safetensors").string());
  EXPECT_EQ(ok.code, 0) << ok.out;
  fs::remove_all(root);
}

}  // namespace
