// Checkpoint and tokenizer loaders: real checkpoints against an independent reference, round
// trips through every format, and corrupt files rejected with errors naming the file.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numbers>
#include <optional>
#include <unordered_map>
#include <random>
#include <thread>

#include "specdec/batch.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/io/tokenizer.hpp"
#include "support/expect_invalid.hpp"
#include "support/llama_fixtures.hpp"
#include "support/shared_files.hpp"
#include "support/naive_llama.hpp"
#include "specdec/text/prompts.hpp"
#include "text/python_corpus.hpp"

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_io {

namespace {

using namespace specdec;
namespace fs = std::filesystem;

// A fresh folder per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("specdec_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(std::random_device{}()));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `load` and expects a FormatError whose message names the file and contains `problem`.
template <class F>
void expect_format_error(F load, const fs::path& file, const std::string& problem) {
  try {
    load();
    FAIL() << "loaded a corrupt file, expected: " << problem;
  } catch (const io::FormatError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(file.filename().string()), std::string::npos) << message;
    EXPECT_NE(message.find(problem), std::string::npos) << message;
  }
}

at::Tensor logits_of(const models::LlamaConfig& config, const models::LlamaWeights& weights,
                     const std::vector<int64_t>& tokens) {
  models::LlamaModel<> model(config, weights);
  auto cache = model.make_cache(1);
  return model.forward(at::tensor(tokens, at::kLong).view({1, -1}), cache);
}

const std::vector<int64_t> kReadmeStart{1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426};

TEST(Llama2c, Stories260KContinuesBosAsTheReferenceDoes) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/stories260K.bin");
  const io::Llama2cCheckpoint checkpoint = io::load_llama2c(path);
  EXPECT_EQ(checkpoint.version, 0);
  EXPECT_TRUE(checkpoint.shared_classifier);
  EXPECT_EQ(checkpoint.config.dim, 64);
  EXPECT_EQ(checkpoint.config.n_kv_heads, 4);
  const std::vector<int64_t> bos{1};
  const auto reference = test::naive_greedy(test::NaiveLlama(checkpoint.config, checkpoint.weights), bos, 120);
  EXPECT_TRUE(std::equal(kReadmeStart.begin() + 1, kReadmeStart.end(), reference.begin()));
  models::LlamaModel<DynamicKVCache> dynamic_model(checkpoint.config, checkpoint.weights);
  models::LlamaModel<StaticKVCache> static_model(checkpoint.config, checkpoint.weights);
  for (bool use_cache : {true, false}) {
    const GenerationOptions options{.max_new_tokens = 120, .use_cache = use_cache};
    EXPECT_EQ(autoregressive_generate(dynamic_model, bos, options).tokens, reference) << use_cache;
    EXPECT_EQ(autoregressive_generate(static_model, bos, options).tokens, reference) << use_cache;
  }
}

TEST(Llama2c, SpeculativeWithLlama2xsDrafterEqualsAutoregressive) {
  SPECDEC_REQUIRE_MODEL(target_path, "stories260K/stories260K.bin");
  SPECDEC_REQUIRE_MODEL(drafter_path, "llama2xs/model.bin");
  const auto t = io::load_llama2c(target_path);
  const auto d = io::load_llama2c(drafter_path);
  models::LlamaModel<StaticKVCache> target(t.config, t.weights);
  models::LlamaModel<StaticKVCache> drafter(d.config, d.weights);
  const std::vector<int64_t> bos{1};
  const auto reference = autoregressive_generate(target, bos, {.max_new_tokens = 200});
  for (int64_t gamma : {1, 4, 7}) {
    const auto result = speculative_generate(drafter, target, bos, {.max_new_tokens = 200, .gamma = gamma});
    // llama2xs holds 256 positions: generation stops there for both.
    EXPECT_EQ(result.tokens, std::vector<int64_t>(reference.tokens.begin(), reference.tokens.begin() + 200));
    EXPECT_GT(result.stats.acceptance_rate(), 0.3);
    ::testing::Test::RecordProperty("acceptance_gamma_" + std::to_string(gamma),
                                    std::to_string(result.stats.acceptance_rate()));
    std::cout << "stories260K <- llama2xs, gamma " << gamma << ": acceptance rate "
              << result.stats.acceptance_rate() << ", tokens per target call "
              << result.stats.tokens_per_target_call() << "\n";
  }
}

// Weight-only int8 on a real model: perplexity of a story stories260K itself wrote (400 tokens
// sampled at temperature 1) within 1% of fp32's, greedy agreement reported, and speculation with
// an int8 llama2xs exact with respect to the int8 target. bf16 weights (packed, fp32
// activations) are reported beside them.
TEST(Llama2c, Int8Stories260KKeepsItsPerplexityAndSpeculationIsExact) {
  SPECDEC_REQUIRE_MODEL(target_path, "stories260K/stories260K.bin");
  SPECDEC_REQUIRE_MODEL(drafter_path, "llama2xs/model.bin");
  const auto t = io::load_llama2c(target_path);
  const auto d = io::load_llama2c(drafter_path);
  models::LlamaModel<StaticKVCache> fp32(t.config, t.weights);
  models::LlamaModel<StaticKVCache> int8(t.config, t.weights);
  models::LlamaModel<StaticKVCache> bf16(t.config, t.weights);
  int8.quantize_int8();
  bf16.pack_weights(specdec::detail::WeightFormat::bf16);
  const std::vector<int64_t> bos{1};
  std::vector<int64_t> story = bos;
  const auto sampled = autoregressive_generate(fp32, bos, {.max_new_tokens = 400, .seed = 7}, MultinomialProcessor{1.0});
  story.insert(story.end(), sampled.tokens.begin(), sampled.tokens.end());
  ASSERT_EQ(story.size(), 401U);
  // Perplexity of story[1:] given its prefix, in one forward.
  const auto perplexity = [&](models::LlamaModel<StaticKVCache>& model) {
    auto cache = model.make_cache(1);
    const at::Tensor ids = at::tensor(story, at::kLong).view({1, -1});
    const at::Tensor logits = model.forward(ids.narrow(1, 0, 400), cache).to(at::kDouble)[0];
    const at::Tensor nll = -logits.log_softmax(-1).gather(1, ids[0].narrow(0, 1, 400).unsqueeze(1));
    return std::exp(nll.mean().item<double>());
  };
  const double exact = perplexity(fp32), quantized = perplexity(int8), rounded = perplexity(bf16);
  std::cout << "stories260K perplexity of its own 400-token story: fp32 " << exact << ", int8 " << quantized
            << " (" << 100 * (quantized / exact - 1) << "%), bf16 " << rounded << " (" << 100 * (rounded / exact - 1)
            << "%)\n";
  EXPECT_LT(std::abs(quantized / exact - 1), 0.01);
  EXPECT_LT(std::abs(rounded / exact - 1), 0.01);
  const auto reference = autoregressive_generate(fp32, bos, {.max_new_tokens = 200}).tokens;
  const auto greedy = autoregressive_generate(int8, bos, {.max_new_tokens = 200}).tokens;
  size_t same = 0;
  while (same < reference.size() && same < greedy.size() && reference[same] == greedy[same]) ++same;
  std::cout << "int8 greedy output equals fp32's for the first " << same << " of 200 tokens\n";
  ::testing::Test::RecordProperty("int8_greedy_prefix", std::to_string(same));
  models::LlamaModel<StaticKVCache> drafter(d.config, d.weights);
  drafter.quantize_int8();
  for (const int64_t gamma : {1, 4}) {
    EXPECT_EQ(speculative_generate(drafter, int8, bos, {.max_new_tokens = 200, .gamma = gamma}).tokens, greedy)
        << "gamma " << gamma;
  }
}

TEST(Llama2c, NGramDraftingOnARepetitivePromptCutsTargetCalls) {
  SPECDEC_REQUIRE_MODEL(target_path, "stories260K/stories260K.bin");
  SPECDEC_REQUIRE_MODEL(tokenizer_path, "stories260K/tok512.bin");
  const auto t = io::load_llama2c(target_path);
  models::LlamaModel<StaticKVCache> target(t.config, t.weights);
  const auto tokenizer = io::Llama2cTokenizer::load(tokenizer_path, 512);
  const auto prompt = tokenizer.encode(
      "Tom saw a big red ball in the park. Tom saw a big red ball in the park. Tom saw a big red ball in the");
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 120});
  NGramStorage storage(3, 512);
  PromptLookupDrafter lookup;
  const auto ngram = ngram_assisted_generate(storage, target, prompt, {.max_new_tokens = 120, .gamma = 5});
  const auto looked_up = ngram_assisted_generate(lookup, target, prompt, {.max_new_tokens = 120, .gamma = 5});
  EXPECT_EQ(ngram.tokens, reference.tokens);
  EXPECT_EQ(looked_up.tokens, reference.tokens);
  for (const auto* result : {&ngram, &looked_up}) {
    EXPECT_GT(result->stats.accepted, 10);
    EXPECT_GT(result->stats.tokens_per_target_call(), 1.3);
  }
  std::cout << "stories260K, repetitive prompt: NASD " << ngram.stats.tokens_per_target_call()
            << " tokens per target call (acceptance " << ngram.stats.acceptance_rate() << "), prompt lookup "
            << looked_up.stats.tokens_per_target_call() << " (acceptance " << looked_up.stats.acceptance_rate() << ")\n";
}

