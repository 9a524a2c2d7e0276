// Starting copies of this program as other processes, for the programs that run a target split
// over ranks on one machine (specdec-generate --tp, bench_parallel).
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace specdec::examples {

// Starts /proc/self/exe with `args` (args[0] is its name) and this process's environment, its
// standard output discarded (its standard error kept, for its errors). Returns its process id;
// throws std::runtime_error when it cannot start.
inline pid_t start_copy(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int failed = posix_spawn(&pid, "/proc/self/exe", &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (failed != 0) throw std::runtime_error("cannot start a copy of this program (posix_spawn: error " + std::to_string(failed) + ")");
  return pid;
}

}  // namespace specdec::examples
