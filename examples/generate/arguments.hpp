// specdec-generate's command line: the options (Arguments), their parsing and checks, and the
// sampling policy they choose.
#pragma once

#include <specdec/distributed.hpp>
#include <specdec/drafting/eagle.hpp>
#include <specdec/drafting/head_batches.hpp>
#include <specdec/drafting/medusa.hpp>
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/eagle.hpp>
#include <specdec/io/hf_tokenizer.hpp>
#include <specdec/io/medusa.hpp>
#include <specdec/io/parallel_drafter.hpp>
#include <specdec/io/regular_file.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>
#include <specdec/text/prompts.hpp>
#ifdef SPECDEC_HAVE_REMOTE
#include <specdec/remote/client.hpp>
#endif

#include <torch/version.h>
#include <unistd.h>

#include "../support/cli.hpp"
#include "../support/parallel.hpp"

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
  std::optional<int64_t> tree_nodes;  // STAND's template (default 64), or a --tree's nodes (default 16)
  std::string tree = "none";          // --tree: none, static or dynamic
  int64_t tree_depth = 5;
  int64_t tree_top_k = 4;
  double tree_score_temperature = 1.0;
  int64_t ngram_order = 3;
  int64_t filler = 3;
  NGramDraftRule draft_rule;
  std::string storage, save_storage;
  SuffixDraftRule suffix_rule;
  int64_t suffix_cache_mib = 256;
  bool suffix_tree = false;
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
  std::string weights = "auto";     // --weights: auto, unpacked, packed or int8
  int64_t max_seq_len = io::LoadLimits{}.max_sequence_length;
  int threads = 1;                  // from --threads: N, or auto (specdec::available_cores() / --tp)
  std::string threads_option = "1";
  bool compare = false, trace = false, json = false;
  int compare_runs = 3;
  std::string verifier, verifier_token_file;
  std::string verifier_token;  // read from verifier_token_file or $SPECDEC_VERIFIER_TOKEN by parse()
  std::string verifier_tls_ca, verifier_tls_cert, verifier_tls_key;
  double added_latency_ms = 0;
  bool half_q = false;
  examples::TensorParallelFlags parallel;  // --tp, --rank, --world-size, --master, --tp-timeout-ms
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
      {"--drafter", {"speculative", "eagle", "medusa", "parallel"}},
      {"--gamma", {"speculative", "ngram", "prompt-lookup", "suffix", "eagle", "medusa", "parallel"}},
      {"--gamma-policy", {"speculative", "parallel"}},
      {"--gamma-min", {"speculative", "parallel"}},
      {"--gamma-max", {"speculative", "parallel"}},
      {"--egag-beta", {"speculative", "parallel"}},
      {"--p-min", {"speculative", "parallel"}},
      {"--entropy-gate", {"speculative", "parallel"}},
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
      {"--storage", {"ngram", "stand", "suffix"}},
      {"--save-storage", {"ngram", "stand", "suffix"}},
      {"--suffix-depth", {"suffix"}},
      {"--suffix-factor", {"suffix"}},
      {"--suffix-min-prob", {"suffix"}},
      {"--suffix-cache-mib", {"suffix"}},
      {"--suffix-tree", {"suffix"}},
      {"--trajectories", {"stand"}},
      {"--deterministic", {"stand"}},
      {"--tree-nodes", {"stand", "speculative", "eagle", "medusa", "parallel"}},
      {"--tree", {"speculative", "eagle", "medusa", "parallel"}},
      {"--tree-depth", {"speculative", "eagle", "medusa", "parallel"}},
      {"--tree-top-k", {"speculative", "eagle", "medusa"}},
      {"--tree-score-temperature", {"speculative", "eagle", "medusa"}},
      {"--num-beams", {"beam"}},
      {"--length-penalty", {"beam"}},
      {"--batch-file", {"speculative", "autoregressive", "ngram", "suffix", "eagle", "medusa"}},
      {"--temperature", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "stand", "eagle", "medusa", "parallel"}},
      {"--top-k", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "stand", "eagle", "medusa", "parallel"}},
      {"--top-p", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "stand", "eagle", "medusa", "parallel"}},
      {"--seed", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "stand", "eagle", "medusa", "parallel"}},
      {"--stop", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "eagle", "medusa", "parallel"}},
      {"--compare", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "stand", "eagle", "medusa", "parallel"}},
      {"--trace", {"speculative", "autoregressive", "ngram", "suffix", "prompt-lookup", "eagle", "medusa", "parallel"}},
  };
  return table;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
  return out;
}

