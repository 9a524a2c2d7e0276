// specdec-generate: text in, text out, with speculative or autoregressive decoding.
//
// By default it runs the bundled pair (models/bundled: a byte-level target and a drafter trained
// on Python sources); --target/--drafter take a llama2.c checkpoint file or a Hugging Face Llama
// folder, and --tokenizer a llama2.c tokenizer file.
#include <specdec/io/checkpoint.hpp>
#include <specdec/io/tokenizer.hpp>
#include <specdec/models/llama.hpp>
#include <specdec/specdec.hpp>
#include <specdec/text/prompts.hpp>

#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
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

constexpr std::string_view kUsage = R"(usage: specdec-generate [options]
Generates a continuation of a prompt and prints it as it is produced, then statistics.

models
  --target PATH          target: llama2.c .bin file or Hugging Face Llama folder
                         (default: the bundled target, )" SPECDEC_BUNDLED_MODELS_DIR R"(/target)
  --drafter PATH         drafter, same formats (default: the bundled drafter)
  --tokenizer PATH       llama2.c tokenizer file; without it the models are byte-level
  --device D             cpu (default) or cuda[:N]: where the models run
  --dtype T              float32 (default), float16 or bfloat16: the weights and activations
                         (RMSNorm, softmax and verification compute in float32 or wider)
decoding
  --mode MODE            speculative (default), autoregressive, ngram, prompt-lookup, stand or beam
  --trajectories N       --mode stand: sample N generations of the prompt sharing one memory
  --deterministic        --mode stand: draft the memory's most probable tokens, not Gumbel draws
  --tree-nodes N         --mode stand: nodes of the default tree template (default 64)
  --ngram-order N        n of the n-gram storage for --mode ngram (default 3)
  --filler K             teach the storage the target's top-K per position (default 3; 1 = off)
  --storage FILE         start --mode ngram or stand from a storage saved with --save-storage
  --save-storage FILE    save the n-gram storage after generating
  --num-beams N          beams for --mode beam (default 4)
  --length-penalty A     beam score = log-probability / length^A (default 1)
  --prompt TEXT          the prompt (default: a line of Python)
  --batch-file FILE      generate for every line of FILE as one batch (modes speculative,
                         autoregressive, ngram) and print each row's text and stats; \n in a
                         line stands for a newline
  --gamma N              drafts per step (default 4)
  --gamma-policy P       fixed (default), egag (entropy-adaptive) or schedule (+2 / -1)
  --gamma-min N          egag, schedule: fewest drafts per step (default 1)
  --gamma-max N          egag, schedule: most drafts per step (default: --gamma)
  --egag-beta B          egag: EMA smoothing of the drafter's entropy, in [0, 1) (default 0)
  --p-min P              stop drafting where the drafter's top probability is below P
  --entropy-gate H       stop drafting where the drafter's normalised entropy is above H
  --verify V             rejection (default, exact) or threshold (lossy, seed 003)
  --threshold T          threshold verification's tau (default 0.25)
  --calibrate            choose --threshold first: run the grid on the dev prompts and print it
  --dev-file FILE        dev prompts for --calibrate: 8 windows of this text (default: the prompt)
  --thresholds LIST      the --calibrate grid (default 0.15,0.2,0.25,0.3,0.35)
  --target-acceptance A  --calibrate aims at this acceptance rate (default 0.7)
  --max-new-tokens N     tokens to generate (default 200)
  --temperature T        0 = greedy (default); > 0 samples
  --top-k K              keep the K most probable tokens (with --temperature > 0)
  --top-p P              keep the nucleus of mass P (with --temperature > 0)
  --seed N               sampling seed (default 0)
  --eos ID               an end token id (repeatable; llama2.c models default to 2)
  --stop TEXT            stop when the output contains TEXT's tokens (repeatable; kept in the
                         output)
output
  --compare              also run autoregressive decoding and print the speedup
  --trace                show every step: accepted drafts, rejected drafts, the target's token
  --json                 print the statistics as one JSON object instead of text
  --help                 this text
)";