TEST(Llama2cTokenizer, EncodesAsSentencePieceAndRoundTrips) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/tok512.bin");
  const auto tokenizer = io::Llama2cTokenizer::load(path, 512);
  // Expected ids from SentencePiece with tok512.model, BOS prepended.
  EXPECT_EQ(tokenizer.encode("Once upon a time, there was a little girl named Lily."), kReadmeStart);
  EXPECT_EQ(tokenizer.encode("The cat sat on the mat."),
            (std::vector<int64_t>{1, 291, 280, 294, 262, 294, 353, 265, 284, 294, 426}));
  EXPECT_EQ(tokenizer.encode("héllo wörld ✓ 日本"),
            (std::vector<int64_t>{1, 270, 485, 306, 414, 263, 198, 185, 420, 341, 410, 229, 159, 150,
                                  410, 233, 154, 168, 233, 159, 175}));
  for (const std::string text : {"Tom and Sue went to the park!", "tabs\tand\nnewlines", "bytes \x01\x7f\xff end",
                                 "emoji 🙂 and ünïcödé", "  two leading spaces", "x"}) {
    const auto ids = tokenizer.encode(text);
    EXPECT_EQ(tokenizer.decode(std::span(ids).subspan(1), io::Llama2cTokenizer::kBos), text);
    EXPECT_EQ(tokenizer.encode(text, /*bos=*/false).front(), ids[1]);
  }
  EXPECT_EQ(tokenizer.encode(""), std::vector<int64_t>{1});
  EXPECT_THROW((void)tokenizer.decode_piece(-1, 512), std::invalid_argument);
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const io::ByteTokenizer bytes;
  const auto ids = bytes.encode(all);
  EXPECT_EQ(ids.size(), 256u);
  EXPECT_EQ(ids[200], 200);
  EXPECT_EQ(bytes.decode(ids), all);
  EXPECT_THROW((void)bytes.decode_piece(-1, 256), std::invalid_argument);
}

TEST(HfLlama, RoundTripGivesIdenticalLogits) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/stories260K.bin");
  const auto original = io::load_llama2c(path);
  const std::vector<int64_t> tokens{1, 403, 407, 261, 378, 432, 383};
  const at::Tensor expected = logits_of(original.config, original.weights, tokens);
  TempDir dir;
  io::save_hf_llama(dir.path() / "fp32", original.config, original.weights, at::kFloat);
  const auto loaded = io::load_hf_llama(dir.path() / "fp32");
  EXPECT_TRUE(loaded.tied_classifier);
  EXPECT_TRUE(at::equal(logits_of(loaded.config, loaded.weights, tokens), expected));
  for (auto storage : {at::kHalf, at::kBFloat16}) {
    io::save_hf_llama(dir.path() / "half", original.config, original.weights, storage);
    const auto half = io::load_llama(dir.path() / "half");
    EXPECT_EQ(half.format, "huggingface");
    const at::Tensor logits = logits_of(half.config, half.weights, tokens);
    EXPECT_LT((logits - expected).abs().max().item<float>(), 0.05 * expected.abs().max().item<float>()) << storage;
    EXPECT_TRUE(at::equal(logits.argmax(-1), expected.argmax(-1))) << storage;
  }
}

