// Adapts a drafter model to parallel drafting (PARD, An et al. 2025, arXiv 2504.18583) for a target
// (by default the bundled pair) and writes it in the published layout (io::save_parallel_drafter:
// a Hugging Face folder whose config.json names the mask token as pard_token).
//
// The drafter's vocabulary grows by one row, the mask token (id = the target's vocabulary size;
// its embedding starts at the mean of the others'). Training continues the drafter on sequences
// where, after every real token, chains of 1 .. --masks mask tokens stand at the following
// positions; the j-th mask after real token x_s predicts x_{s+j+1}, seeing x_0 .. x_s and the masks
// of its own chain. All chains of a sequence go through one forward (each sequence once as real
// tokens and --masks times as masks, with an attention mask that says who sees whom), which is
// PARD's training layout; its conditional drop of chains (to train cheaper) is not used. The loss
// at every position, real or mask, is the cross-entropy against the target's own distribution of
// the token it predicts (distillation: the target's softmax given the true prefix, whose average
// over the tokens the mask hides is what the mask should predict).
//
// Data: with --data, windows of the Python sources there (the bundled pair) and, for
// --self-fraction of each batch, the target's own continuations of them; with --data none, the
// target's own generations from --bos (stories260K). At the end it measures, on held-out prompts
// and greedy at --gamma, the drafts accepted per step of the adapted drafter drafting in parallel
// (one forward a step) and of the original drafter drafting one token at a time.
//
//   train_pard [--target PATH] [--drafter PATH] [--data DIR|none] [--bos N] [--out DIR]
//              [--masks K] [--steps N] [--batch N] [--seq-len N] [--self-fraction F]
//              [--temperature T] [--lr X] [--init DIR] [--gamma N] [--seed N] [--threads N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../examples/support/cli.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/parallel.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/parallel_drafter.hpp"
#include "specdec/models/llama.hpp"
#include "text/python_corpus.hpp"
#include "text/training.hpp"

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

namespace {

using Model = specdec::models::LlamaModel<specdec::DynamicKVCache>;
using specdec::models::LlamaConfig;
using specdec::models::LlamaWeights;

struct Arguments {
  std::string target = SPECDEC_BUNDLED_MODELS_DIR "/target";
  std::string drafter = SPECDEC_BUNDLED_MODELS_DIR "/drafter";
  std::string data = "/usr/lib/python3.11";
  int64_t bos = 1;
  std::filesystem::path out = "models/bundled/pard";
  int64_t masks = 7;
  double chains = 0.25;
  int64_t steps = 600;
  int64_t batch = 8;
  int64_t seq_len = 96;
  double self_fraction = 0.5;
  double temperature = 1.0;
  double lr = 1e-3;
  std::string init;  // empty: adapt --drafter afresh
  int64_t gamma = 4;
  uint64_t seed = 20261201;
  int threads = 1;
};

Arguments parse(int argc, char** argv) {
  Arguments args;
  CLI::App app("Adapts a drafter model to parallel drafting (PARD) for a target, on text and the target's own "
               "generations.",
               "train_pard");
  app.add_option("--target", args.target, "llama2.c file or Hugging Face folder (default: the bundled target)");
  app.add_option("--drafter", args.drafter,
                 "the drafter to adapt: llama2.c file or Hugging Face folder (default: the bundled drafter)");
  app.add_option("--data", args.data, "folder of *.py training sources, or none: the target's generations only")
      ->check(CLI::ExistingDirectory | CLI::IsMember({"none"}));
  app.add_option("--bos", args.bos, "first token of the target's own generations with --data none (default 1)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--out", args.out, "folder the drafter is written to (default models/bundled/pard)");
  app.add_option("--masks", args.masks, "longest chain of mask tokens trained, gamma - 1 at most (default 7)")
      ->check(cli::integer<int64_t>(1, 32));
  app.add_option("--chains", args.chains,
                 "share of the positions that start a chain of masks in a training sequence (default 0.25; 1: "
                 "every position, PARD's full layout)")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--steps", args.steps, "training steps (default 600)")->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--batch", args.batch, "sequences per step (default 8)")->check(cli::integer<int64_t>(1, 4096));
  app.add_option("--seq-len", args.seq_len, "tokens per training sequence (default 96)")
      ->check(cli::integer<int64_t>(16, 1 << 16));
  app.add_option("--self-fraction", args.self_fraction,
                 "share of each batch that is the target's own continuations (default 0.5; 1 with --data none)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--temperature", args.temperature, "temperature of the target's own generations (default 1; 0: greedy)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--lr", args.lr, "peak learning rate (default 1e-3)")->check(CLI::Range(1e-8, 1.0));
  app.add_option("--init", args.init,
                 "continue training a saved parallel drafter (its folder); --drafter stays the unadapted one the "
                 "measurement compares with")
      ->check(CLI::ExistingDirectory);
  app.add_option("--gamma", args.gamma, "drafts per step of the held-out measurement (default 4)")
      ->check(cli::integer<int64_t>(1, 64));
  app.add_option("--seed", args.seed, "sampling and initialisation seed")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()));
  app.add_option("--threads", args.threads, "torch threads (default 1)")->check(cli::integer<int>(1, 1024));
  cli::parse_or_help(app, argc, argv);
  if (args.data == "none") args.self_fraction = 1.0;
  return args;
}

