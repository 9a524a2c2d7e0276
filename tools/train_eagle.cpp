// Trains an EAGLE-3 head for a target (by default the bundled one) and writes it in the EAGLE
// project's layout (io::save_eagle: config.json + model.safetensors), which io::load_eagle reads.
//
// The target stays frozen: the hidden states at its three feature layers and its next-token
// distributions are computed without gradients. The head learns the target's distribution
// (cross-entropy against it, over the draft vocabulary) with the training-time test of EAGLE-3:
// step 0 reads the target's hidden states; step j reads the head's own outputs of step j - 1
// one position back, as draft j does at inference, and attends to the target-fed positions up to
// j places back plus its own earlier steps' positions on the diagonal; step j's loss weighs
// 0.8^j. The draft vocabulary is the --draft-vocab most frequent tokens of the training data.
// The head reads the target's embedding (not written), starts its lm_head from the target's
// classifier rows of the draft vocabulary, and checks once, before training, that its training
// forward equals the library's EagleHead at step 0.
//
// Data: with --data, windows of the Python sources there (the bundled target) and, for
// --self-fraction of each batch, the target's own continuations of them; with --data none, only
// the target's own generations from --bos (stories260K). At the end it measures the head on
// held-out prompts: greedy drafts accepted per step at --gamma, and that the output equals the
// target's alone.
//
// --init DIR continues training a saved head (its layers and draft vocabulary); --temperature
// sets how the target's own generations are sampled (0: greedy).
//
//   train_eagle [--target PATH] [--data DIR|none] [--bos N] [--out DIR] [--layers a,b,c]
//               [--draft-vocab N] [--intermediate N] [--ttt N] [--steps N] [--batch N]
//               [--seq-len N] [--self-fraction F] [--temperature T] [--init DIR] [--lr X]
//               [--gamma N] [--seed N] [--threads N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../examples/support/cli.hpp"
#include "specdec/drafting/eagle.hpp"
#include "specdec/generate.hpp"
#include "specdec/io/checkpoint.hpp"
#include "specdec/io/eagle.hpp"
#include "specdec/models/eagle.hpp"
#include "specdec/models/llama.hpp"
#include "specdec/step.hpp"
#include "text/python_corpus.hpp"
#include "text/training.hpp"

#ifndef SPECDEC_BUNDLED_MODELS_DIR
#define SPECDEC_BUNDLED_MODELS_DIR "models/bundled"
#endif

