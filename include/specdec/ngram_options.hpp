// Options of the n-gram storages: the tie rule of their counts and the rule that stops a
// confident draft. Plain C++ (no libtorch), shared by ngram_storage.hpp and options.hpp.
#pragma once

#include <cstdint>
#include <limits>
#include <ostream>

#include "specdec/detail/check.hpp"

namespace specdec {

// How a context's best follower is chosen among followers with equal counts.
enum class NGramTies {
  first_to_reach,  // seed 000: the first follower to reach the highest count keeps the lead until
                   // another strictly exceeds it; depends on the order of updates and merges
  smallest_token,  // the smallest token id among those with the highest count: independent of the
                   // order of updates and merges, so a merge equals one build over both texts
};

inline std::ostream& operator<<(std::ostream& out, NGramTies ties) {
  return out << (ties == NGramTies::first_to_reach ? "first_to_reach" : "smallest_token");
}

// When a multi-token draft from an n-gram storage stops (draft() and NGramAssistedOptions). Each
// drafted token comes from the longest known context of at least min_context tokens; drafting
// stops at the first position where no such context is known or its best follower is not
// confident: fewer than min_count observations, or less than min_share of the context's
// observations. The neutral values (1, 0, 1) draft as far as any context is known.
struct NGramDraftRule {
  int64_t min_count = 1;    // least count of the drafted follower (>= 1; 1: off)
  double min_share = 0.0;   // least share of its context's count, in [0, 1] (0: off)
  int64_t min_context = 1;  // shortest context drafted from, in tokens (>= 1; 1: back off to one
                            // token; n - 1 or more: the storage's longest contexts only)

  void validate() const {
    if (min_count < 1 || min_count > std::numeric_limits<uint32_t>::max()) {
      detail::throw_invalid("draft_rule.min_count", "be in [1, 2^32 - 1]", min_count);
    }
    if (!(min_share >= 0.0 && min_share <= 1.0)) detail::throw_invalid("draft_rule.min_share", "be in [0, 1]", min_share);
    if (min_context < 1) detail::throw_invalid("draft_rule.min_context", "be >= 1", min_context);
  }
  [[nodiscard]] bool neutral() const noexcept { return min_count == 1 && min_share == 0.0 && min_context == 1; }

  friend std::ostream& operator<<(std::ostream& out, const NGramDraftRule& rule) {
    return out << "NGramDraftRule{min_count=" << rule.min_count << ", min_share=" << rule.min_share
               << ", min_context=" << rule.min_context << "}";
  }
};

}  // namespace specdec
