// Collectives (parallel.hpp) over PyTorch's c10d process groups: Gloo between processes on CPUs,
// NCCL between GPUs, met at a rendezvous (a file on one machine, or rank 0's TCP store).
//
//   specdec::Rendezvous where{.rank = rank, .world_size = 2, .master = "10.0.0.1:29500"};
//   const std::shared_ptr<specdec::Collectives> group = specdec::connect(where);
//   LlamaModel<> target(config, models::llama_shard(config, weights, rank, 2), group);
//   specdec::SharedDecisions decisions(*group);   // every rank emits rank 0's tokens
//
// Link specdec::distributed (CMake): c10d's Gloo header includes Gloo's own headers (Debian:
// libgloo-dev), and USE_C10D_GLOO (USE_C10D_NCCL for NCCL) must be defined for it.
//
// Failures are std::runtime_error naming what failed and where: a rendezvous that does not
// complete within the timeout (an unreachable master, a rank that never comes), a collective whose
// peer is gone ("Connection closed by peer" at once when a rank's process ends) or that does not
// complete within the timeout (a rank that hangs).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(SPECDEC_HAVE_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define SPECDEC_HAVE_NCCL 1
#endif

#include "specdec/detail/check.hpp"
#include "specdec/parallel.hpp"

namespace specdec {

// Where and how the ranks of a group meet.
struct Rendezvous {
  enum class Backend { gloo, nccl };
  int64_t rank = 0;        // this process's rank, in [0, world_size)
  int64_t world_size = 1;  // the number of ranks, >= 1
  // Exactly one of the two: a file path every rank opens (ranks on one machine; the file must
  // not exist before rank 0 starts: a file left from another group would mix the two), or
  // "host:port" of rank 0's TCP store (rank 0 listens on port, the others connect to host).
  std::string file{};
  std::string master{};
  // The rendezvous and every collective fail after this long (a rank that hangs).
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  Backend backend = Backend::gloo;  // nccl: CUDA tensors, a build with NCCL (SPECDEC_HAVE_NCCL)

  // Throws std::invalid_argument naming the first field out of range.
  void validate() const {
    if (world_size < 1) detail::throw_invalid("Rendezvous::world_size", "be >= 1", world_size);
    if (rank < 0 || rank >= world_size) {
      detail::throw_invalid_message("Rendezvous::rank must be in [0, world_size = ", world_size, "), got ", rank);
    }
    if (file.empty() == master.empty()) {
      throw std::invalid_argument("Rendezvous: give exactly one of file and master (host:port), got " +
                                  std::string(file.empty() ? "neither" : "both"));
    }
    if (!master.empty()) (void)host_and_port();
    if (timeout.count() < 1) detail::throw_invalid("Rendezvous::timeout (ms)", "be >= 1", timeout.count());
#ifndef SPECDEC_HAVE_NCCL
    if (backend == Backend::nccl) {
      throw std::invalid_argument("Rendezvous::backend nccl: this build of specdec has no NCCL (it needs a "
                                  "libtorch with CUDA and USE_C10D_NCCL, see specdec::distributed)");
    }
#endif
  }

  // master split into its host and its port (1 to 65535); throws std::invalid_argument otherwise.
  [[nodiscard]] std::pair<std::string, uint16_t> host_and_port() const {
    const size_t colon = master.rfind(':');
    const std::string port = colon == std::string::npos ? std::string() : master.substr(colon + 1);
    char* end = nullptr;
    const long value = port.empty() ? 0 : std::strtol(port.c_str(), &end, 10);
    if (colon == 0 || port.empty() || *end != '\0' || value < 1 || value > 65535) {
      throw std::invalid_argument("Rendezvous::master must be host:port with a port in [1, 65535], got \"" + master +
                                  "\"");
    }
    return {master.substr(0, colon), static_cast<uint16_t>(value)};
  }

  // Where, for messages: "file PATH" or "master HOST:PORT".
  [[nodiscard]] std::string where() const { return file.empty() ? "master " + master : "file " + file; }
};

namespace detail {

// The first line of an exception's message (c10's errors append a backtrace).
inline std::string first_line(const std::exception& e) {
  const std::string what = e.what();
  return what.substr(0, what.find('\n'));
}

}  // namespace detail

// Collectives over one c10d process group (c10d::ProcessGroupGloo or ProcessGroupNCCL, held as
// the base both derive from in the libtorch compiled against).
class ProcessGroupCollectives final : public Collectives {
 public:
#if SPECDEC_TORCH_AT_LEAST(2, 0)
  using Group = c10d::Backend;
#else
  using Group = c10d::ProcessGroup;
#endif

