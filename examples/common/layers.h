#pragma once
// What the examples' models share about their layers (as_layers: the model as a list of
// layers, for pipeline stages and for loading a checkpoint layer by layer).

#include <c10/util/Exception.h>

#include <string>

namespace examples {

/// The error of a model's layer_param_name for `name`, which is not a parameter of its
/// as_layers' layers (`ok` false); `who` names the function.
inline void check_layer_param_name(bool ok, const char* who, const std::string& name) {
  TORCH_CHECK(ok, who, ": '", name, "' is not a parameter of as_layers' layers");
}

}  // namespace examples
