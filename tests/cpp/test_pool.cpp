// Worker pools: phased tasks, FIFO order, dynamic items, errors, idle CPU, shutdown.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <thread>

#include "tandem/error.h"
#include "tandem/pool_config.h"
#include "tandem/topology.h"
#include "test_util.h"

namespace tandem {
namespace {

PoolOptions small_pool(int subpools, int threads) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = threads;
  return pool_options(cpu);
}

// Phase p of subpool s has (p + 1) * (s + 2) items; every item bumps its counter once.
struct CountingTask : Task {
  explicit CountingTask(int subpools, int phases = 3) : P(phases), S(subpools), hits(P * S * 64) {}
  int phases() const override { return P; }
  int items(int p, int s) override {
    // Phases run in order: everything of phase p - 1 is done before phase p is set up.
    if (p > 0)
      for (int q = 0; q < S; ++q)
        for (int i = 0; i < p * (q + 2); ++i) EXPECT_EQ(hits[((p - 1) * S + q) * 64 + i].load(), 1);
    return (p + 1) * (s + 2);
  }
  void run(int p, int s, int i, int) override { hits[(p * S + s) * 64 + i].fetch_add(1); }
  void finished() override { finished_calls++; }
  int P, S;
  std::vector<std::atomic<int>> hits;
  std::atomic<int> finished_calls{0};
};

TEST(Pool, RunsEveryItemOfEveryPhaseOnce) {
  for (int subpools : {1, 2, 3}) {
    Pool pool(small_pool(subpools, 1));
    ASSERT_EQ(pool.subpools(), subpools);
    auto t = std::make_shared<CountingTask>(subpools);
    pool.run(t);
    for (int p = 0; p < 3; ++p)
      for (int s = 0; s < subpools; ++s)
        for (int i = 0; i < 64; ++i)
          ASSERT_EQ(t->hits[(p * subpools + s) * 64 + i].load(), i < (p + 1) * (s + 2) ? 1 : 0) << p << " " << s << " " << i;
    EXPECT_EQ(t->finished_calls.load(), 1);
  }
}

struct OrderTask : Task {
  OrderTask(std::vector<int>& log, std::mutex& mu, int id) : log(log), mu(mu), id(id) {}
  int phases() const override { return 1; }
  int items(int, int) override { return 1; }
  void run(int, int, int, int) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> g(mu);
    log.push_back(id);
  }
  std::vector<int>& log;
  std::mutex& mu;
  int id;
};

TEST(Pool, SubmitReturnsAtOnceAndTasksRunInOrder) {
  Pool pool(small_pool(2, 1));
  std::vector<int> log;
  std::mutex mu;
  for (int i = 0; i < 10; ++i) pool.submit(std::make_shared<OrderTask>(log, mu, i));
  pool.sync(3);  // at most 3 still pending
  EXPECT_LE(pool.pending(), 3u);
  pool.sync();
  EXPECT_EQ(pool.pending(), 0u);
  std::vector<int> want;
  for (int i = 0; i < 10; ++i) want.push_back(i), want.push_back(i);  // one item per subpool
  EXPECT_EQ(log, want);
}

struct ThrowingTask : Task {
  int phases() const override { return 2; }
  int items(int, int) override { return 8; }
  void run(int p, int, int i, int) override {
    if (p == 0 && i == 5) TANDEM_FAIL(Errc::invalid_argument, "item 5 is broken");
    ran_phase1 += p == 1;
  }
  std::atomic<int> ran_phase1{0};
};

TEST(Pool, WorkerExceptionsReachSyncAndThePoolStaysUsable) {
  Pool pool(small_pool(2, 1));
  auto bad = std::make_shared<ThrowingTask>();
  pool.submit(bad);
  EXPECT_EQ(test::error_of([&] { pool.sync(); }), "item 5 is broken");
  EXPECT_EQ(bad->ran_phase1.load(), 0) << "a failed task's later phases are skipped";
  auto good = std::make_shared<CountingTask>(2);
  pool.run(good);  // no stale error
  EXPECT_EQ(good->finished_calls.load(), 1);
}

// Records which thread ran each item under which worker index.
struct WhoTask : Task {
  explicit WhoTask(int n) : n(n), thread(n), worker(n) {}
  int phases() const override { return 2; }
  int items(int, int s) override { return s == 0 ? n : 0; }
  void run(int p, int, int i, int w) override {
    if (p == 0) {
      thread[i] = std::this_thread::get_id();
      worker[i] = w;
      if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let every thread take items
    }
  }
  int n;
  std::vector<std::thread::id> thread;
  std::vector<int> worker;
};

