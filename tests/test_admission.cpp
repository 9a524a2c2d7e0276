// The verifier's front door under denial of service (remote/admission.hpp, remote/server.hpp;
// docs/remote.md states the threat model): max-min fair admission and the wire cost of requests
// on their own, then on loopback servers: unauthenticated requests refused before their message
// is read, a rapid-reset flood, calls that withhold their message, clients of one host hoarding
// sessions, concurrent maximal requests against the memory budget, operator files that are not
// regular files, a TLS key of another certificate, bounded clients, and memory handed back after
// a storm of sessions.
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "specdec/remote/admission.hpp"
#include "specdec/remote/server.hpp"
#include "specdec/specdec.hpp"
#include "support/markov_fixtures.hpp"
#include "support/rapid_reset.hpp"
#include "support/remote_fixtures.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_admission {

namespace {

using namespace specdec;
using namespace specdec::test;
using remote::RemoteVerifier;
using remote::VerifierServer;
using remote::detail::Holding;
using Clock = std::chrono::steady_clock;

// Whether the process's resident memory says what the server holds: not under AddressSanitizer,
// whose allocator keeps freed memory in its quarantine (256 MiB) and its shadow beside it. The
// bounds on memory are checked in the Release leg; the sanitized leg checks everything else.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kMemoryIsMeasured = false;
#else
constexpr bool kMemoryIsMeasured = true;
#endif

// Max-min fair admission on hand-made holdings: a newcomer takes from a group only where that
// group holds at least two more than its own, level by level (host, then connection), and then
// the least recently used takeable holding of that group's largest client.
TEST(Admission, FairVictimTakesFromTheLargestHolderOnly) {
  const std::vector<std::string> a1{"host:a", "connection:a:1"}, a2{"host:a", "connection:a:2"},
      a3{"host:a", "connection:a:3"}, b1{"host:b", "connection:b:1"};
  const auto at = [](int seconds) { return Clock::time_point{} + std::chrono::seconds(seconds); };
  using remote::detail::fair_victim;
  // a:1 holds three (used at 5, 2, 9), a:2 one: a newcomer on a:3 takes a:1's least recently used.
  std::vector<Holding> held{{&a1, at(5)}, {&a1, at(2)}, {&a1, at(9)}, {&a2, at(1)}};
  EXPECT_EQ(fair_victim(held, a3), std::optional<size_t>(1));
  // a:2 holding one is not displaced by a newcomer holding none... unless it is the largest by two.
  EXPECT_EQ(fair_victim(std::vector<Holding>{{&a1, at(1)}, {&a2, at(2)}}, a3), std::nullopt);
  // a:1 itself takes nothing from a:2 (it holds more already), nor from itself.
  EXPECT_EQ(fair_victim(held, a1), std::nullopt);
  // Hosts first: b's newcomer takes from host a (four sessions) even though no connection of a
  // holds two more than... b's connection; inside a, from its largest client, a:1.
  EXPECT_EQ(fair_victim(held, b1), std::optional<size_t>(1));
  // A host holding as much as the other: the comparison goes down to connections inside it.
  std::vector<Holding> even{{&a1, at(3)}, {&a1, at(4)}, {&b1, at(1)}, {&b1, at(2)}};
  EXPECT_EQ(fair_victim(even, a2), std::optional<size_t>(0));
  // Holdings that may not be taken (serving a call) are passed over; none left: nothing taken.
  held[1].takeable = false;
  EXPECT_EQ(fair_victim(held, a3), std::optional<size_t>(0));
  held[0].takeable = held[2].takeable = false;
  EXPECT_EQ(fair_victim(held, a3), std::nullopt);
  // Certificates are one level: the other certificate takes from the one holding many.
  const std::vector<std::string> alice{"certificate:alice"}, bob{"certificate:bob"};
  EXPECT_EQ(fair_victim(std::vector<Holding>{{&alice, at(2)}, {&alice, at(1)}}, bob), std::optional<size_t>(1));
  EXPECT_EQ(fair_victim(std::vector<Holding>{{&alice, at(2)}}, bob), std::nullopt);
}

// A packed field of `count` one-byte varints (each the value 1): field number `field`.
std::string packed_ones(int field, size_t count) {
  std::string wire(1, static_cast<char>(field << 3 | 2));
  for (size_t length = count;; length >>= 7) {
    wire.push_back(static_cast<char>((length & 0x7f) | (length >= 0x80 ? 0x80 : 0)));
    if (length < 0x80) break;
  }
  wire.append(count, '\x01');
  return wire;
}

// The wire cost of a request equals what its fields hold once parsed, element for element, for
// real messages in every encoding and for hostile ones; malformed bytes have none.
TEST(Admission, WireCostIsWhatParsingWillHold) {
  using remote::detail::wire_cost;
  remote::wire::VerifyRequest request;
  request.set_session(std::string(32, 'a'));
  request.set_secret(std::string(32, 'b'));
  request.set_length(7);
  for (int64_t t = 0; t < 300; ++t) request.add_append(t);
  for (int64_t t = 0; t < 5; ++t) request.add_drafts(t + 1000);
  request.mutable_q()->set_encoding(remote::wire::DraftProbs::SPARSE);
  for (int r = 0; r < 5; ++r) request.mutable_q()->add_row_lengths(2);
  for (int i = 0; i < 10; ++i) request.mutable_q()->add_indices(i), request.mutable_q()->add_values(0.1f);
  const auto cost = wire_cost(request.SerializeAsString(), remote::detail::verify_shape());
  ASSERT_TRUE(cost.has_value());
  EXPECT_EQ(cost->elements.at(4), 300);
  EXPECT_EQ(cost->elements.at(5), 5);
  EXPECT_EQ(cost->parsed, 64 + 8 * 305 + 4 * 5 + 4 * 10 + 4 * 10);
  // One-byte varints become eight bytes each; an unpacked repeated field counts each occurrence.
  EXPECT_EQ(wire_cost(packed_ones(4, 100000), remote::detail::verify_shape())->parsed, 800000);
  std::string unpacked;
  for (int i = 0; i < 10; ++i) unpacked += std::string{static_cast<char>(5 << 3), '\x07'};
  EXPECT_EQ(wire_cost(unpacked, remote::detail::verify_shape())->elements.at(5), 10);
  // Unknown fields are kept by protobuf: each costs kUnknownFieldBytes and its payload.
  std::string unknown;
  for (int i = 0; i < 100; ++i) unknown += std::string{static_cast<char>(char(99 << 3 & 0x7f) | 0x80), '\x06', '\x00'};
  EXPECT_EQ(wire_cost(unknown, remote::detail::verify_shape())->parsed, 100 * remote::detail::kUnknownFieldBytes);
  // Malformed: a length past the end, a truncated varint, a group, a nested message that runs
  // past its own length.
  EXPECT_FALSE(wire_cost(packed_ones(4, 1000).substr(0, 900), remote::detail::verify_shape()));
  EXPECT_FALSE(wire_cost(std::string{'\x10', '\x80'}, remote::detail::verify_shape()));
  EXPECT_FALSE(wire_cost(std::string{'\x0b'}, remote::detail::verify_shape()));
  EXPECT_FALSE(wire_cost(std::string{'\x32', '\x02', '\x12', '\x05', '\x01'}, remote::detail::verify_shape()));
  // Every request of the protocol, as serialized, parses to what its cost says it holds.
  remote::wire::OpenRequest open;
  for (int64_t t = 0; t < 1000; ++t) open.add_prompt(t);
  open.mutable_sampling()->set_top_k(5);
  const auto open_cost = wire_cost(open.SerializeAsString(), remote::detail::open_shape());
  ASSERT_TRUE(open_cost);
  EXPECT_EQ(open_cost->elements.at(5), 1000);
  EXPECT_EQ(open_cost->parsed, 8000);
}

// One client's verification loop on its own connection: opens a session with `token` and sends
// greedy steps until `stop`; counts the calls that succeeded and those that did not.
struct WellBehaved {
  std::atomic<int64_t> ok = 0, failed = 0;
  std::string last_error;
  std::mutex mutex;
  void run(int port, const std::string& token, const std::atomic<bool>& stop) { run(own_channel(port), token, stop); }
  void run(std::shared_ptr<grpc::Channel> channel, const std::string& token, const std::atomic<bool>& stop) {
    RawClient client(std::move(channel), token);
    while (!stop) {
      remote::wire::OpenReply opened;
      const grpc::Status open = client.open({0, 1}, &opened);
      if (!open.ok()) {
        note(open);
        continue;
      }
      ++ok;
      remote::wire::VerifyRequest request;
      request.set_session(opened.session());
      request.set_secret(opened.secret());
      request.set_length(2);
      request.set_last_token(1);
      for (int step = 0; step < 4 && !stop; ++step) {
        remote::wire::VerifyReply reply;
        const grpc::Status verified = client.verify(request, &reply);
        if (!verified.ok()) {
          note(verified);
          break;
        }
        ++ok;
        request.set_length(reply.length());
        request.set_last_token(reply.token());
      }
      const grpc::Status closed = client.close(opened.session(), opened.secret());
      if (closed.ok()) {
        ++ok;
      } else {
        note(closed);
      }
    }
  }
  void note(const grpc::Status& status) {
    ++failed;
    const std::lock_guard lock(mutex);
    last_error = std::to_string(status.error_code()) + ": " + status.error_message();
  }
};

// A channel whose connection comes from `host` (an address of 127/8 other than 127.0.0.1, which
// the server sees as another host); null where it cannot connect.
std::shared_ptr<grpc::Channel> channel_from(const char* host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in from{}, to{};
  from.sin_family = to.sin_family = AF_INET;
  ::inet_pton(AF_INET, host, &from.sin_addr);
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&from), sizeof from) != 0 ||
      ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
    if (fd >= 0) ::close(fd);
    return nullptr;
  }
  return grpc::CreateInsecureChannelFromFd("127.0.0.1:" + std::to_string(port), fd);  // gRPC owns fd
}

