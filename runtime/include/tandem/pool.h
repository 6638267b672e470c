// tandem/pool.h: NUMA worker pools that run phased tasks asynchronously.
//
// A Pool is a set of subpools, one per NUMA node (or several "virtual" subpools on
// one node, so the split/merge paths run on 1-node machines). Each subpool's threads
// are pinned to its node's physical cores (one thread per core by default) and prefer
// its memory, so buffers they first touch live there.
//
// Work is a Task: a fixed number of phases; in each phase every subpool has a number
// of work items, handed out dynamically (an atomic counter per subpool; a thread that
// runs out steals from the other subpools). All threads of all subpools finish a phase
// before the next starts; the last thread to arrive asks the task for the next phase's
// item counts, so they can depend on the previous phase's results.
//
// submit() queues a task and returns at once with its ticket; tasks run one after
// another in FIFO order, and wait(ticket) blocks until that one finished. sync(n) blocks (without spinning) until at most n tasks are pending and
// rethrows the first exception a finished task threw (the pool stays usable). Idle
// workers spin for a few microseconds, then park on a futex.
//
// run() (submit and wait) on an idle pool lets the calling thread do one worker's share
// itself (the worker pinned to the CPU the caller is on, or worker 0 of an unpinned pool;
// a pinned pool without the caller's CPU runs the task on its workers; that worker's
// thread sits the task out, parked): the caller neither sleeps on a
// condition variable while the workers run nor waits to be woken when they finish, and on
// a machine where the caller and the workers share the cores (CPU decode: torch's thread
// and the pool) one thread fewer competes for them. The items, phases and worker indices
// are the same as without it (set_caller_runs(false), or TANDEM_POOL_CALLER_RUNS=0 in the
// environment when the pool is made, turns it off).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tandem {

struct SubpoolSpec {
  int numa_node = 0;      // OS index of the node whose memory it prefers
  std::vector<int> cpus;  // logical CPUs to pin its threads to, one thread each; empty: no pinning
  int threads = 0;        // used when cpus is empty
};

struct PoolOptions {
  std::vector<SubpoolSpec> subpools;
  int spin_us = 50;  // how long idle workers spin before parking
};

// pool_options(config.cpu), the options from a placement config: tandem/pool_config.h.

class Task {
 public:
  virtual ~Task() = default;
  virtual int phases() const = 0;
  // Item counts of phase p for subpool s; called once per phase, before it starts.
  virtual int items(int phase, int subpool) = 0;
  // Runs one item of subpool `subpool`'s list. `worker` is the calling thread's index
  // in the whole pool (0 .. total_threads - 1), for per-thread scratch; a thread may
  // take items of another subpool on the same NUMA node once its own are gone.
  virtual void run(int phase, int subpool, int item, int worker) = 0;
  // Called once, by the thread that finishes the last phase, before sync() sees the
  // task as done (e.g. to record its span).
  virtual void finished() {}
};

class Pool {
 public:
  explicit Pool(PoolOptions options);
  ~Pool();  // runs the tasks still queued, then joins the threads
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int subpools() const { return static_cast<int>(subs_.size()); }
  int threads(int subpool) const { return subs_[subpool].threads; }
  int total_threads() const { return static_cast<int>(workers_.size()); }
  const SubpoolSpec& spec(int subpool) const { return options_.subpools[subpool]; }

  // Queues a task; returns its ticket (1, 2, 3, ... in submission order).
  uint64_t submit(std::shared_ptr<Task> task);
  // Waits until the task with this ticket (and so every earlier one: FIFO) finished,
  // then rethrows the first error of the finished tasks (clearing it). Ticket 0: no wait.
  void wait(uint64_t ticket);
  // Waits until at most `allow_pending` submitted tasks have not finished, then rethrows
  // the first error of the finished tasks (clearing it).
  void sync(int allow_pending = 0);
  // As sync(), but gives up after `timeout_ms`; returns whether the wait was satisfied.
  bool wait_for(int allow_pending, int timeout_ms);
  // Runs a task and waits for it (submit + sync(0)); on an idle pool the calling thread
  // runs one worker's part (see the file comment). Not from inside a task.
  void run(std::shared_ptr<Task> task);
  void set_caller_runs(bool on) { caller_runs_.store(on, std::memory_order_relaxed); }
  bool caller_runs() const { return caller_runs_.load(std::memory_order_relaxed); }
  uint64_t pending() const { return submitted_.load() - completed_.load(); }

 private:
  struct Sub {
    int threads = 0;
    std::vector<int> steal_from;  // other subpools on the same node
    alignas(64) std::atomic<int> next{0};
    std::atomic<int> count{0};
  };
  struct Queued {
    std::shared_ptr<Task> task;
    int sit_out = -1;  // the worker whose part the submitting thread runs (run()), or -1
  };
  void worker_main(int subpool, int worker, int index, int cpu);
  void run_phases(Task& t, int subpool, int worker);  // one thread's part of a task, all phases
  void stop_and_join();  // workers finish the queued tasks and exit; all are joined
  void run_items(Task& t, int phase, int subpool, int worker);
  void arrive(Task& t, int& phase);
  void set_counts(Task& t, int phase);
  void fail(std::exception_ptr e);
  void rethrow_first_error();  // the first error of the finished tasks, cleared
  template <typename Pred>
  void wait_until(std::atomic<uint64_t>& word, Pred done, int spin_us);

  PoolOptions options_;
  std::deque<Sub> subs_;  // deque: Sub holds atomics (not movable)
  std::vector<std::thread> workers_;

  std::mutex queue_mu_;
  std::deque<Queued> queue_;  // front: the running task
  std::condition_variable done_cv_;          // completed_ changed (callers of sync wait here)
  alignas(64) std::atomic<uint64_t> submitted_{0};
  alignas(64) std::atomic<uint64_t> completed_{0};
  alignas(64) std::atomic<uint64_t> wake_{0};  // bumps on submit and stop: parked idle workers wait on it
  alignas(64) std::atomic<uint64_t> phase_gen_{0};  // bumps when a phase (or task) completes
  alignas(64) std::atomic<uint64_t> retired_{0};    // tasks whose last barrier was released (a
                                                    // sitting-out worker parks on it)
  std::atomic<int> arrived_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> task_failed_{false};
  std::atomic<bool> caller_runs_{true};
  std::exception_ptr task_error_;   // of the running task
  std::mutex error_mu_;
  std::exception_ptr first_error_;  // of finished tasks, for sync()
};

// Runs fn(subpool, item) for item in [0, items) on every subpool's own threads (one
// single-phase task) and waits; progress(done, subpools * items), when given, is called
// on this thread at least every 100 ms and once at the end. Rethrows fn's first error.
void for_each_item(Pool& pool, int items, const std::function<void(int subpool, int item)>& fn,
                   const std::function<void(int done, int total)>& progress = {}, const char* span = "pack");

}  // namespace tandem