TEST(HfLlama, LoadsShardedCheckpointsAndUntiedClassifiers) {
  const models::LlamaConfig config = test::small_llama_config();
  const auto weights = models::LlamaWeights::random(config, 9);  // untied classifier
  TempDir dir;
  io::save_hf_llama(dir.path(), config, weights);
  // Split model.safetensors into two shards listed by an index.
  auto contents = io::load_safetensors(dir.path() / "model.safetensors");
  std::map<std::string, at::Tensor> first, second;
  nlohmann::json map;
  for (const auto& [name, tensor] : contents.tensors) {
    const bool in_first = name.find("layers.1.") == std::string::npos;
    (in_first ? first : second)[name] = tensor;
    map[name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  io::save_safetensors(dir.path() / "model-00001-of-00002.safetensors", first);
  io::save_safetensors(dir.path() / "model-00002-of-00002.safetensors", second);
  fs::remove(dir.path() / "model.safetensors");
  write_file(dir.path() / "model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  const auto loaded = io::load_hf_llama(dir.path());
  EXPECT_FALSE(loaded.tied_classifier);
  const std::vector<int64_t> tokens{3, 1, 4, 1, 5};
  EXPECT_TRUE(at::equal(logits_of(loaded.config, loaded.weights, tokens), logits_of(config, weights, tokens)));
  // A shard named outside the folder is refused.
  map["model.norm.weight"] = "../escape.safetensors";
  write_file(dir.path() / "model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  expect_format_error([&] { (void)io::load_hf_llama(dir.path()); }, "model.safetensors.index.json", "invalid file name");
}

// Medusa heads in their published layout: a folder written here loads and gives the heads'
// logits; every problem of an untrusted folder is a FormatError naming the file and the field or
// tensor: counts out of range, a target of another size, a missing tensor, a wrong shape, an
// integer tensor, a tensor the layout does not name, one named both bare and prefixed.
TEST(MedusaLoader, ReadsThePublishedLayoutAndRefusesWhatDoesNotFit) {
  TempDir dir;
  const models::MedusaConfig config{.hidden_size = 8, .vocab_size = 12, .num_heads = 2, .num_layers = 1};
  const auto heads = models::MedusaHeads::random(config, 7);
  std::map<std::string, at::Tensor> tensors;
  for (size_t i = 0; i < heads.size(); ++i) {
    const std::string prefix = "medusa_head." + std::to_string(i) + ".";
    tensors[prefix + "0.linear.weight"] = heads[i].block_weights[0];
    tensors[prefix + "0.linear.bias"] = heads[i].block_biases[0];
    tensors[prefix + "1.weight"] = heads[i].classifier;
  }
  const auto write = [&](const nlohmann::json& json, const std::map<std::string, at::Tensor>& weights) {
    write_file(dir.path() / "config.json", json.dump());
    io::save_safetensors(dir.path() / "medusa_lm_head.safetensors", weights);
  };
  const nlohmann::json good{{"medusa_num_heads", 2}, {"medusa_num_layers", 1}, {"hidden_size", 8}};
  write(good, tensors);
  const models::MedusaHeads loaded = io::load_medusa(dir.path(), 8, 12);
  const at::Tensor hidden = at::randn({8});
  EXPECT_TRUE(at::equal(loaded.logits(hidden, 2), models::MedusaHeads(config, heads).logits(hidden, 2)));

  const auto refused = [&](const nlohmann::json& json, const std::map<std::string, at::Tensor>& weights,
                           const char* file, const std::string& problem) {
    write(json, weights);
    expect_format_error([&] { (void)io::load_medusa(dir.path(), 8, 12); }, file, problem);
  };
  nlohmann::json bad = good;
  bad["medusa_num_heads"] = 0;
  refused(bad, tensors, "config.json", "medusa_num_heads = 0 is outside [1, 64]");
  bad = good;
  bad["medusa_num_layers"] = 1.5;
  refused(bad, tensors, "config.json", "medusa_num_layers' must be an integer");
  bad = good;
  bad["hidden_size"] = 16;
  refused(bad, tensors, "config.json", "hidden_size = 16 but the target's is 8");
  bad = good;
  bad["medusa_num_heads"] = 3;
  refused(bad, tensors, "medusa_lm_head.safetensors", "missing tensor '2.0.linear.weight'");
  auto changed = tensors;
  changed["medusa_head.1.1.weight"] = at::zeros({12, 9});
  refused(good, changed, "medusa_lm_head.safetensors", "tensor '1.1.weight' has shape [12, 9], expected [12, 8]");
  changed = tensors;
  changed["medusa_head.0.0.linear.bias"] = at::zeros({8}, at::kInt);
  refused(good, changed, "medusa_lm_head.safetensors", "tensor '0.0.linear.bias' is not floating point");
  changed = tensors;
  changed["medusa_head.0.2.weight"] = at::zeros({12, 8});
  refused(good, changed, "medusa_lm_head.safetensors", "unexpected tensor '0.2.weight'");
  changed = tensors;
  changed["0.1.weight"] = tensors.at("medusa_head.0.1.weight");
  refused(good, changed, "medusa_lm_head.safetensors", "tensor '0.1.weight' appears twice");
  fs::remove(dir.path() / "medusa_lm_head.safetensors");
  expect_format_error([&] { (void)io::load_medusa(dir.path(), 8, 12); }, dir.path().filename().string(),
                      "holds neither medusa_lm_head.safetensors nor model.safetensors");
}

// EAGLE heads in their published layouts: save_eagle() writes what load_eagle() reads back to
// the same outputs (wq and wk through the rotate-half permutation and back); every problem of an
// untrusted folder is a FormatError naming the file and the field or tensor.
TEST(EagleLoader, ReadsThePublishedLayoutAndRefusesWhatDoesNotFit) {
  TempDir dir;
  models::LlamaConfig target_config = test::small_llama_config();
  target_config.n_layers = 4;
  const models::LlamaWeights target = models::LlamaWeights::random(target_config, 2);
  const io::EagleTarget info{.hidden_size = 32, .vocab_size = 48, .num_layers = 4, .embedding = target.token_embedding,
                             .classifier = target.output};
  models::EagleConfig config{.kind = models::EagleKind::eagle3, .layer = target_config, .target_hidden_size = 32,
                             .draft_vocab_size = 20, .feature_layers = {1, 2, 4}};
  const models::EagleHead head(config, models::EagleHead::random(config, target.token_embedding, target.output, 5));
  const at::Tensor features = at::randn({5, 96});
  const at::Tensor ids = at::tensor({3, 9, 1, 30, 7}, at::kLong);
  const auto logits_of = [&](const models::EagleHead& h) {
    models::EagleCache cache;
    return h.logits(h.forward(ids, h.fuse(features), cache));
  };
  io::save_eagle(dir.path(), head);
  const models::EagleHead loaded = io::load_eagle(dir.path(), info);
  EXPECT_EQ(loaded.config().feature_layers, config.feature_layers);
  EXPECT_EQ(loaded.config().draft_vocab_size, 20);
  EXPECT_TRUE(at::allclose(logits_of(loaded), logits_of(head), 1e-5, 1e-5));
  EXPECT_TRUE(at::equal(loaded.to_target(at::arange(20)), head.to_target(at::arange(20))));

  // EAGLE-1: the target's classifier and embedding; the same outputs.
  models::EagleConfig config1{.kind = models::EagleKind::eagle1, .layer = target_config, .target_hidden_size = 32,
                              .draft_vocab_size = 48, .feature_layers = {4}};
  const models::EagleHead head1(config1, models::EagleHead::random(config1, target.token_embedding, target.output, 6));
  TempDir dir1;
  io::save_eagle(dir1.path(), head1);
  const models::EagleHead loaded1 = io::load_eagle(dir1.path(), info);
  EXPECT_EQ(loaded1.config().kind, models::EagleKind::eagle1);
  models::EagleCache a, b;
  const at::Tensor x = at::randn({5, 32});
  EXPECT_TRUE(at::allclose(loaded1.logits(loaded1.forward(ids, x, a)), head1.logits(head1.forward(ids, x, b)), 1e-5, 1e-5));

  const nlohmann::json good = nlohmann::json::parse(read_file(dir.path() / "config.json"));
  const std::map<std::string, at::Tensor> tensors = io::load_safetensors(dir.path() / "model.safetensors").tensors;
  const auto refused = [&](const nlohmann::json& json, const std::map<std::string, at::Tensor>& weights,
                           const char* file, const std::string& problem, const io::EagleTarget& with = {}) {
    write_file(dir.path() / "config.json", json.dump());
    io::save_safetensors(dir.path() / "model.safetensors", weights);
    expect_format_error([&] { (void)io::load_eagle(dir.path(), with.vocab_size > 0 ? with : info); }, file, problem);
  };
  nlohmann::json bad = good;
  bad["vocab_size"] = 50;
  refused(bad, tensors, "config.json", "vocab_size = 50 but the target's vocabulary is 48");
  bad = good;
  bad["hidden_size"] = 16;
  refused(bad, tensors, "config.json", "hidden_size = 16 but the target's hidden size is 32");
  bad = good;
  bad["eagle_aux_hidden_state_layer_ids"] = {1, 2, 5};
  refused(bad, tensors, "config.json", "eagle_aux_hidden_state_layer_ids[2] = 5 is not a hidden state of the target's (0 to 4)");
  bad = good;
  bad.erase("eagle_aux_hidden_state_layer_ids");
  io::EagleTarget shallow = info;
  shallow.num_layers = 2;
  refused(bad, tensors, "config.json", "no default feature layers", shallow);
  bad = good;
  bad["draft_vocab_size"] = 0;
  refused(bad, tensors, "config.json", "draft_vocab_size = 0 is outside [1, 48]");
  bad = good;
  bad["num_hidden_layers"] = 2;
  refused(bad, tensors, "config.json", "num_hidden_layers = 2: a head has one layer");
  auto changed = tensors;
  at::Tensor d2t = tensors.at("d2t").clone();
  d2t[3] = 60;
  changed["d2t"] = d2t;
  refused(good, changed, "model.safetensors", "d2t[3] = 60 maps draft id 3 to 63, outside the target vocabulary [0, 48)");
  changed = tensors;
  d2t = tensors.at("d2t").clone();
  d2t[4] = d2t[3].item<int64_t>() - 1;
  changed["d2t"] = d2t;
  refused(good, changed, "model.safetensors", "d2t maps two draft ids to the same target id");
  changed = tensors;
  changed["t2d"] = at::ones({48}, at::kBool);
  refused(good, changed, "model.safetensors", "t2d does not mark exactly the target ids d2t maps to");
  changed = tensors;
  changed.erase("midlayer.hidden_norm.weight");
  refused(good, changed, "model.safetensors", "missing tensor 'midlayer.hidden_norm.weight'");
  changed = tensors;
  changed["midlayer.self_attn.q_proj.weight"] = at::zeros({32, 32});
  refused(good, changed, "model.safetensors", "tensor 'midlayer.self_attn.q_proj.weight' has shape [32, 32], expected [32, 64]");
  changed = tensors;
  changed["layers.0.mlp.up_proj.weight"] = tensors.at("midlayer.mlp.up_proj.weight");
  refused(good, changed, "model.safetensors", "holds both midlayer.* and layers.0.* tensors");
  changed = tensors;
  changed["extra"] = at::zeros({2});
  refused(good, changed, "model.safetensors", "unexpected tensor 'extra' for an eagle3 head");
  bad = good;
  bad["speculators_model_type"] = "medusa";
  refused(bad, tensors, "config.json", "speculators_model_type 'medusa' is not supported (only eagle3)");
  fs::remove(dir.path() / "model.safetensors");
  write_file(dir.path() / "pytorch_model.bin", "pickle");
  expect_format_error([&] { (void)io::load_eagle(dir.path(), info); }, dir.path().filename().string(),
                      "holds pytorch_model.bin, a pickle, which is not read");
}

TEST(Llama2c, Version1And2RoundTrip) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/stories260K.bin");
  const auto original = io::load_llama2c(path);
  const std::vector<int64_t> tokens{1, 403, 407, 261, 378};
  const at::Tensor expected = logits_of(original.config, original.weights, tokens);
  TempDir dir;
  io::save_llama2c(dir.path() / "v1.bin", original.config, original.weights, 1);
  const auto v1 = io::load_llama2c(dir.path() / "v1.bin");
  EXPECT_EQ(v1.version, 1);
  EXPECT_TRUE(at::equal(logits_of(v1.config, v1.weights, tokens), expected));
  io::save_llama2c(dir.path() / "v2.bin", original.config, original.weights, 2, 32);
  const auto v2 = io::load_llama2c(dir.path() / "v2.bin");
  EXPECT_EQ(v2.version, 2);
  // Q8_0 keeps logits within a few percent of their range, and the predicted tokens.
  const at::Tensor quantized = logits_of(v2.config, v2.weights, tokens);
  EXPECT_LT((quantized - expected).abs().max().item<float>(), 0.05 * expected.abs().max().item<float>());
  EXPECT_TRUE(at::equal(quantized.argmax(-1), expected.argmax(-1)));
  // Untied classifier through version 1.
  const auto config = test::small_llama_config();
  const auto untied = models::LlamaWeights::random(config, 4);
  io::save_llama2c(dir.path() / "untied.bin", config, untied, 1);
  const auto loaded = io::load_llama2c(dir.path() / "untied.bin");
  EXPECT_FALSE(loaded.shared_classifier);
  const std::vector<int64_t> small_tokens{1, 40, 7, 26, 3};
  EXPECT_TRUE(at::equal(logits_of(loaded.config, loaded.weights, small_tokens),
                        logits_of(config, untied, small_tokens)));
}

TEST(Llama2c, RejectsCorruptCheckpoints) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/stories260K.bin");
  const std::string bytes = read_file(path);
  TempDir dir;
  const fs::path file = dir.path() / "corrupt.bin";
  const auto load = [&] { (void)io::load_llama2c(file); };
  write_file(file, bytes.substr(0, bytes.size() - 100));
  expect_format_error(load, file, "truncated");
  write_file(file, bytes + "extra");
  expect_format_error(load, file, "oversized");
  write_file(file, bytes.substr(0, 10));
  expect_format_error(load, file, "truncated");
  std::string huge = bytes;
  const int32_t big = 1 << 24;
  std::memcpy(huge.data(), &big, 4);  // dim = 2^24: the implied size dwarfs the file
  write_file(file, huge);
  expect_format_error(load, file, "truncated");
  std::string negative = bytes;
  const int32_t minus = -8;
  std::memcpy(negative.data() + 12, &minus, 4);  // n_heads = -8
  write_file(file, negative);
  expect_format_error(load, file, "out of range");
  std::string odd = bytes;
  const int32_t three = 3;
  std::memcpy(odd.data() + 16, &three, 4);  // n_kv_heads = 3 does not divide 8 heads
  write_file(file, odd);
  expect_format_error(load, file, "n_kv_heads");
  std::string version = bytes;
  const uint32_t magic = 0x616b3432;
  const int32_t seven = 7;
  std::memcpy(version.data(), &magic, 4);
  std::memcpy(version.data() + 4, &seven, 4);
  write_file(file, version);
  expect_format_error(load, file, "unsupported llama2.c version 7");
  write_file(file, "");
  expect_format_error(load, file, "truncated");
  expect_format_error([&] { (void)io::load_llama(dir.path() / "missing.bin"); }, "missing.bin", "no such file");
}

TEST(Llama2cTokenizer, RejectsCorruptFiles) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/tok512.bin");
  const std::string bytes = read_file(path);
  TempDir dir;
  const fs::path file = dir.path() / "tok.bin";
  const auto load = [&] { (void)io::Llama2cTokenizer::load(file, 512); };
  write_file(file, bytes.substr(0, bytes.size() - 3));
  expect_format_error(load, file, "truncated");
  write_file(file, bytes + "x");
  expect_format_error(load, file, "bytes follow");
  std::string long_token = bytes;
  const int32_t length = 1000;
  std::memcpy(long_token.data() + 8, &length, 4);  // token 0 claims 1000 bytes, max is smaller
  write_file(file, long_token);
  expect_format_error(load, file, "outside [0, max_token_length");
  std::string bad_max = bytes;
  const int32_t zero = 0;
  std::memcpy(bad_max.data(), &zero, 4);
  write_file(file, bad_max);
  expect_format_error(load, file, "max_token_length 0");
  EXPECT_THROW((void)io::Llama2cTokenizer::load(path, 1), std::invalid_argument);
}

TEST(Safetensors, RoundTripsDtypesAndMetadata) {
  TempDir dir;
  const std::map<std::string, at::Tensor> tensors{
      {"a", at::arange(6, at::kFloat).view({2, 3})},  {"b", at::ones({4}, at::kHalf)},
      {"c", at::arange(5, at::kLong)},                 {"d", at::zeros({0, 3}, at::kBFloat16)},
      {"e", at::tensor({1, 0, 1}).to(at::kBool)}};
  io::save_safetensors(dir.path() / "x.safetensors", tensors, {{"note", "hello"}});
  const auto loaded = io::load_safetensors(dir.path() / "x.safetensors");
  EXPECT_EQ(loaded.metadata.at("note"), "hello");
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    EXPECT_EQ(loaded.tensors.at(name).scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(at::equal(loaded.tensors.at(name), tensor)) << name;
  }
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename(), "x.safetensors") << "a temporary file is left behind";
  }
}