struct Arguments {
  std::string target = SPECDEC_BUNDLED_MODELS_DIR "/target";
  std::string drafter = SPECDEC_BUNDLED_MODELS_DIR "/drafter";
  std::string tokenizer;
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
  bool compare = false, trace = false, json = false;
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

// "0.1,0.2,0.3" -> {0.1, 0.2, 0.3}
std::vector<double> parse_list(const std::string& text) {
  std::vector<double> values;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) values.push_back(std::stod(item));
  return values;
}

Arguments parse(int argc, char** argv) {
  Arguments a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help") { std::cout << kUsage; std::exit(0); }
    if (flag == "--compare") { a.compare = true; continue; }
    if (flag == "--trace") { a.trace = true; continue; }
    if (flag == "--json") { a.json = true; continue; }
    if (flag == "--calibrate") { a.calibrate = true; continue; }
    if (flag == "--deterministic") { a.deterministic = true; continue; }
    if (i + 1 >= argc) throw std::invalid_argument(std::string(flag) + " needs a value (see --help)");
    const std::string v = argv[++i];
    if (flag == "--target") a.target = v;
    else if (flag == "--drafter") a.drafter = v;
    else if (flag == "--tokenizer") a.tokenizer = v;
    else if (flag == "--mode") a.mode = v;
    else if (flag == "--prompt") a.prompt = v;
    else if (flag == "--gamma") a.gamma = std::stoll(v);
    else if (flag == "--gamma-policy") a.gamma_policy = v;
    else if (flag == "--gamma-min") a.gamma_min = std::stoll(v);
    else if (flag == "--gamma-max") a.gamma_max = std::stoll(v);
    else if (flag == "--egag-beta") a.egag_beta = std::stod(v);
    else if (flag == "--p-min") a.p_min = std::stod(v);
    else if (flag == "--entropy-gate") a.entropy_gate = std::stod(v);
    else if (flag == "--verify") a.verify = v;
    else if (flag == "--threshold") a.threshold = std::stod(v);
    else if (flag == "--dev-file") a.dev_file = v;
    else if (flag == "--thresholds") a.thresholds = parse_list(v);
    else if (flag == "--target-acceptance") a.target_acceptance = std::stod(v);
    else if (flag == "--num-beams") a.num_beams = std::stoll(v);
    else if (flag == "--trajectories") a.trajectories = std::stoll(v);
    else if (flag == "--tree-nodes") a.tree_nodes = std::stoll(v);
    else if (flag == "--ngram-order") a.ngram_order = std::stoll(v);
    else if (flag == "--filler") a.filler = std::stoll(v);
    else if (flag == "--storage") a.storage = v;
    else if (flag == "--save-storage") a.save_storage = v;
    else if (flag == "--length-penalty") a.length_penalty = std::stod(v);
    else if (flag == "--max-new-tokens") a.max_new_tokens = std::stoll(v);
    else if (flag == "--temperature") a.temperature = std::stod(v);
    else if (flag == "--top-k") a.top_k = std::stoll(v);
    else if (flag == "--top-p") a.top_p = std::stod(v);
    else if (flag == "--seed") a.seed = std::stoull(v);
    else if (flag == "--eos") a.eos.push_back(std::stoll(v));
    else if (flag == "--stop") a.stops.push_back(v);
    else if (flag == "--batch-file") a.batch_file = v;
    else if (flag == "--device") a.device = v;
    else if (flag == "--dtype") a.dtype = v;
    else throw std::invalid_argument("unknown option " + std::string(flag) + " (see --help)");
  }
  if (a.mode != "speculative" && a.mode != "autoregressive" && a.mode != "beam" && a.mode != "ngram" &&
      a.mode != "prompt-lookup" && a.mode != "stand") {
    throw std::invalid_argument("--mode must be speculative, autoregressive, ngram, prompt-lookup, stand or beam, got " +
                                a.mode);
  }
  if (a.trajectories < 1) throw std::invalid_argument("--trajectories must be >= 1, got " + std::to_string(a.trajectories));
  if (a.temperature < 0) throw std::invalid_argument("--temperature must be >= 0");
  if (a.gamma_policy != "fixed" && a.gamma_policy != "egag" && a.gamma_policy != "schedule") {
    throw std::invalid_argument("--gamma-policy must be fixed, egag or schedule, got " + a.gamma_policy);
  }
  if (a.verify != "rejection" && a.verify != "threshold") {
    throw std::invalid_argument("--verify must be rejection or threshold, got " + a.verify);
  }
  if (a.calibrate && a.mode != "speculative") throw std::invalid_argument("--calibrate needs --mode speculative");
  if (!a.batch_file.empty() && a.mode != "speculative" && a.mode != "autoregressive" && a.mode != "ngram") {
    throw std::invalid_argument("--batch-file needs --mode speculative, autoregressive or ngram, got " + a.mode);
  }
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

