// specdec: lossless speculative decoding for causal language models on libtorch.
// The umbrella header: everything except models/ and io/.
#pragma once

#include "specdec/batch.hpp"
#include "specdec/beam_search.hpp"
#include "specdec/calibration.hpp"
#include "specdec/concepts.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/generate.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/ngram_options.hpp"
#include "specdec/ngram_storage.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/session.hpp"
#include "specdec/stand.hpp"
#include "specdec/step.hpp"
#include "specdec/threads.hpp"
#include "specdec/tree.hpp"
#include "specdec/verification.hpp"
#include "specdec/version.hpp"