// A safetensors file with the given JSON header and data bytes.
void write_safetensors(const fs::path& path, const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  const uint64_t length = header.size();
  std::memcpy(bytes.data(), &length, 8);
  write_file(path, bytes + header + data);
}

TEST(Safetensors, RejectsCorruptFiles) {
  TempDir dir;
  const fs::path file = dir.path() / "bad.safetensors";
  const auto load = [&] { (void)io::load_safetensors(file); };
  const std::string data(16, '\0');
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})", data);
  EXPECT_NO_THROW(load());
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]})", data);
  expect_format_error(load, file, "malformed JSON");
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 32]}})", data);
  expect_format_error(load, file, "outside the data buffer");
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}})", data);
  expect_format_error(load, file, "needs 6 elements of 4 bytes");
  write_safetensors(file, R"({"t": {"dtype": "Q4", "shape": [2, 2], "data_offsets": [0, 16]}})", data);
  expect_format_error(load, file, "unsupported dtype");
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}})", data);
  expect_format_error(load, file, "invalid dimension");
  write_safetensors(file, R"({"t": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})", data);
  expect_format_error(load, file, "larger than the file");
  write_safetensors(file, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", data);
  expect_format_error(load, file, "overlap");
  write_safetensors(file, R"([1, 2])", data);
  expect_format_error(load, file, "not an object");
  std::string huge_header(8, '\0');
  const uint64_t length = uint64_t{1} << 40;
  std::memcpy(huge_header.data(), &length, 8);
  write_file(file, huge_header + "{}");
  expect_format_error(load, file, "header length");
  write_file(file, "abc");
  expect_format_error(load, file, "truncated");
}

TEST(HfLlama, RejectsBadConfigs) {
  const models::LlamaConfig config = test::small_llama_config();
  TempDir dir;
  io::save_hf_llama(dir.path(), config, models::LlamaWeights::random(config, 2));
  auto json = nlohmann::json::parse(read_file(dir.path() / "config.json"));
  const auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json copy = json;
    change(copy);
    write_file(dir.path() / "config.json", copy.dump());
  };
  const auto load = [&] { (void)io::load_hf_llama(dir.path()); };
  with([](auto& j) { j.erase("hidden_size"); });
  expect_format_error(load, "config.json", "missing key 'hidden_size'");
  with([](auto& j) { j["num_hidden_layers"] = "five"; });
  expect_format_error(load, "config.json", "key 'num_hidden_layers' must be an integer, got \"five\"");
  with([](auto& j) { j["num_key_value_heads"] = 3; });
  expect_format_error(load, "config.json", "n_kv_heads");
  with([](auto& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
  expect_format_error(load, "config.json", "rope_scaling.rope_type 'yarn' is not supported");
  with([](auto& j) { j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}}; });
  expect_format_error(load, "config.json", "rope_scaling.low_freq_factor must be a number");
  with([](auto& j) { j["model_type"] = "gemma"; });
  expect_format_error(load, "config.json", "model_type 'gemma' is not supported");
  with([](auto& j) { j["architectures"] = {"MistralForCausalLM"}; });
  expect_format_error(load, "config.json", "architectures [\"MistralForCausalLM\"] is not supported for model_type 'llama'");
  with([](auto& j) { j["hidden_act"] = "gelu"; });
  expect_format_error(load, "config.json", "hidden_act 'gelu' is not supported");
  with([](auto& j) { j["model_type"] = "qwen2"; j["architectures"] = {"Qwen2ForCausalLM"}; j["use_sliding_window"] = true; });
  expect_format_error(load, "config.json", "use_sliding_window: true is not supported");
  with([](auto& j) { j["hidden_size"] = 64; });
  expect_format_error(load, "model.safetensors", "has shape");
  write_file(dir.path() / "config.json", "{not json");
  expect_format_error(load, "config.json", "malformed JSON");
}

// Hostile configs: sizes that are not integers or exceed the limits are refused before anything
// is allocated, deep nesting is refused while parsing, and messages quote values only in part.
TEST(HfLlama, RefusesHostileConfigsBeforeAllocating) {
  const models::LlamaConfig config = test::small_llama_config();
  TempDir dir;
  io::save_hf_llama(dir.path(), config, models::LlamaWeights::random(config, 2));
  const std::string original = read_file(dir.path() / "config.json");
  const auto json = nlohmann::json::parse(original);
  const auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json copy = json;
    change(copy);
    write_file(dir.path() / "config.json", copy.dump());
  };
  const auto load = [&] { (void)io::load_hf_llama(dir.path()); };
  with([](auto& j) { j["hidden_size"] = 96.5; });
  expect_format_error(load, "config.json", "key 'hidden_size' must be an integer, got 96.5");
  write_file(dir.path() / "config.json",
             original.substr(0, original.rfind('}')) + R"(, "hidden_size": 99999999999999999999999})");
  expect_format_error(load, "config.json", "key 'hidden_size' must be an integer, got 9.99");
  with([](auto& j) { j["max_position_embeddings"] = 16777216; });
  expect_format_error(load, "config.json",
                      "max_position_embeddings = 16777216 exceeds the limit of 131072 "
                      "(LoadLimits::max_sequence_length)");
  with([](auto& j) { j["max_position_embeddings"] = 1e12; });
  expect_format_error(load, "config.json", "key 'max_position_embeddings' must be an integer");
  with([](auto& j) { j["vocab_size"] = int64_t{1} << 40; });
  expect_format_error(load, "config.json", "vocab_size = 1099511627776 exceeds the limit");
  with([](auto& j) { j["num_hidden_layers"] = -3; });
  expect_format_error(load, "config.json", "num_hidden_layers = -3 is outside [1, 1048576]");
  with([](auto& j) { j["num_hidden_layers"] = 0; });  // held as unsigned by the JSON parser
  expect_format_error(load, "config.json", "num_hidden_layers = 0 is outside [1, 1048576]");
  // The limit can be raised: then the same config loads as far as its weights.
  with([](auto& j) { j["max_position_embeddings"] = 262144; });
  expect_format_error(load, "config.json", "exceeds the limit of 131072");
  EXPECT_NO_THROW((void)io::load_hf_llama(dir.path(), at::kFloat, {.max_sequence_length = 262144}));

  // 100,000 levels of nesting (a stack overflow when serialized whole) and a long value.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  write_file(dir.path() / "config.json", original.substr(0, original.rfind('}')) + ", \"x\": " + deep + "}");
  expect_format_error(load, "config.json", "JSON nested deeper than 32 levels (LoadLimits::max_json_depth)");
  with([](auto& j) { j["rope_scaling"] = {{"type", std::string(100000, 'y')}}; });
  try {
    load();
    FAIL() << "loaded rope_scaling";
  } catch (const io::FormatError& e) {
    EXPECT_LT(std::string(e.what()).size(), 400u) << "the message quotes the value in part";
  }
  write_file(dir.path() / "config.json", original);
  ASSERT_NO_THROW(load());
}

