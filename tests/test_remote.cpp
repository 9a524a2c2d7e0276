// Remote verification over gRPC on loopback, server and clients in this process: greedy output
// equal to local autoregressive decoding, sampled output distributed as the target's (with a check
// that the test catches a wrong q), reproducibility, every bad request refused with its status and
// the server serving on, idle sessions freed, a server stopped mid-generation, 16 concurrent
// clients, and tensor parallelism. The front door under denial of service: test_admission.cpp.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <utility>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "specdec/io/checkpoint.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/remote/client.hpp"
#include "specdec/remote/server.hpp"
#include "specdec/specdec.hpp"
#include "support/markov_fixtures.hpp"
#include "support/remote_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_remote {

namespace {

using namespace specdec;
using namespace specdec::test;
using remote::RemoteError;
using remote::RemoteVerifier;
using remote::VerifierServer;


// One token reader for server and client (remote/token.hpp): a file's first line or the
// variable's value, trimmed of spaces, tabs, CRs and LFs on both ends; a byte gRPC metadata cannot
// carry (CR, LF, tab, NUL or a space inside) is refused naming the file or variable and the byte,
// never the token; the library refuses such a token in RemoteOptions and ServerOptions with an
// exception (gRPC itself would abort the process).
TEST(RemoteToken, OneReaderTrimsAndRefusesWhatMetadataCannotCarry) {
  const std::filesystem::path folder = std::filesystem::temp_directory_path() / ("specdec_token_" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const auto file_with = [&](const std::string& bytes) {
    const std::filesystem::path path = folder / "token";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return path.string();
  };
  const auto message_of = [](const auto& read) {
    try {
      (void)read();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  for (const std::string bytes : {"tok\r\n", "tok \n", " \ttok\t \r\nsecond line", "tok", "tok\n\n"}) {
    EXPECT_EQ(remote::read_token(file_with(bytes), "--token-file"), "tok") << bytes;
  }
  for (const std::string bytes : {"", "\n", "\r\n", " \t\nTOKEN"}) {
    EXPECT_NE(message_of([&] { return remote::read_token(file_with(bytes), "--token-file"); }).find("holds no token"),
              std::string::npos);
  }
  const std::vector<std::pair<std::string, std::string>> refused{
      {"secret\tword\n", "0x09 at position 6"}, {"secret\rword\n", "0x0d at position 6"},
      {std::string("secret\0word\n", 12), "0x00 at position 6"}, {"secret word\n", "0x20 at position 6"},
      {"secret\x7fword", "0x7f at position 6"}};
  for (const auto& [bytes, byte] : refused) {
    const std::string path = file_with(bytes);
    const std::string message = message_of([&] { return remote::read_token(path, "--token-file"); });
    EXPECT_NE(message.find("--token-file " + path + ": the token holds byte " + byte), std::string::npos) << message;
    EXPECT_EQ(message.find("secret"), std::string::npos) << "the message shows the token: " << message;
  }
  EXPECT_NE(message_of([&] { return remote::read_token(folder.string(), "--token-file"); }).find("is a folder"),
            std::string::npos);
  EXPECT_NE(message_of([&] { return remote::read_token((folder / "missing").string(), "--token-file"); }).find("does not exist"),
            std::string::npos);

  // The variable: the same trimming and checks.
  ::unsetenv(remote::kTokenVariable);
  EXPECT_EQ(remote::read_token("", "--token-file"), "");
  ::setenv(remote::kTokenVariable, "tok\n", 1);
  EXPECT_EQ(remote::read_token("", "--token-file"), "tok");
  ::setenv(remote::kTokenVariable, "secret\tword", 1);
  const std::string message = message_of([] { return remote::read_token("", "--token-file"); });
  EXPECT_NE(message.find("$SPECDEC_VERIFIER_TOKEN: the token holds byte 0x09"), std::string::npos) << message;
  ::setenv(remote::kTokenVariable, " \r\n", 1);
  EXPECT_NE(message_of([] { return remote::read_token("", "--token-file"); }).find("holds no token"), std::string::npos);
  ::unsetenv(remote::kTokenVariable);

  // Tokens given to the library directly: checked, never trimmed, refused with an exception.
  EXPECT_NE(message_of([] { return RemoteVerifier("127.0.0.1:1", {.token = "tok\n"}); }).find("RemoteOptions::token"),
            std::string::npos);
  Model target = bundled("target");
  EXPECT_NE(message_of([&] { return std::make_unique<VerifierServer<Model>>(target, remote::ServerOptions{.address = "127.0.0.1:0", .token = "a b"}); })
                .find("ServerOptions::token"),
            std::string::npos);
  std::filesystem::remove_all(folder);
}

TEST(Remote, GreedyOutputEqualsLocalAutoregressiveDecoding) {
  Model target = bundled("target");
  Model drafter = bundled("drafter");
  Model reference = bundled("target");
  VerifierServer server(target, loopback());
  RemoteVerifier verifier(local(server.port()));
  const Ids prompt = bytes("def fibonacci(n):\n    ");
  const Ids expected = autoregressive_generate(reference, prompt, {.max_new_tokens = 80}).tokens;
  ModelDraftSource drafts(drafter);
  std::vector<StepInfo> steps;
  const GenerationResult result = remote::remote_generate(
      drafts, verifier, prompt, {.max_new_tokens = 80, .on_step = [&](const StepInfo& s) { steps.push_back(s); }, .gamma = 4});
  EXPECT_EQ(result.tokens, expected);
  EXPECT_GT(result.stats.accepted, 0);
  EXPECT_GT(result.stats.rtt_seconds, 0);
  EXPECT_GT(result.stats.prefill_seconds, 0);
  EXPECT_LE(result.stats.prefill_seconds, result.stats.rtt_seconds);
  ASSERT_FALSE(steps.empty());
  EXPECT_GT(steps.back().rtt_seconds, 0);
  EXPECT_EQ(result.stats.target_calls, result.stats.steps);  // one round trip per step
  // Autoregressive over the wire (no drafts) and threshold verification under greedy decoding.
  NoDrafts none;
  EXPECT_EQ(remote::remote_generate(none, verifier, prompt, {.max_new_tokens = 30}).tokens,
            Ids(expected.begin(), expected.begin() + 30));
  ModelDraftSource again(drafter);
  EXPECT_EQ(remote::remote_generate(again, verifier, prompt,
                                    {.max_new_tokens = 80, .gamma = 4, .verification = Verification::threshold,
                                     .threshold = 0.25})
                .tokens,
            expected);
  EXPECT_EQ(server.sessions(), 0);  // every generation closed its session
}

// Two tokens after prompt {0} from the Markov pair, sampled remotely, against the target's exact
// distribution (chi-square at a tail of 1e-6). `wrong_q` sends the drafts with a uniform q
// instead of the drafter's: verification is then biased, which the test must catch.
struct UniformQ {
  ModelDraftSource<test::MarkovModel> inner;
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    Drafts drafts = inner.draft(request, processor, gen);
    if (drafts.probs.defined()) drafts.probs = at::full_like(drafts.probs, 1.0 / static_cast<double>(drafts.probs.size(1)));
    return drafts;
  }
  void verified(const VerifiedDrafts& v) { inner.verified(v); }
};

// Runs the samples from `clients` threads at once, each with its own connection (sample i on
// thread i mod clients), so that a batching server verifies them in shared forwards.
bool remote_samples_pass(int port, bool wrong_q, const MultinomialProcessor& processor, int clients = 1) {
  test::MarkovModel drafter(test::markov_drafter_rows());
  const at::Tensor p = test::markov_target_rows();
  constexpr int64_t kSamples = 2000;
  std::map<std::pair<int64_t, int64_t>, int64_t> observed;
  std::mutex observed_mutex;
  std::atomic<int> failures = 0;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      try {
        RemoteVerifier verifier(local(port));
        for (int64_t i = c; i < kSamples; i += clients) {
          const SpeculativeOptions options{.max_new_tokens = 2, .seed = static_cast<uint64_t>(i), .gamma = 2, .first_target = false};
          Ids tokens;
          if (wrong_q) {
            UniformQ source{ModelDraftSource<test::MarkovModel>(drafter)};
            tokens = remote::remote_generate(source, verifier, Ids{0}, options, processor).tokens;
          } else {
            ModelDraftSource<test::MarkovModel> source(drafter);
            tokens = remote::remote_generate(source, verifier, Ids{0}, options, processor).tokens;
          }
          const std::lock_guard lock(observed_mutex);
          ++observed[{tokens[0], tokens[1]}];
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  std::map<std::pair<int64_t, int64_t>, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) expected[{a, b}] = p[0][a].item<double>() * p[a][b].item<double>();
  }
  const test::ChiSquare fit = test::chi_square(observed, expected, kSamples);
  return failures == 0 && fit.outside_support == 0 && fit.statistic < test::chi_square_quantile(fit.dof, 4.75);
}

TEST(Remote, SampledOutputIsDistributedAsTheTarget) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, loopback());
  EXPECT_TRUE(remote_samples_pass(server.port(), /*wrong_q=*/false, MultinomialProcessor(1.0)));
  // Power: the same harness fails when verification gets a q the drafts were not drawn from.
  EXPECT_FALSE(remote_samples_pass(server.port(), /*wrong_q=*/true, MultinomialProcessor(1.0)));
}

// Four clients at once on a server that batches their verifications: every row of a shared
// forward is verified exactly (and the wrong-q power check still fails).
TEST(Remote, BatchedVerificationIsDistributedAsTheTarget) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, loopback({.max_batch = 4, .batch_delay = std::chrono::milliseconds(20)}));
  EXPECT_TRUE(remote_samples_pass(server.port(), /*wrong_q=*/false, MultinomialProcessor(1.0), /*clients=*/4));
  EXPECT_FALSE(remote_samples_pass(server.port(), /*wrong_q=*/true, MultinomialProcessor(1.0), /*clients=*/4));
  const remote::ServerStats stats = server.stats();
  EXPECT_EQ(stats.largest_batch, 4);
  EXPECT_LT(stats.forwards * 2, stats.verifications) << "most forwards should serve several clients";
}

