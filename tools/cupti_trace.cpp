// kiln's GPU activity tracer: a CUDA injection library that records, through CUPTI's activity
// API, the start and end of every kernel, copy and memset a process runs between
// cudaProfilerStart and cudaProfilerStop, and writes them as CSV in the columns of Nsight
// Systems' `cuda_gpu_trace` report (Start, Duration, Strm, Name), which bench/gpu_timeline.py
// reads. It exists because the GPU machine this project measures on has Nsight Compute but not
// Nsight Systems, and ncu replays each kernel alone with cold caches: only a trace of the real run
// shows a step's idle gaps and its kernels as they run inside the CUDA graphs. Kernels inside
// graphs are recorded one by one (CUPTI traces graph kernel nodes).
//
//   CUDA_INJECTION64_PATH=build-gpu/libkiln_cupti_trace.so KILN_TRACE_OUT=trace.csv \
//     build-gpu/kiln bench --model vgg16_bn --batch 256 --amp --steps 5 --cuda-profiler-range
//
// The CUDA driver loads the library when it initialises and calls InitializeInjection; any
// program can be traced so, PyTorch too. KILN_TRACE_RANGE=all records from initialisation on
// instead of only inside the profiler range. The CSV is written when the process exits, to a
// temporary name that is then renamed. A CUPTI failure ends the process with one message.
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Activity {
  uint64_t start = 0, end = 0;  // ns, CUPTI's clock
  uint32_t stream = 0;
  std::string name;
};

std::mutex g_mutex;
std::vector<Activity> g_activities;  // guarded by g_mutex
std::atomic<bool> g_recording{false};
std::atomic<uint64_t> g_dropped{0};
std::atomic<uint64_t> g_stopped_at{0};  // CUPTI's clock at the last cudaProfilerStop, 0 before one
std::string g_out;

constexpr size_t kBufferBytes = 8u << 20;  // CUPTI fills these and hands them back
const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                     CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

