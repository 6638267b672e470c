#include "tandem/pool.h"

#include <immintrin.h>
#include <numa.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <string_view>
#include <system_error>

#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {

Pool::Pool(PoolOptions options) : options_(std::move(options)) {
  if (const char* v = std::getenv("TANDEM_POOL_CALLER_RUNS"); v && std::string_view(v) == "0")
    caller_runs_.store(false);
  TANDEM_CHECK(!options_.subpools.empty(), Errc::invalid_argument, "pool: no subpools");
  for (size_t s = 0; s < options_.subpools.size(); ++s) {
    auto& sp = options_.subpools[s];
    if (!sp.cpus.empty()) sp.threads = static_cast<int>(sp.cpus.size());
    TANDEM_CHECK(sp.threads >= 1, Errc::invalid_argument, "pool: subpool ", s, " has no threads");
    subs_.emplace_back();
    subs_.back().threads = sp.threads;
  }
  for (size_t s = 0; s < subs_.size(); ++s)
    for (size_t o = 0; o < subs_.size(); ++o)
      if (o != s && options_.subpools[o].numa_node == options_.subpools[s].numa_node)
        subs_[s].steal_from.push_back(static_cast<int>(o));
  int worker = 0, total = 0;
  for (const auto& sp : options_.subpools) total += sp.threads;
  try {
    for (size_t s = 0; s < subs_.size(); ++s) {
      const auto& sp = options_.subpools[s];
      for (int i = 0; i < sp.threads; ++i, ++worker)
        workers_.emplace_back(&Pool::worker_main, this, static_cast<int>(s), worker, i,
                              sp.cpus.empty() ? -1 : sp.cpus[i]);
    }
  } catch (const std::system_error& e) {
    // The system refused a thread (memory, thread limits): stop and join the workers that
    // did start, so the throw below leaves no joinable std::thread behind (which would be
    // std::terminate, i.e. SIGABRT, instead of an error the caller can report).
    stop_and_join();
    TANDEM_FAIL(Errc::io, "pool: cannot start worker thread ", worker + 1, " of ", total, " (", e.what(),
                "); lower cpu.threads or cpu.virtual_subpools, or raise the system's thread / memory limits");
  }
}

Pool::~Pool() { stop_and_join(); }

void Pool::stop_and_join() {
  stop_.store(true);
  wake_.fetch_add(1);
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

template <typename Pred>
void Pool::wait_until(std::atomic<uint64_t>& word, Pred done, int spin_us) {
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0; !done(); ++i) {
    if ((i & 63) == 63 && Clock::now() > until) {
      for (;;) {  // park
        const uint64_t v = word.load(std::memory_order_acquire);
        if (done()) return;
        word.wait(v, std::memory_order_acquire);
      }
    }
    _mm_pause();
  }
}

uint64_t Pool::submit(std::shared_ptr<Task> task) {
  TANDEM_CHECK(task != nullptr, Errc::invalid_argument, "pool: submit(nullptr)");
  TANDEM_CHECK(!stop_.load(), Errc::invalid_argument, "pool: submit after shutdown began");
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back({std::move(task), -1});
    ticket = submitted_.fetch_add(1, std::memory_order_release) + 1;
  }
  wake_.fetch_add(1, std::memory_order_release);
  wake_.notify_all();
  return ticket;
}

void Pool::wait(uint64_t ticket) {
  TANDEM_CHECK(ticket <= submitted_.load(), Errc::invalid_argument, "pool: wait(", ticket, ") for a task never submitted (",
               submitted_.load(), " so far)");
  {
    std::unique_lock<std::mutex> lock(queue_mu_);
    done_cv_.wait(lock, [&] { return completed_.load() >= ticket; });
  }
  rethrow_first_error();
}

void Pool::rethrow_first_error() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> g(error_mu_);
    std::swap(e, first_error_);
  }
  if (e) std::rethrow_exception(e);
}

