// Servers and clients of the remote verifier's tests (test_remote.cpp, test_admission.cpp): the
// bundled models, loopback servers, raw clients that send what a misbehaving client would, calls
// that withhold their message, and the process's resident memory.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "specdec/io/checkpoint.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/remote/client.hpp"
#include "specdec/remote/server.hpp"

namespace specdec::test {

using Model = models::LlamaModel<StaticKVCache>;
using Ids = std::vector<int64_t>;

inline Model bundled(const char* which) {
  const auto checkpoint = io::load_llama(std::string(SPECDEC_BUNDLED_MODELS_DIR) + "/" + which);
  return Model(checkpoint.config, checkpoint.weights);
}

inline Ids bytes(const std::string& text) { return Ids(text.begin(), text.end()); }

inline std::string local(int port) { return "127.0.0.1:" + std::to_string(port); }

inline remote::ServerOptions loopback(remote::ServerLimits limits = {}) {
  return {.address = "127.0.0.1:0", .limits = limits};
}

// A raw client: requests as a misbehaving one would send them.
class RawClient {
 public:
  RawClient(int port, std::string token = "")
      : RawClient(grpc::CreateChannel(local(port), grpc::InsecureChannelCredentials()), std::move(token)) {}
  RawClient(const std::shared_ptr<grpc::Channel>& channel, std::string token = "")
      : stub_(remote::wire::Verifier::NewStub(channel)), token_(std::move(token)) {}
  grpc::Status open(const Ids& prompt, remote::wire::OpenReply* reply, remote::wire::Sampling::Kind kind = remote::wire::Sampling::GREEDY,
                    uint64_t seed = 0) {
    remote::wire::OpenRequest request;
    request.mutable_sampling()->set_kind(kind);
    request.mutable_sampling()->set_temperature(1.0);
    request.mutable_prompt()->Add(prompt.begin(), prompt.end());
    request.set_seed(seed);
    grpc::ClientContext context;
    authorize(context);
    return stub_->Open(&context, request, reply);
  }
  grpc::Status verify(const remote::wire::VerifyRequest& request, remote::wire::VerifyReply* reply = nullptr) {
    remote::wire::VerifyReply ignored;
    grpc::ClientContext context;
    authorize(context);
    return stub_->Verify(&context, request, reply != nullptr ? reply : &ignored);
  }
  grpc::Status close(const std::string& session, const std::string& secret) {
    remote::wire::CloseRequest request;
    request.set_session(session);
    request.set_secret(secret);
    remote::wire::CloseReply reply;
    grpc::ClientContext context;
    authorize(context);
    return stub_->Close(&context, request, &reply);
  }

 private:
  void authorize(grpc::ClientContext& context) const {
    if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
  }
  std::unique_ptr<remote::wire::Verifier::Stub> stub_;
  std::string token_;
};

inline void expect_status(const grpc::Status& status, grpc::StatusCode code, const std::string& words) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(words), std::string::npos) << status.error_message();
}

inline std::string tls_file(const char* name) {
  // Appended, not operator+: GCC 12 warns falsely (-Warray-bounds) on the inlined concatenation.
  std::string path(SPECDEC_TEST_DATA_DIR);
  path.append("/tls/").append(name);
  return remote::read_pem(path, "test file");
}

// The process's resident memory, from /proc/self/statm.
inline int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// The highest resident memory seen, sampled every 2 ms while it lives.
class PeakResident {
 public:
  PeakResident() : sampler_([this] {
    while (!stop_) {
      peak_ = std::max(peak_.load(), resident_bytes());
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }) {}
  PeakResident(const PeakResident&) = delete;
  PeakResident& operator=(const PeakResident&) = delete;
  ~PeakResident() { stop(); }
  int64_t stop() {
    stop_ = true;
    if (sampler_.joinable()) sampler_.join();
    return peak_ = std::max(peak_.load(), resident_bytes());
  }

 private:
  std::atomic<bool> stop_ = false;
  std::atomic<int64_t> peak_ = 0;
  std::thread sampler_;
};

inline constexpr double kMiB = 1 << 20;

// A channel of its own: its own connection, not one shared with the process's other channels.
inline std::shared_ptr<grpc::Channel> own_channel(int port) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(local(port), grpc::InsecureChannelCredentials(), arguments);
}

// A unary call of `method` (Open, Verify or Close) whose message is `message`, bytes as they
// are: what a client that is not ours may send.
inline grpc::Status call_bytes(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                        const grpc::ByteBuffer& message, const std::string& token = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  grpc::CompletionQueue queue;
  grpc::ByteBuffer reply;
  grpc::Status status;
  const auto call = stub.PrepareUnaryCall(&context, "/specdec.remote.v1.Verifier/" + method, message, &queue);
  call->StartCall();
  call->Finish(&reply, &status, nullptr);
  void* tag = nullptr;
  bool ok = false;
  (void)queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  return status;
}

// A call that sends its headers and never its message, on `channel`.
class HeldCall {
 public:
  HeldCall(const std::shared_ptr<grpc::Channel>& channel) : stub_(channel) {
    call_ = stub_.PrepareCall(&context_, "/specdec.remote.v1.Verifier/Verify", &queue_);
    call_->StartCall(this);
    void* tag = nullptr;
    bool ok = false;
    started_ = queue_.Next(&tag, &ok) && ok;
  }
  HeldCall(const HeldCall&) = delete;
  HeldCall& operator=(const HeldCall&) = delete;
  ~HeldCall() {
    if (!finished_) context_.TryCancel();
    (void)finish();
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
    }
  }
  [[nodiscard]] bool started() const { return started_; }
  // Waits for the server's answer.
  grpc::Status finish() {
    if (!finished_) {
      call_->Finish(&status_, this);
      void* tag = nullptr;
      bool ok = false;
      (void)queue_.Next(&tag, &ok);
      finished_ = true;
    }
    return status_;
  }

 private:
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  grpc::Status status_;
  bool started_ = false, finished_ = false;
};

}  // namespace specdec::test
