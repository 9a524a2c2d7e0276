// Trains the bundled target/drafter pair: two byte-level Llama models on the Python standard
// library sources that Debian installs with python3 (every top-level *.py file of
// /usr/lib/python3.11, sorted by name; every tenth file is held out). The target learns from the
// bytes; the drafter, 7x cheaper per token, learns to match the target's distributions
// (distillation), which is what speculative decoding rewards. Writes Hugging Face folders
// (config.json + fp16 model.safetensors) that io::load_hf_llama reads.
//
//   train_bundled_pair [--data DIR] [--out DIR] [--target-steps N] [--drafter-steps N]
//                      [--batch N] [--seq-len N] [--seed N] [--threads N]
// The models' max_seq_len is the training window: rotary positions beyond it were never trained.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../examples/support/cli.hpp"
#include "specdec/io/hf_llama.hpp"
#include "specdec/models/llama.hpp"
#include "text/python_corpus.hpp"
#include "text/training.hpp"

namespace {

using specdec::text::batch_of;
using specdec::text::learning_rate;
using specdec::models::LlamaConfig;
using specdec::models::LlamaLayerWeights;
using specdec::models::LlamaModel;
using specdec::models::LlamaWeights;

struct Arguments {
  std::filesystem::path data = "/usr/lib/python3.11";
  std::filesystem::path out = "models/bundled";
  int64_t target_steps = 2000;
  int64_t drafter_steps = 1000;
  int64_t batch = 4;
  int64_t seq_len = 512;  // training window: the models are used within this many positions
  uint64_t seed = 20261122;
  int threads = 2;
};

// Parses the command line with CLI11; exits 0 after --help, throws CLI::ParseError naming a bad
// flag or value.
Arguments parse(int argc, char** argv) {
  Arguments args;
  CLI::App app("Trains the bundled byte-level target/drafter pair on Python sources.", "train_bundled_pair");
  app.add_option("--data", args.data, "folder of *.py training sources (default /usr/lib/python3.11)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--out", args.out, "where the target/ and drafter/ folders are written (default models/bundled)");
  app.add_option("--target-steps", args.target_steps, "target training steps (default 2000)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--drafter-steps", args.drafter_steps, "drafter distillation steps (default 1000)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--batch", args.batch, "sequences per step (default 4)")->check(cli::integer<int64_t>(1, 4096));
  app.add_option("--seq-len", args.seq_len, "training window and the models' context (default 512)")
      ->check(cli::integer<int64_t>(2, 1 << 16));
  app.add_option("--seed", args.seed, "initialisation and sampling seed")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()));
  app.add_option("--threads", args.threads, "torch threads (default 2)")->check(cli::integer<int>(1, 1024));
  cli::parse_or_help(app, argc, argv);
  return args;
}

// GPT-2 style initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers).
LlamaWeights initial_weights(const LlamaConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layers));
  const auto normal = [](std::vector<int64_t> shape, double std) {
    return (torch::randn(shape) * std).requires_grad_();
  };
  const auto ones = [](int64_t n) { return torch::ones({n}).requires_grad_(); };
  LlamaWeights w;
  w.token_embedding = normal({c.vocab_size, c.dim}, 0.02);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    w.layers.push_back(LlamaLayerWeights{
        ones(c.dim), normal({c.dim, c.dim}, 0.02), normal({c.kv_dim(), c.dim}, 0.02),
        normal({c.kv_dim(), c.dim}, 0.02), normal({c.dim, c.dim}, residual), ones(c.dim),
        normal({c.hidden_dim, c.dim}, 0.02), normal({c.dim, c.hidden_dim}, residual),
        normal({c.hidden_dim, c.dim}, 0.02)});
  }
  w.norm = ones(c.dim);
  w.output = normal({c.vocab_size, c.dim}, 0.02);
  return w;
}

std::vector<torch::Tensor> parameters(const LlamaWeights& w) {
  std::vector<torch::Tensor> p{w.token_embedding, w.norm, w.output};
  for (const auto& l : w.layers) {
    for (const auto& t : {l.attention_norm, l.wq, l.wk, l.wv, l.wo, l.ffn_norm, l.w1, l.w2, l.w3}) {
      p.push_back(t);
    }
  }
  return p;
}

// The logits of a model of `weights` as they are now. LlamaModel lays its products out (and fuses
// q|k|v, gate|up) once, when it is made, so a model made before an optimizer step would still
// compute with the weights of before; gradients flow through the layout to the leaves.
torch::Tensor logits_of(const LlamaConfig& config, const LlamaWeights& weights, const torch::Tensor& inputs) {
  LlamaModel<> model(config, weights);
  auto cache = model.make_cache(inputs.size(0));
  return model.forward(inputs, cache);
}