bool Pool::wait_for(int allow_pending, int timeout_ms) {
  TANDEM_CHECK(allow_pending >= 0, Errc::invalid_argument, "pool: sync(", allow_pending, "): must be >= 0");
  std::unique_lock<std::mutex> lock(queue_mu_);
  auto ok = [&] { return submitted_.load() - completed_.load() <= static_cast<uint64_t>(allow_pending); };
  bool satisfied;
  if (timeout_ms < 0) {
    done_cv_.wait(lock, ok);
    satisfied = true;
  } else {
    satisfied = done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ok);
  }
  lock.unlock();
  if (satisfied) rethrow_first_error();
  return satisfied;
}

void Pool::sync(int allow_pending) { wait_for(allow_pending, -1); }

void Pool::run(std::shared_ptr<Task> task) {
  TANDEM_CHECK(task != nullptr, Errc::invalid_argument, "pool: run(nullptr)");
  TANDEM_CHECK(!stop_.load(), Errc::invalid_argument, "pool: run after shutdown began");
  bool here = caller_runs();
  uint64_t ticket = 0;
  // The worker whose part this thread runs: the one pinned to the CPU it is on (so the
  // other workers keep their own cores), else worker 0.
  int as = 0, as_subpool = 0;
  if (here) {
    // A pinned pool whose CPUs do not include the caller's keeps the caller out: as worker 0
    // it would leave that worker's core idle and share another.
    const int cpu = sched_getcpu();
    bool pinned = false, found = false;
    for (int s = 0, w = 0; s < static_cast<int>(options_.subpools.size()); ++s) {
      const auto& sp = options_.subpools[s];
      for (int i = 0; i < sp.threads; ++i, ++w) {
        pinned |= !sp.cpus.empty();
        if (!sp.cpus.empty() && sp.cpus[i] == cpu) as = w, as_subpool = s, found = true;
      }
    }
    here = found || !pinned;
  }
  if (here) {
    std::lock_guard<std::mutex> lock(queue_mu_);
    here = queue_.empty();  // idle: no task ahead of this one (FIFO)
    if (here) {
      queue_.push_back({task, as});
      ticket = submitted_.fetch_add(1, std::memory_order_release) + 1;
    }
  }
  if (!here) {
    submit(std::move(task));
    sync(0);
    return;
  }
  wake_.fetch_add(1, std::memory_order_release);
  wake_.notify_all();
  // The task before this one has finished (the queue was empty), but the thread that
  // finished it may not have released its last barrier yet: arriving at this task's first
  // barrier before that would read the old barrier generation.
  wait_until(retired_, [&] { return retired_.load(std::memory_order_acquire) + 1 >= ticket; }, options_.spin_us);
  run_phases(*task, as_subpool, as);  // that worker's part; when it returns the task has finished
  rethrow_first_error();
}

void Pool::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> g(error_mu_);
  if (!task_error_) task_error_ = e;
  task_failed_.store(true, std::memory_order_relaxed);
}

void Pool::set_counts(Task& t, int phase) {
  for (size_t s = 0; s < subs_.size(); ++s) {
    int n = 0;
    if (!task_failed_.load(std::memory_order_relaxed)) {
      try {
        n = t.items(phase, static_cast<int>(s));
      } catch (...) {
        fail(std::current_exception());
      }
    }
    subs_[s].next.store(0, std::memory_order_relaxed);
    subs_[s].count.store(std::max(n, 0), std::memory_order_relaxed);
  }
}

