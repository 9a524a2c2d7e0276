// Trains Medusa heads for a target (by default the bundled one) and writes them in the published
// layout that io::load_medusa reads (config.json + medusa_lm_head.safetensors).
//
// The target stays frozen: its final normalised hidden state (FeatureTarget tap L) is computed
// without gradients, and head i learns to predict the token i + 2 places ahead with
// cross-entropy, head losses weighted 0.8^i (as the Medusa paper weights them). Each head's
// blocks start at zero and its classifier at the target's own, as Medusa initialises them. Half
// of each batch (--self-fraction) is the target's own sampled continuations of training text
// (self-distillation: the heads learn what the target says, which is what verification
// accepts), the rest the text itself (the Python sources of the bundled pair's trainer; with
// --data none, all of it is the target's own generations from --bos, as for stories260K). At the
// end it measures the heads on held-out prompts: greedy drafts per step accepted, and that the
// output equals the target's alone. --temperature sets how the target's own generations are
// sampled (0: greedy).
//
//   train_medusa [--target DIR] [--data DIR|none] [--bos N] [--out DIR] [--heads K] [--layers N] [--steps N]
//                [--batch N] [--seq-len N] [--self-fraction F] [--temperature T] [--seed N] [--threads N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../examples/support/cli.hpp"
#include "specdec/drafting/medusa.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/medusa.hpp"
#include "specdec/io/safetensors.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/models/medusa.hpp"
#include "specdec/step.hpp"
#include "text/python_corpus.hpp"
#include "text/training.hpp"

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

namespace {

using Model = specdec::models::LlamaModel<specdec::DynamicKVCache>;

struct Arguments {
  std::filesystem::path target = SPECDEC_BUNDLED_MODELS_DIR "/target";
  std::string data = "/usr/lib/python3.11";
  int64_t bos = 1;
  std::filesystem::path out = "models/bundled/medusa";
  int64_t heads = 3;
  int64_t layers = 1;
  int64_t steps = 1500;
  int64_t batch = 8;
  int64_t seq_len = 128;
  double self_fraction = 0.5;
  double temperature = 1.0;
  uint64_t seed = 20261125;
  int threads = 1;  // one thread trained these small heads faster than two on 2 cores
};

Arguments parse(int argc, char** argv) {
  Arguments args;
  CLI::App app("Trains Medusa heads for a target on Python sources and its own continuations.", "train_medusa");
  app.add_option("--target", args.target, "llama2.c file or Hugging Face folder (default: the bundled target)");
  app.add_option("--data", args.data,
                 "folder of *.py training sources (default /usr/lib/python3.11), or none: the target's generations only")
      ->check(CLI::ExistingDirectory | CLI::IsMember({"none"}));
  app.add_option("--bos", args.bos, "first token of the target's own generations with --data none (default 1)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--out", args.out, "folder the heads are written to (default models/bundled/medusa)");
  app.add_option("--heads", args.heads, "Medusa heads (default 3)")->check(cli::integer<int64_t>(1, 16));
  app.add_option("--layers", args.layers, "residual blocks per head (default 1)")->check(cli::integer<int64_t>(0, 8));
  app.add_option("--steps", args.steps, "training steps (default 1500)")->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--batch", args.batch, "sequences per step (default 8)")->check(cli::integer<int64_t>(1, 4096));
  app.add_option("--seq-len", args.seq_len, "tokens per training sequence (default 128)")
      ->check(cli::integer<int64_t>(16, 1 << 16));
  app.add_option("--self-fraction", args.self_fraction,
                 "share of each batch that is the target's own continuations (default 0.5)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--temperature", args.temperature,
                 "sampling temperature of the target's own generations (default 1; 0: greedy)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--seed", args.seed, "initialisation and sampling seed")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()));
  app.add_option("--threads", args.threads, "torch threads (default 1)")->check(cli::integer<int>(1, 1024));
  cli::parse_or_help(app, argc, argv);
  return args;
}

struct Head {
  std::vector<torch::Tensor> weights, biases;
  torch::Tensor classifier;
};

