// tandem/trace.h: spans of work, written as a Chrome trace (chrome://tracing, Perfetto).
//
//   tandem::trace::enable(true);                 // or TANDEM_TRACE=path.json in the environment
//   { tandem::trace::Span s("down", {.layer = 3, .experts = 8, .tokens = 1}); ... }
//   tandem::trace::write("trace.json");          // also at exit when TANDEM_TRACE is set
//
// Each thread appends to its own buffer of fixed-size chunks: the owner writes an event
// and then publishes the new count (release); a writer reads up to the published count
// (acquire). No locks on the recording path; a disabled recorder costs one relaxed load
// per span. Timestamps are CLOCK_MONOTONIC (std::chrono::steady_clock) in microseconds;
// the trace's metadata carries the offset to the wall clock so other traces
// (torch.profiler) can be aligned with it (python/tandem/trace_merge.py).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace tandem::trace {

struct Args {
  int layer = -1, experts = -1, tokens = -1;  // -1: not recorded
};

bool enabled() noexcept;
void enable(bool on) noexcept;

// Names the calling thread (and the process lane it belongs to: one per subpool).
void name_thread(const std::string& name, int process = 0, const std::string& process_name = "tandem");

int64_t now_ns() noexcept;  // steady clock

// Records [begin, end) on the calling thread when recording is on (otherwise nothing:
// no buffer is made for the thread).
void record(const char* name, int64_t begin_ns, int64_t end_ns, const Args& args = {}) noexcept;

class Span {
 public:
  explicit Span(const char* name, const Args& args = {}) noexcept
      : name_(enabled() ? name : nullptr), args_(args), begin_(name_ ? now_ns() : 0) {}
  ~Span() {
    if (name_) record(name_, begin_, now_ns(), args_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;  // nullptr: recording was off at construction
  Args args_;
  int64_t begin_;
};

// Writes every span recorded so far as Chrome trace JSON (atomically: a temporary file
// renamed over the target). Safe while other threads keep recording.
void write(const std::filesystem::path& path);
// Number of spans recorded so far (all threads).
size_t span_count();

}  // namespace tandem::trace