// The weights with every tensor a fresh leaf that requires gradients; a tied classifier stays tied.
LlamaWeights trainable(const LlamaWeights& w) {
  const auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(); };
  LlamaWeights out = w;
  out.token_embedding = leaf(w.token_embedding);
  out.output = w.output.is_same(w.token_embedding) ? out.token_embedding : leaf(w.output);
  out.norm = leaf(w.norm);
  for (auto& l : out.layers) {
    for (torch::Tensor* t : {&l.attention_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w1, &l.w2, &l.w3}) {
      *t = leaf(*t);
    }
  }
  return out;
}

// The drafter's weights with the mask row appended to the embedding and to the classifier (a tied
// one grown once), each starting at the mean of the rows before it.
LlamaWeights with_mask_row(const LlamaWeights& w) {
  const auto grown = [](const torch::Tensor& t) { return torch::cat({t, t.mean(0, /*keepdim=*/true)}); };
  LlamaWeights out = w;
  out.token_embedding = grown(w.token_embedding);
  out.output = w.output.is_same(w.token_embedding) ? out.token_embedding : grown(w.output);
  return trainable(out);
}

std::vector<torch::Tensor> parameters(const LlamaWeights& w) {
  std::vector<torch::Tensor> p{w.token_embedding, w.norm};
  if (!w.output.is_same(w.token_embedding)) p.push_back(w.output);
  for (const auto& l : w.layers) {
    for (const auto& t : {l.attention_norm, l.wq, l.wk, l.wv, l.wo, l.ffn_norm, l.w1, l.w2, l.w3}) p.push_back(t);
  }
  return p;
}

// PARD's training layout for sequences of `length` tokens: the real tokens (node t at position t),
// then for each start s of `starts` a chain of up to `masks` mask tokens, its c-th at position
// s + c (while below `length`), seeing the real tokens 0 .. s and its chain's masks up to itself.
// Every node predicts the token after its position. Returns each node's position [N], who sees
// whom [N, N] and each node's place in its chain [N] (0: a real token; c: a chain's c-th mask).
struct Layout {
  torch::Tensor depth, visible, place;
};
Layout pard_layout(int64_t length, int64_t masks, const std::vector<int64_t>& starts) {
  std::vector<int64_t> depth(static_cast<size_t>(length)), start(static_cast<size_t>(length), -1),
      place(static_cast<size_t>(length), 0);
  for (int64_t t = 0; t < length; ++t) depth[static_cast<size_t>(t)] = t;
  for (const int64_t s : starts) {
    for (int64_t c = 1; c <= masks && s + c < length; ++c) {
      depth.push_back(s + c);
      start.push_back(s);
      place.push_back(c);
    }
  }
  const auto n = static_cast<int64_t>(depth.size());
  torch::Tensor visible = torch::zeros({n, n}, torch::kBool);
  auto v = visible.accessor<bool, 2>();
  for (int64_t node = 0; node < n; ++node) {
    const int64_t s = start[static_cast<size_t>(node)];
    const int64_t prefix = s < 0 ? depth[static_cast<size_t>(node)] : s;
    for (int64_t t = 0; t <= prefix; ++t) v[node][t] = true;
    // A chain's masks are laid out in order: the ones before this node with the same start.
    for (int64_t other = node; s >= 0 && other >= length && start[static_cast<size_t>(other)] == s; --other) {
      v[node][other] = true;
    }
  }
  return {torch::tensor(depth, torch::kLong), visible, torch::tensor(place, torch::kLong)};
}

