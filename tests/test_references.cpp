// specdec against the Python reference implementations: Hugging Face transformers for the model
// families and assisted generation, Hugging Face tokenizers (the Rust library) for tokenizer.json.
//
// The references are made by tests/reference/hf_models.py and hf_tokenizers.py (CTest runs them
// first, with the pinned packages of scripts/python-requirements.txt) into the folder named by
// SPECDEC_REFERENCE_DIR. Without it the tests skip with the reason, except in CI (CI=true), where
// a skip would hide a broken check and they fail instead.
#include <gtest/gtest.h>

#include <specdec/generate.hpp>
#include <specdec/io/eagle.hpp>
#include <specdec/io/hf_llama.hpp>
#include <specdec/io/hf_tokenizer.hpp>
#include <specdec/drafting/parallel.hpp>
#include <specdec/io/medusa.hpp>
#include <specdec/io/parallel_drafter.hpp>
#include <specdec/io/safetensors.hpp>
#include <specdec/models/llama.hpp>

#include "support/shared_files.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
using specdec::DynamicKVCache;
using specdec::StaticKVCache;
using specdec::models::LlamaModel;

using specdec::test::in_ci;
using specdec::test::tokenizers_dir;

// The folder of the references, or "" where none was made.
fs::path reference_dir() {
  const char* dir = std::getenv("SPECDEC_REFERENCE_DIR");
  return dir != nullptr && *dir != '\0' ? fs::path(dir) : fs::path();
}

// Skips (fails in CI) when `path` does not exist, saying why.
#define SPECDEC_REQUIRE_REFERENCE(path)                                                                     \
  do {                                                                                                      \
    if (reference_dir().empty() || !fs::exists(path)) {                                                     \
      const std::string reason = "no Python reference at '" + (path).string() +                             \
                                 "': configure with -DSPECDEC_PYTHON=<python with the packages of "         \
                                 "scripts/python-requirements.txt> (scripts/install-torch2.sh) and run "    \
                                 "through ctest";                                                           \
      if (in_ci()) FAIL() << reason << " (a skip is a failure in CI)";                                      \
      GTEST_SKIP() << reason;                                                                               \
    }                                                                                                       \
  } while (false)

Ids to_ids(const at::Tensor& t) {
  const at::Tensor flat = t.to(at::kLong).contiguous().view({-1});
  return Ids(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
}

// ---- transformers: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM ---------------------

struct Reference {
  fs::path folder;
  std::map<std::string, at::Tensor> tensors;
  std::string drafter;  // the folder of the model that drafted transformers' assisted generation
};

Reference read_reference(const std::string& name) {
  Reference r{reference_dir() / "models" / name, {}, {}};
  r.tensors = specdec::io::load_safetensors(r.folder / "reference.safetensors").tensors;
  std::ifstream in(r.folder / "reference.json");
  const nlohmann::json info = nlohmann::json::parse(in);
  r.drafter = info.at("drafter").get<std::string>();
  return r;
}

template <class Cache>
LlamaModel<Cache> load_model(const fs::path& folder) {
  auto checkpoint = specdec::io::load_hf_llama(folder);
  return LlamaModel<Cache>(checkpoint.config, std::move(checkpoint.weights));
}

// The largest absolute difference, and where, for a failure message.
std::string worst(const at::Tensor& got, const at::Tensor& expected) {
  const at::Tensor difference = (got.to(at::kDouble) - expected.to(at::kDouble)).abs();
  const int64_t at_index = difference.argmax().item<int64_t>();
  std::ostringstream text;
  text << "largest difference " << difference.max().item<double>() << " at row " << at_index / expected.size(1)
       << ", token " << at_index % expected.size(1);
  return text.str();
}

constexpr double kLogitTolerance = 1e-4;

// Each case's references, read once the folder is known to exist (SetUp skips, or fails in CI,
// where it does not; the test body then does not run).
class HfModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SPECDEC_REQUIRE_REFERENCE(reference_dir() / "models" / GetParam());
    r = read_reference(GetParam());
  }
  Reference r;
};

// The whole sequence in one forward, through both forwards of the reference model (the CPU loops
// and the ATen operations), with both caches.
TEST_P(HfModel, LogitsEqualTransformersOverTheWholeSequence) {
  const at::Tensor& ids = r.tensors.at("input_ids");
  const at::Tensor& expected = r.tensors.at("logits");
  for (const bool loops : {true, false}) {
    SCOPED_TRACE(loops ? "CPU loops" : "ATen forward");
    auto model = load_model<StaticKVCache>(r.folder);
    model.use_cpu_kernels(loops);
    auto cache = model.make_cache(1);
    const at::Tensor logits = model.forward(ids, cache)[0];
    ASSERT_EQ(logits.sizes(), expected.sizes());
    EXPECT_TRUE(at::allclose(logits, expected, 0.0, kLogitTolerance)) << worst(logits, expected);
  }
  auto dynamic = load_model<DynamicKVCache>(r.folder);
  auto cache = dynamic.make_cache(1);
  const at::Tensor logits = dynamic.forward(ids, cache)[0];
  EXPECT_TRUE(at::allclose(logits, expected, 0.0, kLogitTolerance)) << worst(logits, expected);
}