// --tree and the flags that shape a tree, against the mode and the chain-only flags.
void check_tree_flags(const CLI::App& app, const Arguments& a) {
  if (a.tree == "none") {
    for (const char* flag : {"--tree-depth", "--tree-top-k", "--tree-score-temperature"}) {
      if (app.count(flag) > 0) throw std::invalid_argument(std::string(flag) + " applies with --tree static or dynamic");
    }
    if (a.mode != "stand" && app.count("--tree-nodes") > 0) {
      throw std::invalid_argument("--tree-nodes applies to --mode stand, or with --tree static or dynamic");
    }
    return;
  }
  if (a.tree == "static" && a.mode == "eagle") {
    throw std::invalid_argument("--tree static does not apply to --mode eagle: EAGLE heads grow dynamic trees");
  }
  if (a.tree == "dynamic" && a.mode == "medusa") {
    throw std::invalid_argument("--tree dynamic does not apply to --mode medusa: Medusa heads fill static trees");
  }
  if (a.tree == "dynamic" && a.mode == "parallel") {
    throw std::invalid_argument(
        "--tree dynamic does not apply to --mode parallel: a parallel drafter fills static trees from one forward");
  }
  for (const char* flag : {"--tree-top-k", "--tree-score-temperature"}) {
    if (a.tree == "static" && app.count(flag) > 0) throw std::invalid_argument(std::string(flag) + " applies to --tree dynamic");
  }
  const std::pair<const char*, bool> chains_only[] = {
      {"--batch-file", !a.batch_file.empty()},      {"--verifier", !a.verifier.empty()},
      {"--gamma-policy", a.gamma_policy != "fixed"}, {"--p-min", a.p_min > 0},
      {"--entropy-gate", a.entropy_gate < 1},        {"--verify", a.verify != "rejection"},
      {"--calibrate", a.calibrate},                  {"--tp", a.parallel.tp > 1 || a.parallel.by_hand()}};
  for (const auto& [flag, given] : chains_only) {
    if (given) throw std::invalid_argument(std::string(flag) + " does not apply with --tree");
  }
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
  app.add_option("--drafter", a.drafter,
                 "drafter, same formats (default: the bundled drafter); with --mode eagle or medusa, the head's "
                 "folder in its published layout (default: the bundled target's); with --mode parallel, a parallel "
                 "drafter's folder (config.json naming pard_token; default: the bundled target's)")
      ->group(models);
  app.add_option("--tokenizer", a.tokenizer,
                 "llama2.c tokenizer file, or tokenizer.json or its folder (default: the target folder's "
                 "tokenizer.json; without one the models are byte-level)")
      ->group(models);
  app.add_flag("--chat", a.chat, "wrap the prompt in the tokenizer's chat format (Llama 3, ChatML, Zephyr, [INST])")
      ->group(models);
  app.add_option("--device", a.device, "cpu (default) or cuda[:N]: where the models run")->group(models);
  app.add_option("--dtype", a.dtype, "float32 (default), float16 or bfloat16 (norms, softmax and verification stay float32)")
      ->check(in({"float32", "float16", "bfloat16"}))->group(models);
  app.add_option("--weights", a.weights,
                 "CPU weight products: auto (default: packed where a model's weights outgrow the caches, "
                 "or are bfloat16), packed (streamed once per forward), int8 (packed, weight-only int8 with a "
                 "scale per output) or unpacked (BLAS or oneDNN products); see docs/performance.md")
      ->check(in({"auto", "unpacked", "packed", "int8"}))->group(models);
  app.add_option("--threads", a.threads_option,
                 "CPU threads of libtorch and of the loaded BLAS together: N, or auto for every core this process "
                 "may run on (default 1, best for small models; auto for a memory-bound target: see "
                 "docs/performance.md)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            int value = 0;
            if (text == "auto") return {};
            if (!cli::parse_integer(text, value)) return "'" + text + "' is neither auto nor an integer in [1, 1024]";
            if (value < 1 || value > 1024) return text + " is outside [1, 1024]";
            return {};
          },
          "N|auto"))
      ->group(models);
  app.add_option("--max-seq-len", a.max_seq_len,
                 "the longest context a checkpoint may declare (default 131072; raise it for longer ones)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 24))->group(models);

  const std::string common = "Decoding (every mode)";
  app.add_option("--mode", a.mode,
                 "speculative (default), autoregressive, ngram, prompt-lookup, suffix (suffix decoding), stand, beam, eagle (an EAGLE-3 or "
                 "EAGLE-1 head), medusa (Medusa heads) or parallel (a parallel drafter: every draft from one forward)")
      ->check(in({"speculative", "autoregressive", "ngram", "prompt-lookup", "suffix", "stand", "beam", "eagle", "medusa",
                  "parallel"}))
      ->group(common);
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

  const std::string speculative = "Speculative decoding (--mode speculative; --gamma also ngram, prompt-lookup, suffix)";
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

  const std::string suffix = "Suffix decoding (--mode suffix; --storage and --save-storage hold its cache of responses)";
  app.add_option("--suffix-depth", a.suffix_rule.max_depth,
                 "longest substring the request's tree and the cache keep and match, in tokens (default 32)")
      ->check(cli::integer<int64_t>(2, 1024))->group(suffix);
  app.add_option("--suffix-factor", a.suffix_rule.max_spec_factor,
                 "a draft is at most this many times the matched suffix's length (default 1; also at most --gamma)")
      ->check(cli::real(0.0, 1024.0))->group(suffix);
  app.add_option("--suffix-min-prob", a.suffix_rule.min_token_prob,
                 "stop drafting where the path's estimated probability falls below this (default 0.1)")
      ->check(cli::real(0.0, 1.0))->group(suffix);
  app.add_option("--suffix-cache-mib", a.suffix_cache_mib,
                 "memory bound of a new cache of responses, in MiB (default 256)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 20))->group(suffix);
  app.add_flag("--suffix-tree", a.suffix_tree,
               "draft trees of at most --gamma nodes, every follower of a matched context a branch, most "
               "probable first, instead of chains (not with --batch-file)")
      ->group(suffix);

  const std::string stand = "STAND (--mode stand)";
  app.add_option("--trajectories", a.trajectories, "sample N generations of the prompt sharing one memory")
      ->check(cli::integer<int64_t>(1, 1 << 20))->group(stand);
  app.add_flag("--deterministic", a.deterministic, "draft the memory's most probable tokens, not Gumbel draws")
      ->group(stand);
  app.add_option("--tree-nodes", a.tree_nodes,
                 "nodes of the default tree template (default 64); with --tree, the nodes a tree verifies (default 16)")
      ->check(cli::integer<int64_t>(1, 1024))->group(stand);

  const std::string trees = "Draft trees (--mode speculative with a drafter model, eagle, medusa or parallel)";
  app.add_option("--tree", a.tree,
                 "none (default: chains), static (a fixed shape: the drafter's, the Medusa heads' or the "
                 "parallel drafter's top "
                 "tokens at each node) or dynamic (EAGLE-2's: the shape follows the drafter's confidence; "
                 "a drafter model or an EAGLE head)")
      ->check(in({"none", "static", "dynamic"}))->group(trees);
  app.add_option("--tree-depth", a.tree_depth, "deepest draft of a tree (default 5; Medusa: at most its heads)")
      ->check(cli::integer<int64_t>(1, 64))->group(trees);
  app.add_option("--tree-top-k", a.tree_top_k, "dynamic trees: children per expanded node (default 4)")
      ->check(cli::integer<int64_t>(1, 64))->group(trees);
  app.add_option("--tree-score-temperature", a.tree_score_temperature,
                 "dynamic trees: divides the drafter's logits when paths are scored (default 1; below 1 grows "
                 "deeper trees for a drafter that understates how often the target agrees; the output does not "
                 "change, see docs/drafting.md)")
      ->check(cli::real(0.0, 1e6, /*low_open=*/true))->group(trees);

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

  a.parallel.add_to(app);

  const std::string output = "Output";
  app.add_option("--batch-file", a.batch_file,
                 "generate for every line of FILE as one batch (speculative, autoregressive, ngram, eagle, medusa); "
                 "\\n in a line "
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

  cli::parse_or_help(app, argc, argv);
  if (!thresholds.empty()) a.thresholds = cli::real_list("--thresholds", thresholds, 0.0, 1.0);

  for (const FlagModes& entry : flag_modes()) {
    if (app.count(entry.flag) > 0 && std::find(entry.modes.begin(), entry.modes.end(), a.mode) == entry.modes.end()) {
      throw std::invalid_argument(std::string(entry.flag) + " applies to --mode " + join(entry.modes) +
                                  ", not --mode " + a.mode);
    }
  }
  // The heads trained for the bundled target, unless --drafter names others.
  if (a.mode == "medusa" && app.count("--drafter") == 0) a.drafter = SPECDEC_BUNDLED_MODELS_DIR "/medusa";
  if (a.mode == "eagle" && app.count("--drafter") == 0) a.drafter = SPECDEC_BUNDLED_MODELS_DIR "/eagle3";
  if (a.mode == "parallel" && app.count("--drafter") == 0) a.drafter = SPECDEC_BUNDLED_MODELS_DIR "/pard";
  if ((a.mode == "eagle" || a.mode == "medusa" || a.mode == "parallel") && !std::filesystem::is_directory(a.drafter)) {
    throw std::invalid_argument("--drafter " + a.drafter + ": not a folder (--mode " + a.mode + " reads a " +
                                (a.mode == "parallel" ? "parallel drafter's" : "head's") + " folder)");
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
  a.parallel.check();
  if ((a.parallel.tp > 1 || a.parallel.by_hand()) && !a.verifier.empty()) {
    throw std::invalid_argument("--tp, --rank, --world-size and --master do not apply to --verifier: the target is on "
                                "the server");
  }
  if (!a.batch_file.empty() && a.trace) {
    throw std::invalid_argument("--trace does not apply to --batch-file");
  }
  check_tree_flags(app, a);
  if (a.device != "cpu" && (a.weights == "packed" || a.weights == "int8")) {
    throw std::invalid_argument("--weights " + a.weights + " applies to --device cpu, not " + a.device);
  }
  if ((a.weights == "packed" || a.weights == "int8") && a.dtype == "float16") {
    throw std::invalid_argument("--weights " + a.weights + " packs float32 or bfloat16 weights, not --dtype float16");
  }
  if (!a.batch_file.empty() && (a.weights == "packed" || a.weights == "int8")) {
    throw std::invalid_argument("--weights " + a.weights +
                                " does not apply to --batch-file: rows of different lengths run the ATen forward, "
                                "which would unpack every weight in every forward");
  }
  // auto: every core this process may use, shared by the ranks --tp starts on this machine.
  a.threads = a.threads_option == "auto" ? std::max(1, available_cores() / static_cast<int>(a.parallel.tp))
                                         : std::stoi(a.threads_option);
  if (!a.batch_file.empty() && a.suffix_tree) {
    throw std::invalid_argument("--suffix-tree does not apply to --batch-file: batches draft chains");
  }
  if (!a.dev_file.empty()) require_file("--dev-file", a.dev_file);
  if (!a.batch_file.empty()) require_file("--batch-file", a.batch_file);
  if (!a.storage.empty()) require_file("--storage", a.storage);
  if (!a.tokenizer.empty() && !std::filesystem::is_directory(a.tokenizer)) require_file("--tokenizer", a.tokenizer);
  if (!a.save_storage.empty()) io::detail::require_writable_path(a.save_storage, "--save-storage");
#ifdef SPECDEC_HAVE_REMOTE
  if (!a.verifier.empty()) a.verifier_token = remote::read_token(a.verifier_token_file, "--verifier-token-file");
#endif
  if (!has_matrix_products(parse_dtype(a.dtype), parse_device(a.device))) {
    throw std::invalid_argument("--dtype " + a.dtype + " on " + a.device + ": this libtorch " + TORCH_VERSION +
                                " has no " + a.dtype + " matrix products there; use bfloat16 or float32, or a GPU");
  }
  return a;
}

// The four sampling processors as one type, so that every mode of this program is compiled for
// two processors (greedy and sampled) instead of five: the library treats every processor other
// than GreedyProcessor alike, and each call goes to the processor chosen, so what is sampled is
// unchanged. (Each of the five instantiations of this program's modes is a minute of compilation.)
class SampledProcessor {
 public:
  using Choice = std::variant<MultinomialProcessor, TopKProcessor, NucleusProcessor, TopKNucleusProcessor>;

  explicit SampledProcessor(Choice choice) : choice_(std::move(choice)) {}

  [[nodiscard]] at::Tensor operator()(const at::Tensor& logits) const {
    return std::visit([&](const auto& chosen) -> at::Tensor { return chosen(logits); }, choice_);
  }

  [[nodiscard]] at::Tensor sample(const at::Tensor& probs, at::Generator& gen) const {
    return std::visit([&](const auto& chosen) -> at::Tensor { return chosen.sample(probs, gen); }, choice_);
  }

  [[nodiscard]] const Choice& choice() const noexcept { return choice_; }

  friend std::ostream& operator<<(std::ostream& out, const SampledProcessor& p) {
    std::visit([&](const auto& chosen) { out << chosen; }, p.choice_);
    return out;
  }

 private:
  Choice choice_;
};
static_assert(LogitsProcessor<SampledProcessor>);

using Processor = std::variant<GreedyProcessor, SampledProcessor>;
Processor make_processor(const Arguments& a) {
  if (a.temperature == 0) return GreedyProcessor{};
  if (a.top_k > 0 && a.top_p < 1) return SampledProcessor(TopKNucleusProcessor(a.top_k, a.top_p, a.temperature));
  if (a.top_k > 0) return SampledProcessor(TopKProcessor(a.top_k, a.temperature));
  if (a.top_p < 1) return SampledProcessor(NucleusProcessor(a.top_p, a.temperature));
  return SampledProcessor(MultinomialProcessor(a.temperature));
}

}  // namespace