TEST(Remote, ASeedReproducesARunInEveryEncoding) {
  Model target = bundled("target");
  Model drafter = bundled("drafter");
  VerifierServer server(target, loopback());
  const Ids prompt = bytes("import os\n");
  for (const bool half : {false, true}) {
    RemoteVerifier verifier(local(server.port()), {.half_precision_q = half});
    const auto run = [&](const auto& processor, uint64_t seed) {
      ModelDraftSource drafts(drafter);
      return remote::remote_generate(drafts, verifier, prompt, {.max_new_tokens = 40, .seed = seed, .gamma = 4}, processor).tokens;
    };
    EXPECT_EQ(run(MultinomialProcessor(0.8), 7), run(MultinomialProcessor(0.8), 7));  // dense q
    EXPECT_EQ(run(TopKProcessor(5, 0.8), 7), run(TopKProcessor(5, 0.8), 7));          // sparse q
    EXPECT_NE(run(MultinomialProcessor(1.5), 7), run(MultinomialProcessor(1.5), 8));
  }
}


TEST(Remote, BadRequestsGetTheirStatusAndTheServerGoesOn) {
  Model target = bundled("target");
  Model drafter = bundled("drafter");
  VerifierServer server(target, loopback({.max_sessions = 3, .max_gamma = 8}));
  RawClient raw(server.port());
  remote::wire::OpenReply opened;
  expect_status(raw.open({}, &opened), grpc::StatusCode::INVALID_ARGUMENT, "prompt must not be empty");
  expect_status(raw.open({1, 300}, &opened), grpc::StatusCode::INVALID_ARGUMENT, "prompt[1] = 300 is outside the vocabulary");
  ASSERT_TRUE(raw.open(bytes("x = "), &opened).ok());
  EXPECT_EQ(opened.vocab_size(), 256);

  remote::wire::VerifyRequest request;
  request.set_session(opened.session());
  request.set_secret(opened.secret());
  request.set_length(4);
  request.set_last_token(' ');
  for (int i = 0; i < 9; ++i) request.add_drafts('1');
  expect_status(raw.verify(request), grpc::StatusCode::INVALID_ARGUMENT, "more than max_gamma = 8");
  request.clear_drafts();
  request.add_drafts(256);
  expect_status(raw.verify(request), grpc::StatusCode::INVALID_ARGUMENT, "drafts[0] = 256 is outside the vocabulary");
  request.clear_drafts();
  request.add_drafts('1');
  request.set_last_token('y');
  expect_status(raw.verify(request), grpc::StatusCode::FAILED_PRECONDITION, "client and server hold different sequences");
  request.set_last_token(' ');
  request.set_length(99);
  expect_status(raw.verify(request), grpc::StatusCode::FAILED_PRECONDITION, "is not a length of the session");
  request.set_length(4);
  request.mutable_q()->set_encoding(remote::wire::DraftProbs::DENSE_F32);
  expect_status(raw.verify(request), grpc::StatusCode::INVALID_ARGUMENT, "q must have encoding NONE");
  request.clear_q();
  request.set_session("no-such-session");
  expect_status(raw.verify(request), grpc::StatusCode::NOT_FOUND, "no such session for this client");
  request.set_session(opened.session());
  request.set_secret(opened.secret());
  remote::wire::VerifyReply reply;
  ASSERT_TRUE(raw.verify(request, &reply).ok());  // the session survived every bad request
  EXPECT_EQ(reply.length(), 4 + reply.accepted() + 1);

  // Sampled sessions need q, of the right size, in which each draft is possible.
  remote::wire::OpenReply sampled;
  ASSERT_TRUE(raw.open(bytes("y = "), &sampled, remote::wire::Sampling::MULTINOMIAL).ok());
  remote::wire::VerifyRequest with_q;
  with_q.set_session(sampled.session());
  with_q.set_secret(sampled.secret());
  with_q.set_length(4);
  with_q.set_last_token(' ');
  with_q.add_drafts('1');
  with_q.mutable_q()->set_encoding(remote::wire::DraftProbs::DENSE_F32);
  for (int i = 0; i < 10; ++i) with_q.mutable_q()->add_values(0.1f);
  expect_status(raw.verify(with_q), grpc::StatusCode::INVALID_ARGUMENT, "expected drafts (1) x vocab (256)");
  with_q.mutable_q()->set_encoding(remote::wire::DraftProbs::SPARSE);
  with_q.mutable_q()->clear_values();
  with_q.mutable_q()->add_row_lengths(1);
  with_q.mutable_q()->add_indices('2');
  with_q.mutable_q()->add_values(1.0f);
  expect_status(raw.verify(with_q), grpc::StatusCode::INVALID_ARGUMENT, "has probability 0 under its q row");

  // A third session fills the server; a fourth is refused.
  remote::wire::OpenReply third;
  ASSERT_TRUE(raw.open(bytes("z"), &third).ok());
  expect_status(raw.open(bytes("w"), &opened), grpc::StatusCode::RESOURCE_EXHAUSTED, "max_sessions");
  EXPECT_EQ(server.sessions(), 3);
}