// FeatureTarget: every hidden state transformers returns with output_hidden_states (the input of
// each layer, the embeddings first, then the final normalised state), through both forwards.
TEST_P(HfModel, HiddenStatesEqualTransformers) {
  const at::Tensor& ids = r.tensors.at("input_ids");
  const at::Tensor& expected = r.tensors.at("hidden_states");  // [L + 1, S, H]
  for (const bool loops : {true, false}) {
    SCOPED_TRACE(loops ? "CPU loops" : "ATen forward");
    auto model = load_model<StaticKVCache>(r.folder);
    model.use_cpu_kernels(loops);
    const int64_t layers = model.num_hidden_layers(), dim = model.hidden_size();
    ASSERT_EQ(expected.size(0), layers + 1);
    std::vector<int64_t> taps(static_cast<size_t>(layers + 1));
    for (int64_t i = 0; i <= layers; ++i) taps[static_cast<size_t>(i)] = i;
    auto cache = model.make_cache(1);
    const at::Tensor features = model.forward_features(ids, cache, taps).features[0];  // [S, (L + 1) H]
    for (int64_t i = 0; i <= layers; ++i) {
      const at::Tensor got = features.narrow(-1, i * dim, dim);
      EXPECT_TRUE(at::allclose(got, expected[i], 0.0, kLogitTolerance)) << "hidden state " << i << ": " << worst(got, expected[i]);
    }
  }
}

// Medusa heads loaded from the published layout (io/medusa.hpp) against the Medusa project's
// module definitions (tests/reference/medusa_heads.py): every head's logits at random hidden
// states within 1e-4 and the same greedy drafts, for heads named bare and with the prefix.
class MedusaReference : public ::testing::TestWithParam<std::string> {};

TEST_P(MedusaReference, LogitsAndGreedyDraftsEqualThePublishedHeads) {
  const fs::path folder = reference_dir() / "medusa" / GetParam();
  SPECDEC_REQUIRE_REFERENCE(folder);
  const auto reference = specdec::io::load_safetensors(folder / "reference.safetensors").tensors;
  const at::Tensor& hidden = reference.at("hidden");  // [N, H]
  const at::Tensor& logits = reference.at("logits");  // [N, K, V]
  const specdec::models::MedusaHeads heads = specdec::io::load_medusa(folder, hidden.size(1), logits.size(2));
  ASSERT_EQ(heads.config().num_heads, logits.size(1));
  for (int64_t n = 0; n < hidden.size(0); ++n) {
    const at::Tensor got = heads.logits(hidden[n], heads.config().num_heads);
    EXPECT_TRUE(at::allclose(got, logits[n], 0.0, kLogitTolerance)) << "row " << n << ": " << worst(got, logits[n]);
    EXPECT_TRUE(at::equal(got.argmax(-1), logits[n].argmax(-1))) << "row " << n;
  }
}
INSTANTIATE_TEST_SUITE_P(Medusa, MedusaReference, ::testing::Values("plain", "prefixed"));

// EAGLE heads loaded from their published layouts (io/eagle.hpp) against the published module
// definitions rebuilt from transformers' Llama layers (tests/reference/eagle_heads.py): the
// layer's outputs and the head's logits over a sequence of random target hidden states within
// 1e-4, and the same greedy drafts continuing it, each draft position reading the layer's own
// output. Cases: the EAGLE project's EAGLE-3 layout, vLLM's speculators layout, EAGLE-1.
class EagleReference : public ::testing::TestWithParam<std::string> {};

