// The trainer options of the torch tests: a tiny preset model with a batch, a sequence length
// and a seed, everything else the trainer's defaults.
#pragma once

#include <cstdint>
#include <string>

#include "tidal/models/trainer.hpp"

namespace tidal::testing {

inline models::TrainerOptions tiny_options(const std::string& model, std::int64_t batch,
                                           std::int64_t seq, std::uint64_t seed) {
  models::TrainerOptions o;
  o.config = models::model_config(model);
  o.batch = batch;
  o.seq = seq;
  o.seed = seed;
  return o;
}

}  // namespace tidal::testing
