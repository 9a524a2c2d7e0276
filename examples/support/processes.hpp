// Starting copies of this program as other processes, for the programs that run a target split
// over ranks on one machine (specdec-generate --tp, specdec-verifier --tp, bench_parallel).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace specdec::examples {

// Starts /proc/self/exe with `args` (args[0] is its name) and this process's environment, its
// standard output discarded (its standard error kept, for its errors), its signals unblocked. Returns its process id;
// throws std::runtime_error when it cannot start.
inline pid_t start_copy(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  // The copy starts with no signal blocked and SIGINT and SIGTERM at their defaults, whatever this
  // thread blocks (a server that takes its signals with sigwait blocks them).
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  const int failed = posix_spawn(&pid, "/proc/self/exe", &files, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&files);
  if (failed != 0) throw std::runtime_error("cannot start a copy of this program (posix_spawn: error " + std::to_string(failed) + ")");
  return pid;
}

}  // namespace specdec::examples