// Sessions belong to the client that opened them: 128-bit handles and secrets from the kernel's
// random source (two servers built alike hand out different ones: nothing seeds them); a call
// with the right handle but another secret gets exactly the answer an unknown handle gets, and
// cannot close the session; no error text shows the session's tokens.
TEST(RemoteSessions, BelongToTheClientThatOpenedThem) {
  Model target = bundled("target");
  VerifierServer server(target, loopback({.max_gamma = 8}));
  VerifierServer twin(target, loopback({.max_gamma = 8}));
  RawClient owner(server.port(), "alice-token");
  const Ids prompt{211, 223, 237, 241};
  remote::wire::OpenReply opened, other, twin_opened;
  ASSERT_TRUE(owner.open(prompt, &opened).ok());
  ASSERT_TRUE(owner.open(prompt, &other).ok());
  ASSERT_TRUE(RawClient(twin.port(), "alice-token").open(prompt, &twin_opened).ok());
  const auto hex128 = [](const std::string& text) {
    return text.size() == 32 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
  };
  EXPECT_TRUE(hex128(opened.session()) && hex128(opened.secret())) << opened.session() << " " << opened.secret();
  EXPECT_NE(opened.session(), other.session());
  EXPECT_NE(opened.secret(), other.secret());
  EXPECT_NE(opened.session(), twin_opened.session()) << "two servers built alike hand out the same handle";
  EXPECT_NE(opened.secret(), twin_opened.secret());

  remote::wire::VerifyRequest request;
  request.set_length(4);
  request.set_last_token(241);
  request.add_drafts('1');
  request.set_session("0123456789abcdef0123456789abcdef");
  request.set_secret(opened.secret());
  const grpc::Status unknown = owner.verify(request);
  ASSERT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
  // The right handle with another session's secret, or with no secret.
  request.set_session(opened.session());
  for (const std::string& secret : {other.secret(), std::string(), opened.secret().substr(0, 31)}) {
    request.set_secret(secret);
    const grpc::Status refused = owner.verify(request);
    EXPECT_EQ(refused.error_code(), unknown.error_code());
    EXPECT_EQ(refused.error_message(), unknown.error_message());
  }
  // An authorization header this server, which requires no token, does not check makes no
  // identity: the secret alone binds the session here (another identity, a TLS client
  // certificate, is refused in TlsWithClientCertificates), so a caller inventing one gets no
  // further with a wrong secret and is not told apart with the right one.
  RawClient mallory(server.port(), "mallory-token");
  request.set_secret(other.secret());
  const grpc::Status stolen = mallory.verify(request);
  EXPECT_EQ(stolen.error_code(), unknown.error_code());
  EXPECT_EQ(stolen.error_message(), unknown.error_message());
  EXPECT_EQ(mallory.close(opened.session(), other.secret()).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(owner.close(opened.session(), other.secret()).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(server.sessions(), 2);
  request.set_secret(opened.secret());

  // Bad requests of the owner: their errors name no token of the session.
  std::vector<std::string> messages;
  request.set_last_token(7);
  messages.push_back(owner.verify(request).error_message());
  request.set_last_token(241);
  request.set_length(99);
  messages.push_back(owner.verify(request).error_message());
  request.set_length(4);
  request.add_drafts(300);
  messages.push_back(owner.verify(request).error_message());
  for (const std::string& message : messages) {
    ASSERT_FALSE(message.empty());
    for (const int64_t token : prompt) {
      EXPECT_EQ(message.find(std::to_string(token)), std::string::npos) << "shows token " << token << ": " << message;
    }
  }
  // The owner still verifies and closes its session.
  request.clear_drafts();
  request.add_drafts('1');
  remote::wire::VerifyReply reply;
  ASSERT_TRUE(owner.verify(request, &reply).ok());
  EXPECT_TRUE(owner.close(opened.session(), opened.secret()).ok());
  EXPECT_EQ(server.sessions(), 1);
}

TEST(Remote, TokensAreRequiredWhereSet) {
  test::MarkovModel target(test::markov_target_rows());
  EXPECT_THROW((void)VerifierServer<test::MarkovModel>(target, {.address = "0.0.0.0:0"}), std::invalid_argument);
  VerifierServer server(target, {.address = "127.0.0.1:0", .token = "s3cret"});
  remote::wire::OpenReply opened;
  expect_status(RawClient(server.port()).open({0}, &opened), grpc::StatusCode::UNAUTHENTICATED, "token");
  expect_status(RawClient(server.port(), "wrong!").open({0}, &opened), grpc::StatusCode::UNAUTHENTICATED, "token");
  EXPECT_TRUE(RawClient(server.port(), "s3cret").open({0}, &opened).ok());
  RemoteVerifier verifier(local(server.port()), {.token = "s3cret"});
  test::MarkovModel drafter(test::markov_drafter_rows());
  ModelDraftSource source(drafter);
  EXPECT_EQ(remote::remote_generate(source, verifier, Ids{0}, {.max_new_tokens = 5}).tokens.size(), 5U);
  RemoteVerifier anonymous(local(server.port()));
  try {
    (void)remote::remote_generate(source, anonymous, Ids{0}, {.max_new_tokens = 5});
    ADD_FAILURE() << "generated without the token";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::UNAUTHENTICATED);
  }
}


// TLS with client certificates (tests/data/tls, made by scripts/make-test-certificates.sh): a
// client with a certificate from the trusted CA generates; one without a certificate, one with a
// certificate from another CA, a plaintext one and one that does not trust the server's CA cannot
// connect. TLS with client certificates stands in for the token off loopback; TLS alone does not.
TEST(Remote, TlsWithClientCertificates) {
  const remote::TlsOptions server_tls{.certificate_chain = tls_file("server.pem"),
                                      .private_key = tls_file("server.key"),
                                      .trusted_ca = tls_file("ca.pem")};
  test::MarkovModel target(test::markov_target_rows());
  const auto refused = [&](remote::ServerOptions options, const std::string& words) {
    try {
      VerifierServer<test::MarkovModel> server(target, std::move(options));
      ADD_FAILURE() << "the server started";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused({.address = "0.0.0.0:0", .tls = {.certificate_chain = server_tls.certificate_chain, .private_key = server_tls.private_key}},
          "a token or TLS with client certificates");
  refused({.address = "127.0.0.1:0", .tls = {.certificate_chain = server_tls.certificate_chain}}, "needs both");

  VerifierServer server(target, {.address = "127.0.0.1:0", .tls = server_tls});
  test::MarkovModel drafter(test::markov_drafter_rows());
  test::MarkovModel reference(test::markov_target_rows());
  const Ids expected = autoregressive_generate(reference, Ids{0}, {.max_new_tokens = 8}).tokens;
  const remote::TlsOptions client_tls{.certificate_chain = tls_file("client.pem"),
                                      .private_key = tls_file("client.key"),
                                      .trusted_ca = tls_file("ca.pem")};
  {
    RemoteVerifier verifier(local(server.port()), {.tls = client_tls});
    ModelDraftSource source(drafter);
    EXPECT_EQ(remote::remote_generate(source, verifier, Ids{0}, {.max_new_tokens = 8}).tokens, expected);
  }
  const std::vector<std::pair<const char*, remote::TlsOptions>> strangers = {
      {"no client certificate", {.trusted_ca = tls_file("ca.pem")}},
      {"a certificate from another CA",
       {.certificate_chain = tls_file("stranger.pem"), .private_key = tls_file("stranger.key"), .trusted_ca = tls_file("ca.pem")}},
      {"plaintext", {}},
      {"a client that does not trust the server's CA",
       {.certificate_chain = client_tls.certificate_chain, .private_key = client_tls.private_key, .trusted_ca = tls_file("other-ca.pem")}},
  };
  for (const auto& [who, tls] : strangers) {
    RemoteVerifier verifier(local(server.port()), {.timeout = std::chrono::milliseconds(3000), .tls = tls});
    ModelDraftSource source(drafter);
    try {
      (void)remote::remote_generate(source, verifier, Ids{0}, {.max_new_tokens = 8});
      ADD_FAILURE() << who << " generated";
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.code(), grpc::StatusCode::UNAVAILABLE) << who << ": " << e.what();
    }
  }
  EXPECT_EQ(server.sessions(), 0);
  EXPECT_THROW((void)RemoteVerifier(local(server.port()), {.tls = {.certificate_chain = client_tls.certificate_chain, .trusted_ca = client_tls.trusted_ca}}),
               std::invalid_argument);
}

// Every PEM path problem gets a message naming the flag, the path and the problem.
TEST(Remote, PemFilesAreReadWithClearErrors) {
  const std::string data = SPECDEC_TEST_DATA_DIR;
  const auto refused = [](const std::string& file, const std::string& words) {
    try {
      (void)remote::read_pem(file, "--tls-key");
      ADD_FAILURE() << file << " was read";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--tls-key " + file + " " + words), std::string::npos) << e.what();
    }
  };
  refused(data + "/tls/missing.pem", "does not exist");
  refused(data + "/tls", "is a folder");
  refused(data + "/byte_tokenizer/tokenizer.json", "holds no PEM block");
  const std::filesystem::path large = std::filesystem::temp_directory_path() / ("specdec-large-" + std::to_string(getpid()) + ".pem");
  {
    std::ofstream out(large, std::ios::binary);
    out << "-----BEGIN CERTIFICATE-----\n" << std::string(size_t{1} << 20, 'A');
  }
  refused(large.string(), "is larger than 1 MiB");
  std::filesystem::remove(large);
  EXPECT_NE(remote::read_pem(data + "/tls/ca.pem", "--tls-client-ca").find("-----BEGIN CERTIFICATE-----"), std::string::npos);
}

TEST(Remote, IdleSessionsAreFreed) {
  test::MarkovModel target(test::markov_target_rows());
  VerifierServer server(target, loopback({.idle_timeout = std::chrono::milliseconds(100)}));
  RawClient raw(server.port());
  remote::wire::OpenReply opened;
  ASSERT_TRUE(raw.open({0, 1}, &opened).ok());  // a client that disconnects without Close
  EXPECT_EQ(server.sessions(), 1);
  for (int i = 0; i < 100 && server.sessions() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(server.sessions(), 0);
  remote::wire::VerifyRequest request;
  request.set_session(opened.session());
  request.set_secret(opened.secret());
  request.set_length(2);
  request.set_last_token(1);
  expect_status(raw.verify(request), grpc::StatusCode::NOT_FOUND, "idle too long");
}

TEST(Remote, AServerStoppedMidGenerationLeavesTheTokensSoFar) {
  Model target = bundled("target");
  Model drafter = bundled("drafter");
  Model reference = bundled("target");
  const Ids prompt = bytes("class Stack:\n    ");
  const Ids expected = autoregressive_generate(reference, prompt, {.max_new_tokens = 100}).tokens;
  std::optional<VerifierServer<Model>> server;
  server.emplace(target, loopback());
  RemoteVerifier verifier(local(server->port()), {.timeout = std::chrono::milliseconds(5000)});
  ModelDraftSource drafts(drafter);
  int64_t steps = 0;
  try {
    (void)remote::remote_generate(drafts, verifier, prompt,
                                  {.max_new_tokens = 100,
                                   .on_step = [&](const StepInfo&) {
                                     if (++steps == 3) server->shutdown();
                                   },
                                   .gamma = 4});
    ADD_FAILURE() << "generation went on after the server stopped";
  } catch (const RemoteError& e) {
    EXPECT_NE(e.code(), grpc::StatusCode::OK);
    EXPECT_NE(std::string(e.what()).find("Verify failed"), std::string::npos) << e.what();
    const Ids& partial = e.partial().tokens;
    ASSERT_GE(partial.size(), 3U);
    EXPECT_EQ(partial, Ids(expected.begin(), expected.begin() + static_cast<std::ptrdiff_t>(partial.size())));
    EXPECT_EQ(e.partial().stats.steps, 3);
  }
}

// Sixteen clients at once on a batching server. Even clients decode greedily and must get their
// local autoregressive output; odd ones sample (top-k at temperature 2, a seed each) and must get exactly what the
// same seeded run gets alone from a server that verifies one request per forward: a row's result
// does not depend on the rows it was batched with.
TEST(Remote, SixteenConcurrentClientsEachGetTheirOwnOutput) {
  constexpr int kClients = 16;
  std::vector<Ids> prompts, expected(kClients), got(kClients);
  for (int c = 0; c < kClients; ++c) prompts.push_back(bytes("def f" + std::to_string(c) + "(x):\n    return "));
  const auto run = [&](int c, int port) {
    Model drafter = bundled("drafter");
    RemoteVerifier verifier(local(port));
    ModelDraftSource drafts(drafter);
    const SpeculativeOptions options{.max_new_tokens = 24, .seed = static_cast<uint64_t>(100 + c), .gamma = 4};
    const Ids& prompt = prompts[static_cast<size_t>(c)];
    return c % 2 == 0 ? remote::remote_generate(drafts, verifier, prompt, options).tokens
                      : remote::remote_generate(drafts, verifier, prompt, options, TopKProcessor(40, 2.0)).tokens;
  };
  {
    Model reference = bundled("target");
    VerifierServer alone(reference, loopback({.max_batch = 1}));
    for (int c = 0; c < kClients; ++c) {
      expected[static_cast<size_t>(c)] =
          c % 2 == 0 ? autoregressive_generate(reference, prompts[static_cast<size_t>(c)], {.max_new_tokens = 24}).tokens
                     : run(c, alone.port());
    }
    EXPECT_EQ(alone.stats().largest_batch, 1);
  }
  Model target = bundled("target");
  VerifierServer server(target, loopback({.batch_delay = std::chrono::milliseconds(2)}));
  std::vector<std::thread> clients;
  std::atomic<int> failures = 0;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      try {
        got[static_cast<size_t>(c)] = run(c, server.port());
      } catch (const std::exception& e) {
        ADD_FAILURE() << "client " << c << ": " << e.what();
        ++failures;
      }
    });
  }
  for (auto& client : clients) client.join();
  EXPECT_EQ(failures.load(), 0);
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(got[static_cast<size_t>(c)], expected[static_cast<size_t>(c)]) << "client " << c;
  EXPECT_EQ(server.sessions(), 0);
  const remote::ServerStats stats = server.stats();
  EXPECT_GE(stats.largest_batch, 4);
  EXPECT_LT(stats.forwards, stats.verifications);
}

