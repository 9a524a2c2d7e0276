// specdec-generate: text in, text out, with speculative or autoregressive decoding.
//
// By default it runs the bundled pair (models/bundled: a byte-level target and a drafter trained
// on Python sources); --target/--drafter take a llama2.c checkpoint file or a Hugging Face Llama
// folder, and --tokenizer a llama2.c tokenizer file or a Hugging Face tokenizer.json (by default
// the target folder's tokenizer.json, where it has one).
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/hf_tokenizer.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>
#include <specdec/text/prompts.hpp>
#ifdef SPECDEC_HAVE_REMOTE
#include <specdec/remote/client.hpp>
#endif

#include <torch/version.h>
#include <unistd.h>

#include "support/cli.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <variant>

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

namespace {

using namespace specdec;
using Model = models::LlamaModel<StaticKVCache>;

struct Arguments {
  std::string target = SPECDEC_BUNDLED_MODELS_DIR "/target";
  std::string drafter = SPECDEC_BUNDLED_MODELS_DIR "/drafter";
  std::string tokenizer;
  bool chat = false;
  std::string mode = "speculative";
  std::string prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";
  int64_t gamma = 4;
  std::string gamma_policy = "fixed";
  int64_t gamma_min = 1;
  std::optional<int64_t> gamma_max;
  double egag_beta = 0.0;
  double p_min = 0.0;
  double entropy_gate = 1.0;
  std::string verify = "rejection";
  double threshold = 0.25;
  bool calibrate = false;
  std::string dev_file;
  std::vector<double> thresholds{0.15, 0.2, 0.25, 0.3, 0.35};
  double target_acceptance = 0.7;
  int64_t num_beams = 4;
  int64_t trajectories = 1;
  bool deterministic = false;
  int64_t tree_nodes = 64;
  int64_t ngram_order = 3;
  int64_t filler = 3;
  NGramDraftRule draft_rule;
  std::string storage, save_storage;
  double length_penalty = 1.0;
  int64_t max_new_tokens = 200;
  double temperature = 0.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<int64_t> eos;
  std::vector<std::string> stops;
  std::string batch_file;
  std::string device = "cpu";
  std::string dtype = "float32";
  int64_t max_seq_len = io::LoadLimits{}.max_sequence_length;
  int threads = 1;
  bool compare = false, trace = false, json = false;
  int compare_runs = 3;
  std::string verifier, verifier_token_file;
  std::string verifier_tls_ca, verifier_tls_cert, verifier_tls_key;
  double added_latency_ms = 0;
  bool half_q = false;
};

// --device: "cpu", "cuda" or "cuda:N", with a CUDA device present.
at::Device parse_device(const std::string& text) {
  if (text != "cpu" && text.rfind("cuda", 0) != 0) {
    throw std::invalid_argument("--device must be cpu or cuda[:N], got " + text);
  }
  std::optional<at::Device> device;
  try {
    device.emplace(text);
  } catch (const std::exception&) {
    throw std::invalid_argument("--device must be cpu or cuda[:N], got " + text);
  }
  if (device->is_cuda() && !at::hasCUDA()) {
    throw std::invalid_argument("--device " + text + ": this libtorch build sees no CUDA device");
  }
  return *device;
}

// --dtype: float32, float16 or bfloat16.
at::ScalarType parse_dtype(const std::string& text) {
  if (text == "float32") return at::kFloat;
  if (text == "float16") return at::kHalf;
  if (text == "bfloat16") return at::kBFloat16;
  throw std::invalid_argument("--dtype must be float32, float16 or bfloat16, got " + text);
}

// Whether this libtorch multiplies matrices of `dtype` on `device` (libtorch 1.13 has no float16
// matrix products on the CPU; 2.x has).
bool has_matrix_products(at::ScalarType dtype, const at::Device& device) {
  try {
    const at::Tensor x = at::ones({2, 2}, at::TensorOptions().dtype(dtype).device(device));
    (void)at::linear(x, x);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Which modes each mode-specific flag applies to; giving one in another mode is an error.
struct FlagModes {
  const char* flag;
  std::vector<std::string> modes;
};

const std::vector<FlagModes>& flag_modes() {
  static const std::vector<std::string> drafting{"speculative", "ngram", "prompt-lookup"};
  static const std::vector<FlagModes> table{
      {"--drafter", {"speculative"}},
      {"--gamma", {"speculative", "ngram", "prompt-lookup"}},
      {"--gamma-policy", {"speculative"}},
      {"--gamma-min", {"speculative"}},
      {"--gamma-max", {"speculative"}},
      {"--egag-beta", {"speculative"}},
      {"--p-min", {"speculative"}},
      {"--entropy-gate", {"speculative"}},
      {"--verify", {"speculative"}},
      {"--threshold", {"speculative"}},
      {"--calibrate", {"speculative"}},
      {"--dev-file", {"speculative"}},
      {"--thresholds", {"speculative"}},
      {"--target-acceptance", {"speculative"}},
      {"--ngram-order", {"ngram"}},
      {"--filler", drafting},
      {"--draft-min-count", {"ngram"}},
      {"--draft-min-share", {"ngram"}},
      {"--draft-min-context", {"ngram"}},
      {"--storage", {"ngram", "stand"}},
      {"--save-storage", {"ngram", "stand"}},
      {"--trajectories", {"stand"}},
      {"--deterministic", {"stand"}},
      {"--tree-nodes", {"stand"}},
      {"--num-beams", {"beam"}},
      {"--length-penalty", {"beam"}},
      {"--batch-file", {"speculative", "autoregressive", "ngram"}},
      {"--temperature", {"speculative", "autoregressive", "ngram", "prompt-lookup", "stand"}},
      {"--top-k", {"speculative", "autoregressive", "ngram", "prompt-lookup", "stand"}},
      {"--top-p", {"speculative", "autoregressive", "ngram", "prompt-lookup", "stand"}},
      {"--seed", {"speculative", "autoregressive", "ngram", "prompt-lookup", "stand"}},
      {"--stop", {"speculative", "autoregressive", "ngram", "prompt-lookup"}},
      {"--compare", {"speculative", "autoregressive", "ngram", "prompt-lookup", "stand"}},
      {"--trace", {"speculative", "autoregressive", "ngram", "prompt-lookup"}},
  };
  return table;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
  return out;
}

// Throws std::invalid_argument naming `flag` unless `path` is a readable regular file.
void require_file(const std::string& flag, const std::string& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) throw std::invalid_argument(flag + " " + path + ": no such file");
  if (!std::filesystem::is_regular_file(path, error)) {
    throw std::invalid_argument(flag + " " + path + ": not a regular file");
  }
}

// Parses the command line with CLI11. Exits 0 after --help; throws CLI::ParseError (a bad flag or
// value, named) or std::invalid_argument (a flag that does not apply to the mode, or a bad
// combination).
Arguments parse(int argc, char** argv) {
  Arguments a;
  CLI::App app("Generates a continuation of a prompt and prints it as it is produced, then statistics.",
               "specdec-generate");
  app.get_formatter()->column_width(30);
  const auto in = [](const std::vector<std::string>& choices) { return CLI::IsMember(choices); };
  constexpr int64_t kMaxTokens = int64_t{1} << 40;

  const std::string models = "Models";
  app.add_option("--target", a.target, "target: llama2.c .bin file or Hugging Face Llama folder (default: the bundled target)")
      ->group(models);
  app.add_option("--drafter", a.drafter, "drafter, same formats (default: the bundled drafter)")->group(models);
  app.add_option("--tokenizer", a.tokenizer,
                 "llama2.c tokenizer file, or tokenizer.json or its folder (default: the target folder's "
                 "tokenizer.json; without one the models are byte-level)")
      ->group(models);
  app.add_flag("--chat", a.chat, "wrap the prompt in the tokenizer's chat format (Llama 3, ChatML, Zephyr, [INST])")
      ->group(models);
  app.add_option("--device", a.device, "cpu (default) or cuda[:N]: where the models run")->group(models);
  app.add_option("--dtype", a.dtype, "float32 (default), float16 or bfloat16 (norms, softmax and verification stay float32)")
      ->check(in({"float32", "float16", "bfloat16"}))->group(models);
  app.add_option("--threads", a.threads,
                 "CPU threads of libtorch and of the loaded BLAS together (default 1: see docs/performance.md)")
      ->check(cli::integer<int>(1, 1024))->group(models);
  app.add_option("--max-seq-len", a.max_seq_len,
                 "the longest context a checkpoint may declare (default 131072; raise it for longer ones)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 24))->group(models);

  const std::string common = "Decoding (every mode)";
  app.add_option("--mode", a.mode, "speculative (default), autoregressive, ngram, prompt-lookup, stand or beam")
      ->check(in({"speculative", "autoregressive", "ngram", "prompt-lookup", "stand", "beam"}))->group(common);
  app.add_option("--prompt", a.prompt, "the prompt (default: a line of Python)")->group(common);
  app.add_option("--max-new-tokens", a.max_new_tokens, "tokens to generate (default 200)")
      ->check(cli::integer<int64_t>(0, kMaxTokens))->group(common);
  app.add_option("--eos", a.eos, "an end token id (repeatable; llama2.c models default to 2)")
      ->check(cli::integer<int64_t>(0, kMaxTokens))->group(common);

  const std::string sampling = "Sampling (all modes but beam)";
  app.add_option("--temperature", a.temperature, "0 = greedy (default); > 0 samples")
      ->check(cli::real(0.0, 1e6))->group(sampling);
  app.add_option("--top-k", a.top_k, "keep the K most probable tokens (needs --temperature > 0)")
      ->check(cli::integer<int64_t>(1, kMaxTokens))->group(sampling);
  app.add_option("--top-p", a.top_p, "keep the nucleus of mass P (needs --temperature > 0)")
      ->check(cli::real(0.0, 1.0, /*low_open=*/true))->group(sampling);
  app.add_option("--seed", a.seed, "sampling seed (default 0)")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()))->group(sampling);
  app.add_option("--stop", a.stops, "stop when the output contains TEXT's tokens (repeatable; kept in the output)")
      ->group(sampling);

  const std::string speculative = "Speculative decoding (--mode speculative; --gamma also ngram, prompt-lookup)";
  app.add_option("--gamma", a.gamma, "drafts per step (default 4)")
      ->check(cli::integer<int64_t>(1, 1024))->group(speculative);
  app.add_option("--gamma-policy", a.gamma_policy, "fixed (default), egag (entropy-adaptive) or schedule (+2 / -1)")
      ->check(in({"fixed", "egag", "schedule"}))->group(speculative);
  app.add_option("--gamma-min", a.gamma_min, "egag, schedule: fewest drafts per step (default 1)")
      ->check(cli::integer<int64_t>(1, 1024))->group(speculative);
  app.add_option("--gamma-max", a.gamma_max, "egag, schedule: most drafts per step (default: --gamma)")
      ->check(cli::integer<int64_t>(1, 1024))->group(speculative);
  app.add_option("--egag-beta", a.egag_beta, "egag: EMA smoothing of the drafter's entropy (default 0)")
      ->check(cli::real(0.0, 1.0, false, /*high_open=*/true))->group(speculative);
  app.add_option("--p-min", a.p_min, "stop drafting where the drafter's top probability is below P")
      ->check(cli::real(0.0, 1.0))->group(speculative);
  app.add_option("--entropy-gate", a.entropy_gate, "stop drafting where the drafter's normalised entropy is above H")
      ->check(cli::real(0.0, 1.0))->group(speculative);
  app.add_option("--verify", a.verify, "rejection (default, exact) or threshold (lossy)")
      ->check(in({"rejection", "threshold"}))->group(speculative);
  app.add_option("--threshold", a.threshold, "threshold verification's tau (default 0.25)")
      ->check(cli::real(0.0, 1.0))->group(speculative);
  app.add_flag("--calibrate", a.calibrate, "choose --threshold first: run the grid on the dev prompts and print it")
      ->group(speculative);
  app.add_option("--dev-file", a.dev_file, "dev prompts for --calibrate: 8 windows of this text (default: the prompt)")
      ->group(speculative);
  std::string thresholds;
  app.add_option("--thresholds", thresholds, "the --calibrate grid (default 0.15,0.2,0.25,0.3,0.35)")->group(speculative);
  app.add_option("--target-acceptance", a.target_acceptance, "--calibrate aims at this acceptance rate (default 0.7)")
      ->check(cli::real(0.0, 1.0))->group(speculative);

  const std::string ngram = "N-gram drafting (--mode ngram; --filler also prompt-lookup; storages also stand)";
  app.add_option("--ngram-order", a.ngram_order, "n of a new n-gram storage (default 3)")
      ->check(cli::integer<int64_t>(2, 8))->group(ngram);
  app.add_option("--filler", a.filler, "teach the storage the target's top-K per position (default 3; 1 = off)")
      ->check(cli::integer<int64_t>(1, 64))->group(ngram);
  app.add_option("--draft-min-count", a.draft_rule.min_count,
                 "confident drafting: stop where the best follower was seen fewer times (default 1 = off)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 31))->group(ngram);
  app.add_option("--draft-min-share", a.draft_rule.min_share,
                 "confident drafting: stop where the best follower has a smaller share of its context "
                 "(default 0 = off; 0.9 with --draft-min-context n-1 drafts best on bench_ngram's stream)")
      ->check(cli::real(0.0, 1.0))->group(ngram);
  app.add_option("--draft-min-context", a.draft_rule.min_context,
                 "confident drafting: back off to contexts of at least this many tokens (default 1)")
      ->check(cli::integer<int64_t>(1, 128))->group(ngram);
  app.add_option("--storage", a.storage, "start from a storage saved with --save-storage")->group(ngram);
  app.add_option("--save-storage", a.save_storage, "save the storage after generating")->group(ngram);

  const std::string stand = "STAND (--mode stand)";
  app.add_option("--trajectories", a.trajectories, "sample N generations of the prompt sharing one memory")
      ->check(cli::integer<int64_t>(1, 1 << 20))->group(stand);
  app.add_flag("--deterministic", a.deterministic, "draft the memory's most probable tokens, not Gumbel draws")
      ->group(stand);
  app.add_option("--tree-nodes", a.tree_nodes, "nodes of the default tree template (default 64)")
      ->check(cli::integer<int64_t>(1, 1024))->group(stand);

  const std::string beam = "Beam search (--mode beam)";
  app.add_option("--num-beams", a.num_beams, "beams (default 4; at most 64: each holds a cache)")
      ->check(cli::integer<int64_t>(1, 64))->group(beam);
  app.add_option("--length-penalty", a.length_penalty, "beam score = log-probability / length^A (default 1)")
      ->check(cli::real(-100.0, 100.0))->group(beam);

  const std::string remote = "Remote verification (the target on a specdec-verifier; speculative, autoregressive)";
  app.add_option("--verifier", a.verifier, "HOST:PORT of a specdec-verifier: --drafter drafts here, the server verifies")
      ->group(remote);
  app.add_option("--verifier-token-file", a.verifier_token_file,
                 "the server's shared secret, first line (default: $SPECDEC_VERIFIER_TOKEN)")
      ->group(remote);
  app.add_option("--verifier-tls-ca", a.verifier_tls_ca, "connect over TLS, trusting the CAs in this PEM file")
      ->group(remote);
  app.add_option("--verifier-tls-cert", a.verifier_tls_cert,
                 "this client's certificate (PEM), for servers that require one (with --verifier-tls-key)")
      ->group(remote);
  app.add_option("--verifier-tls-key", a.verifier_tls_key, "the private key of --verifier-tls-cert (PEM)")->group(remote);
  app.add_option("--added-latency-ms", a.added_latency_ms,
                 "simulate a slower link: sleep this long before each call (default 0)")
      ->check(cli::real(0.0, 60000.0))->group(remote);
  app.add_flag("--half-q", a.half_q, "send dense drafter distributions as float16 (half the bytes, see docs/remote.md)")
      ->group(remote);

  const std::string output = "Output";
  app.add_option("--batch-file", a.batch_file,
                 "generate for every line of FILE as one batch (speculative, autoregressive, ngram); \\n in a line "
                 "stands for a newline")
      ->group(output);
  app.add_flag("--compare", a.compare,
               "also run autoregressive decoding and print the speedup: both warmed up by one untimed run, then "
               "--compare-runs timed runs of each in alternating order, neither streaming its text, medians compared")
      ->group(output);
  app.add_option("--compare-runs", a.compare_runs, "timed runs of each mode with --compare (default 3)")
      ->check(CLI::Range(1, 100))
      ->group(output);
  app.add_flag("--trace", a.trace, "show every step: accepted drafts, rejected drafts, the target's token")
      ->group(output);
  app.add_flag("--json", a.json, "print the statistics as one JSON object instead of text")->group(output);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success&) {
    std::cout << app.help();
    std::exit(0);
  }
  if (!thresholds.empty()) a.thresholds = cli::real_list("--thresholds", thresholds, 0.0, 1.0);

  for (const FlagModes& entry : flag_modes()) {
    if (app.count(entry.flag) > 0 && std::find(entry.modes.begin(), entry.modes.end(), a.mode) == entry.modes.end()) {
      throw std::invalid_argument(std::string(entry.flag) + " applies to --mode " + join(entry.modes) +
                                  ", not --mode " + a.mode);
    }
  }
  if (a.temperature == 0 && (app.count("--top-k") > 0 || app.count("--top-p") > 0)) {
    throw std::invalid_argument("--top-k and --top-p apply when sampling: give --temperature > 0 too");
  }
  if (!a.storage.empty() && app.count("--ngram-order") > 0) {
    throw std::invalid_argument("--ngram-order does not apply with --storage: the saved storage fixes n");
  }
  if (a.gamma_policy == "fixed" && (app.count("--gamma-min") > 0 || app.count("--gamma-max") > 0 ||
                                    app.count("--egag-beta") > 0)) {
    throw std::invalid_argument("--gamma-min, --gamma-max and --egag-beta apply to --gamma-policy egag or schedule");
  }
  if (a.verify != "threshold" && !a.calibrate && app.count("--threshold") > 0) {
    throw std::invalid_argument("--threshold applies to --verify threshold");
  }
  if (!a.calibrate && (app.count("--dev-file") > 0 || app.count("--thresholds") > 0 ||
                       app.count("--target-acceptance") > 0)) {
    throw std::invalid_argument("--dev-file, --thresholds and --target-acceptance apply to --calibrate");
  }
  if (a.calibrate && app.count("--threshold") > 0) {
    throw std::invalid_argument("--threshold and --calibrate exclude each other: --calibrate chooses the threshold");
  }
  if (a.verifier.empty() && (app.count("--verifier-token-file") > 0 || app.count("--added-latency-ms") > 0 ||
                             app.count("--half-q") > 0 || app.count("--verifier-tls-ca") > 0 ||
                             app.count("--verifier-tls-cert") > 0 || app.count("--verifier-tls-key") > 0)) {
    throw std::invalid_argument(
        "--verifier-token-file, --verifier-tls-ca, --verifier-tls-cert, --verifier-tls-key, --added-latency-ms and "
        "--half-q apply to --verifier");
  }
  if (!a.verifier.empty()) {
#ifndef SPECDEC_HAVE_REMOTE
    throw std::invalid_argument("--verifier: this specdec-generate was built without gRPC");
#endif
    if (a.mode != "speculative" && a.mode != "autoregressive") {
      throw std::invalid_argument("--verifier applies to --mode speculative or autoregressive, not --mode " + a.mode);
    }
    for (const char* flag : {"--compare", "--batch-file", "--calibrate", "--target", "--device", "--dtype"}) {
      if (app.count(flag) > 0) {
        throw std::invalid_argument(std::string(flag) + " does not apply to --verifier: the target is on the server");
      }
    }
    if (a.verifier.find(':') == std::string::npos) {
      throw std::invalid_argument("--verifier must be HOST:PORT, got " + a.verifier);
    }
  }
  if (!a.batch_file.empty() && a.trace) {
    throw std::invalid_argument("--trace does not apply to --batch-file");
  }
  if (!a.dev_file.empty()) require_file("--dev-file", a.dev_file);
  if (!a.batch_file.empty()) require_file("--batch-file", a.batch_file);
  if (!a.storage.empty()) require_file("--storage", a.storage);
  if (!a.tokenizer.empty() && !std::filesystem::is_directory(a.tokenizer)) require_file("--tokenizer", a.tokenizer);
  if (!a.save_storage.empty()) io::detail::require_writable_path(a.save_storage, "--save-storage");
  if (!has_matrix_products(parse_dtype(a.dtype), parse_device(a.device))) {
    throw std::invalid_argument("--dtype " + a.dtype + " on " + a.device + ": this libtorch " + TORCH_VERSION +
                                " has no " + a.dtype + " matrix products there; use bfloat16 or float32, or a GPU");
  }
  return a;
}

using Processor = std::variant<GreedyProcessor, MultinomialProcessor, TopKProcessor, NucleusProcessor,
                               TopKNucleusProcessor>;
Processor make_processor(const Arguments& a) {
  if (a.temperature == 0) return GreedyProcessor{};
  if (a.top_k > 0 && a.top_p < 1) return TopKNucleusProcessor(a.top_k, a.top_p, a.temperature);
  if (a.top_k > 0) return TopKProcessor(a.top_k, a.temperature);
  if (a.top_p < 1) return NucleusProcessor(a.top_p, a.temperature);
  return MultinomialProcessor(a.temperature);
}

// Text of tokens: through a Hugging Face tokenizer.json (with its folder's BOS, EOS and chat
// settings), a llama2.c tokenizer, or as bytes.
class Text {
 public:
  Text(const Arguments& a, int64_t vocab) : chat_(a.chat) {
    std::filesystem::path hf;
    if (!a.tokenizer.empty()) {
      const std::filesystem::path path(a.tokenizer);
      if (std::filesystem::is_directory(path) || path.extension() == ".json") hf = path;
      else tokenizer_ = io::Llama2cTokenizer::load(path, vocab);
    } else if (std::filesystem::is_directory(a.target) && std::filesystem::exists(std::filesystem::path(a.target) / "tokenizer.json")) {
      hf = a.target;
    }
    if (!hf.empty()) {
      hf_ = io::HfTokenizer::load(hf);
      if (hf_->vocab_size() > vocab) {
        throw std::invalid_argument(hf_->file().string() + " has ids up to " + std::to_string(hf_->vocab_size() - 1) +
                                    ", beyond the model's vocabulary of " + std::to_string(vocab));
      }
      const auto folder = std::filesystem::is_directory(hf) ? hf : hf.parent_path();
      settings_ = io::read_text_settings(folder, *hf_);
    }
    if (!tokenizer_ && !hf_ && vocab != io::ByteTokenizer::vocab_size()) {
      throw std::invalid_argument("a model with vocabulary " + std::to_string(vocab) +
                                  " needs --tokenizer (byte-level models have 256 tokens)");
    }
    if (chat_ && !(hf_ && settings_.chat)) {
      throw std::invalid_argument("--chat needs a tokenizer.json whose tokens or tokenizer_config.json's chat_template "
                                  "name a known chat format (Llama 3, ChatML, Zephyr, [INST])");
    }
  }
  // The end-of-sequence ids the tokenizer's folder gives (llama2.c: 2; bytes: none).
  [[nodiscard]] std::vector<int64_t> eos() const {
    if (hf_) return settings_.eos_token_ids;
    if (tokenizer_) return {io::Llama2cTokenizer::kEos};
    return {};
  }
  // The fewest tokens a text of `bytes` bytes encodes to (BOS aside).
  [[nodiscard]] int64_t min_tokens(int64_t bytes) const {
    return hf_ ? bytes / hf_->max_token_bytes() : tokenizer_ ? bytes / tokenizer_->max_token_length() : bytes;
  }
  // A prompt: BOS as the tokenizer's settings say, in the chat format under --chat.
  [[nodiscard]] std::vector<int64_t> encode(const std::string& text) const {
    if (hf_) return io::encode_prompt(*hf_, settings_, chat_ ? io::apply_chat_template(*settings_.chat, text) : text);
    return tokenizer_ ? tokenizer_->encode(text) : bytes_.encode(text);
  }
  // Text inside a sequence (a stop string): no BOS, no chat format.
  [[nodiscard]] std::vector<int64_t> encode_inner(const std::string& text) const {
    if (hf_) return hf_->encode(text, false);
    return tokenizer_ ? tokenizer_->encode(text, false) : bytes_.encode(text);
  }
  [[nodiscard]] std::string piece(int64_t previous, int64_t token) const {
    if (hf_) return hf_->decode_piece(previous, token);
    return tokenizer_ ? tokenizer_->decode_piece(previous, token) : bytes_.decode_piece(previous, token);
  }
  // The text of `tokens` following the token `previous`.
  [[nodiscard]] std::string decode(int64_t previous, const std::vector<int64_t>& tokens) const {
    std::string out;
    for (const int64_t t : tokens) out += piece(previous, t), previous = t;
    return out;
  }