// Trains `model` for `steps`; loss_of(inputs, targets) returns the scalar loss of a batch.
template <class Loss>
void train(const std::string& name, LlamaWeights& weights, int64_t steps, double peak_lr, const Arguments& args,
           const std::vector<uint8_t>& stream, std::mt19937_64& rng, Loss loss_of) {
  auto params = parameters(weights);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(peak_lr).weight_decay(0.01));
  const auto start = std::chrono::steady_clock::now();
  double running = 0;
  for (int64_t step = 0; step < steps; ++step) {
    for (auto& group : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(step, steps, peak_lr));
    }
    const auto [inputs, targets] = batch_of(stream, args.batch, args.seq_len, rng);
    optimizer.zero_grad();
    torch::Tensor loss = loss_of(inputs, targets);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    optimizer.step();
    running = step == 0 ? loss.item<double>() : 0.98 * running + 0.02 * loss.item<double>();
    if ((step + 1) % 50 == 0 || step + 1 == steps) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << name << " step " << step + 1 << "/" << steps << " loss " << running << " ("
                << seconds << " s)" << std::endl;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Arguments args = parse(argc, argv);
    torch::set_num_threads(args.threads);
    const specdec::text::PythonCorpus corpus = specdec::text::load_python_corpus(args.data);
    std::cout << "training bytes " << corpus.train.size() << " from " << corpus.train_files
              << " files, held-out bytes " << corpus.held_out.size() << " from "
              << corpus.held_out_files << " files" << std::endl;
    std::mt19937_64 rng(args.seed);

    const LlamaConfig target_config{.dim = 192, .hidden_dim = 512, .n_layers = 4, .n_heads = 6,
                                    .n_kv_heads = 3, .vocab_size = 256, .max_seq_len = args.seq_len};
    const LlamaConfig drafter_config{.dim = 96, .hidden_dim = 256, .n_layers = 2, .n_heads = 3,
                                     .n_kv_heads = 3, .vocab_size = 256, .max_seq_len = args.seq_len};
    LlamaWeights target_weights = initial_weights(target_config, args.seed);
    train("target", target_weights, args.target_steps, 3e-3, args, corpus.train, rng,
          [&](const torch::Tensor& inputs, const torch::Tensor& targets) {
            return torch::nn::functional::cross_entropy(logits_of(target_config, target_weights, inputs).view({-1, 256}),
                                                        targets.view({-1}));
          });

    LlamaModel<> target(target_config, target_weights);  // trained: its weights stay as they are
    LlamaWeights drafter_weights = initial_weights(drafter_config, args.seed + 1);
    train("drafter", drafter_weights, args.drafter_steps, 3e-3, args, corpus.train, rng,
          [&](const torch::Tensor& inputs, const torch::Tensor&) {
            torch::Tensor teacher;
            {
              torch::NoGradGuard no_grad;
              auto cache = target.make_cache(inputs.size(0));
              teacher = target.forward(inputs, cache).log_softmax(-1);
            }
            const torch::Tensor student = logits_of(drafter_config, drafter_weights, inputs).log_softmax(-1);
            // KL(target || drafter), averaged over positions.
            return (teacher.exp() * (teacher - student)).sum(-1).mean();
          });

    const std::string data_note = "python3.11 stdlib sources (" + args.data.string() +
                                  "/*.py sorted by name, every tenth file held out)";
    const std::map<std::string, std::string> metadata{
        {"data", data_note}, {"seed", std::to_string(args.seed)},
        {"target_steps", std::to_string(args.target_steps)},
        {"drafter_steps", std::to_string(args.drafter_steps)},
        {"batch", std::to_string(args.batch)}, {"seq_len", std::to_string(args.seq_len)},
        {"trainer", "tools/train_bundled_pair.cpp"}};
    const nlohmann::json extra{{"specdec_tokenizer", "bytes"}};
    specdec::io::save_hf_llama(args.out / "target", target_config, target_weights, torch::kHalf, extra, metadata);
    specdec::io::save_hf_llama(args.out / "drafter", drafter_config, drafter_weights, torch::kHalf, extra, metadata);
    std::cout << "wrote " << (args.out / "target") << " and " << (args.out / "drafter") << std::endl;
  } catch (const CLI::ParseError& e) {
    std::cerr << "train_bundled_pair: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_bundled_pair: " << e.what() << "\n";
    return 1;
  }
}
