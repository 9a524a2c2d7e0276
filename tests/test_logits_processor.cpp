// Logits processors: golden values on hand-made distributions, invariants across policies,
// sampling statistics and parameter validation.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>

#include "specdec/logits_processor.hpp"
#include "support/statistics.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_logits_processor {

namespace {

using namespace specdec;

at::Tensor log_of(std::vector<double> probs) {
  return at::tensor(probs, at::kDouble).log().to(at::kFloat);
}

void expect_probs(const at::Tensor& actual, std::vector<double> expected) {
  ASSERT_EQ(actual.numel(), static_cast<int64_t>(expected.size()));
  const at::Tensor flat = actual.to(at::kDouble).flatten();
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(flat[static_cast<int64_t>(i)].item<double>(), expected[i], 1e-6) << "index " << i;
  }
}

TEST(GreedyProcessor, OneHotAtFirstArgmax) {
  expect_probs(GreedyProcessor{}(at::tensor({1.0f, 3.0f, 3.0f, 2.0f})), {0, 1, 0, 0});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_EQ(GreedyProcessor{}.sample(at::tensor({0.1f, 0.7f, 0.2f}), gen).item<int64_t>(), 1);
}

TEST(MultinomialProcessor, TemperatureScalesLogits) {
  // logits log(1, 4, 16) at temperature 2 are log(1, 2, 4).
  expect_probs(MultinomialProcessor{2.0}(log_of({1, 4, 16})), {1.0 / 7, 2.0 / 7, 4.0 / 7});
  expect_probs(MultinomialProcessor{1.0}(log_of({0.2, 0.3, 0.5})), {0.2, 0.3, 0.5});
}

TEST(TopKProcessor, KeepsKLargest) {
  const double e3 = std::exp(3.0), e2 = std::exp(2.0);
  expect_probs(TopKProcessor{2}(at::tensor({1.0f, 3.0f, 2.0f, 0.0f})),
               {0, e3 / (e3 + e2), e2 / (e3 + e2), 0});
  expect_probs(TopKProcessor{10}(log_of({0.2, 0.3, 0.5})), {0.2, 0.3, 0.5});
}

TEST(NucleusProcessor, KeepsSmallestSetReachingTopP) {
  const auto logits = log_of({0.5, 0.3, 0.15, 0.05});
  expect_probs(NucleusProcessor{0.6}(logits), {0.625, 0.375, 0, 0});
  expect_probs(NucleusProcessor{0.45}(logits), {1, 0, 0, 0});
  expect_probs(NucleusProcessor{0.85}(logits), {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0});
  expect_probs(NucleusProcessor{1.0}(logits), {0.5, 0.3, 0.15, 0.05});
}

TEST(NucleusProcessor, AppliesTemperatureBeforeFiltering) {
  // At temperature 0.5 the top token holds 0.25 / 0.365 = 0.685 of the mass: the 0.6 nucleus is
  // that token alone. Filtering first would have kept two tokens.
  expect_probs(NucleusProcessor(0.6, 0.5)(log_of({0.5, 0.3, 0.15, 0.05})), {1, 0, 0, 0});
}

TEST(TopKNucleusProcessor, TopKThenNucleusOfTheRest) {
  // top-3 of (0.4, 0.3, 0.2, 0.1) renormalised is (4, 3, 2) / 9; its 0.7 nucleus is 4/9 + 3/9.
  expect_probs(TopKNucleusProcessor(3, 0.7)(log_of({0.4, 0.3, 0.2, 0.1})), {4.0 / 7, 3.0 / 7, 0, 0});
}

TEST(LogitsProcessor, PrintsParameters) {
  std::ostringstream out;
  out << GreedyProcessor{} << ' ' << MultinomialProcessor{0.5} << ' ' << TopKProcessor(3, 0.7) << ' '
      << NucleusProcessor(0.9) << ' ' << TopKNucleusProcessor(5, 0.8, 1.5);
  EXPECT_EQ(out.str(),
            "GreedyProcessor{} MultinomialProcessor{temperature=0.5} TopKProcessor{k=3, "
            "temperature=0.7} NucleusProcessor{top_p=0.9, temperature=1} "
            "TopKNucleusProcessor{k=5, top_p=0.8, temperature=1.5}");
}

template <class P>
P make_processor();
template <>
GreedyProcessor make_processor() { return {}; }
template <>
MultinomialProcessor make_processor() { return MultinomialProcessor{0.8}; }
template <>
TopKProcessor make_processor() { return TopKProcessor{3, 1.2}; }
template <>
NucleusProcessor make_processor() { return NucleusProcessor{0.7}; }
template <>
TopKNucleusProcessor make_processor() { return TopKNucleusProcessor{4, 0.9}; }