// Text of tokens, through the llama2.c tokenizer or as bytes.
class Text {
 public:
  explicit Text(const std::string& tokenizer_path, int64_t vocab) {
    if (!tokenizer_path.empty()) tokenizer_ = io::Llama2cTokenizer::load(tokenizer_path, vocab);
    else if (vocab != io::ByteTokenizer::vocab_size()) {
      throw std::invalid_argument("a model with vocabulary " + std::to_string(vocab) +
                                  " needs --tokenizer (byte-level models have 256 tokens)");
    }
  }
  [[nodiscard]] bool llama2c() const { return tokenizer_.has_value(); }
  [[nodiscard]] std::vector<int64_t> encode(const std::string& text) const {
    return tokenizer_ ? tokenizer_->encode(text) : bytes_.encode(text);
  }
  [[nodiscard]] std::string piece(int64_t previous, int64_t token) const {
    return tokenizer_ ? tokenizer_->decode_piece(previous, token) : bytes_.decode_piece(previous, token);
  }
  // The text of `tokens` following the token `previous`.
  [[nodiscard]] std::string decode(int64_t previous, const std::vector<int64_t>& tokens) const {
    std::string out;
    for (const int64_t t : tokens) out += piece(previous, t), previous = t;
    return out;
  }

 private:
  std::optional<io::Llama2cTokenizer> tokenizer_;
  io::ByteTokenizer bytes_;
};

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
  for (int64_t i = 0; i < a.trajectories; ++i) {
    StandOptions run = options;
    run.seed = a.seed + static_cast<uint64_t>(i);
    const GenerationResult result =
        std::visit([&](const auto& p) { return stand_generate(memory, target, prompt, run, p); }, processor);
    stand_total += result.stats;
    std::optional<GenerationResult> baseline;
    if (a.compare) {
      baseline = std::visit([&](const auto& p) {
        return autoregressive_generate(target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                        .seed = run.seed}, p);
      }, processor);
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
              << "x; output identical: " << (identical ? "yes" : "no") << "\n";
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
    for (size_t at = line.find("\\n"); at != std::string::npos; at = line.find("\\n", at + 1)) line.replace(at, 2, "\n");
    lines.push_back(line);
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
                                                .filler_top_k = 1},
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

