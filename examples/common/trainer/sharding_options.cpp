#include "sharding_options.h"

#include "../cli.h"
#include "lm_config.h"

#include <fsdp/core/options.h>

namespace lm {
namespace {

using examples::usage_checked;
using examples::UsageError;

void set_precision(const std::string& precision, fsdp::MixedPrecision& mp) {
  if (precision == "bf16") {
    mp.param_dtype = torch::kBFloat16;
    mp.reduce_dtype = torch::kBFloat16;
    mp.output_dtype = torch::kFloat32;
  } else if (precision == "fp16") {
    // fp16 gradients under- and overflow without a loss scale: a dynamic one (DeepSpeed's
    // rules) scales the loss, and a step whose gradients hold inf or nan is skipped.
    mp.param_dtype = torch::kHalf;
    mp.reduce_dtype = torch::kHalf;
    mp.output_dtype = torch::kFloat32;
  } else {
    usage_checked([&] {
      return fsdp::core::parse_precision(precision, fsdp::core::Option::kPrecision,
                                         fsdp::core::Surface::kFlags);
    });
  }
}

fsdp::ShardingStrategy parse_sharding(const std::string& s) {
  return usage_checked([&] { return fsdp::core::parse_strategy(s, "--sharding"); });
}

fsdp::wrap::WrapPolicy parse_wrap(const std::string& s, const fsdp::wrap::WrapPolicy& block) {
  if (s == "block") return block;
  if (s == "none") return fsdp::wrap::never_wrap_policy();
  if (s.rfind("size:", 0) == 0) {
    try {
      size_t used = 0;
      long long n = std::stoll(s.substr(5), &used);
      if (used == s.size() - 5 && n >= 0) return fsdp::wrap::size_based_policy(n);
    } catch (const std::exception&) {
    }
  }
  throw UsageError("--wrap " + s +
                   " is unknown; use block, none or size:N (N = least parameters per unit)");
}

fsdp::wrap::WrapPolicy parse_checkpointing(const std::string& s,
                                           const fsdp::wrap::WrapPolicy& block) {
  if (s == "none") return nullptr;
  if (s == "all") return block;
  if (s.rfind("every:", 0) == 0) {
    try {
      size_t used = 0;
      int k = std::stoi(s.substr(6), &used);
      if (used == s.size() - 6 && k >= 1) {
        return fsdp::wrap::all_policy({block, fsdp::wrap::every_kth_policy(k)});
      }
    } catch (const std::exception&) {
    }
  }
  throw UsageError("--activation-checkpointing " + s +
                   " is unknown; use none, all or every:K (K >= 1)");
}

}  // namespace

fsdp::ShardingOptions sharding_options(const std::string& precision, const std::string& sharding,
                                       int hybrid_group_size, const std::string& wrap,
                                       const std::string& activation_checkpointing,
                                       const fsdp::wrap::WrapPolicy& block) {
  fsdp::ShardingOptions so;
  set_precision(precision, so.mixed_precision);
  so.strategy = parse_sharding(sharding);
  so.hybrid_group_size = hybrid_group_size;
  so.auto_wrap_policy = parse_wrap(wrap, block);
  so.checkpoint_policy = parse_checkpointing(activation_checkpointing, block);
  return so;
}

}  // namespace lm
