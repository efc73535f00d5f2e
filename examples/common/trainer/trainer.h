#pragma once
// The training program train_gpt and train_llama share (trainer.cpp): flags, data,
// sharding, checkpoints, logs and exports are one code path; the program picks the model
// family.

#include "flags.h"

namespace lm {

/// Parses the command line as `program` and trains; returns the process's exit status
/// (2 for a usage error, 1 for another failure), printing errors as "<name>: error: ...".
int run_training(const Program& program, int argc, char** argv);

}  // namespace lm