TEST_P(EagleReference, LogitsAndGreedyDraftsEqualThePublishedHeads) {
  const fs::path folder = reference_dir() / "eagle" / GetParam();
  SPECDEC_REQUIRE_REFERENCE(folder);
  const auto reference = specdec::io::load_safetensors(folder / "reference.safetensors").tensors;
  const at::Tensor sizes = reference.at("target");
  const specdec::io::EagleTarget target{.hidden_size = sizes[0].item<int64_t>(),
                                        .vocab_size = sizes[1].item<int64_t>(),
                                        .num_layers = sizes[2].item<int64_t>(),
                                        .embedding = reference.at("embedding"),
                                        .classifier = reference.at("classifier")};
  const specdec::models::EagleHead head = specdec::io::load_eagle(folder, target);
  specdec::models::EagleCache cache;
  const at::Tensor outputs = head.forward(reference.at("ids"), head.fuse(reference.at("features")), cache);
  EXPECT_TRUE(at::allclose(outputs, reference.at("outputs"), 0.0, kLogitTolerance)) << worst(outputs, reference.at("outputs"));
  const at::Tensor logits = head.logits(outputs);
  EXPECT_TRUE(at::allclose(logits, reference.at("logits"), 0.0, kLogitTolerance)) << worst(logits, reference.at("logits"));
  const Ids expected = to_ids(reference.at("drafts"));
  Ids drafts;
  at::Tensor last = outputs.narrow(0, outputs.size(0) - 1, 1);
  for (size_t i = 0; i < expected.size(); ++i) {
    if (i > 0) last = head.forward(at::tensor({drafts.back()}, at::kLong), last, cache);
    drafts.push_back(head.to_target(head.logits(last).argmax(-1)).item<int64_t>());
  }
  EXPECT_EQ(drafts, expected);
  if (GetParam() == "speculators") {
    EXPECT_EQ(head.config().feature_layers, (std::vector<int64_t>{1, 3, 5}));
    EXPECT_TRUE(head.config().norm_before_residual);
  }
}
INSTANTIATE_TEST_SUITE_P(Eagle, EagleReference, ::testing::Values("eagle3", "speculators", "eagle1"));

// Parallel drafters loaded from the published PARD layout (io/parallel_drafter.hpp) against
// transformers running the same random checkpoint through PARD's procedure
// (tests/reference/pard_drafters.py): the logits at the context's last token and at each mask
// within 1e-4, through both forwards, and ParallelDraftSource's greedy drafts from one forward.
class ParallelDrafterReference : public ::testing::TestWithParam<std::string> {};