// The paths a user may get wrong: a file of the folder, a folder where a file belongs, shard
// names and links that lead outside the checkpoint.
TEST(HfLlama, NamesWrongPathsAndRefusesLinksOutOfTheFolder) {
  const models::LlamaConfig config = test::small_llama_config();
  TempDir dir;
  const fs::path model = dir.path() / "model";
  io::save_hf_llama(model, config, models::LlamaWeights::random(config, 2));
  for (const char* file : {"config.json", "model.safetensors"}) {
    expect_format_error([&] { (void)io::load_llama(model / file); }, file,
                        "is a file of a Hugging Face checkpoint: pass the folder that holds it");
  }
  // A folder where config.json belongs.
  const fs::path odd = dir.path() / "odd";
  fs::create_directories(odd / "config.json");
  expect_format_error([&] { (void)io::load_llama(odd); }, "config.json", "is not a regular file");
  // No temporary file is left beside config.json and model.safetensors.
  for (const auto& entry : fs::directory_iterator(model)) {
    EXPECT_TRUE(entry.path().filename() == "config.json" || entry.path().filename() == "model.safetensors")
        << entry.path();
  }

  // Shards: a NUL in a name is refused and shown escaped; a link out of the folder is refused.
  const fs::path sharded = dir.path() / "sharded";
  fs::create_directories(sharded);
  fs::copy_file(model / "config.json", sharded / "config.json");
  const fs::path outside = dir.path() / "elsewhere.safetensors";
  fs::copy_file(model / "model.safetensors", outside);
  const auto index = [&](const std::string& shard) {
    nlohmann::json map = nlohmann::json::object();
    for (const auto& [name, _] : io::load_safetensors(outside).tensors) map[name] = shard;
    write_file(sharded / "model.safetensors.index.json", nlohmann::json{{"weight_map", map}}.dump());
  };
  index(std::string("a\0b.safetensors", 15));
  expect_format_error([&] { (void)io::load_llama(sharded); }, "model.safetensors.index.json", "a\\u0000b.safetensors");
  fs::create_symlink(outside, sharded / "link.safetensors");
  index("link.safetensors");
  expect_format_error([&] { (void)io::load_llama(sharded); }, "link.safetensors", "outside the checkpoint folder");
  // A link inside the folder is followed.
  fs::remove(sharded / "link.safetensors");
  fs::copy_file(outside, sharded / "real.safetensors");
  fs::create_symlink(sharded / "real.safetensors", sharded / "link.safetensors");
  EXPECT_NO_THROW((void)io::load_llama(sharded));
  // The Hugging Face hub cache: snapshots/REV links into the repository's blobs.
  const fs::path repository = dir.path() / "models--x--y";
  fs::create_directories(repository / "blobs");
  fs::create_directories(repository / "snapshots" / "abc");
  fs::copy_file(model / "model.safetensors", repository / "blobs" / "1234");
  fs::copy_file(model / "config.json", repository / "blobs" / "5678");
  fs::create_symlink("../../blobs/1234", repository / "snapshots" / "abc" / "model.safetensors");
  fs::create_symlink("../../blobs/5678", repository / "snapshots" / "abc" / "config.json");
  EXPECT_NO_THROW((void)io::load_llama(repository / "snapshots" / "abc"));
}

// Writers racing to one path leave one complete file, never a mix, and no temporary files; a
// folder in the file's place is refused without leaving anything behind.
TEST(AtomicFile, ConcurrentWritersLeaveOneCompleteFile) {
  TempDir dir;
  const fs::path target = dir.path() / "shared.bin";
  constexpr size_t kBytes = 1 << 20;
  std::vector<std::thread> writers;
  for (char mark = 'a'; mark < 'a' + 8; ++mark) {
    writers.emplace_back([&, mark] {
      for (int round = 0; round < 3; ++round) {
        io::detail::write_atomically(target, [&](std::ofstream& out) {
          const std::string chunk(kBytes / 16, mark);
          for (int i = 0; i < 16; ++i) out.write(chunk.data(), static_cast<std::streamsize>(chunk.size()));
        });
      }
    });
  }
  for (auto& writer : writers) writer.join();
  const std::string bytes = read_file(target);
  ASSERT_EQ(bytes.size(), kBytes);
  EXPECT_EQ(bytes, std::string(kBytes, bytes.front())) << "a mix of writers";
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);

  fs::create_directories(dir.path() / "folder");
  try {
    io::detail::write_atomically(dir.path() / "folder", [](std::ofstream& out) { out << "x"; });
    FAIL() << "wrote over a folder";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("it is a folder"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 2);
  EXPECT_THROW(io::detail::require_writable_path(dir.path() / "folder", "--save-storage"), std::invalid_argument);
  EXPECT_THROW(io::detail::require_writable_path(dir.path() / "no" / "x.bin", "--save-storage"), std::invalid_argument);
  EXPECT_NO_THROW(io::detail::require_writable_path(dir.path() / "x.bin", "--save-storage"));
}