TEST(Pool, RunOnAnIdlePoolTakesTheCallerAsWorkerZero) {
  for (int threads : {1, 2, 3}) {
    PoolOptions o;
    o.subpools.push_back(SubpoolSpec{0, {}, threads});  // (threads, not pinned: any machine)
    Pool pool(o);
    ASSERT_TRUE(pool.caller_runs());
    for (int round = 0; round < 20; ++round) {
      auto t = std::make_shared<WhoTask>(64);
      pool.run(t);
      std::set<int> workers;
      for (int i = 0; i < t->n; ++i) {
        ASSERT_GE(t->worker[i], 0);
        ASSERT_LT(t->worker[i], threads);
        workers.insert(t->worker[i]);
        // worker 0's items, and only they, ran on this thread
        EXPECT_EQ(t->worker[i] == 0, t->thread[i] == std::this_thread::get_id()) << i;
      }
      if (threads == 1) EXPECT_EQ(workers, std::set<int>{0});
    }
    auto c = std::make_shared<CountingTask>(1);
    pool.run(c);  // phases in order, each item once (CountingTask checks)
    EXPECT_EQ(c->finished_calls.load(), 1);
    pool.set_caller_runs(false);
    auto t = std::make_shared<WhoTask>(8);
    pool.run(t);
    for (int i = 0; i < t->n; ++i) EXPECT_NE(t->thread[i], std::this_thread::get_id());
  }
}

TEST(Pool, RunTakesThePlaceOfTheWorkerOnTheCallersCpu) {
  Pool pool(small_pool(1, 0));  // one pinned thread per core, when the machine allows pinning
  const std::vector<int>& cpus = pool.spec(0).cpus;
  if (cpus.empty()) GTEST_SKIP() << "the pool is not pinned here";
  std::thread t([&] {
    for (int w : {static_cast<int>(cpus.size()) - 1, 0}) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[w], &set);
      ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(set), &set), 0);
      auto task = std::make_shared<WhoTask>(32);
      pool.run(task);
      for (int i = 0; i < task->n; ++i)  // this thread ran worker w's items, and only those
        EXPECT_EQ(task->worker[i] == w, task->thread[i] == std::this_thread::get_id()) << w << " " << i;
    }
  });
  t.join();
}

TEST(Pool, RunBehindQueuedTasksWaitsItsTurnAndErrorsReachTheCaller) {
  Pool pool(small_pool(2, 1));
  std::vector<int> log;
  std::mutex mu;
  for (int i = 0; i < 4; ++i) pool.submit(std::make_shared<OrderTask>(log, mu, i));
  pool.run(std::make_shared<OrderTask>(log, mu, 4));  // not idle: queued behind them (FIFO)
  EXPECT_EQ(pool.pending(), 0u);
  std::vector<int> want;
  for (int i = 0; i < 5; ++i) want.push_back(i), want.push_back(i);
  EXPECT_EQ(log, want);
  auto bad = std::make_shared<ThrowingTask>();
  EXPECT_EQ(test::error_of([&] { pool.run(bad); }), "item 5 is broken");
  EXPECT_EQ(bad->ran_phase1.load(), 0);
  // run() and submit() from other threads at once: every task runs once, in some order
  std::vector<std::shared_ptr<CountingTask>> tasks;
  for (int i = 0; i < 40; ++i) tasks.push_back(std::make_shared<CountingTask>(2, 2));
  std::thread other([&] {
    for (int i = 0; i < 20; ++i) pool.submit(tasks[i]);
  });
  for (int i = 20; i < 40; ++i) pool.run(tasks[i]);
  other.join();
  pool.sync();
  for (const auto& t : tasks) EXPECT_EQ(t->finished_calls.load(), 1);
}

TEST(Pool, ShutdownWithTasksPendingRunsThemAndJoins) {
  std::vector<int> log;
  std::mutex mu;
  {
    Pool pool(small_pool(2, 1));
    for (int i = 0; i < 5; ++i) pool.submit(std::make_shared<OrderTask>(log, mu, i));
  }  // destructor: drains the queue, joins
  EXPECT_EQ(log.size(), 10u);
}

double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
}

