// The remote verifier's queue, apart from gRPC: callers on many threads hand it work and wait,
// and one thread of its own (the model's) serves the work in rounds, one at a time.
//
//   specdec::remote::ForwardQueue<Job> queue({.max_batch = 16},
//       {.task = [&](Job& job) { ... },                         // a prefill, alone
//        .verify = [&](std::span<Job* const> jobs) { ... }});    // verifications, one forward
//   queue.verify(job);  // on a handler thread: returns once the round that served it has ended
//
// Two kinds of work wait: tasks (a session's prefill), each served alone, and verifications,
// served together. A round runs the oldest waiting task, if any, and then every waiting
// verification (up to max_batch) in one call of `verify`. A verification that finds the model idle
// is served at once, so batching adds no waiting of its own: a batch is what queued up while the
// previous round ran. With a batch_delay, a round of fewer than max_batch verifications first
// waits that long for more (serving the tasks that arrive meanwhile), and starts as soon as
// max_batch are waiting. With a heartbeat, the model's thread calls `idle` after each heartbeat
// that passed with nothing waiting (a tensor-parallel rank 0 tells the other ranks it is alive).
// stop() lets the thread serve what is waiting, then calls `stop` once and ends it.
//
// Every round runs on the queue's thread, so one thread's scratch buffers serve every forward.
// The handlers are the caller's; an exception one throws reaches the callers whose work that round
// served (rethrown by task() or verify()) and no one else, and the queue goes on serving.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace specdec::remote {

struct ForwardQueueOptions {
  int64_t max_batch = 16;                    // verifications in one round (1: no batching)
  std::chrono::microseconds batch_delay{0};  // how long a round of fewer waits for more
  // How often the thread calls `idle` while nothing waits; none: it waits without a limit.
  std::optional<std::chrono::milliseconds> heartbeat{};
};

// What the rounds have served: verifications, rounds that served verifications, the most
// verifications one round served, and tasks.
struct ForwardQueueStats {
  int64_t verifications = 0;
  int64_t forwards = 0;
  int64_t largest_batch = 0;
  int64_t tasks = 0;
};

template <class Job>
class ForwardQueue {
 public:
  struct Rounds {
    std::function<void(Job&)> task{};                     // serves one task alone
    std::function<void(std::span<Job* const>)> verify{};  // serves a batch of verifications
    std::function<void()> idle{};                         // a heartbeat passed with nothing waiting
    std::function<void()> stop{};                         // the last round, after stop()
  };

  // Starts the queue's thread. Throws std::invalid_argument for max_batch < 1, a negative
  // batch_delay, a heartbeat that is not positive, a missing task or verify, or a heartbeat
  // without idle.
  ForwardQueue(ForwardQueueOptions options, Rounds rounds) : options_(options), rounds_(std::move(rounds)) {
    if (options_.max_batch < 1) {
      throw std::invalid_argument("ForwardQueueOptions::max_batch must be at least 1, not " +
                                  std::to_string(options_.max_batch));
    }
    if (options_.batch_delay.count() < 0) {
      throw std::invalid_argument("ForwardQueueOptions::batch_delay must not be negative, not " +
                                  std::to_string(options_.batch_delay.count()) + " us");
    }
    if (options_.heartbeat && options_.heartbeat->count() <= 0) {
      throw std::invalid_argument("ForwardQueueOptions::heartbeat must be positive, not " +
                                  std::to_string(options_.heartbeat->count()) + " ms");
    }
    if (!rounds_.task || !rounds_.verify) {
      throw std::invalid_argument("ForwardQueue::Rounds: task and verify must both be set");
    }
    if (options_.heartbeat && !rounds_.idle) {
      throw std::invalid_argument("ForwardQueue::Rounds: idle must be set when ForwardQueueOptions::heartbeat is");
    }
    thread_ = std::thread([this] { serve(); });
  }

  ForwardQueue(const ForwardQueue&) = delete;
  ForwardQueue& operator=(const ForwardQueue&) = delete;
  ~ForwardQueue() { stop(); }

  // Queues `job` as a task and returns when it has been served; rethrows what `task` threw for
  // it. Throws std::logic_error once stop() has been called.
  void task(Job& job) { wait_for(job, /*is_task=*/true); }

  // Queues `job` as a verification and returns when the round that served it has ended; rethrows
  // what `verify` threw for that round. Throws std::logic_error once stop() has been called.
  void verify(Job& job) { wait_for(job, /*is_task=*/false); }

