#pragma once
// train_gpt --config FILE: a JSON object of flags, read as if given first on the command
// line (so that the flags given there override it).

#include <string>
#include <vector>

namespace lm {

/// Turns {"n_layer": 4, "lr-schedule": "cosine", "resume": true} into
/// "--n-layer=4 --lr-schedule=cosine --resume" (a switch set to false is left out).
std::vector<std::string> config_file_args(const std::string& path);

}  // namespace lm
