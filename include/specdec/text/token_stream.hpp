// A seeded synthetic token stream for n-gram benchmarks and tests: Zipf-distributed unigrams with a
// given share of the tokens in spans copied from earlier in the stream, as text repeats names,
// phrases and code. Plain C++ (no libtorch).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "specdec/detail/check.hpp"

namespace specdec::text {

struct TokenStreamOptions {
  int64_t tokens = 1'000'000;  // length of the stream (>= 1)
  int64_t vocab_size = 32000;  // tokens are in [0, vocab_size) (>= 1)
  double zipf_exponent = 1.1;  // fresh token t has weight 1 / (t + 1)^exponent (>= 0)
  double copied_share = 0.3;   // expected share of tokens inside copied spans, in [0, 1)
  int64_t min_span = 4;        // copied span lengths are uniform in [min_span, max_span] (>= 1)
  int64_t max_span = 60;
  uint64_t seed = 42;          // the stream is a function of the options
};

struct TokenStream {
  std::vector<int64_t> tokens{};
  int64_t copied = 0;  // tokens that lie in copied spans
};

// Alternates runs of fresh Zipf tokens (lengths uniform in [1, 2m - 1], with m chosen so that the
// expected copied share is options.copied_share) with a span copied from a uniformly chosen
// earlier position (token by token, so a span may overlap its own source).
inline TokenStream make_token_stream(const TokenStreamOptions& options) {
  if (options.tokens < 1) detail::throw_invalid("tokens", "be >= 1", options.tokens);
  if (options.vocab_size < 1) detail::throw_invalid("vocab_size", "be >= 1", options.vocab_size);
  if (!(options.zipf_exponent >= 0)) detail::throw_invalid("zipf_exponent", "be >= 0", options.zipf_exponent);
  if (!(options.copied_share >= 0 && options.copied_share < 1)) {
    detail::throw_invalid("copied_share", "be in [0, 1)", options.copied_share);
  }
  if (options.min_span < 1 || options.max_span < options.min_span) {
    detail::throw_invalid_message("spans must satisfy 1 <= min_span <= max_span, got ", options.min_span, " and ",
                                  options.max_span);
  }
  std::vector<double> weights(static_cast<size_t>(options.vocab_size));
  for (size_t t = 0; t < weights.size(); ++t) weights[t] = 1.0 / std::pow(static_cast<double>(t + 1), options.zipf_exponent);
  std::discrete_distribution<int64_t> zipf(weights.begin(), weights.end());
  std::uniform_int_distribution<int64_t> span(options.min_span, options.max_span);
  const double mean_span = 0.5 * static_cast<double>(options.min_span + options.max_span);
  const double mean_fresh = mean_span * (1 - options.copied_share) / std::max(options.copied_share, 1e-9);
  std::uniform_int_distribution<int64_t> fresh(1, std::max<int64_t>(1, std::llround(2 * mean_fresh) - 1));
  std::mt19937_64 rng(options.seed);

  TokenStream stream;
  auto& tokens = stream.tokens;
  tokens.reserve(static_cast<size_t>(options.tokens));
  const auto size = static_cast<size_t>(options.tokens);
  while (tokens.size() < size) {
    for (int64_t i = fresh(rng); i > 0 && tokens.size() < size; --i) tokens.push_back(zipf(rng));
    if (options.copied_share == 0) continue;
    const auto length = static_cast<size_t>(span(rng));
    if (tokens.size() < length) continue;
    size_t source = std::uniform_int_distribution<size_t>(0, tokens.size() - length)(rng);
    for (size_t i = 0; i < length && tokens.size() < size; ++i, ++stream.copied) tokens.push_back(tokens[source++]);
  }
  return stream;
}

}  // namespace specdec::text