// Saves refuse special files in the file's place (they would be replaced by a regular file) and
// folders the process cannot write, naming the flag and the path, and leave the special file as it
// was: a FIFO, a character device node the test creates (/dev/null where creating one is not
// permitted), a read-only folder (checked as an unprivileged user where the test runs as root,
// whom permissions do not stop).
TEST(AtomicFile, SavesRefuseSpecialFilesAndUnwritableFolders) {
  TempDir dir;
  const fs::path fifo = dir.path() / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::path device = dir.path() / "null";
  if (::mknod(device.c_str(), S_IFCHR | 0600, ::makedev(1, 3)) != 0) device = "/dev/null";
  for (const auto& [path, kind] : {std::pair{fifo, std::string("a FIFO")}, std::pair{device, std::string("a character device")}}) {
    try {
      io::detail::require_writable_path(path, "--save-storage");
      FAIL() << "accepted " << path;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--save-storage " + path.string() + " is " + kind), std::string::npos) << e.what();
    }
    try {
      io::detail::write_atomically(path, [](std::ofstream& out) { out << "x"; });
      FAIL() << "wrote over " << path;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("it is " + kind + ", not a regular file"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_TRUE(fs::is_character_file(device));
  // A saved n-gram storage refuses the FIFO the same way, before writing anything.
  EXPECT_THROW(NGramStorage(3, 256).save(fifo), std::runtime_error);
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), device.parent_path() == dir.path() ? 2 : 1);

  const fs::path locked = dir.path() / "locked";
  fs::create_directories(locked);
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                              fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  const bool root = ::geteuid() == 0;
  if (root) {
    ASSERT_EQ(::seteuid(65534), 0);  // nobody: the folder's permissions apply
  }
  std::string message;
  try {
    io::detail::require_writable_path(locked / "x.bin", "--save-storage");
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  if (root) {
    ASSERT_EQ(::seteuid(0), 0);
  }
  EXPECT_NE(message.find("--save-storage " + (locked / "x.bin").string() + ": the folder " + locked.string() +
                         " is not writable"),
            std::string::npos)
      << message;
  fs::permissions(locked, fs::perms::owner_all);
}

TEST(Llama2c, RefusesContextsAndVocabulariesBeyondTheLimits) {
  // A header of seq_len 2^24 in a tiny file: refused by the limit before the size check.
  TempDir dir;
  const fs::path file = dir.path() / "huge_context.bin";
  const int32_t header[7] = {64, 172, 1, 8, 4, 256, 1 << 24};
  write_file(file, std::string(reinterpret_cast<const char*>(header), sizeof(header)) + std::string(18000, '\0'));
  expect_format_error([&] { (void)io::parse_llama2c(file); }, file,
                      "seq_len = 16777216 exceeds the limit of 131072 (LoadLimits::max_sequence_length)");
  expect_format_error([&] { (void)io::parse_llama2c(file, {.max_sequence_length = 1 << 24}); }, file, "truncated");
  const int32_t vocab_header[7] = {64, 172, 1, 8, 4, 1 << 24, 256};
  write_file(file, std::string(reinterpret_cast<const char*>(vocab_header), sizeof(vocab_header)));
  expect_format_error([&] { (void)io::parse_llama2c(file); }, file, "vocab_size = 16777216 exceeds the limit");
  // 16,777,215 layers declared in 28 bytes (a fuzzer's find): sized arithmetically, never listed,
  // and the products saturate instead of wrapping.
  const int32_t layers_header[7] = {1 << 24, 1 << 24, (1 << 24) - 1, 8, 4, 512, 256};
  write_file(file, std::string(reinterpret_cast<const char*>(layers_header), sizeof(layers_header)));
  expect_format_error([&] { (void)io::parse_llama2c(file); }, file, "truncated: the header implies 18446744073709551615 bytes");
  const int32_t many_layers[7] = {64, 172, (1 << 24) - 1, 8, 4, 512, 256};
  write_file(file, std::string(reinterpret_cast<const char*>(many_layers), sizeof(many_layers)));
  expect_format_error([&] { (void)io::parse_llama2c(file); }, file, "truncated: the header implies");
}

TEST(Safetensors, BoundsTheHeaderWhileParsing) {
  TempDir dir;
  const fs::path file = dir.path() / "many.safetensors";
  std::string header = "{";
  for (int i = 0; i < 300; ++i) header += "\"t" + std::to_string(i) + "\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]},";
  header.back() = '}';
  write_safetensors(file, header, "");
  EXPECT_EQ(io::parse_safetensors(file).entries.size(), 300u);
  expect_format_error([&] { (void)io::parse_safetensors(file, {.max_json_entries = 100}); }, file,
                      "more than 100 entries (LoadLimits::max_json_entries)");
  expect_format_error([&] { (void)io::parse_safetensors(file, {.max_safetensors_header = 64}); }, file,
                      "exceeds the limit of 64 bytes (LoadLimits::max_safetensors_header)");
  // A deeply nested dtype: refused while parsing, never serialized.
  write_safetensors(file, "{\"t\": {\"dtype\": " + std::string(5000, '[') + std::string(5000, ']') + "}}", "");
  expect_format_error([&] { (void)io::parse_safetensors(file); }, file, "JSON nested deeper than 32 levels");
}

TEST(Llama2cTokenizer, NamesAVocabularyMismatch) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/tok512.bin");
  expect_format_error([&] { (void)io::Llama2cTokenizer::load(path, 256); }, path,
                      "holds 512 tokens but the model's vocabulary has 256");
  expect_format_error([&] { (void)io::Llama2cTokenizer::load(path, 1000); }, path,
                      "holds 512 tokens but the model's vocabulary has 1000");
}

// The merge loop is a priority queue; this is the plain quadratic loop it replaced (the pair whose
// concatenation scores highest, leftmost on ties, merged until none is in the vocabulary).
std::vector<int64_t> merge_naively(const io::Llama2cTokenizer& tokenizer, const std::vector<int64_t>& symbols,
                                   const std::vector<float>& scores,
                                   const std::unordered_map<std::string, int64_t>& lookup) {
  std::vector<int64_t> tokens = symbols;
  while (true) {
    float best = -std::numeric_limits<float>::infinity();
    std::optional<size_t> at;
    int64_t merged = 0;
    for (size_t i = 1; i + 1 < tokens.size(); ++i) {
      const auto it = lookup.find(tokenizer.piece(tokens[i]) + tokenizer.piece(tokens[i + 1]));
      if (it != lookup.end() && scores[static_cast<size_t>(it->second)] > best) {
        best = scores[static_cast<size_t>(it->second)];
        at = i;
        merged = it->second;
      }
    }
    if (!at) return tokens;
    tokens[*at] = merged;
    tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(*at) + 1);
  }
}

TEST(Llama2cTokenizer, PriorityQueueMergesEqualThePlainLoop) {
  SPECDEC_REQUIRE_MODEL(path, "stories260K/tok512.bin");
  const auto tokenizer = io::Llama2cTokenizer::load(path, 512);
  // The scores and first-wins lookup, read back from the file's layout through the public API.
  std::vector<float> scores;
  std::unordered_map<std::string, int64_t> lookup;
  {
    const std::string bytes = read_file(path);
    size_t at = 4;
    for (int64_t i = 0; i < 512; ++i) {
      float score = 0;
      int32_t length = 0;
      std::memcpy(&score, bytes.data() + at, 4);
      std::memcpy(&length, bytes.data() + at + 4, 4);
      scores.push_back(score);
      lookup.emplace(bytes.substr(at + 8, static_cast<size_t>(length)), i);
      at += 8 + static_cast<size_t>(length);
    }
  }
  std::mt19937 rng(5);
  const std::string alphabet = "the cat sat on a mat. Once upon a time, Lily and Tom went to the park!";
  for (int trial = 0; trial < 40; ++trial) {
    std::string text;
    const size_t length = 1 + rng() % 400;
    for (size_t i = 0; i < length; ++i) text += alphabet[rng() % alphabet.size()];
    const std::vector<int64_t> fast = tokenizer.encode(text);
    // The symbols before merging: BOS, the dummy space, one token per character (all in tok512).
    std::vector<int64_t> symbols{io::Llama2cTokenizer::kBos, lookup.at(" ")};
    for (const char c : text) symbols.push_back(lookup.at(std::string(1, c)));
    EXPECT_EQ(fast, merge_naively(tokenizer, symbols, scores, lookup)) << text;
  }
}

}  // namespace

