#pragma once
// train_gpt --deepspeed-config FILE: a DeepSpeed ds_config.json over train_gpt's flags
// (fsdp::deepspeed::load_config reads it).
//
// Note [DeepSpeed config over flags]: a key the config has sets its flags (DeepSpeed has
// the config decide); "auto", and a key the config leaves out, keep the flag's value, as
// Hugging Face's Trainer fills "auto" from its arguments. A flag given (on the command
// line or in --config) with another value than the config's is an error naming both, so
// that neither silently wins.

#include "flags.h"

#include <string>

namespace lm {

/// Applies f.deepspeed_config (if any) to `f` for a job of `world` ranks. Returns the
/// lines rank 0 prints: the options the config became and one line per key; "" without
/// a config. Throws a UsageError for a config that cannot run or that conflicts with a
/// flag given.
std::string apply_deepspeed_config(Flags& f, int world);

}  // namespace lm