int run(const Arguments& a) {
  const auto weights = at::TensorOptions().dtype(parse_dtype(a.dtype)).device(parse_device(a.device));
  const io::LlamaCheckpoint target_checkpoint = io::load_llama(a.target, weights);
  Model target(target_checkpoint.config, target_checkpoint.weights);
  const Text text(a.tokenizer, target.vocab_size());
  std::optional<Model> drafter;
  const std::vector<int64_t> prompt = text.encode(a.prompt);
  std::vector<std::vector<int64_t>> stops;
  for (const std::string& stop : a.stops) {
    if (stop.empty()) throw std::invalid_argument("--stop must not be empty");
    stops.push_back(text.encode(stop));
  }
  std::vector<int64_t> eos = a.eos;
  if (eos.empty() && text.llama2c()) eos.push_back(io::Llama2cTokenizer::kEos);
  if (a.mode == "beam") return run_beam(a, target, text, prompt, eos);
  if (a.mode == "stand") return run_stand(a, target, text, prompt, eos, make_processor(a));
  if (a.mode == "speculative") {
    const io::LlamaCheckpoint drafter_checkpoint = io::load_llama(a.drafter, weights);
    drafter.emplace(drafter_checkpoint.config, drafter_checkpoint.weights);
  }
  const Processor processor = make_processor(a);
  if (!a.batch_file.empty()) {
    return run_batch_file(a, target, drafter ? &*drafter : nullptr, text, eos, stops, processor);
  }
  SpeculativeOptions speculative_options{
      .max_new_tokens = a.max_new_tokens, .eos_token_ids = eos, .stop_sequences = stops, .seed = a.seed,
      .gamma = a.gamma,
      .gamma_policy = a.gamma_policy == "egag" ? GammaPolicy::egag
                      : a.gamma_policy == "schedule" ? GammaPolicy::schedule : GammaPolicy::fixed,
      .gamma_min = a.gamma_min, .gamma_max = a.gamma_max, .egag_ema_beta = a.egag_beta, .p_min = a.p_min,
      .entropy_gate = a.entropy_gate,
      .verification = a.verify == "threshold" ? Verification::threshold : Verification::rejection,
      .threshold = a.threshold};
  std::optional<CalibrationResult> calibration;
  if (a.calibrate) {
    calibration = calibrate(a, *drafter, target, text, prompt, speculative_options, processor);
    speculative_options.verification = Verification::threshold;
    speculative_options.threshold = calibration->best_threshold;
  }
  const bool color = isatty(fileno(stdout)) != 0;
  const Colors colors = color ? Colors{"\033[32m", "\033[9;31m", "\033[1;34m", "\033[0m"} : Colors{};
  const bool show_text = !a.json;

  int64_t previous = prompt.back();
  const auto on_step = [&](const StepInfo& step) {
    if (!show_text) return;
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

  if (show_text) {
    std::cout << "target:  " << a.target << " (" << target_checkpoint.format << ", " << target.config() << ", "
              << a.dtype << " on " << a.device << ")\n";
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
  std::optional<NGramStorage> storage;
  if (a.mode == "ngram") {
    storage.emplace(a.storage.empty() ? NGramStorage(a.ngram_order, target.vocab_size()) : NGramStorage::load(a.storage));
    if (storage->vocab_size() != target.vocab_size()) {
      throw std::invalid_argument("--storage was built for vocabulary " + std::to_string(storage->vocab_size()) +
                                  ", the target has " + std::to_string(target.vocab_size()));
    }
  }
  const GenerationResult result = std::visit(
      [&](const auto& p) {
        const NGramAssistedOptions ngram_options{.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                 .stop_sequences = stops, .seed = a.seed, .on_step = on_step,
                                                 .gamma = a.gamma, .filler_top_k = a.filler};
        if (storage) return ngram_assisted_generate(*storage, target, prompt, ngram_options, p);
        if (a.mode == "prompt-lookup") {
          PromptLookupDrafter lookup;
          return ngram_assisted_generate(lookup, target, prompt, ngram_options, p);
        }
        if (drafter) {
          SpeculativeOptions options = speculative_options;
          options.on_step = on_step;
          return speculative_generate(*drafter, target, prompt, options, p);
        }
        return autoregressive_generate(target, prompt,
                                       {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                        .stop_sequences = stops, .seed = a.seed, .on_step = on_step}, p);
      },
      processor);
  if (storage && !a.save_storage.empty()) storage->save(a.save_storage);
  std::optional<GenerationResult> baseline;
  if (a.compare && a.mode != "autoregressive") {
    baseline = std::visit([&](const auto& p) {
      return autoregressive_generate(target, prompt, {.max_new_tokens = a.max_new_tokens, .eos_token_ids = eos,
                                                      .stop_sequences = stops, .seed = a.seed}, p);
    }, processor);
  }

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
              << "x; output identical: " << (baseline->tokens == result.tokens ? "yes" : "no") << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "specdec-generate: " << e.what() << "\n";
    return 2;
  }
}