namespace bundled {

using namespace specdec;

// The bundled byte-level pair on held-out Python sources (every tenth file of the training folder).
TEST(BundledPair, GreedyOnHeldOutTextEqualsAutoregressiveAtTwoOrMoreTokensPerTargetCall) {
  if (!std::filesystem::exists("/usr/lib/python3.11")) {
    GTEST_SKIP() << "the held-out text needs /usr/lib/python3.11 (Debian's libpython3.11-stdlib)";
  }
  const auto target_checkpoint = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/target");
  const auto drafter_checkpoint = io::load_llama(SPECDEC_BUNDLED_MODELS_DIR "/drafter");
  models::LlamaModel<StaticKVCache> target(target_checkpoint.config, target_checkpoint.weights);
  models::LlamaModel<StaticKVCache> drafter(drafter_checkpoint.config, drafter_checkpoint.weights);
  // The drafter costs at most a fifth of the target's multiply-adds per token.
  const auto macs = [](const models::LlamaConfig& c) {
    return c.n_layers * (2 * c.dim * c.dim + 2 * c.kv_dim() * c.dim + 3 * c.dim * c.hidden_dim) + c.vocab_size * c.dim;
  };
  EXPECT_GE(macs(target.config()), 5 * macs(drafter.config()));

  const auto corpus = text::load_python_corpus("/usr/lib/python3.11");
  const io::ByteTokenizer bytes;
  GenerationStats total;
  for (const auto& prompt_text : text::line_prompts(corpus.held_out, 8, 200)) {
    const auto prompt = bytes.encode(prompt_text);
    const auto result = speculative_generate(drafter, target, prompt, {.max_new_tokens = 128, .gamma = 4});
    EXPECT_EQ(result.tokens, autoregressive_generate(target, prompt, {.max_new_tokens = 128}).tokens);
    total += result.stats;
  }
  std::cout << "bundled pair, held-out text, gamma 4: " << total.tokens_per_target_call()
            << " tokens per target call, acceptance rate " << total.acceptance_rate() << "\n";
  EXPECT_GE(total.tokens_per_target_call(), 2.0);
}


// ---- Hugging Face families: Llama 3.x (rope_scaling llama3), Qwen2/2.5 (q, k, v biases),
// Mistral (sliding window), tied embeddings. Each checkpoint is written as the family writes it
// (config.json keys of the real configs, tensor names of the real checkpoints, q and k rows in
// Hugging Face's rotate-half order), loaded, and checked against a forward written here on the
// raw tensors with plain tensor ops and no cache. Its formulas follow Hugging Face transformers:
// rotate_half and apply_rotary_pos_emb (modeling_llama.py), the llama3 frequencies
// (_compute_llama3_parameters in modeling_rope_utils.py), Mistral's sliding-window mask (a query
// at position i sees keys j with i - sliding_window < j <= i), Qwen2's biased q, k, v projections.

struct Family {
  std::string name;
  nlohmann::json config;
};

std::vector<Family> hf_families() {
  const nlohmann::json common = {{"hidden_act", "silu"},          {"hidden_size", 64},
                                 {"initializer_range", 0.02},     {"intermediate_size", 96},
                                 {"max_position_embeddings", 256}, {"num_attention_heads", 4},
                                 {"num_hidden_layers", 2},        {"num_key_value_heads", 2},
                                 {"torch_dtype", "bfloat16"},     {"use_cache", true},
                                 {"vocab_size", 300}};
  nlohmann::json llama3 = common;  // Llama 3.2's keys
  llama3.update({{"architectures", {"LlamaForCausalLM"}}, {"attention_bias", false}, {"attention_dropout", 0.0},
                 {"bos_token_id", 128000}, {"eos_token_id", {128001, 128008, 128009}}, {"head_dim", 16},
                 {"mlp_bias", false}, {"model_type", "llama"}, {"pretraining_tp", 1}, {"rms_norm_eps", 1e-5},
                 {"rope_scaling", {{"factor", 32.0}, {"high_freq_factor", 4.0}, {"low_freq_factor", 1.0},
                                   {"original_max_position_embeddings", 64}, {"rope_type", "llama3"}}},
                 {"rope_theta", 500000.0}, {"tie_word_embeddings", true}, {"transformers_version", "4.45.0.dev0"}});
  nlohmann::json qwen2 = common;  // Qwen2.5's keys
  qwen2.update({{"architectures", {"Qwen2ForCausalLM"}}, {"attention_dropout", 0.0}, {"bos_token_id", 151643},
                {"eos_token_id", 151645}, {"max_window_layers", 2}, {"model_type", "qwen2"}, {"rms_norm_eps", 1e-6},
                {"rope_scaling", nullptr}, {"rope_theta", 1000000.0}, {"sliding_window", 256},
                {"tie_word_embeddings", true}, {"transformers_version", "4.43.1"}, {"use_sliding_window", false}});
  nlohmann::json mistral = common;  // Mistral 7B v0.1's keys, with a window of 5 positions
  mistral.update({{"architectures", {"MistralForCausalLM"}}, {"bos_token_id", 1}, {"eos_token_id", 2},
                  {"model_type", "mistral"}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                  {"sliding_window", 5}, {"tie_word_embeddings", false}, {"transformers_version", "4.34.0.dev0"}});
  nlohmann::json linear = common;  // a Llama 2 with linear position interpolation and attention_bias
  linear.update({{"architectures", {"LlamaForCausalLM"}}, {"attention_bias", true}, {"model_type", "llama"},
                 {"rms_norm_eps", 1e-5}, {"rope_scaling", {{"type", "linear"}, {"factor", 4.0}}},
                 {"tie_word_embeddings", false}});
  return {{"llama3", llama3}, {"qwen2", qwen2}, {"mistral", mistral}, {"llama_linear", linear}};
}

// Random tensors under the family's real names.
std::map<std::string, at::Tensor> hf_family_tensors(const nlohmann::json& config, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto normal = [&](std::vector<int64_t> shape, double std) {
    return at::normal(0.0, std, shape, gen, at::TensorOptions(at::kDouble));
  };
  const int64_t d = config["hidden_size"], h = config["intermediate_size"], v = config["vocab_size"];
  const int64_t kv = d / config["num_attention_heads"].get<int64_t>() * config["num_key_value_heads"].get<int64_t>();
  const std::string type = config["model_type"];
  const bool qkv_bias = type == "qwen2" || config.value("attention_bias", false);
  std::map<std::string, at::Tensor> t;
  t["model.embed_tokens.weight"] = normal({v, d}, 1.0);
  for (int64_t i = 0; i < config["num_hidden_layers"].get<int64_t>(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t[p + "input_layernorm.weight"] = 1.0 + normal({d}, 0.1);
    t[p + "post_attention_layernorm.weight"] = 1.0 + normal({d}, 0.1);
    t[p + "self_attn.q_proj.weight"] = normal({d, d}, 1.0 / 8);
    t[p + "self_attn.k_proj.weight"] = normal({kv, d}, 1.0 / 8);
    t[p + "self_attn.v_proj.weight"] = normal({kv, d}, 1.0 / 8);
    t[p + "self_attn.o_proj.weight"] = normal({d, d}, 1.0 / 8);
    t[p + "mlp.gate_proj.weight"] = normal({h, d}, 1.0 / 8);
    t[p + "mlp.up_proj.weight"] = normal({h, d}, 1.0 / 8);
    t[p + "mlp.down_proj.weight"] = normal({d, h}, 1.0 / 10);
    if (qkv_bias) {
      t[p + "self_attn.q_proj.bias"] = normal({d}, 0.5);
      t[p + "self_attn.k_proj.bias"] = normal({kv}, 0.5);
      t[p + "self_attn.v_proj.bias"] = normal({kv}, 0.5);
    }
    if (type == "llama" && config.value("attention_bias", false)) t[p + "self_attn.o_proj.bias"] = normal({d}, 0.1);
  }
  t["model.norm.weight"] = 1.0 + normal({d}, 0.1);
  if (!config.value("tie_word_embeddings", false)) t["lm_head.weight"] = normal({v, d}, 0.5);
  return t;
}

// The rotary inverse frequencies, loop by loop, as the family's config says.
std::vector<double> hf_inverse_frequencies(const nlohmann::json& config, int64_t head_dim) {
  const double theta = config.value("rope_theta", 10000.0);
  std::vector<double> f;
  for (int64_t i = 0; i < head_dim; i += 2) f.push_back(1.0 / std::pow(theta, static_cast<double>(i) / static_cast<double>(head_dim)));
  if (!config.contains("rope_scaling") || config["rope_scaling"].is_null()) return f;
  const auto& r = config["rope_scaling"];
  const std::string type = r.contains("rope_type") ? r["rope_type"] : r["type"];
  const double factor = r["factor"];
  for (double& x : f) {
    if (type == "linear") {
      x /= factor;
      continue;
    }
    const double original = r["original_max_position_embeddings"], low = r["low_freq_factor"], high = r["high_freq_factor"];
    const double wavelength = 2 * std::numbers::pi / x;
    if (wavelength > original / low) {
      x /= factor;
    } else if (wavelength >= original / high) {  // medium: smooth between scaled and kept
      const double smooth = (original / wavelength - low) / (high - low);
      x = (1 - smooth) * x / factor + smooth * x;
    }
  }
  return f;
}

// Logits [T, vocab] of the whole sequence, straight from the Hugging Face tensors.
at::Tensor hf_reference_forward(const nlohmann::json& config, std::map<std::string, at::Tensor> t,
                                const std::vector<int64_t>& tokens) {
  const int64_t d = config["hidden_size"], heads = config["num_attention_heads"], kv_heads = config["num_key_value_heads"];
  const int64_t hd = d / heads, n = static_cast<int64_t>(tokens.size());
  const double eps = config["rms_norm_eps"];
  const int64_t window = config["model_type"] == "mistral" ? config["sliding_window"].get<int64_t>() : 0;
  const auto rms = [&](const at::Tensor& x, const at::Tensor& w) { return x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * w; };
  const auto linear = [&](const at::Tensor& x, const std::string& name) {
    const at::Tensor y = at::matmul(x, t.at(name + ".weight").t());
    return t.count(name + ".bias") ? y + t.at(name + ".bias") : y;
  };
  const std::vector<double> inv = hf_inverse_frequencies(config, hd);
  at::Tensor cos = at::empty({n, hd}, at::kDouble), sin = at::empty({n, hd}, at::kDouble);
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t i = 0; i < hd; ++i) {  // emb = cat(freqs, freqs)
      const double angle = static_cast<double>(p) * inv[static_cast<size_t>(i % (hd / 2))];
      cos[p][i] = std::cos(angle);
      sin[p][i] = std::sin(angle);
    }
  }
  const auto rotate_half = [&](const at::Tensor& x) {
    return at::cat({-x.narrow(-1, hd / 2, hd / 2), x.narrow(-1, 0, hd / 2)}, -1);
  };
  at::Tensor mask = at::zeros({n, n}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      if (j > i || (window > 0 && j <= i - window)) mask[i][j] = -std::numeric_limits<double>::infinity();
    }
  }
  at::Tensor x = t.at("model.embed_tokens.weight").index_select(0, at::tensor(tokens, at::kLong));
  for (int64_t l = 0; l < config["num_hidden_layers"].get<int64_t>(); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const at::Tensor h = rms(x, t.at(p + "input_layernorm.weight"));
    at::Tensor q = linear(h, p + "self_attn.q_proj").view({n, heads, hd}).transpose(0, 1);  // [heads, n, hd]
    at::Tensor k = linear(h, p + "self_attn.k_proj").view({n, kv_heads, hd}).transpose(0, 1);
    const at::Tensor v = linear(h, p + "self_attn.v_proj").view({n, kv_heads, hd}).transpose(0, 1);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    const at::Tensor keys = k.repeat_interleave(heads / kv_heads, 0), values = v.repeat_interleave(heads / kv_heads, 0);
    const at::Tensor weights = (at::matmul(q, keys.transpose(1, 2)) / std::sqrt(static_cast<double>(hd)) + mask).softmax(-1);
    x = x + linear(at::matmul(weights, values).transpose(0, 1).reshape({n, d}), p + "self_attn.o_proj");
    const at::Tensor f = rms(x, t.at(p + "post_attention_layernorm.weight"));
    x = x + at::matmul(at::silu(linear(f, p + "mlp.gate_proj")) * linear(f, p + "mlp.up_proj"),
                       t.at(p + "mlp.down_proj.weight").t());
  }
  const at::Tensor output = t.count("lm_head.weight") ? t.at("lm_head.weight") : t.at("model.embed_tokens.weight");
  return at::matmul(rms(x, t.at("model.norm.weight")), output.t());
}