TEST_P(ParallelDrafterReference, MaskLogitsAndDraftsEqualTransformersRunningPard) {
  const fs::path folder = reference_dir() / "pard" / GetParam();
  SPECDEC_REQUIRE_REFERENCE(folder);
  const auto reference = specdec::io::load_safetensors(folder / "reference.safetensors").tensors;
  const at::Tensor& ids = reference.at("input_ids");  // [1, P + K - 1]
  const at::Tensor& expected = reference.at("logits");  // [K, V]
  const int64_t k = expected.size(0);
  auto checkpoint = specdec::io::load_parallel_drafter(folder);
  EXPECT_EQ(checkpoint.mask_token, ids[0][ids.size(1) - 1].item<int64_t>());
  for (const bool loops : {true, false}) {
    SCOPED_TRACE(loops ? "CPU loops" : "ATen forward");
    LlamaModel<StaticKVCache> drafter(checkpoint.config, checkpoint.weights);
    drafter.use_cpu_kernels(loops);
    auto cache = drafter.make_cache(1);
    const at::Tensor logits = drafter.forward(ids, cache)[0].narrow(0, ids.size(1) - k, k);
    EXPECT_TRUE(at::allclose(logits, expected, 0.0, kLogitTolerance)) << worst(logits, expected);
    specdec::ParallelDraftSource<LlamaModel<StaticKVCache>> source(
        drafter, {.mask_token = checkpoint.mask_token, .vocab_size = checkpoint.config.vocab_size});
    const Ids context = to_ids(ids[0].narrow(0, 0, ids.size(1) - (k - 1)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
    const specdec::Drafts drafts = source.draft({.sequence = context, .gamma = k, .room = k},
                                                specdec::GreedyProcessor(), gen);
    EXPECT_EQ(drafts.calls, 1);
    EXPECT_EQ(to_ids(drafts.tokens), to_ids(reference.at("drafts")));
  }
}
INSTANTIATE_TEST_SUITE_P(Pard, ParallelDrafterReference, ::testing::Values("qwen2", "llama_untied"));

// The same sequence fed in pieces of 5, 1, 7, 3 and the rest, each attending to the cache the
// earlier ones left (for the Mistral case, across its sliding window).
TEST_P(HfModel, LogitsEqualTransformersInCachedPieces) {
  const at::Tensor& ids = r.tensors.at("input_ids");
  const at::Tensor& expected = r.tensors.at("logits");
  auto model = load_model<StaticKVCache>(r.folder);
  auto cache = model.make_cache(1);
  std::vector<at::Tensor> pieces;
  int64_t start = 0;
  for (const int64_t length : {5, 1, 7, 3}) {
    pieces.push_back(model.forward(ids.narrow(1, start, length), cache)[0]);
    start += length;
  }
  pieces.push_back(model.forward(ids.narrow(1, start, ids.size(1) - start), cache)[0]);
  const at::Tensor logits = at::cat(pieces, 0);
  ASSERT_EQ(logits.sizes(), expected.sizes());
  EXPECT_TRUE(at::allclose(logits, expected, 0.0, kLogitTolerance)) << worst(logits, expected);
}

TEST_P(HfModel, GreedyTokensEqualTransformersGenerate) {
  const Ids prompt = to_ids(r.tensors.at("prompt"));
  const Ids expected = to_ids(r.tensors.at("greedy"));
  auto model = load_model<StaticKVCache>(r.folder);
  const auto result = specdec::autoregressive_generate(
      model, prompt, {.max_new_tokens = static_cast<int64_t>(expected.size()), .eos_token_ids = {}});
  EXPECT_EQ(result.tokens, expected);
}

// transformers' assisted generation (assistant_model=) against speculative_generate on the same
// pair: the same greedy tokens, at several draft lengths.
TEST_P(HfModel, SpeculativeGenerateEqualsTransformersAssistedGeneration) {
  const Ids prompt = to_ids(r.tensors.at("prompt"));
  const Ids expected = to_ids(r.tensors.at("assisted"));
  auto target = load_model<StaticKVCache>(r.folder);
  auto drafter = load_model<StaticKVCache>(reference_dir() / "models" / r.drafter);
  for (const int64_t gamma : {1, 3, 5}) {
    SCOPED_TRACE("gamma " + std::to_string(gamma));
    const auto result = specdec::speculative_generate(
        drafter, target, prompt,
        {.max_new_tokens = static_cast<int64_t>(expected.size()), .eos_token_ids = {}, .gamma = gamma});
    EXPECT_EQ(result.tokens, expected);
    EXPECT_GT(result.stats.accepted, 0) << "the drafter never agreed with the target: the pair tests nothing";
    EXPECT_LT(result.stats.accepted, result.stats.drafted) << "the drafter always agreed: no rejection tested";
    std::printf("%s gamma %lld: %lld of %lld drafts accepted\n", GetParam().c_str(), static_cast<long long>(gamma),
                static_cast<long long>(result.stats.accepted), static_cast<long long>(result.stats.drafted));
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, HfModel,
                         ::testing::Values("llama_llama3_tied", "llama_linear_bias_untied", "qwen2", "mistral_window"));

// ---- tokenizers: tokenizer.json of Llama 3, Qwen3 and Llama 2 ----------------------------------

const nlohmann::json& tokenizer_references() {
  static const nlohmann::json data = [] {
    std::ifstream in(reference_dir() / "tokenizers.json");
    return nlohmann::json::parse(in);
  }();
  return data;
}

class HfTokenizerReference : public ::testing::TestWithParam<std::string> {};

// Every text of the corpus (the fixture texts and over 2,000 generated ones): ids with and
// without the post-processor's special tokens, and the decoded text with and without them.
TEST_P(HfTokenizerReference, EncodingAndDecodingEqualTheTokenizersLibrary) {
  const fs::path file = tokenizers_dir() / ("tokenizer-" + GetParam()) / "package/models/tokenizer.json";
  if (!fs::exists(file)) {
    const std::string reason = "the " + GetParam() + " tokenizer.json is absent at " + file.string() +
                               " (../shared/tokenizers, or SPECDEC_TOKENIZERS_DIR)";
    if (in_ci()) FAIL() << reason;
    GTEST_SKIP() << reason;
  }
  SPECDEC_REQUIRE_REFERENCE(reference_dir() / "tokenizers.json");
  const nlohmann::json& data = tokenizer_references();
  const nlohmann::json& texts = data.at("texts");
  const nlohmann::json& expected = data.at("tokenizers").at(GetParam());
  ASSERT_EQ(texts.size(), expected.size());
  ASSERT_GE(texts.size(), 2000U);
  const auto tokenizer = specdec::io::HfTokenizer::load(file);
  int64_t mismatches = 0;
  std::ostringstream first;
  const auto check = [&](bool same, size_t i, const char* what) {
    if (same) return;
    if (++mismatches <= 5) first << "\n  text " << i << " " << texts[i].dump() << ": " << what << " differs";
  };
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const nlohmann::json& e = expected[i];
    const Ids ids = tokenizer.encode(text, false);
    check(ids == e.at("ids").get<Ids>(), i, "ids");
    check(tokenizer.encode(text) == e.at("ids_with_special_tokens").get<Ids>(), i, "ids with special tokens");
    const Ids reference_ids = e.at("ids").get<Ids>();
    check(tokenizer.decode(reference_ids) == e.at("decoded").get<std::string>(), i, "decoded text");
    check(tokenizer.decode(reference_ids, true) == e.at("decoded_skipping_special").get<std::string>(), i,
          "decoded text skipping special tokens");
  }
  EXPECT_EQ(mismatches, 0) << mismatches << " differences over " << texts.size() << " texts (" << data.at("generator")
                           << "); the first:" << first.str();
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, HfTokenizerReference, ::testing::Values("llama3", "qwen3", "llama2"));

}  // namespace