namespace {

using Model = specdec::models::LlamaModel<specdec::DynamicKVCache>;
using specdec::models::EagleConfig;
using specdec::models::EagleHead;
using specdec::models::EagleWeights;

struct Arguments {
  std::string target = SPECDEC_BUNDLED_MODELS_DIR "/target";
  std::string data = "/usr/lib/python3.11";
  int64_t bos = 1;
  std::filesystem::path out = "models/bundled/eagle3";
  std::string layers;       // empty: EAGLE-3's default
  int64_t draft_vocab = 0;  // 0: half the target's vocabulary
  int64_t ttt = 7;
  int64_t intermediate = 0;  // 0: the target's feed-forward width
  int64_t steps = 1500;
  int64_t batch = 8;
  int64_t seq_len = 128;
  double self_fraction = 0.5;
  double temperature = 1.0;
  std::string init;  // empty: a fresh head
  double lr = 2e-3;
  int64_t gamma = 4;
  uint64_t seed = 20261126;
  int threads = 1;  // one thread trained these small heads faster than two on 2 cores
};

Arguments parse(int argc, char** argv) {
  Arguments args;
  CLI::App app(
      "Trains an EAGLE-3 head for a target, with the training-time test, on text and the target's "
      "own "
      "generations.",
      "train_eagle");
  app.add_option("--target", args.target,
                 "llama2.c file or Hugging Face folder (default: the bundled target)");
  app.add_option("--data", args.data,
                 "folder of *.py training sources, or none: the target's generations only")
      ->check(CLI::ExistingDirectory | CLI::IsMember({"none"}));
  app.add_option("--bos", args.bos,
                 "first token of the target's own generations with --data none (default 1)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--out", args.out,
                 "folder the head is written to (default models/bundled/eagle3)");
  app.add_option("--layers", args.layers,
                 "the target's three feature layers a,b,c (default 2,L/2,L-3)");
  app.add_option("--draft-vocab", args.draft_vocab,
                 "draft vocabulary size (default half the target's)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 24));
  app.add_option("--intermediate", args.intermediate,
                 "the head's feed-forward width (default: the target's)")
      ->check(cli::integer<int64_t>(1, int64_t{1} << 20));
  app.add_option("--ttt", args.ttt, "training-time test steps (default 7)")
      ->check(cli::integer<int64_t>(1, 16));
  app.add_option("--steps", args.steps, "training steps (default 1500)")
      ->check(cli::integer<int64_t>(0, int64_t{1} << 30));
  app.add_option("--batch", args.batch, "sequences per step (default 8)")
      ->check(cli::integer<int64_t>(1, 4096));
  app.add_option("--seq-len", args.seq_len, "tokens per training sequence (default 128)")
      ->check(cli::integer<int64_t>(16, 1 << 16));
  app.add_option("--self-fraction", args.self_fraction,
                 "share of each batch that is the target's own continuations (default 0.5; 1 with "
                 "--data none)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--temperature", args.temperature,
                 "sampling temperature of the target's own generations (default 1; 0: greedy)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--init", args.init,
                 "start from the head saved in this folder (its layers and draft vocabulary) "
                 "instead of a fresh one")
      ->check(CLI::ExistingDirectory);
  app.add_option("--lr", args.lr, "peak learning rate (default 2e-3)")
      ->check(CLI::Range(1e-6, 1.0));
  app.add_option("--gamma", args.gamma, "drafts per step of the held-out measurement (default 4)")
      ->check(cli::integer<int64_t>(1, 64));
  app.add_option("--seed", args.seed, "initialisation and sampling seed")
      ->check(cli::integer<uint64_t>(0, std::numeric_limits<uint64_t>::max()));
  app.add_option("--threads", args.threads, "torch threads (default 1)")
      ->check(cli::integer<int>(1, 1024));
  cli::parse_or_help(app, argc, argv);
  if (args.data == "none") args.self_fraction = 1.0;
  return args;
}

std::vector<int64_t> parse_layers(const std::string& text, int64_t layers) {
  if (text.empty()) return EagleConfig::eagle3_default_layers(layers);
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || id < 0 || id > layers) {
      throw std::invalid_argument("--layers: '" + item + "' is not a layer of the target's (0 to " +
                                  std::to_string(layers) + ")");
    }
    ids.push_back(id);
  }
  if (ids.size() != 3)
    throw std::invalid_argument("--layers must name 3 layers, got '" + text + "'");
  return ids;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, true) + eps) * weight;
}

// Consecutive pairs (2i, 2i+1) of x [B, P, n, hd] rotated by the angles of positions 0..P-1.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto sizes = x.sizes();
  const torch::Tensor pairs = x.reshape({sizes[0], sizes[1], sizes[2], sizes[3] / 2, 2});
  const torch::Tensor even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
  return torch::stack({even * cos - odd * sin, even * sin + odd * cos}, -1).reshape(sizes);
}

// x [B, P, ...] moved `by` positions later along dim 1, zeros in front.
torch::Tensor shift(const torch::Tensor& x, int64_t by) {
  if (by == 0) return x;
  const int64_t p = x.size(1);
  return torch::cat({torch::zeros_like(x.narrow(1, 0, by)), x.narrow(1, 0, p - by)}, 1);
}