 private:
  bool chat_ = false;
  std::optional<io::HfTokenizer> hf_;
  io::HfTextSettings settings_;
  std::optional<io::Llama2cTokenizer> tokenizer_;
  io::ByteTokenizer bytes_;
};

// The prompt, stop sequences and end tokens of a run, through its tokenizer.
struct Request {
  std::vector<int64_t> prompt{};
  std::vector<std::vector<int64_t>> stops{};
  std::vector<int64_t> eos{};
};
Request encode_request(const Arguments& a, const Text& text) {
  Request request{.prompt = text.encode(a.prompt), .eos = a.eos};
  if (request.prompt.empty()) throw std::invalid_argument("--prompt must not be empty");
  for (const std::string& stop : a.stops) {
    if (stop.empty()) throw std::invalid_argument("--stop must not be empty");
    request.stops.push_back(text.encode_inner(stop));
  }
  if (request.eos.empty()) request.eos = text.eos();
  return request;
}

// The speculative options the flags give.
SpeculativeOptions make_speculative_options(const Arguments& a, const std::vector<int64_t>& eos,
                                            const std::vector<std::vector<int64_t>>& stops) {
  return {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .stop_sequences = stops, .seed = a.seed,
          .gamma = a.gamma,
          .gamma_policy = a.gamma_policy == "egag" ? GammaPolicy::egag
                          : a.gamma_policy == "schedule" ? GammaPolicy::schedule : GammaPolicy::fixed,
          .gamma_min = a.gamma_min, .gamma_max = a.gamma_max, .egag_ema_beta = a.egag_beta, .p_min = a.p_min,
          .entropy_gate = a.entropy_gate,
          .verification = a.verify == "threshold" ? Verification::threshold : Verification::rejection,
          .threshold = a.threshold};
}

struct Colors {
  const char* accepted = "";
  const char* rejected = "";
  const char* target = "";
  const char* reset = "";
};

nlohmann::json stats_json(const GenerationStats& s) {
  return {{"generated", s.generated}, {"steps", s.steps}, {"drafted", s.drafted}, {"accepted", s.accepted},
          {"acceptance_rate", s.acceptance_rate()}, {"target_calls", s.target_calls},
          {"drafter_calls", s.drafter_calls}, {"tokens_per_target_call", s.tokens_per_target_call()},
          {"total_seconds", s.total_seconds}, {"target_seconds", s.target_seconds},
          {"drafter_seconds", s.drafter_seconds}, {"target_positions", s.target_positions},
          {"tokens_per_second", s.total_seconds > 0 ? s.generated / s.total_seconds : 0.0}};
}

// Beam search prints its n-best list when it is done (hypotheses are not final before).
int run_beam(const Arguments& a, Model& target, const Text& text, const std::vector<int64_t>& prompt,
             const std::vector<int64_t>& eos) {
  const BeamSearchResult result = beam_search_generate(
      target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .num_beams = a.num_beams,
                       .top_k = a.num_beams, .alpha = a.length_penalty});
  const auto decode = [&](const std::vector<int64_t>& tokens) { return text.decode(prompt.back(), tokens); };
  const GenerationStats& s = result.stats;
  if (a.json) {
    nlohmann::json hypotheses = nlohmann::json::array();
    for (const auto& h : result.n_best) {
      hypotheses.push_back({{"text", decode(h.tokens)}, {"score", h.score}, {"log_probability", h.log_probability},
                            {"finished", h.finished}});
    }
    std::cout << nlohmann::json{{"mode", "beam"}, {"num_beams", a.num_beams}, {"n_best", hypotheses},
                                {"stats", stats_json(s)}, {"tokens_scored", result.tokens_scored}}.dump(2) << "\n";
    return 0;
  }
  std::cout << "beam search, " << a.num_beams << " beams, length penalty " << a.length_penalty << "\n\n"
            << a.prompt << decode(result.tokens) << "\n\n";
  for (size_t i = 0; i < result.n_best.size(); ++i) {
    std::cout << "#" << i + 1 << " score " << result.n_best[i].score << (result.n_best[i].finished ? "" : " (length limit)")
              << ": " << decode(result.n_best[i].tokens).substr(0, 60) << "\n";
  }
  std::cout << std::fixed << std::setprecision(2) << "\n" << s.target_calls << " target calls, "
            << result.tokens_scored << " tokens scored in " << s.total_seconds << " s\n";
  return 0;
}