void Pool::run_items(Task& t, int phase, int subpool, int worker) {
  auto drain = [&](int s) {
    Sub& sub = subs_[s];
    const int n = sub.count.load(std::memory_order_relaxed);
    for (int i; (i = sub.next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      if (task_failed_.load(std::memory_order_relaxed)) continue;  // skip the rest of a failed task
      try {
        t.run(phase, s, i, worker);
      } catch (...) {
        fail(std::current_exception());
      }
    }
  };
  drain(subpool);
  for (int s : subs_[subpool].steal_from) drain(s);
}

// The phase barrier. The last thread to arrive sets up the next phase (or finishes the
// task) and releases the others by bumping phase_gen_.
void Pool::arrive(Task& t, int& phase) {
  const uint64_t gen = phase_gen_.load(std::memory_order_acquire);
  const int total = static_cast<int>(workers_.size());
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == total) {
    arrived_.store(0, std::memory_order_relaxed);
    const int next = phase + 1;
    const bool last = next >= t.phases();  // asked once: after the release below the task may be gone
    if (!last) {
      set_counts(t, next);
    } else {
      try {
        t.finished();
      } catch (...) {
        fail(std::current_exception());
      }
      {
        std::lock_guard<std::mutex> lock(queue_mu_);
        queue_.pop_front();
        {
          std::lock_guard<std::mutex> g(error_mu_);
          if (task_error_ && !first_error_) first_error_ = task_error_;
          task_error_ = nullptr;
        }
        task_failed_.store(false, std::memory_order_relaxed);
        completed_.fetch_add(1, std::memory_order_release);
      }
      done_cv_.notify_all();
    }
    phase_gen_.fetch_add(1, std::memory_order_release);
    phase_gen_.notify_all();
    if (last) {  // the task's last barrier released
      retired_.fetch_add(1, std::memory_order_release);
      retired_.notify_all();
    }
  } else {
    wait_until(phase_gen_, [&] { return phase_gen_.load(std::memory_order_acquire) != gen; }, options_.spin_us);
  }
  ++phase;
}

void Pool::run_phases(Task& t, int subpool, int worker) {
  // Phase -1: everyone has picked the task up; the last one sets up phase 0.
  int phase = -1;
  arrive(t, phase);
  while (phase < t.phases()) {
    run_items(t, phase, subpool, worker);
    arrive(t, phase);
  }
}

void Pool::worker_main(int subpool, int worker, int index, int cpu) {
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a failure leaves it unpinned
  }
  if (numa_available() >= 0 && numa_num_configured_nodes() > 1) numa_set_preferred(options_.subpools[subpool].numa_node);
  omp_set_num_threads(1);  // kernels and packers called from here must not start OpenMP teams
  trace::name_thread(str_cat("subpool ", subpool, " worker ", index), subpool + 1,
                     str_cat("tandem subpool ", subpool, " (NUMA node ", options_.subpools[subpool].numa_node, ")"));
  uint64_t done = 0;
  bool sat_out = false;
  for (;;) {
    // After sitting a task out, park at once: the thread that ran its part may share this
    // core, and spinning here would take it from that thread.
    wait_until(wake_, [&] { return submitted_.load(std::memory_order_acquire) > done || stop_.load(); },
               sat_out ? 0 : options_.spin_us);
    if (submitted_.load(std::memory_order_acquire) == done) break;  // stopping, queue drained
    // Every task before this one released its last barrier (a task this worker sat out may
    // still be running on its caller): then task done + 1 is the front, unless it was one
    // this worker sits out that finished before it looked (only those finish without it).
    wait_until(retired_, [&] { return retired_.load(std::memory_order_acquire) >= done; },
               sat_out ? 0 : options_.spin_us);
    Queued q;
    bool finished = false;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      finished = done < completed_.load(std::memory_order_acquire);
      if (!finished) q = queue_.front();
    }
    ++done;
    sat_out = finished || q.sit_out == worker;
    if (sat_out) continue;  // the submitting thread runs this worker's part (run())
    run_phases(*q.task, subpool, worker);
  }
}

namespace {

class ForEachTask : public Task {
 public:
  ForEachTask(int n, const std::function<void(int, int)>& f, const char* name) : items_(n), fn_(f), name_(name) {}
  int phases() const override { return 1; }
  int items(int, int) override { return items_; }
  void run(int, int s, int i, int) override {
    trace::Span span(name_, {-1, 1, -1});
    fn_(s, i);
    done.fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<int> done{0};

 private:
  int items_;
  const std::function<void(int, int)>& fn_;
  const char* name_;
};

}  // namespace

void for_each_item(Pool& pool, int items, const std::function<void(int, int)>& fn,
                   const std::function<void(int, int)>& progress, const char* span) {
  auto task = std::make_shared<ForEachTask>(items, fn, span);
  const int total = items * pool.subpools();
  pool.submit(task);
  for (;;) {
    const bool finished = pool.wait_for(0, 100);  // rethrows the task's error, if any
    if (progress) progress(task->done.load(), total);
    if (finished) break;
  }
}

}  // namespace tandem
