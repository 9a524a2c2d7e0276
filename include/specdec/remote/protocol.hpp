// What client and server of the remote verification service share: the processors as the wire
// describes them, the drafter's distributions q in the wire's encodings, the per-step seed and
// the authorization header and TLS material. Link specdec::remote (gRPC, protobuf and the generated code of
// proto/specdec/remote/v1/verifier.proto).
#pragma once

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <variant>

#include "specdec/detail/torch_compat.hpp"
#include "specdec/io/regular_file.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/remote/processors.hpp"
#include "specdec/remote/v1/verifier.grpc.pb.h"

namespace specdec::remote {

namespace wire = ::specdec::remote::v1;

// The wire's description of `processor`.
template <LogitsProcessor P>
wire::Sampling describe(const P& processor) {
  wire::Sampling sampling;
  if constexpr (std::is_same_v<P, GreedyProcessor>) {
    sampling.set_kind(wire::Sampling::GREEDY);
  } else if constexpr (std::is_same_v<P, MultinomialProcessor>) {
    sampling.set_kind(wire::Sampling::MULTINOMIAL);
    sampling.set_temperature(processor.temperature());
  } else if constexpr (std::is_same_v<P, TopKProcessor>) {
    sampling.set_kind(wire::Sampling::TOP_K);
    sampling.set_temperature(processor.temperature());
    sampling.set_top_k(processor.k());
  } else if constexpr (std::is_same_v<P, NucleusProcessor>) {
    sampling.set_kind(wire::Sampling::NUCLEUS);
    sampling.set_temperature(processor.temperature());
    sampling.set_top_p(processor.top_p());
  } else if constexpr (std::is_same_v<P, TopKNucleusProcessor>) {
    sampling.set_kind(wire::Sampling::TOP_K_NUCLEUS);
    sampling.set_temperature(processor.temperature());
    sampling.set_top_k(processor.k());
    sampling.set_top_p(processor.top_p());
  } else {
    static_assert(!sizeof(P), "the remote service knows the five processors of logits_processor.hpp");
  }
  return sampling;
}

// The processor a description names. Throws std::invalid_argument (from the processor's own
// checks) for a bad temperature, k or p, and for an unknown kind.
inline AnyProcessor processor_of(const wire::Sampling& sampling) {
  switch (sampling.kind()) {
    case wire::Sampling::GREEDY:
      return GreedyProcessor{};
    case wire::Sampling::MULTINOMIAL:
      return MultinomialProcessor(sampling.temperature());
    case wire::Sampling::TOP_K:
      return TopKProcessor(sampling.top_k(), sampling.temperature());
    case wire::Sampling::NUCLEUS:
      return NucleusProcessor(sampling.top_p(), sampling.temperature());
    case wire::Sampling::TOP_K_NUCLEUS:
      return TopKNucleusProcessor(sampling.top_k(), sampling.top_p(), sampling.temperature());
    default:
      throw std::invalid_argument("sampling.kind " + std::to_string(sampling.kind()) + " is unknown");
  }
}

// How q travels for a processor: nothing under greedy decoding (verification compares argmaxes)
// or threshold verification (it reads p only), the nonzero entries where the processor truncates
// (top-k, nucleus), every entry otherwise.
template <LogitsProcessor P>
wire::DraftProbs::Encoding encoding_for(bool threshold, bool half_precision) {
  if (threshold || std::is_same_v<P, GreedyProcessor>) return wire::DraftProbs::NONE;
  if constexpr (std::is_same_v<P, MultinomialProcessor>) {
    return half_precision ? wire::DraftProbs::DENSE_F16 : wire::DraftProbs::DENSE_F32;
  }
  return wire::DraftProbs::SPARSE;
}

// Writes q [k, vocab] (any device, any floating dtype) into `out` in `encoding`.
inline void encode_q(const at::Tensor& q, wire::DraftProbs::Encoding encoding, wire::DraftProbs* out) {
  out->set_encoding(encoding);
  if (encoding == wire::DraftProbs::NONE || !q.defined()) return;
  const at::Tensor host = q.to(at::kCPU, at::kFloat).contiguous();
  const int64_t k = host.size(0), vocab = host.size(1);
  const float* values = host.data_ptr<float>();
  if (encoding == wire::DraftProbs::DENSE_F32) {
    out->mutable_values()->Add(values, values + k * vocab);
  } else if (encoding == wire::DraftProbs::DENSE_F16) {
    const at::Tensor halves = host.to(at::kHalf).contiguous();
    out->set_halves(std::string(static_cast<const char*>(halves.data_ptr()), static_cast<size_t>(k * vocab * 2)));
  } else {
    for (int64_t row = 0; row < k; ++row) {
      int32_t n = 0;
      for (int64_t t = 0; t < vocab; ++t) {
        const float v = values[row * vocab + t];
        if (v > 0) out->add_indices(static_cast<int32_t>(t)), out->add_values(v), ++n;
      }
      out->add_row_lengths(n);
    }
  }
}

// q [k, vocab] float32 on the CPU from the wire, every size, index and value checked: each row a
// distribution (finite, non-negative) in which its draft has positive probability. Throws
// std::invalid_argument naming the field.
inline at::Tensor decode_q(const wire::DraftProbs& q, std::span<const int64_t> drafts, int64_t vocab) {
  const auto k = static_cast<int64_t>(drafts.size());
  at::Tensor out = at::zeros({k, vocab}, at::kFloat);
  float* data = out.data_ptr<float>();
  const auto fail = [](const std::string& message) { throw std::invalid_argument(message); };
  switch (q.encoding()) {
    case wire::DraftProbs::DENSE_F32:
      if (static_cast<int64_t>(q.values_size()) != k * vocab) {
        fail("q.values holds " + std::to_string(q.values_size()) + " entries, expected drafts (" + std::to_string(k) +
             ") x vocab (" + std::to_string(vocab) + ")");
      }
      std::memcpy(data, q.values().data(), static_cast<size_t>(k * vocab) * sizeof(float));
      break;
    case wire::DraftProbs::DENSE_F16: {
      if (static_cast<int64_t>(q.halves().size()) != k * vocab * 2) {
        fail("q.halves holds " + std::to_string(q.halves().size()) + " bytes, expected 2 x drafts x vocab = " +
             std::to_string(k * vocab * 2));
      }
      at::Tensor halves = at::empty({k, vocab}, at::kHalf);
      std::memcpy(halves.data_ptr(), q.halves().data(), q.halves().size());
      out.copy_(halves.to(at::kFloat));
      break;
    }
    case wire::DraftProbs::SPARSE: {
      if (q.row_lengths_size() != k) {
        fail("q.row_lengths holds " + std::to_string(q.row_lengths_size()) + " rows, expected " + std::to_string(k));
      }
      if (q.indices_size() != q.values_size()) fail("q.indices and q.values differ in length");
      int64_t at = 0;
      for (int64_t row = 0; row < k; ++row) {
        const int64_t n = q.row_lengths(static_cast<int>(row));
        if (n < 0 || n > vocab || at + n > q.indices_size()) fail("q.row_lengths[" + std::to_string(row) + "] = " + std::to_string(n) + " is out of range");
        for (int64_t i = at; i < at + n; ++i) {
          const int64_t t = q.indices(static_cast<int>(i));
          if (t < 0 || t >= vocab) fail("q.indices[" + std::to_string(i) + "] = " + std::to_string(t) + " is outside the vocabulary");
          data[row * vocab + t] = q.values(static_cast<int>(i));
        }
        at += n;
      }
      if (at != q.indices_size()) fail("q.indices holds more entries than q.row_lengths add up to");
      break;
    }
    default:
      fail("q.encoding " + std::to_string(q.encoding()) + " does not carry distributions");
  }
  for (int64_t row = 0; row < k; ++row) {
    double sum = 0;
    for (int64_t t = 0; t < vocab; ++t) {
      const float v = data[row * vocab + t];
      if (!std::isfinite(v) || v < 0) fail("q row " + std::to_string(row) + " holds " + std::to_string(v) + " at token " + std::to_string(t));
      sum += v;
    }
    if (std::abs(sum - 1.0) > 1e-2) fail("q row " + std::to_string(row) + " sums to " + std::to_string(sum) + ", not 1");
    if (data[row * vocab + drafts[static_cast<size_t>(row)]] <= 0) {
      fail("drafts[" + std::to_string(row) + "] = " + std::to_string(drafts[static_cast<size_t>(row)]) +
           " has probability 0 under its q row: it cannot have been drawn from it");
    }
  }
  return out;
}

// The seed of a session's step `step`: splitmix64 of (seed, step), so each step's sampling is
// reproducible and independent of the others.
inline uint64_t step_seed(uint64_t seed, uint64_t step) noexcept {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (step + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The metadata key and value prefix of the shared secret.
// TLS material, PEM text (not file names; read_pem reads a file): a side's own certificate chain
// and private key, and the certificates it trusts to sign the other side's.
struct TlsOptions {
  std::string certificate_chain{};  // this side's certificate, then its intermediates
  std::string private_key{};        // the key of that certificate
  std::string trusted_ca{};         // server: CAs that sign client certificates (required of every
                                    // client when set); client: CAs that sign the server's
  [[nodiscard]] bool enabled() const noexcept {
    return !certificate_chain.empty() || !private_key.empty() || !trusted_ca.empty();
  }
};

// The contents of a PEM file. Throws std::invalid_argument naming `what` and the file when it
// does not exist, is not a regular file (a folder, a FIFO, a socket, a device), cannot be opened
// (with the system's reason), is larger than 1 MiB or holds no PEM block.
inline std::string read_pem(const std::string& file, const char* what) {
  const std::string named = std::string(what) + " " + file;
  const std::string text = io::read_regular_file(file, what, size_t{1} << 20);
  if (text.size() > (size_t{1} << 20)) throw std::invalid_argument(named + " is larger than 1 MiB");
  if (text.find("-----BEGIN ") == std::string::npos) throw std::invalid_argument(named + " holds no PEM block (-----BEGIN ...)");
  return text;
}

// Throws std::invalid_argument unless `tls`'s certificate_chain opens with a certificate whose
// public key is that of private_key (both PEM; OpenSSL reads them), naming them as `chain_name`
// and `key_name` (a flag and a file) and the cause: a chain without a readable certificate, a key
// that cannot be read (an encrypted key is refused: the server has no passphrase), or a key that is
// another certificate's. gRPC would only fail to listen, without saying why. Does nothing when
// either is empty.
inline void check_tls_key(const TlsOptions& tls, const std::string& chain_name, const std::string& key_name) {
  if (tls.certificate_chain.empty() || tls.private_key.empty()) return;
  const auto bio_of = [](const std::string& pem) {
    return std::unique_ptr<BIO, decltype(&BIO_free)>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  };
  const auto chain = bio_of(tls.certificate_chain);
  const auto key = bio_of(tls.private_key);
  if (!chain || !key) throw std::bad_alloc();
  const std::unique_ptr<X509, decltype(&X509_free)> certificate(PEM_read_bio_X509(chain.get(), nullptr, nullptr, nullptr),
                                                                &X509_free);
  if (!certificate) throw std::invalid_argument(chain_name + " holds no readable certificate (PEM CERTIFICATE)");
  // A callback that gives no passphrase: an encrypted key fails here instead of prompting.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return 0; };
  const std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> private_key(
      PEM_read_bio_PrivateKey(key.get(), nullptr, no_passphrase, nullptr), &EVP_PKEY_free);
  ERR_clear_error();
  if (!private_key) {
    throw std::invalid_argument(key_name + " holds no readable private key (PEM PRIVATE KEY, unencrypted)");
  }
  if (X509_check_private_key(certificate.get(), private_key.get()) != 1) {
    ERR_clear_error();
    throw std::invalid_argument(key_name + " is not the private key of the certificate in " + chain_name +
                                " (the key belongs to another certificate)");
  }
}

inline constexpr std::string_view kAuthorization = "authorization";
inline constexpr std::string_view kBearer = "Bearer ";

}  // namespace specdec::remote
