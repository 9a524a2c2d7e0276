// specdec-generate's tensor parallelism: the target split over ranks, one process each.
//
//   --tp N                               N ranks on this machine: this process is rank 0 and
//                                        starts ranks 1..N-1 as copies of itself, meeting them
//                                        at a file in a fresh temporary folder.
//   --rank R --world-size N --master H:P one rank of a group started by hand, on this machine or
//                                        others; rank 0 listens on port P of host H.
//
// Every rank reads its shard of the target (io::load_llama with an io::Shard) and a whole
// drafter; every decision is rank 0's (specdec::SharedDecisions). Only rank 0 prints; the other
// ranks' standard output is discarded, their errors reach standard error, prefixed.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <specdec/distributed.hpp>

#include "../support/processes.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

// The ranks of this run and what they share; on destruction rank 0 (of --tp) waits for the
// ranks it started, and stops them if it fails.
class Parallel {
 public:
  Parallel() = default;
  Parallel(const Parallel&) = delete;
  Parallel& operator=(const Parallel&) = delete;

  // Meets the other ranks (starting them first for --tp on rank 0) once `config` is known to
  // divide over them; a run of one rank does nothing.
  void start(const Arguments& a, const models::LlamaConfig& config) {
    const io::Shard part = shard(a);
    if (part.world_size <= 1) return;
    if (part.rank > 0) label() = " (rank " + std::to_string(part.rank) + ")";
    check_tensor_parallel(config, part.world_size);  // before any rank is started: nobody waits in vain
    Rendezvous where{.rank = part.rank, .world_size = part.world_size,
                     .timeout = std::chrono::milliseconds(a.tp_timeout_ms)};
    if (!a.master.empty()) {
      where.master = a.master;
    } else if (!a.tp_rendezvous_file.empty()) {
      where.file = a.tp_rendezvous_file;
    } else {  // --tp N on rank 0: start the others
      folder_ = std::filesystem::temp_directory_path() / ("specdec-tp-" + std::to_string(getpid()));
      std::filesystem::remove_all(folder_);
      std::filesystem::create_directories(folder_);
      where.file = (folder_ / "rendezvous").string();
      for (int64_t rank = 1; rank < part.world_size; ++rank) spawn(rank, where.file);
    }
    if (a.device.rfind("cuda", 0) == 0) where.backend = Rendezvous::Backend::nccl;
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
        std::cerr << "specdec-generate: a rank started by --tp ended with status "
                  << (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)) << "\n";
      }
    }
    if (!folder_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(folder_, ignored);
    }
  }

  // This process's part of the target.
  static io::Shard shard(const Arguments& a) {
    return {.rank = std::max<int64_t>(a.rank, 0), .world_size = a.world_size > 0 ? a.world_size : a.tp};
  }

  // " (rank R)" on ranks other than 0, for their messages.
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
    children_.push_back(examples::start_copy(std::move(args)));
  }

  std::shared_ptr<ProcessGroupCollectives> group_;
  std::optional<SharedDecisions> decisions_;
  std::vector<pid_t> children_;
  std::filesystem::path folder_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace
