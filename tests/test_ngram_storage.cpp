// N-gram storages and n-gram assisted generation: storage semantics, persistence, merging,
// prompt lookup, greedy equality with autoregressive decoding and exact sampled distributions.
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <map>
#include <random>

#include "specdec/generate.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

using namespace specdec;
using Tokens = std::vector<int64_t>;

TEST(NGramStorage, BacksOffFromTheLongestKnownContext) {
  NGramStorage storage(3, 10);
  storage.initialize(Tokens{1, 2, 3, 4, 2, 5});
  EXPECT_EQ(storage.next_token(Tokens{1, 2}), 3);   // (1, 2) -> 3
  EXPECT_EQ(storage.next_token(Tokens{4, 2}), 5);   // (4, 2) -> 5
  EXPECT_EQ(storage.next_token(Tokens{9, 2}), 3);   // unknown (9, 2): back off to (2) -> 3 first
  EXPECT_EQ(storage.next_token(Tokens{3}), 4);
  EXPECT_EQ(storage.next_token(Tokens{9}), std::nullopt);
  EXPECT_EQ(storage.next_token(Tokens{}), std::nullopt);
}

TEST(OneLevelNGramStorage, UsesOnlyTheFullContext) {
  OneLevelNGramStorage storage(3, 10);
  storage.initialize(Tokens{1, 2, 3, 4, 2, 5});
  EXPECT_EQ(storage.next_token(Tokens{1, 2}), 3);
  EXPECT_EQ(storage.next_token(Tokens{9, 2}), std::nullopt);
  EXPECT_EQ(storage.next_token(Tokens{2}), std::nullopt);
  storage.update(Tokens{7}, Tokens{8});  // shorter than the context: nothing to learn
  EXPECT_EQ(storage.size(), 4u);
}

TEST(NGramStorage, FirstTokenToReachTheTopCountKeepsTheLead) {
  NGramStorage storage(2, 10);
  storage.update(Tokens{1}, Tokens{4});
  storage.update(Tokens{1}, Tokens{6});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);  // tie 1:1, 4 came first
  storage.update(Tokens{1}, Tokens{6, 6});      // several next tokens: 6 now 3:1
  EXPECT_EQ(storage.next_token(Tokens{1}), 6);
  storage.update(Tokens{1}, Tokens{4, 4});      // 3:3 tie: 6 keeps the lead
  EXPECT_EQ(storage.next_token(Tokens{1}), 6);
  storage.update(Tokens{1}, Tokens{4});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);
  storage.clear();
  EXPECT_EQ(storage.size(), 0u);
  EXPECT_EQ(storage.next_token(Tokens{1}), std::nullopt);
}

TEST(NGramStorage, RejectsBadArgumentsNamingThem) {
  EXPECT_THROW(NGramStorage(1, 10), std::invalid_argument);
  EXPECT_THROW(NGramStorage(9, 32000), std::invalid_argument);  // 9 x 15 bits do not fit a key
  EXPECT_NO_THROW(NGramStorage(8, 32000));
  NGramStorage storage(3, 10);
  try {
    storage.update(Tokens{1, 10}, Tokens{2});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tokens (last n - 1)[1] must be in [0, vocab_size = 10), got 10"), std::string::npos) << e.what();
  }
  EXPECT_THROW(storage.initialize(Tokens{-1}), std::invalid_argument);
  EXPECT_THROW(PromptLookupDrafter(2, 3), std::invalid_argument);
}

Tokens random_tokens(size_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tokens tokens(count);
  for (auto& t : tokens) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  return tokens;
}

template <class S>
void expect_same_predictions(const S& a, const S& b, const Tokens& probe) {
  EXPECT_EQ(a.size(), b.size());
  for (size_t end = 0; end <= probe.size(); ++end) {
    EXPECT_EQ(a.next_token(std::span(probe).first(end)), b.next_token(std::span(probe).first(end))) << end;
  }
}

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("specdec_" + name + "_" + std::to_string(std::random_device{}()));
}

// Bytes the allocator reports in use (glibc's own accounting: small blocks and mapped ones), or 0
// where it keeps none (another C library, or a sanitizer's allocator).
size_t allocated_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
#else
  return 0;
#endif
}

// memory_bytes() against the allocator's own accounting of what building the storage took.
template <class Build>
void expect_memory_bytes_exact(Build build) {
  const size_t before = allocated_bytes();
  const auto storage = build();
  const size_t after = allocated_bytes();
  if (before == 0 || after <= before) GTEST_SKIP() << "this allocator keeps no accounting (mallinfo2)";
  const auto held = static_cast<double>(after - before);
  const auto reported = static_cast<double>(storage.memory_bytes());
  std::cout << "memory_bytes " << reported << ", allocator " << held << " bytes\n";
  // The tables are a few large blocks; the storage object and chunk headers add a few hundred bytes.
  EXPECT_NEAR(reported, held, 0.002 * held + 4096);
}

TEST(NGramStorage, MemoryBytesEqualsTheAllocatorsAccounting) {
  const Tokens text = random_tokens(200000, 32000, 9);
  expect_memory_bytes_exact([&] {
    NGramStorage storage(4, 32000);
    storage.initialize(text);
    return storage;
  });
}

TEST(ProbabilisticNGramStorage, MemoryBytesEqualsTheAllocatorsAccounting) {
  expect_memory_bytes_exact([&] {
    ProbabilisticNGramStorage memory(1000, 3);
    std::mt19937 rng(3);
    for (int i = 0; i < 20000; ++i) {
      const std::vector<int64_t> context{static_cast<int64_t>(rng() % 1000), static_cast<int64_t>(rng() % 1000)};
      memory.update(context, std::vector<int64_t>{static_cast<int64_t>(rng() % 1000)}, std::vector<float>{1.0F});
    }
    return memory;
  });
}

TEST(NGramStorage, SaveAndLoadRoundTrip) {
  const Tokens text = random_tokens(3000, 50, 1);
  NGramStorage storage(4, 50);
  storage.initialize(text);
  storage.update(Tokens{1, 2, 3}, Tokens{4, 4, 9});
  const auto path = temp_file("ngram");
  storage.save(path);
  const NGramStorage loaded = NGramStorage::load(path);
  expect_same_predictions(storage, loaded, random_tokens(400, 50, 2));
  OneLevelNGramStorage one(3, 50);
  one.initialize(text);
  one.save(path);
  expect_same_predictions(one, OneLevelNGramStorage::load(path), random_tokens(400, 50, 3));
  EXPECT_THROW((void)NGramStorage::load(path), io::FormatError);  // a one-level file
  std::filesystem::remove(path);
}

TEST(NGramStorage, RejectsCorruptFiles) {
  NGramStorage storage(3, 20);
  storage.initialize(random_tokens(200, 20, 4));
  const auto path = temp_file("ngram_corrupt");
  storage.save(path);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  in.close();
  const auto expect_error = [&](const std::string& content, const std::string& problem) {
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(content.data(), static_cast<std::streamsize>(content.size()));
    try {
      (void)NGramStorage::load(path);
      FAIL() << "loaded a corrupt file: " << problem;
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
    }
  };
  // Any change to a saved file fails its checksum: every single byte changed in turn.
  expect_error(bytes.substr(0, bytes.size() - 5), "no checksum trailer");
  expect_error(bytes + "x", "no checksum trailer");
  for (size_t i = 8 + 4; i < bytes.size() - 16; ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    expect_error(flipped, "checksum mismatch");
  }
  // Version 1 files (before checksums) still load; their parser checks every entry.
  std::string version1 = bytes.substr(0, bytes.size() - 16);
  version1[8] = 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(version1.data(), static_cast<std::streamsize>(version1.size()));
  expect_same_predictions(storage, NGramStorage::load(path), random_tokens(200, 20, 5));
  expect_error(version1.substr(0, version1.size() - 5), "truncated or oversized");
  expect_error(version1 + "x", "truncated or oversized");
  expect_error("XX" + version1.substr(2), "bad magic");
  std::string wrong_token = version1;
  wrong_token[48] = static_cast<char>(0xff);  // the first n-gram's first token becomes >= 20
  expect_error(wrong_token, "invalid");
  expect_error(version1.substr(0, 10), "truncated");
  std::filesystem::remove(path);
}

TEST(NGramStorage, MergeEqualsLearningBothSequences) {
  // Two texts whose n-grams do not tie across them: merging equals learning one after the other.
  const Tokens first{1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 6};
  const Tokens second{7, 8, 9, 7, 8, 9, 2, 3, 1, 2, 3};
  NGramStorage a(3, 10), b(3, 10), both(3, 10);
  a.initialize(first);
  b.initialize(second);
  both.initialize(first);
  both.initialize(second);
  a.merge(b);
  expect_same_predictions(a, both, Tokens{1, 2, 3, 7, 8, 9, 2, 3, 1, 4, 5, 6, 8});
  // A tie keeps this storage's leader.
  NGramStorage x(2, 10), y(2, 10);
  x.update(Tokens{1}, Tokens{5});
  y.update(Tokens{1}, Tokens{6});
  x.merge(y);
  EXPECT_EQ(x.next_token(Tokens{1}), 5);
  y.update(Tokens{1}, Tokens{6});
  x.merge(y);  // 6 now leads 3:1
  EXPECT_EQ(x.next_token(Tokens{1}), 6);
  EXPECT_THROW(x.merge(NGramStorage(3, 10)), std::invalid_argument);
}

TEST(PromptLookupDrafter, ProposesWhatFollowedTheLatestMatch) {
  const PromptLookupDrafter lookup(3, 1);
  EXPECT_EQ(lookup.next_token(Tokens{5, 6, 7, 1, 5, 6}), 7);          // (5, 6) -> 7
  EXPECT_EQ(lookup.next_token(Tokens{1, 2, 9, 3, 2, 8, 4, 2}), 8);    // latest (2) -> 8
  EXPECT_EQ(lookup.next_token(Tokens{1, 2, 3, 4}), std::nullopt);
  EXPECT_EQ(lookup.next_token(Tokens{}), std::nullopt);
  EXPECT_EQ(PromptLookupDrafter(3, 2).next_token(Tokens{1, 2, 9, 3, 2}), std::nullopt);
}

// A target that follows a pattern most of the time: a Markov chain whose successor of t is
// (t + 1) mod V with probability 0.7, the rest spread evenly.
at::Tensor pattern_chain(int64_t vocab) {
  at::Tensor t = at::full({vocab, vocab}, 0.3 / static_cast<double>(vocab - 1), at::kDouble);
  for (int64_t i = 0; i < vocab; ++i) t[i][(i + 1) % vocab] = 0.7;
  return t;
}

// A pattern target whose greedy continuation is not a single cycle: a prefix-hash model mixed in.
TEST(NGramAssistedGenerate, GreedyEqualsAutoregressive) {
  test::PrefixHashModel target(12, 5);
  const Tokens prompt{1, 2, 3, 4, 1, 2, 3, 4, 5};
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 60});
  int64_t accepted = 0, drafted = 0;
  for (int64_t gamma = 1; gamma <= 8; ++gamma) {
    for (bool stop_if_unknown : {false, true}) {
      for (int64_t filler : {1, 3}) {
        NGramStorage storage(3, 12);
        const NGramAssistedOptions options{.max_new_tokens = 60, .gamma = gamma, .filler_top_k = filler,
                                           .stop_if_unknown = stop_if_unknown, .first_target = gamma % 2 == 0};
        const auto result = ngram_assisted_generate(storage, target, prompt, options);
        EXPECT_EQ(result.tokens, reference.tokens) << gamma << " " << stop_if_unknown << " " << filler;
        accepted += result.stats.accepted;
        drafted += result.stats.drafted;
        PromptLookupDrafter lookup;
        EXPECT_EQ(ngram_assisted_generate(lookup, target, prompt, options).tokens, reference.tokens);
        OneLevelNGramStorage one(2, 12);
        EXPECT_EQ(ngram_assisted_generate(one, target, prompt, options).tokens, reference.tokens);
      }
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

TEST(NGramAssistedGenerate, LearnsRepeatedTextAndCutsTargetCalls) {
  test::MarkovModel target(pattern_chain(8));
  NGramStorage storage(3, 8);
  const auto result = ngram_assisted_generate(storage, target, Tokens{0, 1, 2, 3}, {.max_new_tokens = 64, .gamma = 6});
  EXPECT_GT(result.stats.acceptance_rate(), 0.6);
  EXPECT_GT(result.stats.tokens_per_target_call(), 3.0);
  EXPECT_GT(storage.size(), 0u);
}

TEST(NGramAssistedGenerate, RejectsBadInput) {
  test::MarkovModel target(pattern_chain(8));
  NGramStorage storage(3, 8);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{1}, {.gamma = 0}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{1}, {.filler_top_k = 0}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{9}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{}), std::invalid_argument);
}

// Sequences of 3 tokens after prompt {0} with a fresh storage that learned `history`.
const at::Tensor& noisy_chain() {
  static const at::Tensor t = [] {
    std::vector<at::Tensor> rows;
    for (const auto& row : std::vector<std::vector<double>>{{.1, .5, .2, .2}, {.15, .15, .5, .2}, {.2, .2, .1, .5}, {.5, .2, .2, .1}}) {
      rows.push_back(at::tensor(row, at::kDouble));
    }
    return at::stack(rows);
  }();
  return t;
}

// The seed's verifier, deliberately biased: sample x from p; keep the draft when x equals it,
// otherwise sample a fresh token from p. P(draft) becomes p(2 - p).
template <class P>
Tokens biased_generate(test::MarkovModel& target, NGramStorage& storage, const Tokens& prompt, const P& processor,
                       at::Generator& gen) {
  Tokens sequence = prompt;
  storage.initialize(prompt);
  const at::Tensor probs = processor(target.logits());
  while (sequence.size() < prompt.size() + 3) {
    const auto draft = storage.next_token(sequence).value_or(sequence.back());
    const at::Tensor row = probs[sequence.back()].unsqueeze(0);
    int64_t x = processor.sample(row, gen).template item<int64_t>();
    if (x != draft) x = processor.sample(row, gen).template item<int64_t>();
    storage.update(sequence, Tokens{x});
    sequence.push_back(x);
  }
  return Tokens(sequence.begin() + static_cast<long>(prompt.size()), sequence.end());
}

template <class P>
test::ChiSquare fit(const P& processor, bool biased, int64_t samples) {
  test::MarkovModel target(noisy_chain());
  const Tokens prompt{0, 1, 2, 3, 0};
  std::map<Tokens, int64_t> observed;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (int64_t i = 0; i < samples; ++i) {
    NGramStorage storage(3, 4);
    const Tokens tokens = biased ? biased_generate(target, storage, prompt, processor, gen)
                                 : ngram_assisted_generate(storage, target, prompt,
                                                           {.max_new_tokens = 3, .seed = static_cast<uint64_t>(i),
                                                            .gamma = 3, .first_target = false},
                                                           processor).tokens;
    ++observed[tokens];
  }
  const at::Tensor step = processor(target.logits()).to(at::kDouble);
  std::map<Tokens, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t c = 0; c < 4; ++c) expected[{a, b, c}] = (step[0][a] * step[a][b] * step[b][c]).template item<double>();
    }
  }
  return test::chi_square(observed, expected, samples);
}

template <class P>
void expect_exact_and_detectable(const P& processor) {
  const auto exact = fit(processor, false, 8000);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75)) << processor;
  const auto biased = fit(processor, true, 8000);
  EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, 4.75)) << processor;
}

TEST(NGramAssistedDistribution, MultinomialEqualsTarget) { expect_exact_and_detectable(MultinomialProcessor{1.0}); }
TEST(NGramAssistedDistribution, TopKEqualsTarget) { expect_exact_and_detectable(TopKProcessor{3}); }

}  // namespace