// Rapid reset (CVE-2023-44487) without the token: two connections open streams of Verify and reset
// each at once, as fast as this machine lets them, reconnecting when closed, for three seconds and
// until they have opened 5,000 streams. gRPC 1.51 accepts them without limit, but the server's
// front end closes a connection past its reset budget (max_resets_per_connection) and charges
// every reset to a budget its host shares (max_resets_per_host), so reconnecting renews nothing:
// what reaches gRPC is at most the host's budget plus one stream per connection it let through
// (the stream whose reset closed it), and is refused on its headers by a callback that holds no
// thread. So the calls of a token holder connected from the same host before the flood, and of
// one connecting from another host during it, all succeed; no handler thread serves the flood,
// no call of the flood is left once it ends, and the server's memory stays within 128 MiB of
// where it was. With a budget per connection only, the reconnecting flood brought 10,000 streams
// a second to gRPC on a 2-core Xeon, its memory grew by up to 295 MiB and the token holder was
// served 6 calls in 3 s; without the front end, the flood outran gRPC's callback executor and
// held gigabytes (docs/remote.md). The flooding host's new connections are refused while its
// budget is spent: a client that shares an address with an attacker waits until the flood ends.
TEST(RemoteFrontDoor, ARapidResetFloodLeavesTokenHoldersServed) {
  test::MarkovModel target(test::markov_target_rows());
  const remote::ServerOptions options{.address = "127.0.0.1:0", .token = "s3cret"};
  VerifierServer server(target, options);
  std::atomic<bool> stop = false;
  WellBehaved warm[2];  // gRPC's pools and the handler threads of two clients, before the baseline
  {
    std::thread first([&] { warm[0].run(server.port(), "s3cret", stop); });
    std::thread second([&] { warm[1].run(server.port(), "s3cret", stop); });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop = true;
    first.join();
    second.join();
    stop = false;
  }
  const auto held = own_channel(server.port());  // the token holder's, connected before the flood
  ASSERT_TRUE(held->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  const size_t threads = server.handler_threads();
  const int64_t baseline = resident_bytes();
  PeakResident peak;
  constexpr int64_t kFlood = 5000;  // streams the flood opens at least, however slow the machine
  const auto started = Clock::now();
  RapidReset floods[2] = {{server.port(), "/specdec.remote.v1.Verifier/Verify"}, {server.port(), "/specdec.remote.v1.Verifier/Verify"}};
  std::vector<std::thread> attackers;
  for (RapidReset& flood : floods) attackers.emplace_back([&] { (void)flood.run(stop); });
  const auto opened = [&] { return floods[0].opened() + floods[1].opened(); };
  WellBehaved holder, newcomer;
  std::thread client([&] { holder.run(held, "s3cret", stop); });
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto elsewhere = channel_from("127.0.0.2", server.port());
  ASSERT_NE(elsewhere, nullptr) << "cannot connect from 127.0.0.2";
  std::thread other([&] { newcomer.run(elsewhere, "s3cret", stop); });
  std::this_thread::sleep_for(std::chrono::seconds(2));
  while (opened() < kFlood && Clock::now() - started < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop = true;
  client.join();
  other.join();
  for (auto& attacker : attackers) attacker.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  for (int i = 0; i < 500 && server.stats().live_calls > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const double growth = static_cast<double>(peak.stop() - baseline) / kMiB;
  const remote::ServerStats stats = server.stats();
  const auto front = server.front_end();
  const remote::ServerLimits& l = options.limits;
  const int64_t let_through = front.connections - front.refused_for_resets;
  const double bound = static_cast<double>(l.max_resets_per_host) + static_cast<double>(l.host_resets_per_second) * seconds +
                       static_cast<double>(let_through);
  std::cout << "[ figures  ] rapid reset from 2 connections for " << seconds << " s: " << opened()
            << " streams opened and reset, " << stats.unauthenticated << " reached gRPC and were refused on their headers (bound "
            << bound << "); " << front.connections << " connections: " << front.closed_for_resets
            << " closed past their reset budget or their host's, " << front.refused_for_resets
            << " closed as accepted; calls of the token holder connected before: " << holder.ok << " served, " << holder.failed
            << " failed; of one from another host: " << newcomer.ok << " served, " << newcomer.failed << " failed; peak RSS "
            << growth << " MiB above " << static_cast<double>(baseline) / kMiB << " MiB; handler threads "
            << server.handler_threads() << "\n";
  EXPECT_EQ(holder.failed.load(), 0) << holder.last_error;
  EXPECT_GE(holder.ok.load(), 20);
  EXPECT_EQ(newcomer.failed.load(), 0) << newcomer.last_error;
  EXPECT_GE(newcomer.ok.load(), 10);
  EXPECT_GE(opened(), kFlood) << "the flood did not run";
  EXPECT_LE(static_cast<double>(stats.unauthenticated), bound) << "the host's reset budget did not hold";
  EXPECT_GT(front.closed_for_resets, 2);
  EXPECT_GT(front.refused_for_resets, 0) << "no connection of the flooding host was refused";
  EXPECT_EQ(stats.live_calls, 0) << "calls of the flood still held";
  // Two clients, each with one call at a time: a worker may not be idle again yet when its
  // client's next call comes, so up to two threads each; the flood's few calls that reach gRPC
  // (at most the reset budget's, refused on their headers) may each hold a worker for a moment
  // (6 were seen in a run beside other work). A flood that took threads would take one per
  // stream, up to max_concurrent_requests.
  EXPECT_LE(server.handler_threads(), std::max<size_t>(threads, 8)) << "the flood took handler threads";
  if (kMemoryIsMeasured) {
    EXPECT_LT(growth, 128.0);
  }
}

// Connections waiting while the process has no descriptor left: accept fails (EMFILE) and the
// listener stays readable, so the relay stops watching it for a while instead of retrying in a
// loop, and accepts the waiting connections once descriptors are free again. Retrying at once
// held a core for as long as the descriptors were out.
TEST(RemoteFrontDoor, RunningOutOfDescriptorsDoesNotSpin) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, {.address = "127.0.0.1:0", .token = "s3cret"});
  const auto cpu_seconds = [] {
    timespec now{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
    return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
  };
  std::vector<int> waiting, filler;
  for (int i = 0; i < 4; ++i) waiting.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) (void)entry, ++low.rlim_cur;
  low.rlim_cur = std::min(saved.rlim_cur, low.rlim_cur + 64);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC); fd >= 0; fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) {
    filler.push_back(fd);
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(server.port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int connected = 0;
  for (const int fd : waiting) connected += ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
  const int64_t accepted = server.front_end().connections;
  const double before = cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double spent = cpu_seconds() - before;
  const int64_t accepted_while_out = server.front_end().connections - accepted;
  for (const int fd : filler) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  for (int i = 0; i < 100 && server.front_end().connections < accepted + connected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t accepted_after = server.front_end().connections - accepted;
  for (const int fd : waiting) ::close(fd);
  std::atomic<bool> stop = false;
  WellBehaved client;
  std::thread calls([&] { client.run(server.port(), "s3cret", stop); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  calls.join();
  std::cout << "[ figures  ] " << filler.size() << " descriptors taken, " << connected << " connections waiting: "
            << accepted_while_out << " accepted and " << spent << " s of CPU in 0.5 s while out, " << accepted_after
            << " accepted once free; then " << client.ok << " calls served\n";
  EXPECT_EQ(connected, 4);
  EXPECT_EQ(accepted_while_out, 0);
  EXPECT_LT(spent, 0.2) << "the relay retried accept in a loop";
  EXPECT_EQ(accepted_after, connected);
  EXPECT_GT(client.ok.load(), 0);
  EXPECT_EQ(client.failed.load(), 0) << client.last_error;
}

// 64 calls that send their headers and never their message (5 connections, 13 streams each, the
// last connection 12), each renewed before the read timeout, for three seconds: they hold no
// request place, so a well-behaved client's calls all succeed. Calls still reading are bounded:
// where max_reading_calls is full, a call from a connection holding none takes the oldest place
// of the connection holding the most, and is refused (naming the limit) where every connection
// holds as many as the newcomer would.
TEST(RemoteFrontDoor, WithheldMessagesHoldNoRequestPlace) {
  test::MarkovModel target(test::markov_target_rows());
  {
    VerifierServer server(target, loopback({.max_concurrent_requests = 64, .read_timeout = std::chrono::milliseconds(1000)}));
    std::atomic<bool> stop = false;
    std::atomic<int64_t> renewed = 0, most_reading = 0;
    std::vector<std::thread> holders;
    for (int c = 0; c < 5; ++c) {
      holders.emplace_back([&, c] {
        const auto channel = own_channel(server.port());
        const int streams = c < 4 ? 13 : 12;
        while (!stop) {
          std::vector<std::unique_ptr<HeldCall>> held;
          for (int s = 0; s < streams; ++s) held.push_back(std::make_unique<HeldCall>(channel));
          const auto until = Clock::now() + std::chrono::milliseconds(700);
          while (!stop && Clock::now() < until) {
            most_reading = std::max(most_reading.load(), server.reading());
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          renewed += streams;
        }
      });
    }
    for (int i = 0; i < 300 && server.reading() < 64; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    WellBehaved client;
    std::thread good([&] { client.run(server.port(), "", stop); });
    std::this_thread::sleep_for(std::chrono::seconds(3));
    stop = true;
    good.join();
    for (auto& holder : holders) holder.join();
    std::cout << "[ figures  ] " << renewed << " withheld-message calls (at most " << most_reading
              << " at once); the well-behaved client's calls: " << client.ok << " served, " << client.failed
              << " failed\n";
    EXPECT_GE(most_reading.load(), 64);  // and the well-behaved client's own call as it arrives
    EXPECT_EQ(client.failed.load(), 0) << client.last_error;
    EXPECT_GE(client.ok.load(), 20);
  }
  // Fair places for calls still reading.
  VerifierServer server(target, loopback({.max_reading_calls = 8, .read_timeout = std::chrono::milliseconds(20000)}));
  const auto hoarder = own_channel(server.port());
  std::vector<std::unique_ptr<HeldCall>> held;
  for (int s = 0; s < 8; ++s) held.push_back(std::make_unique<HeldCall>(hoarder));
  for (int i = 0; i < 300 && server.reading() < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(server.reading(), 8);
  RawClient newcomer(own_channel(server.port()));
  expect_status(newcomer.close("no-such-session", "x"), grpc::StatusCode::NOT_FOUND, "no such session");
  expect_status(held.front()->finish(), grpc::StatusCode::CANCELLED, "");  // the oldest gave its place
  held.clear();
  for (int i = 0; i < 300 && server.reading() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < 8; ++c) {
    channels.push_back(own_channel(server.port()));
    held.push_back(std::make_unique<HeldCall>(channels.back()));
  }
  for (int i = 0; i < 300 && server.reading() < 8; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(server.reading(), 8);
  expect_status(newcomer.close("no-such-session", "x"), grpc::StatusCode::RESOURCE_EXHAUSTED, "max_reading_calls");
}

// Opens sessions on `channel` until one is refused; returns the handles and secrets of those it got.
std::vector<remote::wire::OpenReply> open_all(RawClient& client, int at_most, grpc::Status* refusal = nullptr) {
  std::vector<remote::wire::OpenReply> opened;
  for (int i = 0; i < at_most; ++i) {
    remote::wire::OpenReply reply;
    const grpc::Status status = client.open({0, 1}, &reply);
    if (!status.ok()) {
      if (refusal != nullptr) *refusal = status;
      break;
    }
    opened.push_back(reply);
  }
  return opened;
}

// 32 clients of one host (each its own connection) open as many sessions as they can, over and
// over, on a server of 64 sessions: a client that opens one session gets it every time (max-min
// fair admission closes a session of a client holding two more), and the clients whose sessions
// were closed are told why on their next call. On a server without a token, invented
// authorization headers make no new client: one connection holds max_sessions_per_client.
TEST(RemoteFairness, ClientsOfOneHostCannotStarveAClientOfOneSession) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, loopback());
  std::atomic<bool> stop = false;
  std::atomic<int64_t> told = 0;
  std::vector<std::thread> hoarders;
  for (int c = 0; c < 32; ++c) {
    hoarders.emplace_back([&] {
      RawClient client(own_channel(server.port()));
      std::vector<remote::wire::OpenReply> mine;
      while (!stop) {
        for (const auto& opened : open_all(client, 64)) mine.push_back(opened);
        // Each session it holds: still there, or closed with the reason.
        for (auto it = mine.begin(); it != mine.end();) {
          remote::wire::VerifyRequest request;
          request.set_session(it->session());
          request.set_secret(it->secret());
          request.set_length(2);
          request.set_last_token(1);
          const grpc::Status status = client.verify(request);
          if (status.error_code() == grpc::StatusCode::NOT_FOUND &&
              status.error_message().find("closed to make room for another client") != std::string::npos) {
            ++told;
            it = mine.erase(it);
          } else {
            ++it;
          }
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int got = 0;
  constexpr int kTries = 20;
  std::string refused;
  for (int round = 0; round < kTries; ++round) {
    RawClient one(own_channel(server.port()));
    remote::wire::OpenReply opened;
    const grpc::Status status = one.open({0, 1}, &opened);
    if (status.ok()) {
      ++got;
      EXPECT_TRUE(one.close(opened.session(), opened.secret()).ok());
    } else {
      refused = status.error_message();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  stop = true;
  for (auto& hoarder : hoarders) hoarder.join();
  std::cout << "[ figures  ] 32 hoarding clients of one host, 64 sessions: the client of one session got it "
            << got << " of " << kTries << " times; " << server.stats().sessions_evicted
            << " sessions closed by fair admission, " << told << " of them reported to their clients\n";
  EXPECT_EQ(got, kTries) << refused;
  EXPECT_GT(told.load(), 0);

  // Invented authorization headers on a server without a token: one connection, one client.
  VerifierServer plain(target, loopback());
  const auto channel = own_channel(plain.port());
  int held = 0;
  grpc::Status refusal;
  for (int i = 0; i < 40; ++i) {
    std::string client("x");  // appended: GCC 12 warns falsely (-Wstringop-overflow) on "x" + string
    client.append(std::to_string(i));
    RawClient inventive(channel, client);
    remote::wire::OpenReply reply;
    refusal = inventive.open({0, 1}, &reply);
    held += refusal.ok() ? 1 : 0;
  }
  EXPECT_EQ(held, 16);
  expect_status(refusal, grpc::StatusCode::RESOURCE_EXHAUSTED, "max_sessions_per_client");
}

// A channel over TLS with `tls` (a client certificate), a connection of its own.
std::shared_ptr<grpc::Channel> tls_channel(int port, const remote::TlsOptions& tls) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.trusted_ca;
  ssl.pem_private_key = tls.private_key;
  ssl.pem_cert_chain = tls.certificate_chain;
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(local(port), grpc::SslCredentials(ssl), arguments);
}

// With client certificates, a client is its certificate: one certificate inventing authorization
// headers on several connections holds at most its quota, another certificate gets in on a full
// server (fair admission closes one of the first's), and cannot use the first's session even
// with its handle and secret.
TEST(RemoteFairness, ACertificateIsOneClient) {
  test::MarkovModel target(test::markov_target_rows());
  const remote::TlsOptions server_tls{.certificate_chain = tls_file("server.pem"),
                                      .private_key = tls_file("server.key"),
                                      .trusted_ca = tls_file("ca.pem")};
  VerifierServer server(target, {.address = "127.0.0.1:0", .limits = {.max_sessions = 8, .max_sessions_per_client = 8},
                                 .tls = server_tls});
  const remote::TlsOptions alice{.certificate_chain = tls_file("client.pem"), .private_key = tls_file("client.key"),
                                 .trusted_ca = tls_file("ca.pem")};
  const remote::TlsOptions bob{.certificate_chain = tls_file("second-client.pem"),
                               .private_key = tls_file("second-client.key"), .trusted_ca = tls_file("ca.pem")};
  std::vector<remote::wire::OpenReply> alices;
  grpc::Status refusal;
  for (int c = 0; c < 4; ++c) {
    RawClient client(tls_channel(server.port(), alice), "invented-" + std::to_string(c));
    for (const auto& opened : open_all(client, 16, &refusal)) alices.push_back(opened);
  }
  EXPECT_EQ(alices.size(), 8u);
  expect_status(refusal, grpc::StatusCode::RESOURCE_EXHAUSTED, "max_sessions_per_client");
  RawClient bobs(tls_channel(server.port(), bob));
  remote::wire::OpenReply opened;
  ASSERT_TRUE(bobs.open({0, 1}, &opened).ok());
  EXPECT_EQ(server.stats().sessions_evicted, 1);
  remote::wire::VerifyRequest request;
  request.set_length(2);
  request.set_last_token(1);
  int closed = 0;
  RawClient alices_client(tls_channel(server.port(), alice));
  for (const auto& session : alices) {
    request.set_session(session.session());
    request.set_secret(session.secret());
    const grpc::Status status = alices_client.verify(request);
    if (!status.ok()) {
      ++closed;
      expect_status(status, grpc::StatusCode::NOT_FOUND, "closed to make room for another client");
    }
    // Bob with Alice's handle and secret: the answer of an unknown session.
    expect_status(bobs.verify(request), grpc::StatusCode::NOT_FOUND, "no such session for this client");
  }
  EXPECT_EQ(closed, 1);
}

// 8 and then 64 authenticated clients send, at once, a maximal Verify (max_request_bytes of
// one-byte varints in append, under a token limit that lets them through to the parse). Each
// would hold 8 times its size once parsed; the server charges that before parsing, so its peak
// memory stays under baseline + max_memory_bytes, and every request it does not serve is refused
// naming the limit that refused it (and the budget is whole again after each round: the same
// request alone is served): max_memory_bytes or max_concurrent_requests from the server,
// or gRPC's own quota (its quarter of max_memory_bytes), which resets a stream it has no memory
// for with HTTP/2's ENHANCE_YOUR_CALM or closes a connection (UNAVAILABLE: "Socket closed"),
// without naming itself.
TEST(RemoteMemory, ConcurrentMaximalRequestsStayWithinTheBudget) {
  test::MarkovModel target(test::markov_target_rows());
  constexpr int64_t kBudget = int64_t{256} << 20, kRequest = int64_t{4} << 20;
  VerifierServer server(target, {.address = "127.0.0.1:0", .token = "s3cret",
                                 .limits = {.max_memory_bytes = kBudget, .max_tokens_per_session = int64_t{1} << 30,
                                            .max_request_bytes = kRequest}});
  const std::string payload = packed_ones(4, static_cast<size_t>(kRequest - 16));
  grpc::Slice slice(payload.data(), payload.size(), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer maximal(&slice, 1);
  for (const int clients : {8, 64}) {
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    for (int c = 0; c < clients; ++c) channels.push_back(own_channel(server.port()));
    (void)call_bytes(channels.front(), "Close", maximal, "s3cret");  // warm
    const int64_t baseline = resident_bytes();
    std::map<std::string, int> answers;
    std::mutex mutex;
    {
      PeakResident peak;
      std::vector<std::thread> senders;
      std::atomic<int> ready = 0;
      for (int c = 0; c < clients; ++c) {
        senders.emplace_back([&, c] {
          ++ready;
          while (ready < clients) std::this_thread::yield();
          const grpc::Status status = call_bytes(channels[static_cast<size_t>(c)], "Verify", maximal, "s3cret");
          std::string kind = status.error_message().find("max_memory_bytes") != std::string::npos ? "max_memory_bytes"
                             : status.error_message().find("RST_STREAM with error code 11") != std::string::npos
                                 ? "gRPC's quota (ENHANCE_YOUR_CALM)"
                             : status.error_code() == grpc::StatusCode::UNAVAILABLE ? "gRPC's quota (connection closed)"
                             : status.error_message().find("max_concurrent_requests") != std::string::npos
                                 ? "max_concurrent_requests"
                             : status.error_code() == grpc::StatusCode::NOT_FOUND ? "parsed and served"
                                                                                  : status.error_message();
          const std::lock_guard lock(mutex);
          ++answers[kind];
        });
      }
      for (auto& sender : senders) sender.join();
      const double growth = static_cast<double>(peak.stop() - baseline) / kMiB;
      std::cout << "[ figures  ] " << clients << " concurrent " << kRequest / (1 << 20) << " MiB requests, budget "
                << kBudget / (1 << 20) << " MiB: peak RSS " << growth << " MiB above baseline;";
      for (const auto& [kind, count] : answers) std::cout << " " << count << " " << kind << ";";
      std::cout << "\n";
      if (kMemoryIsMeasured) {
        EXPECT_LT(growth, static_cast<double>(kBudget) / kMiB);
      }
    }
    if (clients == 8) {
      EXPECT_GE(answers["parsed and served"], 1);
    }
    for (const auto& [kind, count] : answers) {
      EXPECT_TRUE(kind == "max_memory_bytes" || kind == "max_concurrent_requests" || kind == "parsed and served" ||
                  kind == "gRPC's quota (ENHANCE_YOUR_CALM)" || kind == "gRPC's quota (connection closed)")
          << count << " answered: " << kind;
    }
    for (int i = 0; i < 200 && server.charged_bytes() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(server.charged_bytes(), 0);
    // The budget is whole again: the same request alone is parsed and served.
    const grpc::Status alone = call_bytes(channels.front(), "Verify", maximal, "s3cret");
    EXPECT_EQ(alone.error_code(), grpc::StatusCode::NOT_FOUND) << alone.error_message();
  }
}

// Operator files that are not regular files are refused, at once, naming the flag and the path:
// a FIFO without a writer (which would block an open for ever), a socket and a device.
TEST(RemoteFiles, OnlyRegularFilesAreRead) {
  const std::filesystem::path folder =
      std::filesystem::temp_directory_path() / ("specdec_fifo_" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const std::string fifo = (folder / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string socket_path = (folder / "socket").string();
  const int listening = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  socket_path.copy(address.sun_path, sizeof address.sun_path - 1);
  ASSERT_EQ(::bind(listening, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
  const auto refused = [](const auto& read, const std::string& words) {
    const auto started = Clock::now();
    try {
      (void)read();
      ADD_FAILURE() << "read";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - started, std::chrono::seconds(1));
  };
  refused([&] { return remote::read_token(fifo, "--token-file"); }, "--token-file " + fifo + " is a FIFO (named pipe)");
  refused([&] { return remote::read_pem(fifo, "--tls-cert"); }, "--tls-cert " + fifo + " is a FIFO");
  refused([&] { return remote::read_pem(fifo, "--tls-key"); }, "--tls-key " + fifo + " is a FIFO");
  refused([&] { return remote::read_pem(fifo, "--tls-client-ca"); }, "--tls-client-ca " + fifo + " is a FIFO");
  refused([&] { return remote::read_token(socket_path, "--verifier-token-file"); }, "is a socket");
  refused([&] { return remote::read_pem("/dev/zero", "--tls-cert"); }, "--tls-cert /dev/zero is a character device");
  refused([&] { return remote::read_token((folder / "missing").string(), "--token-file"); }, "does not exist");
  ::close(listening);
  std::filesystem::remove_all(folder);
}

// A TLS key that is another certificate's is named as such (gRPC would only fail to listen).
TEST(RemoteFiles, ATlsKeyOfAnotherCertificateIsNamed) {
  test::MarkovModel target(test::markov_target_rows());
  try {
    VerifierServer<test::MarkovModel> server(
        target, {.address = "127.0.0.1:0", .tls = {.certificate_chain = tls_file("server.pem"), .private_key = tls_file("client.key")}});
    ADD_FAILURE() << "the server started";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tls.private_key is not the private key of the certificate in tls.certificate_chain"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)remote::check_tls_key({.certificate_chain = tls_file("ca.pem") + "garbage", .private_key = "-----BEGIN x"},
                                           "a", "b"),
               std::invalid_argument);
}

// The amplification request: a Verify message of 64 MiB whose drafts are one-byte varints, which
// would parse into 512 MiB of int64. Eight clients without the token send it over and over for a
// second and a half, each on its own connection. The server answers them UNAUTHENTICATED from
// their headers, before their message is read, so its memory stays within 64 MiB of where it was
// (each refused call costs at most HTTP/2's flow-control window), and a client with the token
// generates meanwhile. Then one request of the same bytes with the token is read and refused
// from its wire form: it costs the server its 64 MiB of bytes, not the 512 MiB it would parse into.
TEST(RemoteFrontDoor, UnauthenticatedRequestsAreRefusedBeforeTheirMessageIsRead) {
  test::MarkovModel target(test::markov_target_rows());
  test::MarkovModel reference(test::markov_target_rows());
  test::MarkovModel drafter(test::markov_drafter_rows());
  VerifierServer server(target, {.address = "127.0.0.1:0", .token = "s3cret"});
  const Ids expected = autoregressive_generate(reference, Ids{0}, {.max_new_tokens = 24}).tokens;

  constexpr size_t kDrafts = (size_t{64} << 20) - 16;
  std::string payload(1, '\x2a');  // field 5 (drafts), length-delimited: packed varints
  for (size_t length = kDrafts; ; length >>= 7) {
    payload.push_back(static_cast<char>((length & 0x7f) | (length >= 0x80 ? 0x80 : 0)));
    if (length < 0x80) break;
  }
  payload.append(kDrafts, '\x01');
  grpc::Slice slice(payload.data(), payload.size(), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer amplifier(&slice, 1);
  grpc::Slice empty_slice("", 0, grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer empty(&empty_slice, 1);

  constexpr int kClients = 8;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < kClients; ++c) {
    channels.push_back(own_channel(server.port()));
    ASSERT_EQ(call_bytes(channels.back(), "Verify", empty).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const int64_t baseline = resident_bytes();
  std::atomic<bool> stop = false;
  std::atomic<int> refused = 0, otherwise = 0;
  int generations = 0;
  {
    PeakResident peak;
    std::vector<std::thread> attackers;
    for (int c = 0; c < kClients; ++c) {
      attackers.emplace_back([&, c] {
        while (!stop) {
          const grpc::Status status = call_bytes(channels[static_cast<size_t>(c)], "Verify", amplifier);
          ++(status.error_code() == grpc::StatusCode::UNAUTHENTICATED ? refused : otherwise);
        }
      });
    }
    RemoteVerifier verifier(local(server.port()), {.token = "s3cret"});
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    while (std::chrono::steady_clock::now() < until) {
      ModelDraftSource source(drafter);
      EXPECT_EQ(remote::remote_generate(source, verifier, Ids{0}, {.max_new_tokens = 24}).tokens, expected);
      ++generations;
    }
    stop = true;
    for (auto& attacker : attackers) attacker.join();
    const double growth = static_cast<double>(peak.stop() - baseline) / kMiB;
    std::cout << "[ figures  ] " << refused << " unauthenticated 64 MiB requests from " << kClients
              << " clients, refused; " << generations << " authenticated generations meanwhile; peak RSS "
              << growth << " MiB above " << static_cast<double>(baseline) / kMiB << " MiB\n";
    if (kMemoryIsMeasured) {
      EXPECT_LT(growth, 64.0);
    }
  }
  EXPECT_GE(refused.load(), kClients);
  EXPECT_EQ(otherwise.load(), 0);
  EXPECT_GE(generations, 3);

  // With the token the message is read, and refused from its wire form before it is parsed: 64 Mi
  // drafts are over max_gamma. The server holds the message's bytes and nothing it would parse
  // into.
  const int64_t before = resident_bytes();
  PeakResident peak;
  const grpc::Status read = call_bytes(channels.front(), "Verify", amplifier, "s3cret");
  const double growth = static_cast<double>(peak.stop() - before) / kMiB;
  expect_status(read, grpc::StatusCode::INVALID_ARGUMENT, "drafts holds 67108848 tokens, more than max_gamma = 64");
  std::cout << "[ figures  ] the same request with the token: read, refused unparsed, peak RSS " << growth
            << " MiB above " << static_cast<double>(before) / kMiB << " MiB\n";
  if (kMemoryIsMeasured) {
    EXPECT_LT(growth, 160.0);
  }
}

// The other bounds of the front door: sessions per client (a closed one frees its place), a call
// whose message never comes (it holds no request place, and is cancelled after read_timeout),
// connections without calls closed after connection_idle_timeout, streams per
// connection, and bad limits refused naming the rule.
TEST(RemoteFrontDoor, ClientsAreBoundedAndIdleConnectionsClosed) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, loopback({.max_sessions = 8,
                                          .max_sessions_per_client = 2,
                                          .max_concurrent_requests = 1,
                                          .read_timeout = std::chrono::milliseconds(300),
                                          .connection_idle_timeout = std::chrono::milliseconds(200)}));
  RawClient raw(server.port());
  remote::wire::OpenReply a, b, c;
  ASSERT_TRUE(raw.open({0, 1}, &a).ok());
  ASSERT_TRUE(raw.open({0, 2}, &b).ok());
  expect_status(raw.open({0, 3}, &c), grpc::StatusCode::RESOURCE_EXHAUSTED, "max_sessions_per_client");
  ASSERT_TRUE(raw.close(a.session(), a.secret()).ok());
  ASSERT_TRUE(raw.open({0, 3}, &c).ok());

  // A call whose message never comes holds no request place (max_concurrent_requests is 1 here):
  // other calls are served meanwhile; it is cancelled after read_timeout.
  const auto channel = own_channel(server.port());
  const auto started = std::chrono::steady_clock::now();
  grpc::Status held_status;
  {
    HeldCall held(channel);
    ASSERT_TRUE(held.started());
    for (int i = 0; i < 200 && server.reading() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(server.reading(), 1);
    expect_status(raw.close("no-such-session", "x"), grpc::StatusCode::NOT_FOUND, "no such session");
    held_status = held.finish();
  }
  const auto waited = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(held_status.error_code(), grpc::StatusCode::CANCELLED) << held_status.error_message();
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::milliseconds(5000));
  EXPECT_EQ(server.reading(), 0);

  // The connection above has no call now: the server closes it and the channel goes idle.
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  for (int i = 0; i < 300 && channel->GetState(false) == GRPC_CHANNEL_READY; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_IDLE);

  // One stream per connection: a second call on a connection whose stream is held waits (and
  // misses its deadline); on another connection it is served.
  VerifierServer narrow(target, loopback({.max_streams_per_connection = 1}));
  const auto first = own_channel(narrow.port());
  HeldCall held(first);
  ASSERT_TRUE(held.started());
  const auto close_on = [](const std::shared_ptr<grpc::Channel>& on) {
    const auto stub = remote::wire::Verifier::NewStub(on);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    remote::wire::CloseRequest request;
    remote::wire::CloseReply reply;
    return stub->Close(&context, request, &reply);
  };
  EXPECT_EQ(close_on(first).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(close_on(own_channel(narrow.port())).error_code(), grpc::StatusCode::NOT_FOUND);

  const std::vector<std::pair<remote::ServerLimits, std::string>> bad = {
      {{.max_sessions_per_client = 0}, "max_sessions_per_client >= 1"},
      {{.max_resets_per_host = 0}, "max_resets_per_host >= 1"},
      {{.host_resets_per_second = -1}, "host_resets_per_second >= 0"},
  };
  for (const auto& [limits, rule] : bad) {
    try {
      VerifierServer<test::MarkovModel> refused(target, loopback(limits));
      ADD_FAILURE() << "the server started with " << rule << " broken";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(rule), std::string::npos) << e.what();
    }
  }
}

// A storm of sessions on the bundled target (64 sessions of 300-token prompts from 16 clients,
// two steps each, half closed and half left to the idle reaper) and then quiet: the memory the
// sessions held goes back to the system (the reaper trims the allocator), so the server's
// resident memory ends within a quarter of the storm's growth, or 16 MiB, of where it began.
TEST(Remote, MemoryFreedSessionsHeldIsReturnedAfterAStorm) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator holds freed memory in its quarantine; the Release leg measures this";
#else
  Model target = bundled("target");
  VerifierServer server(target, loopback({.max_sessions = 64,
                                          .max_sessions_per_client = 64,
                                          .idle_timeout = std::chrono::milliseconds(1000)}));
  std::string text;
  while (text.size() < 300) text += "def f(x):\n    return x + 1\n";
  const Ids prompt = bytes(text.substr(0, 300));
  const auto storm = [&] {
    std::vector<std::thread> clients;
    for (int c = 0; c < 16; ++c) {
      clients.emplace_back([&, c] {
        RawClient raw(server.port());
        for (int s = 0; s < 4; ++s) {
          remote::wire::OpenReply opened;
          ASSERT_TRUE(raw.open(prompt, &opened).ok());
          for (int step = 0; step < 2; ++step) {
            remote::wire::VerifyRequest request;
            request.set_session(opened.session());
            request.set_secret(opened.secret());
            request.set_length(static_cast<int64_t>(prompt.size()));
            request.set_last_token(prompt.back());
            request.add_drafts('x');
            const grpc::Status status = raw.verify(request);
            ASSERT_TRUE(status.ok()) << status.error_message();
          }
          if ((c + s) % 2 == 0) {
            ASSERT_TRUE(raw.close(opened.session(), opened.secret()).ok());
          }
        }
      });
    }
    for (auto& client : clients) client.join();
    for (int i = 0; i < 300 && server.sessions() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(server.sessions(), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the reaper's next rounds
  };
  storm();  // the first storm warms what stays (threads, their scratch buffers, gRPC's pools)
  const int64_t baseline = resident_bytes();
  PeakResident peak;
  storm();
  const int64_t top = peak.stop();
  const int64_t after = resident_bytes();
  std::cout << "[ figures  ] resident memory before a storm of 64 sessions " << static_cast<double>(baseline) / kMiB
            << " MiB, at its peak " << static_cast<double>(top) / kMiB << " MiB, after "
            << static_cast<double>(after) / kMiB << " MiB\n";
  EXPECT_GT(top - baseline, 32 << 20);  // the storm did hold memory
  EXPECT_LT(after - baseline, std::max<int64_t>(16 << 20, (top - baseline) / 4));
#endif
}
}  // namespace

}  // namespace test_admission