// The training forward of the training-time test over rows [B, S]: for each step j, the head's
// logits [B, S - 1, draft_vocab] at positions 0..S-2 (position p reads the token at p + 1).
std::vector<torch::Tensor> ttt_forward(const EagleConfig& config, const EagleWeights& w,
                                       const torch::Tensor& embedding, const torch::Tensor& ids,
                                       const torch::Tensor& features, int64_t steps) {
  const specdec::models::LlamaConfig& c = config.layer;
  const int64_t batch = ids.size(0), positions = ids.size(1) - 1;
  const int64_t heads = c.n_heads, kv_heads = c.n_kv_heads, head_dim = c.head_dim(),
                group = heads / kv_heads;
  const torch::Tensor embedded = torch::embedding(embedding, ids.narrow(1, 1, positions));
  const torch::Tensor tokens = rms_norm(embedded, w.input_norm, c.norm_eps);
  const torch::Tensor inv_freq = Model::rope_inverse_frequencies(c);
  const torch::Tensor angles =
      torch::arange(positions, torch::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);
  const torch::Tensor cos = angles.cos().to(torch::kFloat).view({1, positions, 1, head_dim / 2});
  const torch::Tensor sin = angles.sin().to(torch::kFloat).view({1, positions, 1, head_dim / 2});
  // Key position k is visible to query position p at step j when k <= p - j.
  const torch::Tensor index = torch::arange(positions, torch::kLong);
  std::vector<torch::Tensor> keys, values, logits;
  torch::Tensor hidden = torch::linear(features.narrow(1, 0, positions), w.fc, w.fc_bias);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (int64_t j = 0; j < steps; ++j) {
    if (j > 0) hidden = shift(hidden, 1);
    const torch::Tensor normed = rms_norm(hidden, w.hidden_norm, c.norm_eps);
    const torch::Tensor residual = config.norm_before_residual ? normed : hidden;
    const torch::Tensor x = torch::cat({tokens, normed}, -1);
    const torch::Tensor q =
        rotate(torch::linear(x, w.wq).view({batch, positions, heads, head_dim}), cos, sin);
    keys.push_back(
        rotate(torch::linear(x, w.wk).view({batch, positions, kv_heads, head_dim}), cos, sin)
            .repeat_interleave(group, 2));
    values.push_back(torch::linear(x, w.wv)
                         .view({batch, positions, kv_heads, head_dim})
                         .repeat_interleave(group, 2));
    // [B, heads, P, P] against the target-fed positions, then one column per earlier step.
    std::vector<torch::Tensor> scores{
        torch::matmul(q.transpose(1, 2), keys[0].permute({0, 2, 3, 1})) * scale};
    const torch::Tensor hidden_keys = index.unsqueeze(0) > (index.unsqueeze(1) - j);
    scores[0] = scores[0].masked_fill(hidden_keys, -std::numeric_limits<float>::infinity());
    for (int64_t i = 1; i <= j; ++i) {
      scores.push_back(
          (q * shift(keys[static_cast<size_t>(i)], j - i)).sum(-1).transpose(1, 2).unsqueeze(-1) *
          scale);
    }
    const torch::Tensor weights =
        torch::softmax(torch::cat(scores, -1), -1);  // [B, heads, P, P + j]
    torch::Tensor attended =
        torch::matmul(weights.narrow(-1, 0, positions), values[0].transpose(1, 2));
    for (int64_t i = 1; i <= j; ++i) {
      attended = attended + weights.narrow(-1, positions + i - 1, 1) *
                                shift(values[static_cast<size_t>(i)], j - i).transpose(1, 2);
    }
    attended = attended.transpose(1, 2).reshape({batch, positions, heads * head_dim});
    torch::Tensor out = residual + torch::linear(attended, w.wo);
    const torch::Tensor f = rms_norm(out, w.ffn_norm, c.norm_eps);
    out = out + torch::linear(torch::silu(torch::linear(f, w.w_gate)) * torch::linear(f, w.w_up),
                              w.w_down);
    logits.push_back(torch::linear(rms_norm(out, w.norm, c.norm_eps), w.lm_head));
    hidden = out;
  }
  return logits;
}