// The starts of a step's mask chains: every position (fraction 1, PARD's layout), or each with
// probability `fraction` (cheaper steps; PARD's conditional drop keeps chains in a similar way).
std::vector<int64_t> chain_starts(int64_t length, double fraction, std::mt19937_64& rng) {
  std::vector<int64_t> starts;
  std::bernoulli_distribution keep(fraction);
  for (int64_t s = 0; s + 1 < length; ++s) {
    if (fraction >= 1.0 || keep(rng)) starts.push_back(s);
  }
  return starts;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Arguments args = parse(argc, argv);
    torch::set_num_threads(args.threads);
    const specdec::io::LlamaCheckpoint target_checkpoint = specdec::io::load_llama(args.target);
    const specdec::io::LlamaCheckpoint drafter_checkpoint = specdec::io::load_llama(args.drafter);
    Model target(target_checkpoint.config, target_checkpoint.weights);
    const LlamaConfig& tc = target_checkpoint.config;
    const int64_t vocab = tc.vocab_size;
    if (drafter_checkpoint.config.vocab_size != vocab) {
      throw std::invalid_argument("--drafter has a vocabulary of " + std::to_string(drafter_checkpoint.config.vocab_size) +
                                  ", the target " + std::to_string(vocab) + ": they must be equal");
    }
    if (args.seq_len > std::min(tc.max_seq_len, drafter_checkpoint.config.max_seq_len)) {
      throw std::invalid_argument("--seq-len " + std::to_string(args.seq_len) + " exceeds a model's context (target " +
                                  std::to_string(tc.max_seq_len) + ", drafter " +
                                  std::to_string(drafter_checkpoint.config.max_seq_len) + ")");
    }
    if (args.bos >= vocab) throw std::invalid_argument("--bos " + std::to_string(args.bos) + " is outside the vocabulary");
    const std::optional<specdec::text::PythonCorpus> corpus = specdec::text::corpus_for(args.data, vocab);
    const std::vector<uint8_t>* stream = corpus ? &corpus->train : nullptr;
    std::mt19937_64 rng(args.seed);
    torch::manual_seed(args.seed);

    LlamaConfig config = drafter_checkpoint.config;
    config.vocab_size = vocab + 1;
    const int64_t mask = vocab;
    LlamaWeights weights;
    if (args.init.empty()) {
      weights = with_mask_row(drafter_checkpoint.weights);
    } else {
      specdec::io::ParallelDrafterCheckpoint init = specdec::io::load_parallel_drafter(args.init);
      if (init.config.vocab_size != vocab + 1 || init.mask_token != mask) {
        throw std::invalid_argument("--init " + args.init + " is not a parallel drafter for this target (vocabulary " +
                                    std::to_string(init.config.vocab_size) + ", mask token " +
                                    std::to_string(init.mask_token) + "; expected " + std::to_string(vocab + 1) +
                                    " and " + std::to_string(mask) + ")");
      }
      config = init.config;
      weights = trainable(init.weights);
    }
    // One training forward holds every chain of a sequence: more tokens than the drafter's context,
    // at positions within it (the saved configuration keeps the drafter's own).
    LlamaConfig training = config;
    training.max_seq_len = std::max(config.max_seq_len, args.seq_len * (args.masks + 1));
    std::cout << "target " << args.target << " (vocabulary " << vocab << "), drafter " << args.drafter << ": "
              << config.n_layers << " layers of " << config.dim << ", mask token " << mask << ", chains of up to "
              << args.masks << " masks; data "
              << (corpus ? args.data + " (" + std::to_string(corpus->train.size()) + " bytes)" : "the target's own")
              << std::endl;

    const auto params = parameters(weights);
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(args.lr).weight_decay(0.0));
    const int64_t self_rows = std::lround(args.self_fraction * static_cast<double>(args.batch));
    const auto start = std::chrono::steady_clock::now();
    std::vector<double> accuracy(static_cast<size_t>(args.masks + 1), 0.0);
    double running = 0;
    for (int64_t step = 0; step < args.steps; ++step) {
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(specdec::text::learning_rate(step, args.steps, args.lr));
      }
      torch::Tensor ids = self_rows > 0 ? specdec::text::continuations(target, stream, args.bos, self_rows, args.seq_len,
                                                                        rng, args.temperature)
                                        : torch::Tensor();
      if (self_rows < args.batch) {
        const torch::Tensor text = specdec::text::batch_of(*stream, args.batch - self_rows, args.seq_len, rng).first;
        ids = ids.defined() ? torch::cat({ids, text}, 0) : text;
      }
      const Layout layout = pard_layout(args.seq_len, args.masks, chain_starts(args.seq_len, args.chains, rng));
      const int64_t nodes = layout.depth.size(0);
      torch::Tensor teacher;  // [B, N, V]: the target's distribution of the token each node predicts
      {
        torch::NoGradGuard no_grad;
        auto cache = target.make_cache(ids.size(0));
        teacher = torch::softmax(target.forward(ids, cache).to(torch::kFloat), -1).index_select(1, layout.depth);
      }
      optimizer.zero_grad();
      // A model of the weights as they are now: LlamaModel lays its products out (and fuses q|k|v,
      // gate|up) once, when it is made, so one made before the optimizer's step would compute with
      // the weights of before; gradients flow through the layout to these leaves.
      Model drafter(training, weights);
      auto cache = drafter.make_cache(ids.size(0));
      const torch::Tensor input =
          torch::cat({ids, torch::full({ids.size(0), nodes - args.seq_len}, mask, torch::kLong)}, 1);
      const torch::Tensor logits = drafter.forward_with_mask(input, cache, layout.depth, layout.visible);
      const torch::Tensor log_q = torch::log_softmax(logits, -1).narrow(2, 0, vocab);
      const torch::Tensor loss = -(teacher * log_q).sum(-1).mean();
      loss.backward();
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      optimizer.step();
      running = step == 0 ? loss.item<double>() : 0.98 * running + 0.02 * loss.item<double>();
      {
        torch::NoGradGuard no_grad;
        const torch::Tensor hit = logits.narrow(2, 0, vocab).argmax(-1).eq(teacher.argmax(-1)).to(torch::kDouble);
        for (int64_t c = 0; c <= args.masks; ++c) {
          const torch::Tensor rows = layout.place.eq(c);
          if (rows.sum().item<int64_t>() == 0) continue;
          const double value = hit.index({torch::indexing::Slice(), rows}).mean().item<double>();
          auto& a = accuracy[static_cast<size_t>(c)];
          a = step == 0 ? value : 0.98 * a + 0.02 * value;
        }
      }
      if ((step + 1) % 50 == 0 || step + 1 == args.steps) {
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << "step " << step + 1 << "/" << args.steps << " | loss " << std::setprecision(4) << running
                  << " | top-1 agreement with the target, real token then by masks:";
        for (const double a : accuracy) std::cout << " " << std::setprecision(3) << a;
        std::cout << " (" << std::setprecision(4) << seconds << " s)" << std::endl;
      }
    }

    const std::map<std::string, std::string> metadata{
        {"trainer", "tools/train_pard.cpp"}, {"target", args.target}, {"drafter", args.drafter},
        {"data", args.data}, {"steps", std::to_string(args.steps)}, {"masks", std::to_string(args.masks)},
        {"seed", std::to_string(args.seed)}};
    specdec::io::save_parallel_drafter(args.out, config, weights, mask, torch::kFloat, metadata);
    specdec::io::ParallelDrafterCheckpoint loaded = specdec::io::load_parallel_drafter(args.out);
    Model parallel(loaded.config, loaded.weights);
    Model original(drafter_checkpoint.config, drafter_checkpoint.weights);
    const auto prompts = specdec::text::held_out_prompts(target, corpus ? &corpus->held_out_paths : nullptr, args.bos, 8);
    const specdec::ParallelDraftOptions options{.mask_token = loaded.mask_token, .vocab_size = vocab};
    const specdec::text::HeldOut adapted = specdec::text::measure_held_out(
        target, prompts, [&] { return specdec::ParallelDraftSource<Model>(parallel, options); }, args.gamma);
    const specdec::text::HeldOut chain = specdec::text::measure_held_out(
        target, prompts, [&] { return specdec::ModelDraftSource<Model>(original); }, args.gamma);
    std::printf("original drafter, one token at a time: %.4g drafts accepted per step, %.3g drafter forwards per step\n",
                chain.accepted_per_step, chain.drafter_calls_per_step);
    std::printf("parallel drafter: %.4g drafts accepted per step, %.3g drafter forwards per step (%.3g of the original's "
                "acceptance)\n",
                adapted.accepted_per_step, adapted.drafter_calls_per_step,
                adapted.accepted_per_step / chain.accepted_per_step);
    specdec::text::print_held_out(adapted, args.gamma);
    std::cout << "wrote " << args.out << std::endl;
    return adapted.identical ? 0 : 1;
  } catch (const CLI::ParseError& e) {
    std::cerr << "train_pard: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_pard: " << e.what() << "\n";
    return 1;
  }
}