  ProcessGroupCollectives(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<Group> group, int64_t rank,
                          int64_t world_size, at::Device device)
      : store_(std::move(store)), group_(std::move(group)), rank_(rank), world_size_(world_size), device_(device) {}

  [[nodiscard]] int64_t rank() const override { return rank_; }
  [[nodiscard]] int64_t world_size() const override { return world_size_; }
  // The device collectives run on: the CPU for Gloo, this rank's GPU for NCCL (tensors elsewhere
  // are copied there and back).
  [[nodiscard]] at::Device device() const { return device_; }

  void all_reduce(at::Tensor& tensor) override {
    run("all_reduce", tensor, [&](std::vector<at::Tensor>& tensors) { return group_->allreduce(tensors); });
  }

  void broadcast(at::Tensor& tensor, int64_t root) override {
    if (root < 0 || root >= world_size_) {
      detail::throw_invalid_message("broadcast root must be in [0, world_size = ", world_size_, "), got ", root);
    }
    c10d::BroadcastOptions options;
    options.rootRank = root;
    run("broadcast", tensor, [&](std::vector<at::Tensor>& tensors) { return group_->broadcast(tensors, options); });
  }

 private:
  template <class Call>
  void run(const char* name, at::Tensor& tensor, const Call& call) {
    const bool moved = tensor.device() != device_;
    std::vector<at::Tensor> tensors{moved ? tensor.to(device_) : tensor};
    try {
      call(tensors)->wait();
    } catch (const std::exception& e) {
      throw std::runtime_error("tensor parallelism: " + std::string(name) + " on rank " + std::to_string(rank_) + " of " +
                               std::to_string(world_size_) + " failed (a rank is gone or did not answer in time): " +
                               detail::first_line(e));
    }
    if (moved) tensor.copy_(tensors[0]);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Group> group_;
  int64_t rank_, world_size_;
  at::Device device_;
};

// Meets the other ranks at `where` and returns the group; blocks until every rank has come.
// Throws std::invalid_argument for a bad Rendezvous (validate()), std::runtime_error naming the
// rendezvous when it does not complete within where.timeout. For NCCL, this rank's GPU is
// cuda:(rank % the GPUs visible).
inline std::shared_ptr<ProcessGroupCollectives> connect(const Rendezvous& where) {
  where.validate();
  const int rank = static_cast<int>(where.rank), size = static_cast<int>(where.world_size);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    if (!where.file.empty()) {
      store = c10::make_intrusive<c10d::FileStore>(where.file, size);
    } else {
      const auto [host, port] = where.host_and_port();
      c10d::TCPStoreOptions options;
      options.port = port;
      options.isServer = rank == 0;
      options.numWorkers = static_cast<size_t>(size);
      options.waitWorkers = true;
      options.timeout = where.timeout;
      store = c10::make_intrusive<c10d::TCPStore>(host, options);
    }
    store->setTimeout(where.timeout);
    if (where.backend == Rendezvous::Backend::nccl) {
#ifdef SPECDEC_HAVE_NCCL
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = where.timeout;
      const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(rank % std::max<int64_t>(1, at::detail::getCUDAHooks().getNumGPUs())));
      auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
      return std::make_shared<ProcessGroupCollectives>(store, group, where.rank, where.world_size, device);
#endif
    }
    auto options = c10d::ProcessGroupGloo::Options::create(where.timeout);
    // Ranks that meet at a file are on one machine: loopback. Otherwise the interface that
    // GLOO_SOCKET_IFNAME names, as in PyTorch, or the one this host's name resolves to.
    const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
    if (interface != nullptr && *interface != '\0') {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    } else if (const std::string host = where.file.empty() ? where.host_and_port().first : std::string();
               host.empty() || host.starts_with("127.") || host == "localhost") {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    return std::make_shared<ProcessGroupCollectives>(store, group, where.rank, where.world_size, at::Device(at::kCPU));
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error("tensor parallelism: rank " + std::to_string(where.rank) + " of " +
                             std::to_string(where.world_size) + " could not meet the others at " + where.where() +
                             " within " + std::to_string(where.timeout.count()) + " ms: " + detail::first_line(e));
  }
}

}  // namespace specdec