// A float32 CPU copy of a head's trained tensors, cut from autograd (for EagleHead, or to train on
// from a loaded head of any dtype).
EagleWeights detached(const EagleWeights& w) {
  EagleWeights d = w;
  for (torch::Tensor* t : {&d.fc, &d.wq, &d.wk, &d.wv, &d.wo, &d.ffn_norm, &d.w_gate, &d.w_up,
                           &d.w_down, &d.input_norm, &d.hidden_norm, &d.norm, &d.lm_head}) {
    *t = t->detach().to(torch::kCPU, torch::kFloat).clone();
  }
  if (d.fc_bias.defined()) d.fc_bias = d.fc_bias.detach().to(torch::kCPU, torch::kFloat).clone();
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Arguments args = parse(argc, argv);
    torch::set_num_threads(args.threads);
    const specdec::io::LlamaCheckpoint checkpoint = specdec::io::load_llama(args.target);
    Model target(checkpoint.config, checkpoint.weights);
    const specdec::models::LlamaConfig& tc = checkpoint.config;
    const int64_t hidden = tc.dim, vocab = tc.vocab_size;
    if (args.seq_len > tc.max_seq_len) {
      throw std::invalid_argument("--seq-len " + std::to_string(args.seq_len) +
                                  " exceeds the target's context " +
                                  std::to_string(tc.max_seq_len));
    }
    if (args.bos >= vocab)
      throw std::invalid_argument("--bos " + std::to_string(args.bos) +
                                  " is outside the vocabulary");
    if (!args.init.empty() && (!args.layers.empty() || args.draft_vocab > 0 || args.intermediate > 0)) {
      throw std::invalid_argument(
          "--layers, --draft-vocab and --intermediate come from the head with --init " + args.init +
          "; leave them out");
    }
    std::optional<EagleHead> init;
    if (!args.init.empty()) {
      init.emplace(specdec::io::load_eagle(args.init, specdec::io::EagleTarget::of(target)));
      if (init->config().kind != specdec::models::EagleKind::eagle3) {
        throw std::invalid_argument("--init " + args.init + " is not an EAGLE-3 head");
      }
    }
    const int64_t draft_vocab =
        init ? init->config().draft_vocab_size
             : (args.draft_vocab > 0 ? args.draft_vocab : std::max<int64_t>(1, vocab / 2));
    if (draft_vocab > vocab) {
      throw std::invalid_argument("--draft-vocab " + std::to_string(draft_vocab) +
                                  " exceeds the target's vocabulary " + std::to_string(vocab));
    }
    std::optional<specdec::text::PythonCorpus> corpus;
    if (args.data != "none") {
      if (vocab != 256) {
        throw std::invalid_argument(
            "--data reads text as bytes: it needs a byte-level target (vocabulary 256), not " +
            std::to_string(vocab) + "; use --data none");
      }
      corpus = specdec::text::load_python_corpus(args.data);
    }
    const std::vector<uint8_t>* stream = corpus ? &corpus->train : nullptr;
    std::mt19937_64 rng(args.seed);
    torch::manual_seed(args.seed);

    EagleConfig config;
    if (init) {
      config = init->config();
    } else {
      config = EagleConfig{.kind = specdec::models::EagleKind::eagle3,
                           .layer = tc,
                           .target_hidden_size = hidden,
                           .draft_vocab_size = draft_vocab,
                           .feature_layers = parse_layers(args.layers, tc.n_layers)};
      config.layer.n_layers = 1;
      if (args.intermediate > 0) config.layer.hidden_dim = args.intermediate;
    }
    std::cout << "target " << args.target << ": hidden " << hidden << ", vocabulary " << vocab
              << ", " << tc.n_layers << " layers; feature layers " << config.feature_layers[0]
              << "," << config.feature_layers[1] << "," << config.feature_layers[2]
              << "; draft vocabulary " << draft_vocab << "; training-time test " << args.ttt
              << " steps; data "
              << (corpus ? args.data + " (" + std::to_string(corpus->train.size()) + " bytes)"
                         : "the target's own")
              << std::endl;

    // The draft vocabulary: the most frequent tokens of a sample of the training data.
    torch::Tensor counts = torch::zeros({vocab}, torch::kLong);
    if (corpus) {
      const torch::Tensor bytes = torch::from_blob(
          corpus->train.data(), {static_cast<int64_t>(corpus->train.size())}, torch::kUInt8);
      counts += torch::bincount(bytes.to(torch::kLong), {}, vocab);
    }
    counts += torch::bincount(specdec::text::continuations(target, stream, args.bos, 64,
                                                           args.seq_len, rng, args.temperature)
                                  .flatten(),
                              {}, vocab);
    // With --init, the head's own draft vocabulary (d2t maps draft id i to target id i + d2t[i]).
    const torch::Tensor chosen =
        init ? (init->weights().d2t.to(torch::kCPU, torch::kLong) +
                torch::arange(draft_vocab, torch::kLong))
             : std::get<0>(std::get<1>(counts.topk(draft_vocab)).sort());
    const double covered =
        counts.index_select(0, chosen).sum().item<double>() / counts.sum().item<double>();
    std::cout << "draft vocabulary covers " << covered << " of the sampled tokens" << std::endl;

    // Initial weights: --init's, or fc and the layer random, norms at one, lm_head the target's
    // classifier rows.
    EagleWeights w;
    if (init) {
      w = detached(init->weights());
      w.d2t = w.d2t.to(torch::kCPU, torch::kLong);
      w.embedding = checkpoint.weights.token_embedding.to(torch::kFloat);
    } else {
      w = EagleHead::random(config, checkpoint.weights.token_embedding.to(torch::kFloat),
                            checkpoint.weights.output.to(torch::kFloat), args.seed);
      w.d2t = chosen - torch::arange(draft_vocab, torch::kLong);
      w.lm_head = checkpoint.weights.output.to(torch::kFloat).index_select(0, chosen).clone();
      w.fc = w.fc * 0.5;
    }
    std::vector<torch::Tensor> params;
    for (torch::Tensor* t : {&w.fc, &w.wq, &w.wk, &w.wv, &w.wo, &w.ffn_norm, &w.w_gate, &w.w_up,
                             &w.w_down, &w.input_norm, &w.hidden_norm, &w.norm, &w.lm_head}) {
      *t = t->detach().clone().requires_grad_();
      params.push_back(*t);
    }
    const torch::Tensor embedding = w.embedding;
    const std::vector<int64_t>& taps = config.feature_layers;

    // The training forward's step 0 equals the library's head on the same weights.
    {
      torch::NoGradGuard no_grad;
      const torch::Tensor ids =
          specdec::text::continuations(target, stream, args.bos, 1, 48, rng, args.temperature);
      auto cache = target.make_cache(1);
      const torch::Tensor features = target.forward_features(ids, cache, taps).features;
      const torch::Tensor trained = ttt_forward(config, w, embedding, ids, features, 1)[0][0];
      const EagleHead head(config, detached(w));
      specdec::models::EagleCache head_cache;
      const torch::Tensor library = head.logits(head.forward(
          ids[0].narrow(0, 1, 47), head.fuse(features[0].narrow(0, 0, 47)), head_cache));
      const double gap = (trained - library).abs().max().item<double>();
      std::cout << "training forward against EagleHead at step 0: largest logit difference " << gap
                << std::endl;
      if (!(gap < 1e-3)) throw std::runtime_error("the training forward differs from EagleHead's");
    }

    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(args.lr).weight_decay(0.0));
    const int64_t self_rows = std::lround(args.self_fraction * static_cast<double>(args.batch));
    const auto start = std::chrono::steady_clock::now();
    std::vector<double> running(static_cast<size_t>(args.ttt), 0.0),
        accuracy(static_cast<size_t>(args.ttt), 0.0);
    for (int64_t step = 0; step < args.steps; ++step) {
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options())
            .lr(specdec::text::learning_rate(step, args.steps, args.lr));
      }
      torch::Tensor ids =
          self_rows > 0 ? specdec::text::continuations(target, stream, args.bos, self_rows,
                                                       args.seq_len, rng, args.temperature)
                        : torch::Tensor();
      if (self_rows < args.batch) {
        const torch::Tensor text =
            specdec::text::batch_of(*stream, args.batch - self_rows, args.seq_len, rng).first;
        ids = ids.defined() ? torch::cat({ids, text}, 0) : text;
      }
      torch::Tensor features, labels;
      {
        torch::NoGradGuard no_grad;
        auto cache = target.make_cache(ids.size(0));
        const specdec::TargetOutput out = target.forward_features(ids, cache, taps);
        features = out.features;
        // Row r of the target's distribution predicts the token at r + 1; the head's position p
        // predicts the token at p + 2: rows 1..S-1, over the draft vocabulary, renormalised.
        const torch::Tensor p =
            torch::softmax(out.logits.narrow(1, 1, args.seq_len - 1), -1).index_select(2, chosen);
        labels = p / p.sum(-1, true).clamp_min(1e-20);
      }
      optimizer.zero_grad();
      const std::vector<torch::Tensor> logits =
          ttt_forward(config, w, embedding, ids, features, args.ttt);
      torch::Tensor loss = torch::zeros({});
      double weights = 0;
      for (int64_t j = 0; j < args.ttt; ++j) {
        // Step j's position p has a chain only for p >= j.
        const int64_t valid = args.seq_len - 1 - j;
        const torch::Tensor l = logits[static_cast<size_t>(j)].narrow(1, j, valid);
        const torch::Tensor y = labels.narrow(1, j, valid);
        const torch::Tensor step_loss = -(y * torch::log_softmax(l, -1)).sum(-1).mean();
        const double weight = std::pow(0.8, static_cast<double>(j));
        loss = loss + weight * step_loss;
        weights += weight;
        const double hit = l.argmax(-1).eq(y.argmax(-1)).to(torch::kDouble).mean().item<double>();
        const auto i = static_cast<size_t>(j);
        running[i] = step == 0 ? step_loss.item<double>()
                               : 0.98 * running[i] + 0.02 * step_loss.item<double>();
        accuracy[i] = step == 0 ? hit : 0.98 * accuracy[i] + 0.02 * hit;
      }
      (loss / weights).backward();
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      optimizer.step();
      if ((step + 1) % 100 == 0 || step + 1 == args.steps) {
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << "step " << step + 1 << "/" << args.steps << " | top-1 by test step";
        for (size_t i = 0; i < running.size(); ++i)
          std::cout << " " << std::setprecision(3) << accuracy[i];
        std::cout << " | loss step 0 " << running[0] << ", step " << running.size() - 1 << " "
                  << running.back() << " (" << std::setprecision(4) << seconds << " s)"
                  << std::endl;
      }
    }

    // Saved in the published layout, then read back through the loader for the measurement.
    const EagleHead trained(config, detached(w));
    specdec::io::save_eagle(args.out, trained);
    const EagleHead loaded =
        specdec::io::load_eagle(args.out, specdec::io::EagleTarget::of(target));
    const auto prompts = specdec::text::held_out_prompts(target, corpus ? &corpus->held_out_paths : nullptr, args.bos, 8);
    const specdec::text::HeldOut held_out = specdec::text::measure_held_out(
        target, prompts, [&] { return specdec::EagleDraftSource(loaded, target); }, args.gamma);
    specdec::text::print_held_out(held_out, args.gamma);
    std::cout << "wrote " << args.out << std::endl;
    return held_out.identical ? 0 : 1;
  } catch (const CLI::ParseError& e) {
    std::cerr << "train_eagle: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train_eagle: " << e.what() << "\n";
    return 1;
  }
}
