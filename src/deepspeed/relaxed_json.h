#pragma once
// JSON as DeepSpeed's configs are written: DeepSpeed reads them with hjson, so comments
// and trailing commas occur in configs that work there.

#include <nlohmann/json.hpp>

#include <string>

namespace fsdp::detail {

/// Parses `text` ("what" names it in errors, e.g. the file), after turning comments
/// (// ..., /* ... */, # ...) and trailing commas outside strings into spaces, so that the
/// line and column of any other error stay those of the text. A duplicate key throws, as
/// DeepSpeed's reader does; a syntax error names the line and column.
nlohmann::json parse_relaxed_json(const std::string& text, const std::string& what);

}  // namespace fsdp::detail