// A resource check, not a speed test: parked workers must not burn CPU.
// A thread the system refuses (here: an address-space limit that leaves no room for the
// workers' stacks) is an error naming what to lower, and the workers already started are
// joined: before, the constructor threw past joinable threads, which is std::terminate.
// Runs in a forked child, whose limit cannot touch this process.
TEST(Pool, AThreadTheSystemRefusesIsAnErrorNotAnAbort) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers reserve terabytes of address space: no address-space limit can leave them room";
#else
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit lim{};
    getrlimit(RLIMIT_AS, &lim);
    // What is mapped now plus 64 MB: room for a few 8 MB thread stacks, not for 64.
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    lim.rlim_cur = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (64l << 20);
    if (pages == 0 || setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    try {
      PoolOptions o;  // 64 unpinned workers (pool_options refuses more threads than cores)
      o.subpools.emplace_back();
      o.subpools[0].threads = 64;
      Pool pool(std::move(o));
      _exit(1);  // every thread started: the limit did not bite
    } catch (const Error& e) {
      const std::string m = e.what();
      _exit(m.find("pool: cannot start worker thread") != std::string::npos &&
                    m.find("lower cpu.threads") != std::string::npos
                ? 0
                : 2);
    } catch (...) {
      _exit(4);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: all threads started; 2: wrong message; 3: no limit set; 4: other exception";
#endif
}

TEST(Pool, IdlePoolUsesAlmostNoCpu) {
  Pool pool(small_pool(2, 2));
  pool.run(std::make_shared<CountingTask>(2));  // wake everyone once
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double before = process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double used = process_cpu_seconds() - before;
  std::printf("[ idle     ] %d workers, 1 s idle: %.4f s CPU\n", pool.total_threads(), used);
  EXPECT_LT(used, 0.02) << "idle workers are spinning";
}

TEST(Pool, OptionsComeFromTheConfigAndBadOnesAreNamed) {
  Config::Cpu cpu;
  cpu.virtual_subpools = 0;
  EXPECT_EQ(test::error_of([&] { pool_options(cpu); }), "cpu.virtual_subpools = 0 must be at least 1");
  cpu.virtual_subpools = 1;
  cpu.numa_nodes = {99};
  EXPECT_EQ(test::error_of([&] { pool_options(cpu); }), "cpu.numa_nodes: node 99 does not exist on this machine");
  cpu.numa_nodes = {};
  int pus = 0;  // logical CPUs of the auto node list's first node: the first with cores
  for (const auto& n : topology().nodes)
    if (!n.cores.empty() && pus == 0)
      for (const auto& core : n.cores) pus += static_cast<int>(core.pus.size());
  cpu.threads = pus + 1;
  const std::string more = test::error_of([&] { pool_options(cpu); });
  EXPECT_EQ(more.rfind(str_cat("cpu.threads = ", pus + 1, " exceeds the ", pus, " logical CPUs of NUMA node "), 0), 0u)
      << more;
  cpu.threads = pus;
  EXPECT_NO_THROW(pool_options(cpu));
  cpu.threads = 0;
  const PoolOptions o = pool_options(cpu);
  EXPECT_GE(o.subpools.size(), 1u);
  for (const auto& s : o.subpools) EXPECT_EQ(s.cpus.size(), static_cast<size_t>(s.threads));
}

// A pool beside a GPU leaves a core to the thread driving it: the first subpool of an auto
// pool has one thread less (never none), the others and explicit thread counts are as asked.
TEST(Pool, ReservedCoresComeOffTheFirstAutoSubpool) {
  Config::Cpu cpu;
  const PoolOptions all = pool_options(cpu), spared = pool_options(cpu, 1);
  ASSERT_EQ(all.subpools.size(), spared.subpools.size());
  EXPECT_EQ(spared.subpools[0].threads, std::max(1, all.subpools[0].threads - 1));
  EXPECT_EQ(spared.subpools[0].cpus.size(), static_cast<size_t>(spared.subpools[0].threads));
  for (size_t i = 1; i < all.subpools.size(); ++i) EXPECT_EQ(spared.subpools[i].threads, all.subpools[i].threads);
  EXPECT_EQ(pool_options(cpu, 1000).subpools[0].threads, 1);
  cpu.threads = 1;
  EXPECT_EQ(pool_options(cpu, 1).subpools[0].threads, 1);
}

}  // namespace
}  // namespace tandem