// The head's logits over hidden states [..., H].
torch::Tensor head_logits(const Head& head, torch::Tensor h) {
  for (size_t b = 0; b < head.weights.size(); ++b) h = h + torch::silu(torch::linear(h, head.weights[b], head.biases[b]));
  return torch::linear(h, head.classifier);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Arguments args = parse(argc, argv);
    torch::set_num_threads(args.threads);
    const specdec::io::LlamaCheckpoint checkpoint = specdec::io::load_llama(args.target.string());
    Model target(checkpoint.config, checkpoint.weights);
    const int64_t hidden = checkpoint.config.dim, vocab = checkpoint.config.vocab_size;
    const std::optional<specdec::text::PythonCorpus> corpus = specdec::text::corpus_for(args.data, vocab);
    const std::vector<uint8_t>* stream = corpus ? &corpus->train : nullptr;
    if (args.bos >= vocab) throw std::invalid_argument("--bos " + std::to_string(args.bos) + " is outside the vocabulary");
    if (args.seq_len > checkpoint.config.max_seq_len) {
      throw std::invalid_argument("--seq-len " + std::to_string(args.seq_len) + " exceeds the target's context " +
                                  std::to_string(checkpoint.config.max_seq_len));
    }
    const std::vector<int64_t> taps{checkpoint.config.n_layers};
    std::mt19937_64 rng(args.seed);
    torch::manual_seed(args.seed);
    std::cout << "target " << args.target << ": hidden " << hidden << ", vocabulary " << vocab << ", "
              << checkpoint.config.n_layers << " layers; " << args.heads << " heads of " << args.layers
              << " blocks; data " << (corpus ? args.data + " (" + std::to_string(corpus->train.size()) + " bytes)" : "the target's own")
              << std::endl;

    std::vector<Head> heads(static_cast<size_t>(args.heads));
    std::vector<torch::Tensor> params;
    for (Head& head : heads) {
      for (int64_t b = 0; b < args.layers; ++b) {
        head.weights.push_back(torch::zeros({hidden, hidden}).requires_grad_());
        head.biases.push_back(torch::zeros({hidden}).requires_grad_());
        params.push_back(head.weights.back());
        params.push_back(head.biases.back());
      }
      head.classifier = checkpoint.weights.output.to(torch::kFloat).clone().requires_grad_();
      params.push_back(head.classifier);
    }
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
    const int64_t self_rows =
        corpus ? static_cast<int64_t>(std::lround(args.self_fraction * static_cast<double>(args.batch))) : args.batch;
    const auto start = std::chrono::steady_clock::now();
    std::vector<double> running(heads.size(), 0.0), accuracy(heads.size(), 0.0);
    for (int64_t step = 0; step < args.steps; ++step) {
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(specdec::text::learning_rate(step, args.steps, 1e-3));
      }
      torch::Tensor ids =
          self_rows > 0 ? specdec::text::continuations(target, stream, args.bos, self_rows, args.seq_len, rng, args.temperature) : torch::Tensor();
      if (self_rows < args.batch) {
        const torch::Tensor text = specdec::text::batch_of(*stream, args.batch - self_rows, args.seq_len, rng).first;
        ids = ids.defined() ? torch::cat({ids, text}, 0) : text;
      }
      torch::Tensor features;
      {
        torch::NoGradGuard no_grad;
        auto cache = target.make_cache(ids.size(0));
        features = target.forward_features(ids, cache, taps).features;  // [B, S, H]
      }
      optimizer.zero_grad();
      torch::Tensor loss = torch::zeros({});
      double weights = 0;
      for (size_t i = 0; i < heads.size(); ++i) {
        const int64_t ahead = static_cast<int64_t>(i) + 2;  // head i predicts the token i + 2 places ahead
        const torch::Tensor logits = head_logits(heads[i], features.narrow(1, 0, args.seq_len - ahead));
        const torch::Tensor labels = ids.narrow(1, ahead, args.seq_len - ahead);
        const torch::Tensor head_loss = torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), labels.reshape({-1}));
        const double weight = std::pow(0.8, static_cast<double>(i));
        loss = loss + weight * head_loss;
        weights += weight;
        const double hit = logits.argmax(-1).eq(labels).to(torch::kDouble).mean().item<double>();
        running[i] = step == 0 ? head_loss.item<double>() : 0.98 * running[i] + 0.02 * head_loss.item<double>();
        accuracy[i] = step == 0 ? hit : 0.98 * accuracy[i] + 0.02 * hit;
      }
      (loss / weights).backward();
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      optimizer.step();
      if ((step + 1) % 100 == 0 || step + 1 == args.steps) {
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << "step " << step + 1 << "/" << args.steps;
        for (size_t i = 0; i < heads.size(); ++i) std::cout << " | head " << i << " loss " << running[i] << " top-1 " << accuracy[i];
        std::cout << " (" << seconds << " s)" << std::endl;
      }
    }

    // Save in the published layout, then read back through the loader for the measurement.
    std::filesystem::create_directories(args.out);
    std::map<std::string, torch::Tensor> tensors;
    for (size_t i = 0; i < heads.size(); ++i) {
      const std::string prefix = std::to_string(i) + ".";
      for (int64_t b = 0; b < args.layers; ++b) {
        tensors[prefix + std::to_string(b) + ".linear.weight"] = heads[i].weights[static_cast<size_t>(b)].detach().to(torch::kHalf);
        tensors[prefix + std::to_string(b) + ".linear.bias"] = heads[i].biases[static_cast<size_t>(b)].detach().to(torch::kHalf);
      }
      tensors[prefix + std::to_string(args.layers) + ".weight"] = heads[i].classifier.detach().to(torch::kHalf);
    }
    specdec::io::save_safetensors(args.out / "medusa_lm_head.safetensors", tensors,
                                  {{"trainer", "tools/train_medusa.cpp"}, {"steps", std::to_string(args.steps)},
                                   {"seed", std::to_string(args.seed)}});
    const nlohmann::json config{{"medusa_num_heads", args.heads}, {"medusa_num_layers", args.layers},
                                {"hidden_size", hidden}, {"vocab_size", vocab},
                                {"base_model_name_or_path", args.target.filename().string()}};
    std::ofstream(args.out / "config.json") << config.dump(2) << "\n";

    const specdec::models::MedusaHeads loaded = specdec::io::load_medusa(args.out, hidden, vocab);
    const auto prompts = specdec::text::held_out_prompts(target, corpus ? &corpus->held_out_paths : nullptr, args.bos, 8);
    const specdec::text::HeldOut held_out = specdec::text::measure_held_out(
        target, prompts, [&] { return specdec::MedusaDraftSource(loaded, target); }, args.heads);
    specdec::text::print_held_out(held_out, args.heads);
    std::cout << "wrote " << args.out << std::endl;
    return held_out.identical ? 0 : 1;
  } catch (const CLI::ParseError& e) {
    std::cerr << "train_medusa: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_medusa: " << e.what() << "\n";
    return 1;
  }
}