// A rank's shard read from the file (only its slices) equals llama_shard of the whole model, for
// every family (biases, tied classifiers); a split the model does not divide into is refused.
TEST(HfFamilies, ShardsReadFromTheFileEqualTheWholeModelsCut) {
  for (const Family& family : hf_families()) {
    SCOPED_TRACE(family.name);
    TempDir dir;
    write_file(dir.path() / "config.json", family.config.dump(2));
    io::save_safetensors(dir.path() / "model.safetensors", hf_family_tensors(family.config, 5), {{"format", "pt"}});
    const io::HfLlamaCheckpoint whole = io::load_hf_llama(dir.path(), at::kDouble);
    for (int64_t rank = 0; rank < 2; ++rank) {
      const io::HfLlamaCheckpoint part = io::load_hf_llama(dir.path(), at::kDouble, {}, {.rank = rank, .world_size = 2});
      const models::LlamaWeights cut = models::llama_shard(whole.config, whole.weights, rank, 2);
      const auto same = [&](const at::Tensor& a, const at::Tensor& b, const std::string& name) {
        ASSERT_EQ(a.defined(), b.defined()) << name;
        if (a.defined()) {
          EXPECT_TRUE(at::equal(a, b)) << name << " of rank " << rank;
        }
      };
      same(part.weights.token_embedding, cut.token_embedding, "token_embedding");
      same(part.weights.norm, cut.norm, "norm");
      if (!whole.tied_classifier) same(part.weights.output, cut.output, "output");
      ASSERT_EQ(part.weights.layers.size(), cut.layers.size());
      for (size_t i = 0; i < cut.layers.size(); ++i) {
        const auto& p = part.weights.layers[i];
        const auto& q = cut.layers[i];
        EXPECT_EQ(p.wq.size(0), whole.config.dim / 2);
        using L = models::LlamaLayerWeights;
        const std::pair<const char*, at::Tensor L::*> members[] = {
            {"wq", &L::wq}, {"wk", &L::wk}, {"wv", &L::wv}, {"wo", &L::wo}, {"w1", &L::w1}, {"w2", &L::w2},
            {"w3", &L::w3}, {"bq", &L::bq}, {"bk", &L::bk}, {"bv", &L::bv}, {"bo", &L::bo},
            {"attention_norm", &L::attention_norm}, {"ffn_norm", &L::ffn_norm}};
        for (const auto& [name, member] : members) same(p.*member, q.*member, name);
      }
    }
    test::expect_invalid([&] { (void)io::load_hf_llama(dir.path(), at::kDouble, {}, {.rank = 0, .world_size = 4}); },
                   {"n_kv_heads (2) does not divide by the world size (4)"});
    test::expect_invalid([&] { (void)io::load_hf_llama(dir.path(), at::kDouble, {}, {.rank = 2, .world_size = 2}); },
                   {"Shard::rank must be in [0, world_size = 2), got 2"});
  }
}

TEST(HfFamilies, LoadAndMatchAPlainForwardOfTheRawTensors) {
  const std::vector<int64_t> tokens{5, 17, 250, 3, 99, 42, 7, 7, 128, 64, 1, 299, 33, 80};  // longer than the window
  for (const Family& family : hf_families()) {
    SCOPED_TRACE(family.name);
    TempDir dir;
    const auto tensors = hf_family_tensors(family.config, 3);
    write_file(dir.path() / "config.json", family.config.dump(2));
    io::save_safetensors(dir.path() / "model.safetensors", tensors, {{"format", "pt"}});
    io::HfLlamaCheckpoint checkpoint = io::load_hf_llama(dir.path(), at::kDouble);
    if (checkpoint.tied_classifier) checkpoint.weights.output = checkpoint.weights.token_embedding;
    const models::LlamaConfig config = checkpoint.config;
    const at::Tensor expected = hf_reference_forward(family.config, tensors, tokens);
    const at::Tensor ids = at::tensor(tokens, at::kLong).view({1, -1});

    models::LlamaModel<DynamicKVCache> model(config, checkpoint.weights);
    auto cache = model.make_cache(1);
    const at::Tensor whole = model.forward(ids, cache)[0];
    EXPECT_LT((whole - expected).abs().max().item<double>(), 1e-9);

    // In pieces through a cache (the window then hides cached positions too), both cache types,
    // and as a chain through the tree-attention forward.
    models::LlamaModel<StaticKVCache> static_model(config, checkpoint.weights);
    auto static_cache = static_model.make_cache(1);
    auto chain_cache = model.make_cache(1);
    int64_t start = 0;
    for (const int64_t piece : {4, 1, 3, 1, 5}) {
      const at::Tensor part = ids.narrow(1, start, piece);
      const at::Tensor reference = expected.narrow(0, start, piece);
      EXPECT_LT((static_model.forward(part, static_cache)[0] - reference).abs().max().item<double>(), 1e-9) << start;
      std::vector<int64_t> parents(static_cast<size_t>(piece));
      for (int64_t i = 0; i < piece; ++i) parents[static_cast<size_t>(i)] = i - 1;
      EXPECT_LT((model.forward_tree(part, chain_cache, parents)[0] - reference).abs().max().item<double>(), 1e-9) << start;
      start += piece;
    }
  }
}

// Generation on each family stays exact: speculative (a one-layer self-drafter) and batched
// greedy output equal autoregressive decoding, past the Mistral window.
TEST(HfFamilies, SpeculativeAndBatchedGreedyEqualAutoregressive) {
  for (const Family& family : hf_families()) {
    SCOPED_TRACE(family.name);
    TempDir dir;
    write_file(dir.path() / "config.json", family.config.dump());
    io::save_safetensors(dir.path() / "model.safetensors", hf_family_tensors(family.config, 4), {{"format", "pt"}});
    io::HfLlamaCheckpoint c = io::load_hf_llama(dir.path(), at::kDouble);
    if (c.tied_classifier) c.weights.output = c.weights.token_embedding;
    models::LlamaModel<StaticKVCache> target(c.config, c.weights);
    models::LlamaModel<StaticKVCache> drafter(models::truncated(c.config, c.weights, 1));
    const std::vector<std::vector<int64_t>> prompts{{1, 2, 3}, {9, 8, 7, 6, 5, 4, 200}};
    const auto batch = speculative_generate_batch(drafter, target, prompts, {.max_new_tokens = 16, .gamma = 3});
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto reference = autoregressive_generate(target, prompts[r], {.max_new_tokens = 16});
      EXPECT_EQ(speculative_generate(drafter, target, prompts[r], {.max_new_tokens = 16, .gamma = 4}).tokens,
                reference.tokens);
      EXPECT_EQ(batch[r].tokens, reference.tokens) << r;
    }
  }
}

// save_hf_llama writes each family's layout back, and it loads to the same model.
TEST(HfFamilies, SaveWritesTheFamilyAndLoadsBack) {
  for (const Family& family : hf_families()) {
    SCOPED_TRACE(family.name);
    TempDir dir, copy;
    write_file(dir.path() / "config.json", family.config.dump());
    io::save_safetensors(dir.path() / "model.safetensors", hf_family_tensors(family.config, 5), {{"format", "pt"}});
    const io::HfLlamaCheckpoint c = io::load_hf_llama(dir.path(), at::kDouble);
    io::save_hf_llama(copy.path(), c.config, c.weights, at::kDouble);
    const auto written = nlohmann::json::parse(read_file(copy.path() / "config.json"));
    EXPECT_EQ(written["model_type"], family.config["model_type"]);
    EXPECT_EQ(written["architectures"], family.config["architectures"]);
    const io::HfLlamaCheckpoint back = io::load_hf_llama(copy.path(), at::kDouble);
    EXPECT_EQ(back.config.rope_scaling.type, c.config.rope_scaling.type);
    EXPECT_EQ(back.config.sliding_window, c.config.sliding_window);
    EXPECT_EQ(back.config.qkv_bias, c.config.qkv_bias);
    models::LlamaModel<DynamicKVCache> a(c.config, c.weights), b(back.config, back.weights);
    const at::Tensor ids = at::tensor(std::vector<int64_t>{4, 8, 15, 16, 23, 42, 108}, at::kLong).view({1, -1});
    auto ca = a.make_cache(1), cb = b.make_cache(1);
    EXPECT_TRUE(at::allclose(a.forward(ids, ca), b.forward(ids, cb), 0, 1e-12));
  }
}

}  // namespace bundled

}  // namespace test_io
