// Tensor parallelism in the example programs (specdec-generate, specdec-verifier): the target
// split over ranks, one process each.
//
//   --tp N                               N ranks on this machine: this process is rank 0 and
//                                        starts ranks 1..N-1 as copies of itself, meeting them
//                                        at a file in a fresh temporary folder.
//   --rank R --world-size N --master H:P one rank of a group started by hand, on this machine or
//                                        others; rank 0 listens on port P of host H.
//
// Every rank reads its shard of the target (io::load_llama with an io::Shard); every decision is
// rank 0's (specdec::SharedDecisions). The ranks --tp starts have their standard output
// discarded; their errors reach standard error, prefixed " (rank R)".
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <specdec/distributed.hpp>
#include <specdec/io/hf_llama.hpp>

#include "cli.hpp"
#include "processes.hpp"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace specdec::examples {

// The command line's tensor-parallel flags.
struct TensorParallelFlags {
  int64_t tp = 1;                // --tp: ranks started on this machine
  int64_t rank = -1;             // --rank: this process's rank (-1: not given)
  int64_t world_size = 0;        // --world-size of a group started by hand (0: not given)
  std::string master;            // --master HOST:PORT of that group
  std::string rendezvous_file;   // set by --tp for the ranks it starts
  int64_t timeout_ms = 60000;    // the rendezvous and every collective

  // Whether this process is a rank other than 0.
  [[nodiscard]] bool follower() const { return rank > 0; }
  // Whether this is a rank of a group started by hand (--world-size, --master).
  [[nodiscard]] bool by_hand() const { return world_size > 0 || !master.empty(); }

  // Adds the flags to `app`, in their own group of its help.
  void add_to(CLI::App& app) {
    const std::string group = "Tensor parallelism (the target split over ranks, one process each; see docs/parallel.md)";
    app.add_option("--tp", tp, "split the target over N processes on this machine (default 1)")
        ->check(cli::integer<int64_t>(1, 1024))->group(group);
    app.add_option("--rank", rank, "this process's rank in a group started by hand (with --world-size and --master)")
        ->check(cli::integer<int64_t>(0, 1023))->group(group);
    app.add_option("--world-size", world_size, "the number of ranks of that group")
        ->check(cli::integer<int64_t>(1, 1024))->group(group);
    app.add_option("--master", master, "HOST:PORT of rank 0, which listens there; the other ranks connect")
        ->group(group);
    app.add_option("--tp-timeout-ms", timeout_ms,
                   "a rank that does not come or answer within this long fails the run (default 60000)")
        ->check(cli::integer<int64_t>(1, 3600000))->group(group);
    app.add_option("--tp-rendezvous-file", rendezvous_file)->group("");  // set by --tp for the ranks it starts
  }

  // Throws std::invalid_argument for flags that do not describe one group.
  void check() const {
    if (by_hand() && tp > 1) {
      throw std::invalid_argument("--tp starts its ranks on this machine; --world-size and --master describe a group "
                                  "started by hand: give one or the other");
    }
    if (by_hand() && (rank < 0 || world_size == 0 || master.empty())) {
      throw std::invalid_argument("a rank of a group started by hand needs --rank, --world-size and --master");
    }
    if (rank >= 0 && !by_hand() && rendezvous_file.empty()) {
      throw std::invalid_argument("--rank applies to a group started by hand: give --world-size and --master too");
    }
    if (by_hand() && rank >= world_size) {
      throw std::invalid_argument("--rank " + std::to_string(rank) + " must be below --world-size " +
                                  std::to_string(world_size));
    }
    if (!master.empty()) (void)Rendezvous{.master = master}.host_and_port();
  }

  // This process's part of the target.
  [[nodiscard]] io::Shard shard() const {
    return {.rank = std::max<int64_t>(rank, 0), .world_size = world_size > 0 ? world_size : tp};
  }
};

// The ranks of this run and what they share; on destruction rank 0 (of --tp) waits for the
// ranks it started, and stops them if it fails.
class Parallel {
 public:
  // `program` names this program in messages.
  explicit Parallel(std::string program) : program_(std::move(program)) {}
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  // Meets the other ranks (starting them first for --tp on rank 0) once `config` is known to
  // divide over them, over NCCL when `nccl`, else Gloo; a run of one rank does nothing.
  void start(const TensorParallelFlags& flags, const models::LlamaConfig& config, bool nccl) {
    const io::Shard part = flags.shard();
    if (part.world_size <= 1) return;
    if (part.rank > 0) label() = " (rank " + std::to_string(part.rank) + ")";
    check_tensor_parallel(config, part.world_size);  // before any rank is started: nobody waits in vain
    Rendezvous where{.rank = part.rank, .world_size = part.world_size,
                     .timeout = std::chrono::milliseconds(flags.timeout_ms)};
    if (!flags.master.empty()) {
      where.master = flags.master;
    } else if (!flags.rendezvous_file.empty()) {
      where.file = flags.rendezvous_file;
    } else {  // --tp N on rank 0: start the others
      folder_ = std::filesystem::temp_directory_path() / ("specdec-tp-" + std::to_string(getpid()));
      std::filesystem::remove_all(folder_);
      std::filesystem::create_directories(folder_);
      where.file = (folder_ / "rendezvous").string();
      for (int64_t rank = 1; rank < part.world_size; ++rank) spawn(rank, where.file);
    }
    if (nccl) where.backend = Rendezvous::Backend::nccl;
    group_ = connect(where);
    decisions_.emplace(*group_);
  }

  [[nodiscard]] const std::shared_ptr<ProcessGroupCollectives>& group() const { return group_; }

  // Rank 0 of --tp waits for the ranks it started when the run ends well, and stops them when it
  // fails (an exception is unwinding), rather than leaving them waiting for a collective.
  ~Parallel() {
    decisions_.reset();
    group_.reset();
    const bool failing = std::uncaught_exceptions() > exceptions_;
    for (const pid_t pid : children_) {
      if (failing) kill(pid, SIGTERM);
      int status = 0;
      if (waitpid(pid, &status, 0) == pid && !failing && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        std::cerr << program_ << ": a rank started by --tp ended with status "
                  << (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)) << "\n";
      }
    }
    if (!folder_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(folder_, ignored);
    }
  }

  // " (rank R)" on ranks other than 0 once start() has run, for their messages; else empty.
  static std::string& label() {
    static std::string text;
    return text;
  }

  // The command line of this process, kept by main() for the ranks --tp starts.
  static std::vector<std::string>& command_line() {
    static std::vector<std::string> args;
    return args;
  }

 private:
  void spawn(int64_t rank, const std::string& file) {
    std::vector<std::string> args = command_line();
    for (const std::string& extra : {std::string("--rank"), std::to_string(rank), std::string("--tp-rendezvous-file"), file}) {
      args.push_back(extra);
    }
    children_.push_back(start_copy(std::move(args)));
  }

  std::string program_;
  std::shared_ptr<ProcessGroupCollectives> group_;
  std::optional<SharedDecisions> decisions_;
  std::vector<pid_t> children_;
  std::filesystem::path folder_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace specdec::examples