// --mode stand: N trajectories of the prompt, one after another, sharing one memory; each is
// printed when done, with its tokens per target call (which grow as the memory learns).
int run_stand(const Arguments& a, Model& target, const Text& text, const std::vector<int64_t>& prompt,
              const std::vector<int64_t>& eos, const Processor& processor) {
  ProbabilisticNGramStorage memory = a.storage.empty() ? ProbabilisticNGramStorage(target.vocab_size(), 3)
                                                       : ProbabilisticNGramStorage::load(a.storage);
  if (memory.vocab_size() != target.vocab_size()) {
    throw std::invalid_argument("--storage was built for vocabulary " + std::to_string(memory.vocab_size()) +
                                ", the target has " + std::to_string(target.vocab_size()));
  }
  const StandOptions options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .seed = a.seed,
                             .tree = TreeTemplate::default_tree(a.tree_nodes),
                             .stochastic = !a.deterministic};
  const auto decode = [&](const std::vector<int64_t>& tokens) { return text.decode(prompt.back(), tokens); };
  nlohmann::json runs = nlohmann::json::array();
  GenerationStats stand_total, baseline_total;
  bool identical = true;
  if (!a.json) {
    std::cout << "mode: stand, " << a.trajectories << " trajectories, " << options.tree
              << (a.deterministic ? ", deterministic drafting" : ", Gumbel drafting") << "\n";
  }
  const auto autoregressive = [&](uint64_t seed) {
    return std::visit([&](const auto& p) {
      return autoregressive_generate(target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                      .seed = seed}, p);
    }, processor);
  };
  if (a.compare) {
    // A fair comparison: both warmed up untimed (STAND on a copy, so that the memory learns only
    // from the timed trajectories), then each trajectory beside an autoregressive run, in
    // alternating order; nothing streams while timed.
    ProbabilisticNGramStorage scratch = memory;
    (void)std::visit([&](const auto& p) { return stand_generate(scratch, target, prompt, options, p); }, processor);
    (void)autoregressive(a.seed);
  }
  for (int64_t i = 0; i < a.trajectories; ++i) {
    StandOptions run = options;
    run.seed = a.seed + static_cast<uint64_t>(i);
    std::optional<GenerationResult> baseline;
    if (a.compare && i % 2 == 1) baseline = autoregressive(*run.seed);
    const GenerationResult result =
        std::visit([&](const auto& p) { return stand_generate(memory, target, prompt, run, p); }, processor);
    if (a.compare && i % 2 == 0) baseline = autoregressive(*run.seed);
    stand_total += result.stats;
    if (baseline) {
      baseline_total += baseline->stats;
      identical = identical && baseline->tokens == result.tokens;
    }
    const GenerationStats& s = result.stats;
    if (a.json) {
      runs.push_back({{"text", decode(result.tokens)}, {"stats", stats_json(s)}});
      continue;
    }
    std::cout << std::fixed << std::setprecision(2) << "\n--- trajectory " << i + 1 << ": " << s.generated
              << " tokens, " << s.tokens_per_target_call() << " tokens per target call, "
              << s.generated / s.total_seconds << " tokens/s\n"
              << std::defaultfloat << a.prompt << decode(result.tokens) << "\n";
  }
  if (!a.save_storage.empty()) memory.save(a.save_storage);
  if (a.json) {
    nlohmann::json out{{"mode", "stand"}, {"trajectories", runs}, {"stats", stats_json(stand_total)},
                       {"memory_contexts", memory.size()}, {"memory_bytes", memory.memory_bytes()}};
    if (a.compare) {
      out["autoregressive"] = stats_json(baseline_total);
      out["speedup"] = baseline_total.total_seconds / stand_total.total_seconds;
      out["identical_to_autoregressive"] = identical;
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\nall trajectories: " << stand_total.generated << " tokens in "
            << stand_total.total_seconds << " s: " << stand_total.generated / stand_total.total_seconds
            << " tokens/s; " << stand_total.tokens_per_target_call() << " tokens per target call; memory "
            << memory.size() << " contexts, " << memory.memory_bytes() / 1024 << " KiB\n";
  if (a.compare) {
    std::cout << "autoregressive: " << baseline_total.generated / baseline_total.total_seconds << " tokens/s; speedup "
              << baseline_total.total_seconds / stand_total.total_seconds
              << "x; output identical: " << (identical ? "yes" : "no") << "\n"
              << "(all trajectories against as many autoregressive runs, alternated, after one untimed warm-up run "
                 "of each)\n";
  }
  return 0;
}

// --calibrate: the threshold grid on the dev prompts, printed as a table (or kept for --json).
CalibrationResult calibrate(const Arguments& a, Model& drafter, Model& target, const Text& text,
                            const std::vector<int64_t>& prompt, const SpeculativeOptions& options,
                            const Processor& processor) {
  std::vector<std::vector<int64_t>> dev{prompt};
  if (!a.dev_file.empty()) {
    std::ifstream in(a.dev_file, std::ios::binary);
    if (!in) throw std::invalid_argument("--dev-file: cannot open " + a.dev_file);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    dev.clear();
    for (const auto& window : text::line_prompts(bytes, 8, 256)) dev.push_back(text.encode(window));
    if (dev.empty()) throw std::invalid_argument("--dev-file: " + a.dev_file + " is too short for 256-byte prompts");
  }
  SpeculativeOptions quiet = options;
  quiet.on_step = nullptr;
  const CalibrationResult result = std::visit(
      [&](const auto& p) {
        return calibrate_threshold(drafter, target, dev, quiet,
                                   {.thresholds = a.thresholds, .target_acceptance = a.target_acceptance}, p);
      },
      processor);
  if (!a.json) {
    std::cout << "calibration on " << dev.size() << " dev prompt(s), target acceptance " << a.target_acceptance
              << "\n  threshold  acceptance  tokens/call  seconds\n" << std::fixed;
    for (const CalibrationPoint& point : result.points) {
      std::cout << std::setprecision(2) << "  " << std::setw(9) << point.threshold << std::setprecision(3)
                << std::setw(12) << point.acceptance_rate() << std::setw(13) << point.tokens_per_target_call()
                << std::setw(9) << point.seconds() << (point.threshold == result.best_threshold ? "  <- chosen" : "")
                << "\n";
    }
    std::cout << std::defaultfloat << "\n";
  }
  return result;
}

// --batch-file: every line of the file is a prompt; all rows generate together as one batch.
int run_batch_file(const Arguments& a, Model& target, Model* drafter, const Text& text,
                   const std::vector<int64_t>& eos, const std::vector<std::vector<int64_t>>& stops,
                   const Processor& processor) {
  std::ifstream in(a.batch_file);
  if (!in) throw std::invalid_argument("--batch-file: cannot open " + a.batch_file);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    // "\n" (backslash, n) in a line stands for a newline of the prompt.
    std::string prompt;
    prompt.reserve(line.size());
    for (size_t i = 0; i < line.size(); ++i) {
      const bool escape = line[i] == '\\' && i + 1 < line.size() && line[i + 1] == 'n';
      prompt.push_back(escape ? '\n' : line[i]);
      if (escape) ++i;
    }
    lines.push_back(std::move(prompt));
  }
  if (lines.empty()) throw std::invalid_argument("--batch-file: " + a.batch_file + " holds no prompt");
  std::vector<std::vector<int64_t>> prompts;
  for (const auto& line : lines) prompts.push_back(text.encode(line));
  std::optional<NGramStorage> storage;
  if (a.mode == "ngram") storage.emplace(a.ngram_order, target.vocab_size());
  const auto start = std::chrono::steady_clock::now();
  const std::vector<GenerationResult> results = std::visit(
      [&](const auto& p) {
        if (storage) {
          return ngram_assisted_generate_batch(*storage, target, prompts,
                                               {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                .stop_sequences = stops, .seed = a.seed, .gamma = a.gamma,
                                                .filler_top_k = 1, .draft_rule = a.draft_rule},
                                               p);
        }
        if (drafter != nullptr) {
          return speculative_generate_batch(*drafter, target, prompts,
                                            {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                             .stop_sequences = stops, .seed = a.seed, .gamma = a.gamma},
                                            p);
        }
        return autoregressive_generate_batch(target, prompts,
                                             {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                              .stop_sequences = stops, .seed = a.seed},
                                             p);
      },
      processor);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // --compare: every row against its own autoregressive decoding, one prompt at a time.
  std::optional<bool> identical;
  if (a.compare) {
    identical = true;
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto alone = std::visit([&](const auto& p) {
        return autoregressive_generate(target, prompts[r], {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                            .stop_sequences = stops, .seed = a.seed}, p);
      }, processor);
      identical = *identical && alone.tokens == results[r].tokens;
    }
  }
  int64_t generated = 0;
  nlohmann::json rows = nlohmann::json::array();
  for (size_t r = 0; r < results.size(); ++r) {
    const GenerationResult& result = results[r];
    generated += result.stats.generated;
    std::ostringstream reason;
    reason << result.stop_reason;
    const std::string continuation = text.decode(prompts[r].back(), result.tokens);
    if (a.json) {
      rows.push_back({{"prompt", lines[r]}, {"text", continuation}, {"stop_reason", reason.str()},
                      {"stats", stats_json(result.stats)}});
      continue;
    }
    std::cout << "--- row " << r << ": " << result.stats.generated << " tokens, stopped by " << reason.str();
    if (a.mode != "autoregressive") {
      std::cout << ", acceptance rate " << std::fixed << std::setprecision(2) << result.stats.acceptance_rate()
                << std::defaultfloat;
    }
    std::cout << ", " << result.stats.target_calls << " target calls\n" << lines[r] << continuation << "\n";
  }
  if (a.json) {
    nlohmann::json out{{"mode", a.mode}, {"batch", results.size()}, {"rows", rows},
                       {"seconds", seconds}, {"tokens_per_second", generated / seconds}};
    if (identical) out["rows_identical_to_autoregressive"] = *identical;
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\nbatch of " << results.size() << ": " << generated
            << " tokens in " << seconds << " s: " << generated / seconds << " tokens/s\n";
  if (identical) std::cout << "rows identical to autoregressive: " << (*identical ? "yes" : "no") << "\n";
  return 0;
}