// A client that rolls back (asks for a shorter length than the session holds) and one that goes
// on, verified in the same forward: the rolled-back row computes its last token again and both get
// what they get alone.
TEST(Remote, ARolledBackSessionIsBatchedWithOthers) {
  Model target = bundled("target");
  VerifierServer server(target, loopback({.max_batch = 2, .batch_delay = std::chrono::milliseconds(500)}));
  RawClient raw(server.port());
  remote::wire::OpenReply first, second;
  const Ids prompt_a = bytes("for i in "), prompt_b = bytes("while x ");
  ASSERT_TRUE(raw.open(prompt_a, &first).ok());
  ASSERT_TRUE(raw.open(prompt_b, &second).ok());
  const auto request = [](const remote::wire::OpenReply& session, const Ids& tokens, int64_t length) {
    remote::wire::VerifyRequest r;
    r.set_session(session.session());
    r.set_secret(session.secret());
    r.set_length(length);
    r.set_last_token(tokens[static_cast<size_t>(length - 1)]);
    return r;
  };
  remote::wire::VerifyReply a1, b1;
  std::thread other([&] { EXPECT_TRUE(raw.verify(request(second, prompt_b, static_cast<int64_t>(prompt_b.size())), &b1).ok()); });
  EXPECT_TRUE(raw.verify(request(first, prompt_a, static_cast<int64_t>(prompt_a.size())), &a1).ok());
  other.join();
  EXPECT_EQ(server.stats().largest_batch, 2);
  // Session a rolls back by one token (its cache covers all it keeps); b goes on after its token.
  Ids b_tokens = prompt_b;
  b_tokens.push_back(b1.token());
  remote::wire::VerifyReply a2, b2;
  std::thread again([&] { EXPECT_TRUE(raw.verify(request(second, b_tokens, static_cast<int64_t>(b_tokens.size())), &b2).ok()); });
  EXPECT_TRUE(raw.verify(request(first, prompt_a, static_cast<int64_t>(prompt_a.size()) - 1), &a2).ok());
  again.join();
  EXPECT_EQ(server.stats().forwards, 2);
  Model reference = bundled("target");
  const Ids shorter(prompt_a.begin(), prompt_a.end() - 1);
  EXPECT_EQ(a1.token(), autoregressive_generate(reference, prompt_a, {.max_new_tokens = 1}).tokens.front());
  EXPECT_EQ(a2.token(), autoregressive_generate(reference, shorter, {.max_new_tokens = 1}).tokens.front());
  EXPECT_EQ(b2.token(), autoregressive_generate(reference, b_tokens, {.max_new_tokens = 1}).tokens.front());
  EXPECT_EQ(a2.length(), static_cast<int64_t>(shorter.size()) + 1);
}