template <class P>
class EveryProcessor : public ::testing::Test {};
using Processors = ::testing::Types<GreedyProcessor, MultinomialProcessor, TopKProcessor,
                                    NucleusProcessor, TopKNucleusProcessor>;
TYPED_TEST_SUITE(EveryProcessor, Processors);

TYPED_TEST(EveryProcessor, NeverModifiesInputAndKeepsLeadingShape) {
  const TypeParam processor = make_processor<TypeParam>();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor logits = at::randn({2, 3, 11}, gen);
  const at::Tensor original = logits.clone();
  const at::Tensor probs = processor(logits);
  EXPECT_TRUE(at::equal(logits, original));
  ASSERT_EQ(probs.sizes(), logits.sizes());
  EXPECT_TRUE(at::allclose(probs.sum(-1), at::ones({2, 3})));
  EXPECT_GE(probs.min().template item<float>(), 0.0f);
  const at::Tensor samples = processor.sample(probs, gen);
  EXPECT_EQ(samples.sizes(), (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(samples.scalar_type(), at::kLong);
  // Every sample has positive probability.
  EXPECT_TRUE(probs.gather(-1, samples).gt(0).all().template item<bool>());
}

TYPED_TEST(EveryProcessor, SameSeedSameSamples) {
  const TypeParam processor = make_processor<TypeParam>();
  const at::Tensor probs = processor(at::randn({64, 20}));
  at::Generator first = at::make_generator<at::CPUGeneratorImpl>(42);
  at::Generator second = at::make_generator<at::CPUGeneratorImpl>(42);
  EXPECT_TRUE(at::equal(processor.sample(probs, first), processor.sample(probs, second)));
}

TYPED_TEST(EveryProcessor, KeepsDoublePrecisionAndPromotesHalf) {
  const TypeParam processor = make_processor<TypeParam>();
  EXPECT_EQ(processor(at::randn({5}, at::kDouble)).scalar_type(), at::kDouble);
  EXPECT_EQ(processor(at::randn({5}).to(at::kBFloat16)).scalar_type(), at::kFloat);
}

TYPED_TEST(EveryProcessor, RejectsLogitsThatAreNotAVocabularyDimension) {
  const TypeParam processor = make_processor<TypeParam>();
  EXPECT_THROW((void)processor(at::scalar_tensor(1.0)), std::invalid_argument);
  EXPECT_THROW((void)processor(at::ones({3}, at::kLong)), std::invalid_argument);
  EXPECT_THROW((void)processor(at::Tensor()), std::invalid_argument);
}

TEST(SampleCategorical, MatchesTheDistribution) {
  const at::Tensor probs = at::tensor({0.1, 0.0, 0.25, 0.4, 0.25}, at::kDouble);
  const int64_t samples = 20000;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor drawn =
      MultinomialProcessor{}.sample(probs.expand({samples, 5}).contiguous(), gen).flatten();
  std::map<int64_t, int64_t> observed;
  const auto* data = drawn.data_ptr<int64_t>();
  for (int64_t i = 0; i < samples; ++i) ++observed[data[i]];
  const std::map<int64_t, double> expected{{0, 0.1}, {1, 0.0}, {2, 0.25}, {3, 0.4}, {4, 0.25}};
  const auto fit = test::chi_square(observed, expected, samples);
  EXPECT_EQ(fit.outside_support, 0);
  EXPECT_LT(fit.statistic, test::chi_square_quantile(fit.dof, 4.75));
}

template <class F>
void expect_invalid(F make, const std::string& parameter, const std::string& value) {
  try {
    make();
    FAIL() << "no exception for " << parameter << " = " << value;
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(parameter), std::string::npos) << message;
    EXPECT_NE(message.find(value), std::string::npos) << message;
  }
}

TEST(LogitsProcessor, RejectsInvalidParametersNamingThem) {
  expect_invalid([] { MultinomialProcessor{0.0}; }, "temperature", "0");
  expect_invalid([] { MultinomialProcessor{-1.0}; }, "temperature", "-1");
  expect_invalid([] { MultinomialProcessor{std::nan("")}; }, "temperature", "nan");
  expect_invalid([] { MultinomialProcessor{INFINITY}; }, "temperature", "inf");
  expect_invalid([] { TopKProcessor{0}; }, "k", "0");
  expect_invalid([] { TopKProcessor(2, -0.5); }, "temperature", "-0.5");
  expect_invalid([] { NucleusProcessor{0.0}; }, "top_p", "0");
  expect_invalid([] { NucleusProcessor{1.5}; }, "top_p", "1.5");
  expect_invalid([] { TopKNucleusProcessor(-3, 0.5); }, "k", "-3");
  expect_invalid([] { TopKNucleusProcessor(3, 2.0); }, "top_p", "2");
}

}  // namespace

}  // namespace test_logits_processor