[[noreturn]] void fail(const char* what, CUptiResult r) {
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kiln cupti trace: %s failed: %s (is libcupti the CUDA driver's version?)\n",
               what, text ? text : "unknown CUPTI error");
  std::_Exit(70);
}
#define CUPTI_OK(call)                        \
  do {                                        \
    const CUptiResult r_ = (call);            \
    if (r_ != CUPTI_SUCCESS) fail(#call, r_); \
  } while (0)

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  return s;
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "Host-to-Device";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "Device-to-Host";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "Device-to-Device";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "Peer-to-Peer";
    default:
      return "other";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;  // a null buffer makes CUPTI drop records, counted below
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t,
                               size_t valid) {
  std::vector<Activity> got;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        got.push_back({k->start, k->end, k->streamId, demangle(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        got.push_back({m->start, m->end, m->streamId,
                       std::string("[CUDA memcpy ") + copy_kind(m->copyKind) + "]"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        got.push_back({m->start, m->end, m->streamId, "[CUDA memset]"});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(context, stream, &dropped) == CUPTI_SUCCESS)
    g_dropped += dropped;
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_activities.insert(g_activities.end(), std::make_move_iterator(got.begin()),
                      std::make_move_iterator(got.end()));
}

void set_recording(bool on) {
  if (g_recording.exchange(on) == on)
    return;  // cudaProfilerStart reaches us as runtime and driver calls
  for (CUpti_ActivityKind kind : kKinds) {
    CUPTI_OK(on ? cuptiActivityEnable(kind) : cuptiActivityDisable(kind));
  }
}

void CUPTIAPI on_api_call(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                          const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_ENTER) return;
  const bool start =
      (domain == CUPTI_CB_DOMAIN_RUNTIME_API &&
       id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) ||
      (domain == CUPTI_CB_DOMAIN_DRIVER_API && id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart);
  const bool stop =
      (domain == CUPTI_CB_DOMAIN_RUNTIME_API &&
       id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000) ||
      (domain == CUPTI_CB_DOMAIN_DRIVER_API && id == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop);
  if (start) set_recording(true);
  if (stop) {
    uint64_t now = 0;
    CUPTI_OK(cuptiGetTimestamp(&now));
    g_stopped_at = now;
    // The range's work has ended (the caller synchronised): collect its records now, before a
    // later launch of the same CUDA graph can reuse what CUPTI keeps per graph node.
    CUPTI_OK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    set_recording(false);
  }
}

std::string csv_quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += '"';
    q += c;
  }
  return q + "\"";
}

void write_trace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mutex);
  // The programs traced synchronise before cudaProfilerStop, so nothing inside the range can
  // end after it. Kernels of a CUDA graph launched again after the range did (their end is the
  // end of the launch after the range): such records are left out and counted, not trusted.
  size_t late = 0;
  if (g_stopped_at != 0) {
    const auto is_late = [](const Activity& a) { return a.end > g_stopped_at; };
    late = static_cast<size_t>(std::count_if(g_activities.begin(), g_activities.end(), is_late));
    g_activities.erase(std::remove_if(g_activities.begin(), g_activities.end(), is_late),
                       g_activities.end());
  }
  std::sort(g_activities.begin(), g_activities.end(),
            [](const Activity& a, const Activity& b) { return a.start < b.start; });
  const std::string tmp = g_out + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  bool ok = f != nullptr;
  if (ok) {
    ok = std::fprintf(f, "Start (ns),Duration (ns),Strm,Name\n") > 0;
    for (const Activity& a : g_activities) {
      if (!ok) break;
      ok = std::fprintf(f, "%llu,%llu,%u,%s\n", static_cast<unsigned long long>(a.start),
                        static_cast<unsigned long long>(a.end - a.start), a.stream,
                        csv_quoted(a.name).c_str()) > 0;
    }
    ok = std::fclose(f) == 0 && ok;
  }
  if (!ok || std::rename(tmp.c_str(), g_out.c_str()) != 0) {
    std::remove(tmp.c_str());
    std::fprintf(stderr,
                 "kiln cupti trace: could not write %s (KILN_TRACE_OUT): check the folder exists "
                 "and is writable\n",
                 g_out.c_str());
    return;
  }
  std::fprintf(
      stderr, "kiln cupti trace: %zu activities written to %s%s\n", g_activities.size(),
      g_out.c_str(),
      g_dropped ? (" (" + std::to_string(g_dropped.load()) + " records dropped)").c_str() : "");
  if (late != 0) {
    std::fprintf(
        stderr,
        "kiln cupti trace: %zu activities left out: they end after cudaProfilerStop, so CUPTI's "
        "timestamps for them are wrong (a CUDA graph replayed more than once: trace one step)\n",
        late);
  }
}

}  // namespace

// Called by the CUDA driver at initialisation when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  const char* out = std::getenv("KILN_TRACE_OUT");
  if (out == nullptr || *out == '\0') {
    std::fprintf(
        stderr,
        "kiln cupti trace: set KILN_TRACE_OUT to the CSV file to write (CUDA_INJECTION64_PATH "
        "loaded the tracer without it)\n");
    std::_Exit(64);
  }
  g_out = out;
  const char* range = std::getenv("KILN_TRACE_RANGE");
  const std::string r = range ? range : "profiler";
  if (r != "profiler" && r != "all") {
    std::fprintf(
        stderr,
        "kiln cupti trace: KILN_TRACE_RANGE=%s: use 'profiler' (between cudaProfilerStart and "
        "Stop, the default) or 'all'\n",
        r.c_str());
    std::_Exit(64);
  }
  CUPTI_OK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  if (r == "all") {
    set_recording(true);
  } else {
    CUpti_SubscriberHandle subscriber = nullptr;
    CUPTI_OK(cuptiSubscribe(&subscriber, on_api_call, nullptr));
    for (const auto& [domain, id] :
         {std::pair{CUPTI_CB_DOMAIN_RUNTIME_API,
                    CUpti_CallbackId{CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000}},
          std::pair{CUPTI_CB_DOMAIN_RUNTIME_API,
                    CUpti_CallbackId{CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000}},
          std::pair{CUPTI_CB_DOMAIN_DRIVER_API,
                    CUpti_CallbackId{CUPTI_DRIVER_TRACE_CBID_cuProfilerStart}},
          std::pair{CUPTI_CB_DOMAIN_DRIVER_API,
                    CUpti_CallbackId{CUPTI_DRIVER_TRACE_CBID_cuProfilerStop}}}) {
      CUPTI_OK(cuptiEnableCallback(1, subscriber, domain, id));
    }
  }
  std::atexit(write_trace);
  return 1;
}
