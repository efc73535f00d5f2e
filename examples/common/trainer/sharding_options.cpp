#include "sharding_options.h"

#include "../cli.h"
#include "lm_config.h"

namespace lm {
namespace {

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
  } else if (precision != "fp32") {
    throw UsageError("--precision " + precision + " is unknown; use fp32, bf16 or fp16");
  }
}

fsdp::ShardingStrategy parse_sharding(const std::string& s) {
  if (s == "full") return fsdp::ShardingStrategy::kFullShard;
  if (s == "grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (s == "none") return fsdp::ShardingStrategy::kNoShard;
  if (s == "hybrid") return fsdp::ShardingStrategy::kHybridShard;
  if (s == "zero1") return fsdp::ShardingStrategy::kZero1;
  if (s == "zero2") return fsdp::ShardingStrategy::kZero2;
  if (s == "zero3") return fsdp::ShardingStrategy::kFullShard;
  throw UsageError("--sharding " + s +
                   " is unknown; use full (= zero3), grad_op, zero2, zero1, none or hybrid");
}

fsdp::WrapPolicy parse_wrap(const std::string& s, const fsdp::WrapPolicy& block) {
  if (s == "block") return block;
  if (s == "none") return fsdp::never_wrap_policy();
  if (s.rfind("size:", 0) == 0) {
    try {
      size_t used = 0;
      long long n = std::stoll(s.substr(5), &used);
      if (used == s.size() - 5 && n >= 0) return fsdp::size_based_policy(n);
    } catch (const std::exception&) {
    }
  }
  throw UsageError("--wrap " + s +
                   " is unknown; use block, none or size:N (N = least parameters per unit)");
}

fsdp::WrapPolicy parse_checkpointing(const std::string& s, const fsdp::WrapPolicy& block) {
  if (s == "none") return nullptr;
  if (s == "all") return block;
  if (s.rfind("every:", 0) == 0) {
    try {
      size_t used = 0;
      int k = std::stoi(s.substr(6), &used);
      if (used == s.size() - 6 && k >= 1) {
        return fsdp::all_policy({block, fsdp::every_kth_policy(k)});
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
                                       const fsdp::WrapPolicy& block) {
  fsdp::ShardingOptions so;
  set_precision(precision, so.mixed_precision);
  so.strategy = parse_sharding(sharding);
  so.hybrid_group_size = hybrid_group_size;
  so.auto_wrap_policy = parse_wrap(wrap, block);
  so.checkpoint_policy = parse_checkpointing(activation_checkpointing, block);
  return so;
}

}  // namespace lm
