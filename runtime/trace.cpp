#include "tandem/trace.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <vector>

#include "tandem/error.h"
#include "tandem/fileio.h"

namespace tandem::trace {
namespace {

struct Event {
  const char* name;
  int64_t begin_ns, end_ns;
  Args args;
};

constexpr size_t kChunk = 4096;

struct Chunk {
  std::array<Event, kChunk> events;
  std::atomic<size_t> count{0};
  std::atomic<Chunk*> next{nullptr};
};

// A thread's spans. The first chunk (160 KB) comes with the first span, not with the
// thread: every pool and stream thread names itself, and an engine made and freed in a
// loop (tests, notebooks, reload loops) must not keep a chunk per thread it ever had.
struct ThreadBuffer {
  int tid = 0;
  std::string name;
  int process = 0;
  std::atomic<Chunk*> head{nullptr};  // written once by the owner, read by writers of the trace
  Chunk* tail = nullptr;              // owner only
  bool empty() const { return head.load(std::memory_order_acquire) == nullptr; }
  ~ThreadBuffer() {
    for (Chunk* c = head.load(); c;) {
      Chunk* n = c->next.load();
      delete c;
      c = n;
    }
  }
};

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<ThreadBuffer>> buffers;  // kept after their threads exit
  std::vector<std::pair<int, std::string>> processes;
  int next_tid = 1;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: spans may be recorded during exit
  return *r;
}

std::atomic<bool> g_enabled{false};

// A thread's registration: its buffer stays after the thread exits when it holds spans
// (a trace written later shows them); one without spans is dropped with its thread.
struct Registration {
  ThreadBuffer* b = nullptr;
  ~Registration() {
    if (!b || !b->empty()) return;
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::erase_if(r.buffers, [&](const std::unique_ptr<ThreadBuffer>& x) { return x.get() == b; });
  }
};

ThreadBuffer& buffer() {
  thread_local Registration reg;
  if (!reg.b) {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto owned = std::make_unique<ThreadBuffer>();
    owned->tid = r.next_tid++;
    owned->name = "thread " + std::to_string(owned->tid);
    r.buffers.push_back(std::move(owned));
    reg.b = r.buffers.back().get();
  }
  return *reg.b;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}

// TANDEM_TRACE=path: record from the start, write at exit.
struct EnvInit {
  EnvInit() {
    const char* p = std::getenv("TANDEM_TRACE");
    if (p && *p) {
      g_enabled.store(true);
      static std::string path = p;
      std::atexit([] {
        try {
          write(path);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "tandem: could not write the trace to %s: %s\n", path.c_str(), e.what());
        }
      });
    }
  }
} g_env_init;

}  // namespace

bool enabled() noexcept { return g_enabled.load(std::memory_order_relaxed); }
void enable(bool on) noexcept { g_enabled.store(on, std::memory_order_relaxed); }

int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void name_thread(const std::string& name, int process, const std::string& process_name) {
  ThreadBuffer& b = buffer();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  b.name = name;
  b.process = process;
  for (auto& p : r.processes)
    if (p.first == process) {
      p.second = process_name;
      return;
    }
  r.processes.emplace_back(process, process_name);
}

void record(const char* name, int64_t begin_ns, int64_t end_ns, const Args& args) noexcept {
  if (!enabled()) return;
  ThreadBuffer& b = buffer();
  Chunk* c = b.tail;
  if (!c) {
    c = new (std::nothrow) Chunk;
    if (!c) return;  // out of memory: drop the span, never crash the work
    b.tail = c;
    b.head.store(c, std::memory_order_release);
  }
  size_t n = c->count.load(std::memory_order_relaxed);
  if (n == kChunk) {
    Chunk* fresh = new (std::nothrow) Chunk;
    if (!fresh) return;  // out of memory: drop the span, never crash the work
    c->next.store(fresh, std::memory_order_release);
    b.tail = c = fresh;
    n = 0;
  }
  c->events[n] = Event{name, begin_ns, end_ns, args};
  c->count.store(n + 1, std::memory_order_release);
}

size_t span_count() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  size_t total = 0;
  for (auto& b : r.buffers)
    for (Chunk* c = b->head.load(std::memory_order_acquire); c; c = c->next.load(std::memory_order_acquire)) total += c->count.load(std::memory_order_acquire);
  return total;
}

void write(const std::filesystem::path& path) {
  const int64_t mono = now_ns();
  const int64_t wall =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string out;
  out += "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"clock\": \"CLOCK_MONOTONIC\", \"wall_minus_monotonic_us\": ";
  out += std::to_string((wall - mono) / 1000);
  out += "}, \"traceEvents\": [\n";
  bool first = true;
  auto emit = [&](const std::string& e) {
    if (!first) out += ",\n";
    out += e;
    first = false;
  };
  const int pid = static_cast<int>(::getpid());
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& [proc, pname] : r.processes)
      emit(str_cat("{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": ", pid * 100 + proc, ", \"args\": {\"name\": \"",
                   json_escape(pname), "\"}}"));
    for (auto& b : r.buffers) {
      emit(str_cat("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": ", pid * 100 + b->process, ", \"tid\": ", b->tid,
                   ", \"args\": {\"name\": \"", json_escape(b->name), "\"}}"));
      for (Chunk* c = b->head.load(std::memory_order_acquire); c; c = c->next.load(std::memory_order_acquire)) {
        const size_t n = c->count.load(std::memory_order_acquire);
        for (size_t i = 0; i < n; ++i) {
          const Event& e = c->events[i];
          char buf[96];
          std::snprintf(buf, sizeof buf, "%.3f, \"dur\": %.3f", e.begin_ns / 1e3, (e.end_ns - e.begin_ns) / 1e3);
          std::string args;
          auto arg = [&](const char* k, int v) {
            if (v < 0) return;
            args += str_cat(args.empty() ? "" : ", ", "\"", k, "\": ", v);
          };
          arg("layer", e.args.layer);
          arg("experts", e.args.experts);
          arg("tokens", e.args.tokens);
          emit(str_cat("{\"ph\": \"X\", \"name\": \"", json_escape(e.name), "\", \"pid\": ", pid * 100 + b->process,
                       ", \"tid\": ", b->tid, ", \"ts\": ", buf, ", \"args\": {", args, "}}"));
        }
      }
    }
  }
  out += "\n]}\n";
  write_file_atomic(path, out, "trace");
}

}  // namespace tandem::trace