  // Serves what is waiting, calls `stop`, and ends the thread. Idempotent; the destructor calls
  // it. Work handed over after it starts is refused (std::logic_error). Called by a handler (on the
  // queue's thread), it returns at once and the thread ends after the rounds that remain.
  void stop() {
    bool handler = false;
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
      handler = serving_ == std::this_thread::get_id();
    }
    arrived_.notify_all();
    if (handler) return;
    const std::lock_guard joining(join_mutex_);
    if (thread_.joinable()) thread_.join();
  }

  [[nodiscard]] ForwardQueueStats stats() const {
    const std::lock_guard lock(mutex_);
    return stats_;
  }

  // Whether stop() has been called: from then on, work handed over is refused.
  [[nodiscard]] bool stopping() const {
    const std::lock_guard lock(mutex_);
    return stopping_;
  }

  // Work handed over and not yet taken into a round: tasks plus verifications.
  [[nodiscard]] size_t waiting() const {
    const std::lock_guard lock(mutex_);
    return tasks_.size() + verifications_.size();
  }

  [[nodiscard]] const ForwardQueueOptions& options() const noexcept { return options_; }

 private:
  // One caller's work while it waits: the round that serves it sets done (and error).
  struct Ticket {
    Job* job = nullptr;
    bool done = false;
    std::exception_ptr error{};
  };

  void wait_for(Job& job, bool is_task) {
    Ticket ticket{.job = &job};
    std::unique_lock lock(mutex_);
    if (stopping_) throw std::logic_error("ForwardQueue: work handed over after stop()");
    (is_task ? tasks_ : verifications_).push_back(&ticket);
    arrived_.notify_one();
    served_.wait(lock, [&] { return ticket.done; });
    if (ticket.error) std::rethrow_exception(ticket.error);
  }

  // The thread: rounds until stop() with nothing waiting (see the top of this file).
  void serve() {
    std::unique_lock lock(mutex_);
    serving_ = std::this_thread::get_id();
    const auto has_work = [&] { return stopping_ || !verifications_.empty() || !tasks_.empty(); };
    const auto size = static_cast<size_t>(options_.max_batch);
    while (true) {
      if (!options_.heartbeat) {
        arrived_.wait(lock, has_work);
      } else if (!arrived_.wait_for(lock, *options_.heartbeat, has_work)) {
        lock.unlock();
        call([&] { rounds_.idle(); });
        lock.lock();
        continue;
      }
      if (verifications_.empty() && tasks_.empty()) break;  // stopping, nothing left
      if (!tasks_.empty()) serve_task(lock);
      if (verifications_.empty()) continue;
      if (options_.batch_delay.count() > 0) {
        const auto deadline = std::chrono::steady_clock::now() + options_.batch_delay;
        while (verifications_.size() < size && !stopping_) {
          if (!tasks_.empty()) {
            serve_task(lock);
          } else if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout) {
            break;
          }
        }
      }
      const auto take = static_cast<std::ptrdiff_t>(std::min(verifications_.size(), size));
      round_.assign(verifications_.begin(), verifications_.begin() + take);
      verifications_.erase(verifications_.begin(), verifications_.begin() + take);
      lock.unlock();
      jobs_.clear();
      for (const Ticket* ticket : round_) jobs_.push_back(ticket->job);
      const std::exception_ptr error = call([&] { rounds_.verify(std::span<Job* const>(jobs_)); });
      lock.lock();
      stats_.verifications += static_cast<int64_t>(round_.size());
      ++stats_.forwards;
      stats_.largest_batch = std::max(stats_.largest_batch, static_cast<int64_t>(round_.size()));
      for (Ticket* ticket : round_) {
        ticket->error = error;
        ticket->done = true;
      }
      served_.notify_all();
    }
    lock.unlock();
    if (rounds_.stop) call([&] { rounds_.stop(); });
  }

  // Serves the oldest task, without the lock while it runs.
  void serve_task(std::unique_lock<std::mutex>& lock) {
    Ticket* ticket = tasks_.front();
    tasks_.pop_front();
    lock.unlock();
    const std::exception_ptr error = call([&] { rounds_.task(*ticket->job); });
    lock.lock();
    ++stats_.tasks;
    ticket->error = error;
    ticket->done = true;
    served_.notify_all();
  }

  // Runs `handler`; what it throws, caught. An idle or stop handler's exception has no caller to
  // reach and is dropped: those handlers report their failures themselves.
  template <class Handler>
  static std::exception_ptr call(Handler&& handler) noexcept {
    try {
      handler();
      return {};
    } catch (...) {
      return std::current_exception();
    }
  }

  ForwardQueueOptions options_;
  Rounds rounds_;
  mutable std::mutex mutex_;  // guards the lists, stopping_, serving_, stats_ and the tickets' results
  std::condition_variable arrived_, served_;
  std::deque<Ticket*> tasks_;
  std::deque<Ticket*> verifications_;
  bool stopping_ = false;
  std::thread::id serving_{};  // the queue's thread, once it runs
  ForwardQueueStats stats_;
  // The round being served and its jobs: the queue's thread's alone, kept from round to round.
  std::vector<Ticket*> round_;
  std::vector<Job*> jobs_;
  std::mutex join_mutex_;  // one stop() joins the thread, the others wait for it
  std::thread thread_{};   // started last by the constructor
};

}  // namespace specdec::remote