#ifdef SPECDEC_HAVE_REMOTE
// --verifier: the drafter (and the tokenizer of its folder) here, the target on the server.
int run_remote(const Arguments& a) {
  const ThreadSettings threads = set_threads(a.threads);
  const io::LlamaCheckpoint checkpoint = io::load_llama(a.drafter, at::kFloat, {.max_sequence_length = a.max_seq_len});
  Model drafter(checkpoint.config, checkpoint.weights);
  Arguments text_arguments = a;
  text_arguments.target = a.drafter;  // a tokenizer.json beside the drafter
  const Text text(text_arguments, drafter.vocab_size());
  const Request request = encode_request(a, text);
  const std::vector<int64_t>& prompt = request.prompt;
  const std::vector<std::vector<int64_t>>& stops = request.stops;
  const std::vector<int64_t>& eos = request.eos;
  std::string token;
  if (!a.verifier_token_file.empty()) {
    std::ifstream in(a.verifier_token_file);
    if (!in || !std::getline(in, token) || token.empty()) {
      throw std::invalid_argument("--verifier-token-file " + a.verifier_token_file + " holds no token on its first line");
    }
  } else if (const char* env = std::getenv("SPECDEC_VERIFIER_TOKEN")) {
    token = env;
  }
  const auto pem = [](const std::string& file, const char* flag) { return file.empty() ? std::string() : remote::read_pem(file, flag); };
  remote::RemoteVerifier verifier(
      a.verifier, {.token = token,
                   .added_latency = std::chrono::microseconds(static_cast<int64_t>(a.added_latency_ms * 1000)),
                   .half_precision_q = a.half_q,
                   .tls = {.certificate_chain = pem(a.verifier_tls_cert, "--verifier-tls-cert"),
                           .private_key = pem(a.verifier_tls_key, "--verifier-tls-key"),
                           .trusted_ca = pem(a.verifier_tls_ca, "--verifier-tls-ca")}});
  const Processor processor = make_processor(a);
  SpeculativeOptions options = make_speculative_options(a, eos, stops);
  int64_t previous = prompt.back();
  options.on_step = [&](const StepInfo& step) {
    if (a.json) return;
    for (const int64_t t : step.emitted) std::cout << text.piece(previous, t), previous = t;
    if (a.trace) {
      std::cout << std::fixed << std::setprecision(2) << "[k=" << step.drafts.size() << " accepted=" << step.accepted
                << " rtt_ms=" << step.rtt_seconds * 1e3 << " prefill_ms=" << step.prefill_seconds * 1e3 << "]"
                << std::defaultfloat;
    }
    std::cout << std::flush;
  };
  if (!a.json) {
    std::cout << "verifier: " << a.verifier << "\ndrafter:  " << a.drafter << " (" << drafter.config()
              << "; threads: " << threads << ")\n";
    std::visit([&](const auto& p) { std::cout << "mode: " << a.mode << " (remote), " << p << ", gamma " << a.gamma; }, processor);
    std::cout << "\n\n" << a.prompt << std::flush;
  }
  GenerationResult result;
  try {
    result = std::visit(
        [&](const auto& p) {
          if (a.mode == "autoregressive") {
            NoDrafts none;
            return remote::remote_generate(none, verifier, prompt, options, p);
          }
          ModelDraftSource drafts(drafter);
          return remote::remote_generate(drafts, verifier, prompt, options, p);
        },
        processor);
  } catch (const remote::RemoteError& e) {
    std::cout << std::endl;
    std::cerr << "specdec-generate: " << e.what() << "\nspecdec-generate: " << e.partial().tokens.size()
              << " tokens were generated before the failure: " << text.decode(prompt.back(), e.partial().tokens) << "\n";
    return 1;
  }
  const GenerationStats& s = result.stats;
  if (a.json) {
    std::ostringstream reason;
    reason << result.stop_reason;
    nlohmann::json stats = stats_json(s);
    stats["rtt_seconds"] = s.rtt_seconds;
    stats["prefill_seconds"] = s.prefill_seconds;
    std::cout << nlohmann::json{{"mode", a.mode}, {"verifier", a.verifier}, {"gamma", a.gamma},
                                {"text", text.decode(prompt.back(), result.tokens)},
                                {"stop_reason", reason.str()}, {"stats", stats}}.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\n\n"
            << s.generated << " tokens in " << s.total_seconds << " s: " << s.generated / s.total_seconds
            << " tokens/s; " << s.target_calls << " round trips (" << s.tokens_per_target_call()
            << " tokens each, " << (s.target_calls > 0 ? s.rtt_seconds * 1e3 / static_cast<double>(s.target_calls) : 0.0)
            << " ms each, of which the server's forward " << (s.target_calls > 0 ? s.prefill_seconds * 1e3 / static_cast<double>(s.target_calls) : 0.0)
            << " ms), stopped by " << result.stop_reason;
  if (a.mode != "autoregressive") {
    std::cout << ", " << s.drafter_calls << " drafter calls, acceptance rate " << s.acceptance_rate();
  }
  std::cout << "\n";
  return 0;
}
#endif

int run(const Arguments& a) {
#ifdef SPECDEC_HAVE_REMOTE
  if (!a.verifier.empty()) return run_remote(a);
#endif
  const ThreadSettings threads = set_threads(a.threads);
  const auto weights = at::TensorOptions().dtype(parse_dtype(a.dtype)).device(parse_device(a.device));
  const io::LoadLimits limits{.max_sequence_length = a.max_seq_len};
  const io::LlamaCheckpoint target_checkpoint = io::load_llama(a.target, weights, limits);
  Model target(target_checkpoint.config, target_checkpoint.weights);
  const Text text(a, target.vocab_size());
  std::optional<Model> drafter;
  // The length check before encoding: a text encodes to at least min_tokens of its bytes.
  const int64_t least = text.min_tokens(static_cast<int64_t>(a.prompt.size()));
  if (least > target.max_sequence_length()) {
    throw std::invalid_argument("--prompt of " + std::to_string(a.prompt.size()) + " bytes is at least " +
                                std::to_string(least) + " tokens, more than the target's max_sequence_length " +
                                std::to_string(target.max_sequence_length()));
  }
  const Request request = encode_request(a, text);
  const std::vector<int64_t>& prompt = request.prompt;
  const std::vector<std::vector<int64_t>>& stops = request.stops;
  const std::vector<int64_t>& eos = request.eos;
  if (a.mode == "beam") return run_beam(a, target, text, prompt, eos);
  if (a.mode == "stand") return run_stand(a, target, text, prompt, eos, make_processor(a));
  if (a.mode == "speculative") {
    const io::LlamaCheckpoint drafter_checkpoint = io::load_llama(a.drafter, weights, limits);
    drafter.emplace(drafter_checkpoint.config, drafter_checkpoint.weights);
  }
  const Processor processor = make_processor(a);
  if (!a.batch_file.empty()) {
    return run_batch_file(a, target, drafter ? &*drafter : nullptr, text, eos, stops, processor);
  }
  SpeculativeOptions speculative_options = make_speculative_options(a, eos, stops);
  std::optional<CalibrationResult> calibration;
  if (a.calibrate) {
    calibration = calibrate(a, *drafter, target, text, prompt, speculative_options, processor);
    speculative_options.verification = Verification::threshold;
    speculative_options.threshold = calibration->best_threshold;
  }
  const bool color = isatty(fileno(stdout)) != 0;
  const Colors colors = color ? Colors{"\033[32m", "\033[9;31m", "\033[1;34m", "\033[0m"} : Colors{};
  const bool show_text = !a.json;

  // A step as the printer needs it, copied out of StepInfo (whose spans live for the callback only).
  struct Printed {
    std::vector<int64_t> drafts, emitted;
    int64_t accepted = 0, token = 0;
  };
  int64_t previous = prompt.back();
  // Prints a StepInfo as it streams, or a recorded step (the same fields).
  const auto print_step = [&](const auto& step) {
    if (a.trace) {
      const size_t accepted = std::min(step.emitted.size(), static_cast<size_t>(step.accepted));
      std::cout << colors.accepted;
      for (size_t i = 0; i < accepted; ++i) {
        std::cout << (color ? "" : "[+") << text.piece(previous, step.emitted[i]) << (color ? "" : "]");
        previous = step.emitted[i];
      }
      std::cout << colors.reset;
      if (step.emitted.size() > accepted) {  // the target's token was emitted too
        if (step.accepted < static_cast<int64_t>(step.drafts.size())) {
          std::cout << colors.rejected << (color ? "" : "[-")
                    << text.piece(previous, step.drafts[static_cast<size_t>(step.accepted)])
                    << (color ? "" : "]") << colors.reset;
        }
        std::cout << colors.target << (color ? "" : "[*") << text.piece(previous, step.token)
                  << (color ? "" : "]") << colors.reset;
        previous = step.token;
      }
      std::cout << std::flush;
      return;
    }
    for (const int64_t token : step.emitted) {
      std::cout << text.piece(previous, token);
      previous = token;
    }
    std::cout << std::flush;
  };
  const auto copy_step = [](const StepInfo& step) {
    return Printed{.drafts = {step.drafts.begin(), step.drafts.end()},
                   .emitted = {step.emitted.begin(), step.emitted.end()},
                   .accepted = step.accepted,
                   .token = step.token};
  };
  // Without --compare the text streams as it is generated; with it, every timed run (of either
  // mode) records its steps the same way and the text is printed after the timing.
  const auto on_step = [&](const StepInfo& step) {
    if (show_text) print_step(step);
  };

  if (show_text) {
    std::cout << "target:  " << a.target << " (" << target_checkpoint.format << ", " << target.config() << ", "
              << a.dtype << " on " << a.device << "; threads: " << threads
              << (target.onednn() ? "; products: " + specdec::detail::onednn_version() : std::string()) << ")\n";
    if (drafter) std::cout << "drafter: " << a.drafter << " (" << drafter->config() << ")\n";
    std::visit([&](const auto& p) { std::cout << "mode: " << a.mode << ", " << p << ", gamma " << a.gamma; }, processor);
    if (drafter) {
      std::cout << ", gamma policy " << a.gamma_policy;
      if (a.p_min > 0) std::cout << ", p_min " << a.p_min;
      if (a.entropy_gate < 1) std::cout << ", entropy gate " << a.entropy_gate;
      if (speculative_options.verification == Verification::threshold) {
        std::cout << ", threshold verification (lossy) at " << speculative_options.threshold;
      }
    }
    std::cout << "\n";
    if (a.trace) {
      std::cout << (color ? "trace: \033[32maccepted drafts\033[0m, \033[9;31mrejected draft\033[0m, \033[1;34mthe target's token\033[0m\n"
                          : "trace: [+accepted draft] [-rejected draft] [*the target's token]\n");
    }
    std::cout << "\n" << a.prompt << std::flush;
  }
  std::optional<NGramStorage> initial_storage;
  if (a.mode == "ngram") {
    initial_storage.emplace(a.storage.empty() ? NGramStorage(a.ngram_order, target.vocab_size())
                                              : NGramStorage::load(a.storage));
    if (initial_storage->vocab_size() != target.vocab_size()) {
      throw std::invalid_argument("--storage was built for vocabulary " + std::to_string(initial_storage->vocab_size()) +
                                  ", the target has " + std::to_string(target.vocab_size()));
    }
  }
  // One run of the chosen mode (`baseline`: autoregressive decoding instead). Each run of the
  // n-gram mode starts from the same storage (its own copy), so that every run drafts alike.
  std::optional<NGramStorage> storage;
  const auto generate = [&](bool baseline, const StepCallback& callback) {
    return std::visit(
        [&](const auto& p) {
          const GenerationOptions plain{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                        .stop_sequences = stops, .seed = a.seed, .on_step = callback};
          if (baseline) return autoregressive_generate(target, prompt, plain, p);
          const NGramAssistedOptions ngram_options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                   .stop_sequences = stops, .seed = a.seed, .on_step = callback,
                                                   .gamma = a.gamma, .filler_top_k = a.filler,
                                                   .draft_rule = a.draft_rule};
          if (initial_storage) {
            storage.emplace(*initial_storage);
            return ngram_assisted_generate(*storage, target, prompt, ngram_options, p);
          }
          if (a.mode == "prompt-lookup") {
            PromptLookupDrafter lookup;
            return ngram_assisted_generate(lookup, target, prompt, ngram_options, p);
          }
          if (drafter) {
            SpeculativeOptions options = speculative_options;
            options.on_step = callback;
            return speculative_generate(*drafter, target, prompt, options, p);
          }
          return autoregressive_generate(target, prompt, plain, p);
        },
        processor);
  };
  const bool comparing = a.compare && a.mode != "autoregressive";
  std::optional<GenerationResult> baseline;
  std::vector<double> mode_seconds, baseline_seconds;
  GenerationResult result;
  if (!comparing) {
    result = generate(false, on_step);
  } else {
    // A fair comparison: both modes warmed up (first forwards of each shape, page faults, the
    // products' first use), then alternated, each timed run recording its steps the same way.
    (void)generate(false, {});
    (void)generate(true, {});
    std::vector<std::vector<Printed>> mode_steps;
    std::vector<GenerationResult> mode_results, baseline_results;
    for (int run = 0; run < a.compare_runs; ++run) {
      for (const bool is_baseline : {run % 2 == 1, run % 2 == 0}) {
        std::vector<Printed> steps;
        GenerationResult timed = generate(is_baseline, [&](const StepInfo& step) { steps.push_back(copy_step(step)); });
        if (is_baseline) {
          baseline_results.push_back(std::move(timed));
        } else {
          mode_results.push_back(std::move(timed));
          mode_steps.push_back(std::move(steps));
        }
      }
    }
    // The runs with the median times stand for their mode (an odd count: the middle one).
    const auto median = [](const std::vector<GenerationResult>& runs) {
      std::vector<size_t> order(runs.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::sort(order.begin(), order.end(),
                [&](size_t x, size_t y) { return runs[x].stats.total_seconds < runs[y].stats.total_seconds; });
      return order[(order.size() - 1) / 2];
    };
    const size_t mode_median = median(mode_results), baseline_median = median(baseline_results);
    for (const auto& r : mode_results) mode_seconds.push_back(r.stats.total_seconds);
    for (const auto& r : baseline_results) baseline_seconds.push_back(r.stats.total_seconds);
    result = std::move(mode_results[mode_median]);
    baseline = std::move(baseline_results[baseline_median]);
    if (show_text) {
      for (const Printed& step : mode_steps[mode_median]) print_step(step);
    }
  }
  if (storage && !a.save_storage.empty()) storage->save(a.save_storage);

  const GenerationStats& s = result.stats;
  if (a.json) {
    std::ostringstream reason;
    reason << result.stop_reason;
    nlohmann::json out{{"mode", a.mode}, {"gamma", a.gamma}, {"device", a.device}, {"dtype", a.dtype},
                       {"stop_reason", reason.str()}, {"stats", stats_json(s)}};
    if (drafter) {
      out["gamma_policy"] = a.gamma_policy;
      out["verification"] = speculative_options.verification == Verification::threshold ? "threshold" : "rejection";
      if (speculative_options.verification == Verification::threshold) out["threshold"] = speculative_options.threshold;
    }
    if (calibration) {
      nlohmann::json table = nlohmann::json::array();
      for (const CalibrationPoint& point : calibration->points) {
        table.push_back({{"threshold", point.threshold}, {"acceptance_rate", point.acceptance_rate()},
                         {"tokens_per_target_call", point.tokens_per_target_call()}, {"seconds", point.seconds()}});
      }
      out["calibration"] = {{"points", table}, {"best_threshold", calibration->best_threshold}};
    }
    if (baseline) {
      out["autoregressive"] = stats_json(baseline->stats);
      out["speedup"] = baseline->stats.total_seconds / s.total_seconds;
      out["identical_to_autoregressive"] = baseline->tokens == result.tokens;
      // What was measured: stats and autoregressive are the median runs of these.
      out["compare"] = {{"warmup_runs", 1},
                        {"timed_runs", a.compare_runs},
                        {"order", "alternating, " + std::string(a.mode) + " first"},
                        {"seconds", mode_seconds},
                        {"autoregressive_seconds", baseline_seconds}};
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::cout << std::fixed << std::setprecision(2) << "\n\n"
            << s.generated << " tokens in " << s.total_seconds << " s: " << s.generated / s.total_seconds
            << " tokens/s; " << s.target_calls << " target calls (" << s.tokens_per_target_call()
            << " tokens each), stopped by " << result.stop_reason;
  if (a.mode != "autoregressive") {
    std::cout << ", " << s.drafter_calls << " drafter calls, acceptance rate " << s.acceptance_rate();
  }
  std::cout << "\n";
  if (baseline) {
    const auto& b = baseline->stats;
    std::cout << "autoregressive: " << b.generated << " tokens in " << b.total_seconds << " s: "
              << b.generated / b.total_seconds << " tokens/s; speedup " << b.total_seconds / s.total_seconds
              << "x; output identical: " << (baseline->tokens == result.tokens ? "yes" : "no") << "\n"
              << "(medians of " << a.compare_runs << " timed runs of each mode, alternated, after one untimed "
              << "warm-up run of each; the text is printed after the timing)\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const CLI::ParseError& e) {
    std::cerr << "specdec-generate: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "specdec-generate: " << e.what() << "\n";
    return 2;
  }
}
