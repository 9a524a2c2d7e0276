// The processors the remote verifier knows: what a session's sampling description on the wire
// (protocol.hpp) becomes, and what its steps verify with (session_batch.hpp).
#pragma once

#include <variant>

#include "specdec/logits_processor.hpp"

namespace specdec::remote {

using AnyProcessor = std::variant<GreedyProcessor, MultinomialProcessor, TopKProcessor, NucleusProcessor,
                                  TopKNucleusProcessor>;

}  // namespace specdec::remote