// Two sessions whose joined forward would not fit under the target's limit (512): one 3 tokens
// from it, one short with 8 drafts. Each gets what it gets alone, none an error.
TEST(Remote, SessionsNearTheLimitAreServedBesideShortOnes) {
  Model target = bundled("target");
  Model reference = bundled("target");
  VerifierServer server(target, loopback({.max_batch = 2, .batch_delay = std::chrono::milliseconds(500)}));
  RawClient raw(server.port());
  std::string text;
  while (text.size() < 505) text += "def f(x):\n    return x + 1\n";
  const Ids near_limit = bytes(text.substr(0, 505)), short_prompt = bytes("for i in ");
  const Ids near_next = autoregressive_generate(reference, near_limit, {.max_new_tokens = 4}).tokens;
  const Ids short_next = autoregressive_generate(reference, short_prompt, {.max_new_tokens = 9}).tokens;
  remote::wire::OpenReply a, b;
  ASSERT_TRUE(raw.open(near_limit, &a).ok());
  ASSERT_TRUE(raw.open(short_prompt, &b).ok());
  // Drafts that the target accepts: 3 for the long session (505 + 3 + 1 = 509 tokens), 8 for the
  // short one; the joined input would be 9 wide after 504 cached positions.
  const auto request = [](const remote::wire::OpenReply& session, const Ids& prompt, const Ids& drafts) {
    remote::wire::VerifyRequest r;
    r.set_session(session.session());
    r.set_secret(session.secret());
    r.set_length(static_cast<int64_t>(prompt.size()));
    r.set_last_token(prompt.back());
    r.mutable_drafts()->Add(drafts.begin(), drafts.end());
    return r;
  };
  remote::wire::VerifyReply near_reply, short_reply;
  grpc::Status short_status;
  std::thread other([&] {
    short_status = raw.verify(request(b, short_prompt, Ids(short_next.begin(), short_next.begin() + 8)), &short_reply);
  });
  const grpc::Status near_status = raw.verify(request(a, near_limit, Ids(near_next.begin(), near_next.begin() + 3)), &near_reply);
  other.join();
  ASSERT_TRUE(near_status.ok()) << near_status.error_message();
  ASSERT_TRUE(short_status.ok()) << short_status.error_message();
  EXPECT_EQ(near_reply.accepted(), 3);
  EXPECT_EQ(near_reply.token(), near_next[3]);
  EXPECT_EQ(short_reply.accepted(), 8);
  EXPECT_EQ(short_reply.token(), short_next[8]);
  EXPECT_EQ(server.stats().largest_batch, 2);  // they came together and were served apart
}

// A second server on a running one's port fails at start naming the address; the first keeps
// every session and serves on.
TEST(Remote, ASecondServerCannotShareTheRunningOnesPort) {
  Model target = bundled("target");
  Model other_target = bundled("target");
  Model reference = bundled("target");
  VerifierServer server(target, loopback());
  const std::string address = local(server.port());
  RawClient raw(server.port());
  const Ids prompt = bytes("def add(a, b):");
  remote::wire::OpenReply opened;
  ASSERT_TRUE(raw.open(prompt, &opened).ok());
  try {
    VerifierServer second(other_target, {.address = address});
    ADD_FAILURE() << "a second server started on " << address;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on " + address), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
  // Every new connection reaches the first server, which holds the session.
  const Ids expected = autoregressive_generate(reference, prompt, {.max_new_tokens = 1}).tokens;
  for (int i = 0; i < 8; ++i) {
    RawClient fresh(server.port());
    remote::wire::VerifyRequest request;
    request.set_session(opened.session());
    request.set_secret(opened.secret());
    request.set_length(static_cast<int64_t>(prompt.size()));
    request.set_last_token(prompt.back());
    remote::wire::VerifyReply reply;
    const grpc::Status status = fresh.verify(request, &reply);
    ASSERT_TRUE(status.ok()) << "connection " << i << ": " << status.error_message();
    EXPECT_EQ(reply.token(), expected.front());
  }
}



// Tensor parallelism, in one process: rank 0's server and a follower (remote::follow_verifier) on
// another thread, joined by ThreadPair, two ranks that pass broadcasts through memory. The
// targets are replicated, not split (the split model and c10d are tested across processes in
// test_parallel.cpp and tests/cli/verifier_tp.sh): so the follower's own decision in every step
// must equal rank 0's bit for bit, which holds only if it replays every round exactly (the same
// sessions, tokens, drafts, batches and seeds).
// The message of what `run` throws; empty when it does not throw.
template <class F>
std::string error_of(const F& run) {
  try {
    (void)run();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

class ThreadPair final : public Collectives {
 public:
  [[nodiscard]] int64_t rank() const override { return thread_rank(); }
  [[nodiscard]] int64_t world_size() const override { return 2; }
  void all_reduce(at::Tensor& /*tensor*/) override { throw std::logic_error("ThreadPair: a replicated target never reduces"); }
  // Rank 0 leaves a copy and goes on; rank 1 takes rank 0's copy of the same call, after
  // comparing shapes and, for a step's decisions (int64 tensors of two or more values), its own
  // values.
  void broadcast(at::Tensor& tensor, int64_t root) override {
    if (root != 0) throw std::logic_error("ThreadPair: rank 0 broadcasts");
    std::unique_lock lock(mutex_);
    if (gone_) throw std::runtime_error("ThreadPair: rank 1 is gone");
    const uint64_t call = calls_[static_cast<size_t>(rank())]++;
    if (rank() == 0) {
      sent_.emplace(call, tensor.clone());
      arrived_.notify_all();
      return;
    }
    if (!arrived_.wait_for(lock, std::chrono::seconds(30), [&] { return gone_ || sent_.contains(call); })) {
      throw std::runtime_error("ThreadPair: rank 0 sent nothing for 30 s");
    }
    if (gone_) throw std::runtime_error("ThreadPair: rank 1 is gone");
    const at::Tensor sent = sent_.at(call);
    sent_.erase(call);
    if (sent.sizes() != tensor.sizes() || sent.scalar_type() != tensor.scalar_type()) {
      ++mismatched_shapes;
      throw std::runtime_error("ThreadPair: the ranks broadcast tensors of different shapes");
    }
    if (tensor.scalar_type() == at::kLong && tensor.numel() >= 2) {
      ++decisions;
      if (!tensor.equal(sent)) ++differing_decisions;
    }
    if (tensor.scalar_type() == at::kByte) ++rounds;
    tensor.copy_(sent);
  }
  // From now on every call on either rank fails, as when rank 1's process ends.
  void end_rank_1() {
    const std::lock_guard lock(mutex_);
    gone_ = true;
    arrived_.notify_all();
  }
  static int64_t& thread_rank() {
    thread_local int64_t rank = 0;
    return rank;
  }
  std::atomic<int64_t> decisions = 0, differing_decisions = 0, mismatched_shapes = 0, rounds = 0;

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<uint64_t, at::Tensor> sent_;
  uint64_t calls_[2] = {0, 0};
  bool gone_ = false;
};

// A client of raw calls (no local model, so no host copy of its own): `new_tokens` tokens after
// `prompt`. Greedy sessions draft `guess`'s next three tokens, every third one changed; sampled
// ones (multinomial, seeded by `seed`) draft nothing. Throws std::runtime_error with a failed
// call's status.
Ids raw_generate(int port, const Ids& prompt, const Ids& guess, bool sampled, uint64_t seed, size_t new_tokens) {
  RawClient raw(port);
  const auto check = [](const grpc::Status& status, const char* call) {
    if (!status.ok()) {
      throw std::runtime_error(std::string(call) + " failed (" + std::to_string(status.error_code()) + "): " + status.error_message());
    }
  };
  remote::wire::OpenReply opened;
  check(raw.open(prompt, &opened, sampled ? remote::wire::Sampling::MULTINOMIAL : remote::wire::Sampling::GREEDY, seed), "Open");
  Ids tokens = prompt;
  while (tokens.size() < prompt.size() + new_tokens) {
    remote::wire::VerifyRequest request;
    request.set_session(opened.session());
    request.set_secret(opened.secret());
    request.set_length(static_cast<int64_t>(tokens.size()));
    request.set_last_token(tokens.back());
    for (size_t at = tokens.size(); !sampled && at < tokens.size() + 3 && at < guess.size(); ++at) {
      request.add_drafts(at % 3 == 0 ? (guess[at] + 1) % 256 : guess[at]);
    }
    remote::wire::VerifyReply reply;
    check(raw.verify(request, &reply), "Verify");
    tokens.insert(tokens.end(), request.drafts().begin(), request.drafts().begin() + reply.accepted());
    tokens.push_back(reply.token());
  }
  check(raw.close(opened.session(), opened.secret()), "Close");
  const auto from = tokens.begin() + static_cast<std::ptrdiff_t>(prompt.size());
  return Ids(from, from + static_cast<std::ptrdiff_t>(new_tokens));
}

TEST(RemoteTensorParallel, TheFollowerReplaysEveryRoundExactly) {
  constexpr int kClients = 4;
  constexpr size_t kNew = 40;
  std::vector<Ids> prompts, guesses, expected(kClients), got(kClients);
  Model reference = bundled("target");
  for (int c = 0; c < kClients; ++c) {
    prompts.push_back(bytes("def g" + std::to_string(c) + "(y):\n    return "));
    Ids guess = prompts.back();
    const Ids more = autoregressive_generate(reference, prompts.back(), {.max_new_tokens = kNew + 4}).tokens;
    guess.insert(guess.end(), more.begin(), more.end());
    guesses.push_back(std::move(guess));
  }
  const auto clients = [&](int port, std::vector<Ids>& out) {
    std::vector<std::thread> threads;
    for (int c = 0; c < kClients; ++c) {
      threads.emplace_back([&, c] {
        try {
          out[static_cast<size_t>(c)] = raw_generate(port, prompts[static_cast<size_t>(c)], guesses[static_cast<size_t>(c)],
                                                     /*sampled=*/c % 2 == 1, 7 + static_cast<uint64_t>(c), kNew);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "client " << c << ": " << e.what();
        }
      });
    }
    for (auto& thread : threads) thread.join();
  };
  const remote::ServerLimits batching{.max_batch = 4, .batch_delay = std::chrono::milliseconds(20)};
  {
    Model target = bundled("target");
    VerifierServer alone(target, loopback(batching));
    clients(alone.port(), expected);
  }
  for (int c = 0; c < kClients; c += 2) {
    const Ids& guess = guesses[static_cast<size_t>(c)];
    EXPECT_EQ(expected[static_cast<size_t>(c)], Ids(guess.begin() + static_cast<std::ptrdiff_t>(prompts[static_cast<size_t>(c)].size()),
                                                    guess.begin() + static_cast<std::ptrdiff_t>(prompts[static_cast<size_t>(c)].size() + kNew)));
  }

  auto pair = std::make_shared<ThreadPair>();
  const SharedDecisions shared(*pair);
  Model target = bundled("target");
  Model follower_target = bundled("target");
  std::string follower_error = "(running)";
  std::thread follower([&] {
    ThreadPair::thread_rank() = 1;
    try {
      remote::follow_verifier(follower_target, pair);
      follower_error.clear();
    } catch (const std::exception& e) {
      follower_error = e.what();
    }
  });
  {
    remote::ServerOptions options = loopback(batching);
    options.group = pair;
    options.heartbeat = std::chrono::milliseconds(10);
    VerifierServer server(target, std::move(options));
    const int64_t before_idle = pair->rounds.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_GE(pair->rounds.load() - before_idle, 5) << "an idle rank 0 sends heartbeats";
    clients(server.port(), got);
    EXPECT_FALSE(server.failure().has_value());
    EXPECT_GT(server.stats().largest_batch, 1) << "batched rounds are replayed too";
  }  // shutdown: the follower returns
  follower.join();
  EXPECT_EQ(follower_error, "");
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(got[static_cast<size_t>(c)], expected[static_cast<size_t>(c)]) << "client " << c;
  EXPECT_GE(pair->decisions.load(), 10);  // one per forward: batched rows share one
  EXPECT_EQ(pair->differing_decisions.load(), 0) << "the follower decided otherwise than rank 0";
  EXPECT_EQ(pair->mismatched_shapes.load(), 0);
}

TEST(RemoteTensorParallel, ALostRankFailsTheCallsAndTheServer) {
  auto pair = std::make_shared<ThreadPair>();
  const SharedDecisions shared(*pair);
  Model target = bundled("target");
  Model follower_target = bundled("target");
  std::string follower_error;
  std::thread follower([&] {
    ThreadPair::thread_rank() = 1;
    try {
      remote::follow_verifier(follower_target, pair);
    } catch (const std::exception& e) {
      follower_error = e.what();
    }
  });
  remote::ServerOptions options = loopback();
  options.group = pair;
  VerifierServer server(target, std::move(options));
  RawClient raw(server.port());
  remote::wire::OpenReply opened;
  ASSERT_TRUE(raw.open(bytes("x = "), &opened).ok());
  pair->end_rank_1();
  follower.join();
  EXPECT_NE(follower_error.find("rank 1 is gone"), std::string::npos) << follower_error;
  remote::wire::VerifyRequest request;
  request.set_session(opened.session());
  request.set_secret(opened.secret());
  request.set_length(4);
  request.set_last_token(' ');
  expect_status(raw.verify(request), grpc::StatusCode::UNAVAILABLE, "tensor-parallel group has failed");
  ASSERT_TRUE(server.failure().has_value());
  EXPECT_NE(server.failure()->find("rank 1 is gone"), std::string::npos) << *server.failure();
  expect_status(raw.open(bytes("y = "), &opened), grpc::StatusCode::UNAVAILABLE, "rank 1 is gone");
}

TEST(RemoteTensorParallel, BadGroupsAreRefused) {
  auto pair = std::make_shared<ThreadPair>();
  Model target = bundled("target");
  remote::ServerOptions options = loopback();
  options.group = pair;
  EXPECT_NE(error_of([&] { return std::make_unique<VerifierServer<Model>>(target, options); }).find("no specdec::SharedDecisions"),
            std::string::npos);
  EXPECT_NE(error_of([&] { remote::follow_verifier(target, pair); }).find("follow_verifier: rank 0 serves"), std::string::npos);
  EXPECT_NE(error_of([&] { remote::follow_verifier(target, std::shared_ptr<Collectives>()); }).find("group must not be null"),
            std::string::npos);
  const SharedDecisions shared(*pair);
  options.heartbeat = std::chrono::milliseconds(0);
  EXPECT_NE(error_of([&] { return std::make_unique<VerifierServer<Model>>(target, options); })
                .find("ServerOptions::heartbeat must be >= 1 ms, got 0 ms"),
            std::string::npos);
  std::string message;
  std::thread rank_1([&] {
    ThreadPair::thread_rank() = 1;
    options.heartbeat = std::chrono::milliseconds(10);
    message = error_of([&] { return std::make_unique<VerifierServer<Model>>(target, options); });
  });
  rank_1.join();
  EXPECT_NE(message.find("this process is rank 1; rank 0 serves"), std::string::npos) << message;
}

}  // namespace

}  // namespace test_remote
