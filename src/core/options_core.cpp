// Note [Options core]
// ~~~~~~~~~~~~~~~~~~
// The sharding options reach the library four ways: a program sets ShardingOptions, a
// user types train_gpt's or fsdp-estimate's flags, a DeepSpeed config maps onto either,
// and the estimator is asked about options not yet tried. Each front end used to check
// the rules itself, in its own words, and they drifted. Here they are written once:
//   - one table names every option for both readers (the C++ field, the flag), and one
//     table each names the strategies, precisions and offload devices;
//   - validate() checks one plain Options value, which each front end fills from what it
//     holds, and its messages name the options as that front end's user wrote them;
//   - the facts derived from the options (the shard group, whether units are freed after
//     forward, whether parameters persist, the pipeline partition) are computed here too,
//     so the estimator and the engine cannot disagree on them.
// What needs the model or the machine (tied parameters, host RAM, NVMe free space) stays
// with the engine's pre-flight checks.
#include <fsdp/core/options.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace fsdp::core {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

struct OptionName {
  Option option;
  const char* api;
  const char* flag;
};

// Every option, as a program sets it and as a command line spells it.
constexpr OptionName kOptionNames[] = {
    {Option::kStrategy, "ShardingOptions::strategy", "--sharding"},
    {Option::kWorldSize, "the process group's size", "--world-size"},
    {Option::kHybridGroupSize, "ShardingOptions::hybrid_group_size", "--hybrid-group-size"},
    {Option::kHpzGroupSize, "ShardingOptions::reshard_after_forward_group_size",
     "--hpz-group-size"},
    {Option::kOffloadOptimizer, "ShardingOptions::offload_optimizer.device", "--offload-optimizer"},
    {Option::kOffloadParam, "ShardingOptions::offload_param.device", "--offload-param"},
    {Option::kCpuOffload, "ShardingOptions::cpu_offload", "--cpu-offload"},
    {Option::kNvmeBufferBytes, "OffloadConfig::buffer_bytes", "--nvme-buffer-bytes"},
    {Option::kPrecision, "MixedPrecision::param_dtype", "--precision"},
    {Option::kReduceDtype, "MixedPrecision::reduce_dtype", "--precision"},
    {Option::kMasterDtype, "MixedPrecision::master_dtype", "--master-dtype"},
    {Option::kKeepFp32, "MixedPrecision::keep_fp32_policy", "MixedPrecision::keep_fp32_policy"},
    {Option::kMaxGatheredUnits, "ShardingOptions::max_gathered_units", "--max-gathered-units"},
    {Option::kActivationCheckpointing, "ShardingOptions::checkpoint_policy",
     "--activation-checkpointing"},
    {Option::kOffloadActivations, "ShardingOptions::offload_activations", "--offload-activations"},
    {Option::kQuantizeWeightBits, "QuantizedCommunication::weight_bits", "--quantize-weight-bits"},
    {Option::kQuantizeGradientBits, "QuantizedCommunication::gradient_bits",
     "--quantize-gradient-bits"},
    {Option::kQuantizeBlock, "QuantizedCommunication::block_size", "--quantize-block"},
};

struct StrategyName {
  ShardingStrategy value;
  const char* api;
  const char* flag;  ///< the printed name; more names below may parse to it
};

// The strategies; the first flag name of each is the one printed.
constexpr StrategyName kStrategyNames[] = {
    {ShardingStrategy::kFullShard, "kFullShard", "full"},
    {ShardingStrategy::kShardGradOp, "kShardGradOp", "grad_op"},
    {ShardingStrategy::kNoShard, "kNoShard", "none"},
    {ShardingStrategy::kHybridShard, "kHybridShard", "hybrid"},
    {ShardingStrategy::kZero2, "kZero2", "zero2"},
    {ShardingStrategy::kZero1, "kZero1", "zero1"},
};
// DeepSpeed's name for ZeRO-3, which --sharding takes too.
constexpr const char* kZero3 = "zero3";

struct PrecisionName {
  Precision value;
  const char* api;
  const char* flag;
};

constexpr PrecisionName kPrecisionNames[] = {
    {Precision::kFp32, "Float", "fp32"},
    {Precision::kBf16, "BFloat16", "bf16"},
    {Precision::kFp16, "Half", "fp16"},
};

struct OffloadName {
  OffloadDevice value;
  const char* api;
  const char* flag;
};

// fsdp::to_string's names, in both: ShardingOptions' messages and DeepSpeed's configs say
// "device=nvme" too.
constexpr OffloadName kOffloadNames[] = {
    {OffloadDevice::kNone, "none", "none"},
    {OffloadDevice::kCpu, "cpu", "cpu"},
    {OffloadDevice::kNvme, "nvme", "nvme"},
};

// A value's name in `table`, as `s` names it; nullptr where no row has it.
template <class Table, class Enum>
const char* name_in(const Table& table, Enum v, Surface s) {
  for (const auto& row : table)
    if (row.value == v) return s == Surface::kApi ? row.api : row.flag;
  return nullptr;
}

const char* find_name(ShardingStrategy v, Surface s) { return name_in(kStrategyNames, v, s); }
const char* find_name(Precision v, Surface s) { return name_in(kPrecisionNames, v, s); }
const char* find_name(OffloadDevice v, Surface s) { return name_in(kOffloadNames, v, s); }

// A value's name, or its number where no table row has it (an enum cast from an int).
template <class Enum>
std::string value_name(Enum v, Surface s) {
  const char* n = find_name(v, s);
  return n != nullptr ? n : std::to_string(static_cast<int>(v));
}

// "ShardingOptions::x=V" or "--x V": an option with the value it was given.
std::string with(Option o, const std::string& value, Surface s) {
  return name(o, s) + (s == Surface::kApi ? "=" : " ") + value;
}

template <class Enum, class = std::enable_if_t<std::is_enum_v<Enum>>>
std::string with(Option o, Enum v, Surface s) {
  return with(o, value_name(v, s), s);
}

std::string with(Option o, int64_t v, Surface s) { return with(o, std::to_string(v), s); }

// "a, b or c": the names of a table's values.
template <class Table>
std::string choices(const Table& table, Surface s) {
  std::string out;
  const size_t n = std::size(table);
  for (size_t i = 0; i < n; ++i) {
    out += (i == 0 ? "" : i + 1 == n ? " or " : ", ");
    out += s == Surface::kApi ? table[i].api : table[i].flag;
  }
  return out;
}

void check_quantized(const Options& o, Surface s) {
  if (!o.quantize_weights && !o.quantize_gradients) return;
  for (auto [bits, option] : {std::pair{o.weight_bits, Option::kQuantizeWeightBits},
                              std::pair{o.gradient_bits, Option::kQuantizeGradientBits}}) {
    if (bits != 8 && bits != 4)
      bad(with(option, bits, s) + " is unsupported; use 8 (int8) or 4 (int4)");
  }
  if (o.quantize_block < 1) {
    bad(with(Option::kQuantizeBlock, o.quantize_block, s) +
        " must be at least 1 element per scale (2048 is the default)");
  }
}

void check_groups(const Options& o, Surface s) {
  if (o.world_size_known && o.world_size < 1)
    bad(with(Option::kWorldSize, o.world_size, s) + " must be at least 1");
  if (find_name(o.strategy, s) == nullptr) {
    bad(with(Option::kStrategy, o.strategy, s) + " is not a strategy; use " +
        choices(kStrategyNames, s));
  }
  if (o.strategy == ShardingStrategy::kHybridShard && o.world_size_known) {
    const int g = o.hybrid_group_size == 0 ? o.world_size : o.hybrid_group_size;
    if (g < 1 || o.world_size % g != 0) {
      bad(with(Option::kHybridGroupSize, o.hybrid_group_size, s) + " must divide the world size " +
          std::to_string(o.world_size) + " (e.g. the ranks per node), or be 0 for the whole world");
    }
  }
  if (const int k = o.hpz_group_size; k != 0) {
    if (!reshards_after_forward(o.strategy)) {
      bad(with(Option::kHpzGroupSize, k, s) + " needs a strategy that frees parameters after " +
          "forward (" + with(Option::kStrategy, ShardingStrategy::kFullShard, s) + " or " +
          value_name(ShardingStrategy::kHybridShard, s) + "); " + value_name(o.strategy, s) +
          " keeps full parameters into backward. Set it to 0, or use " +
          value_name(ShardingStrategy::kFullShard, s));
    }
    const int g = shard_group_size(o);
    if (o.world_size_known && (k <= 1 || k >= g || g % k != 0)) {
      bad(with(Option::kHpzGroupSize, k, s) + " must divide the shard group size " +
          std::to_string(g) + " and lie strictly between 1 and " + std::to_string(g) +
          " (e.g. the number of ranks per node); 0 reshards to the whole shard group");
    }
  }
  if (o.max_gathered_units < 1) {
    bad(with(Option::kMaxGatheredUnits, o.max_gathered_units, s) +
        " must be at least 1 (the unit that computes; 1: no prefetch)");
  }
}

void check_offload(const Options& given, Surface s) {
  const auto nvme = OffloadDevice::kNvme;
  if (given.cpu_offload && (given.offload_optimizer == nvme || given.offload_param == nvme)) {
    bad(name(Option::kCpuOffload, s) + " (everything to host memory) contradicts " +
        with(Option::kOffloadOptimizer, given.offload_optimizer, s) + " and " +
        with(Option::kOffloadParam, given.offload_param, s) + "; use one or the other (" +
        name(Option::kCpuOffload, s) + " means both offloads on the host)");
  }
  const Options o = resolved(given);
  const OffloadDevice opt = o.offload_optimizer, par = o.offload_param;
  if (par != OffloadDevice::kNone && opt == OffloadDevice::kNone) {
    bad(with(Option::kOffloadParam, par, s) + " needs " + name(Option::kOffloadOptimizer, s) +
        " too: the fp32 master shard is the parameter here, so parameters can leave the device "
        "only with the optimizer state. Offload the optimizer as well (" +
        value_name(OffloadDevice::kCpu, s) + " or " + value_name(nvme, s) +
        "), or the optimizer alone");
  }
  if (par == nvme && !reshards_after_forward(o.strategy)) {
    bad(with(Option::kOffloadParam, par, s) + " needs a strategy that frees parameters after " +
        "use (" + with(Option::kStrategy, ShardingStrategy::kFullShard, s) + ", ZeRO-3, or " +
        value_name(ShardingStrategy::kHybridShard, s) + "), as DeepSpeed's offload_param needs " +
        "stage 3; " + value_name(o.strategy, s) + " keeps parameters on the device (" +
        with(Option::kOffloadParam, OffloadDevice::kCpu, s) +
        " there only drops the device copy of the shards)");
  }
  if (par == nvme && opt != nvme) {
    bad(with(Option::kOffloadParam, par, s) + " needs " + with(Option::kOffloadOptimizer, nvme, s) +
        " too (got " + value_name(opt, s) +
        "): the optimizer steps the fp32 masters where they are, streaming them from the files "
        "with its moments. Offload the optimizer to NVMe too, or the parameters to " +
        value_name(OffloadDevice::kCpu, s));
  }
  if (par == nvme && o.master != Precision::kFp32) {
    bad(with(Option::kOffloadParam, par, s) + " keeps fp32 masters in files; " +
        with(Option::kMasterDtype, o.master, s) + " (pure bf16) has none. Use " +
        with(Option::kMasterDtype, Precision::kFp32, s) + ", or " +
        with(Option::kOffloadParam, OffloadDevice::kCpu, s));
  }
  if ((opt == nvme || par == nvme) && o.nvme_buffer_bytes < 1) {
    bad(with(Option::kNvmeBufferBytes, o.nvme_buffer_bytes, s) +
        " is invalid; NVMe offload needs a positive host buffer for the chunks in flight");
  }
}

void check_precision(const Options& o, Surface s) {
  for (auto [p, option] :
       {std::pair{o.param, Option::kPrecision}, std::pair{o.reduce, Option::kReduceDtype},
        std::pair{o.master, Option::kMasterDtype}}) {
    if (find_name(p, s) == nullptr)
      unsupported_dtype(option, std::to_string(static_cast<int>(p)), s);
  }
  if (o.master == Precision::kFp16)
    unsupported_dtype(Option::kMasterDtype, value_name(o.master, s), s);
  if (o.master == Precision::kBf16 && o.param != Precision::kBf16) {
    bad(with(Option::kMasterDtype, o.master, s) + " (pure bf16) needs " +
        with(Option::kPrecision, Precision::kBf16, s) + " too (got " + value_name(o.param, s) +
        "): the gathered parameters cannot be more precise than the shards");
  }
  if (o.master == Precision::kBf16 && o.keep_fp32) {
    bad(name(Option::kKeepFp32, s) + " keeps units in fp32, which pure bf16 (" +
        with(Option::kMasterDtype, o.master, s) + ") has no fp32 values for; drop one of them");
  }
  if (o.offload_activations && !o.activation_checkpointing) {
    bad(name(Option::kOffloadActivations, s) +
        " keeps the inputs that activation checkpointing saves in host memory, and no block is "
        "checkpointed; set " +
        name(Option::kActivationCheckpointing, s) +
        (s == Surface::kApi ? " (e.g. fsdp::wrap::module_type_policy<Block>())"
                            : " (all or every:K)") +
        " too");
  }
}

std::string list(const std::vector<int64_t>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

std::vector<int64_t> explicit_bounds(const std::string& spec, int64_t layers, int stages,
                                     const std::string& name) {
  std::vector<int64_t> b{0};
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || end == nullptr || *end != 0) {
      bad(name + "'" + spec + "': '" + item +
          "' is not a layer index; expected parameters, uniform, or the first layer of stages "
          "1.." +
          std::to_string(stages - 1) + " as a comma-separated list such as '" +
          std::to_string(layers / 2) + "'");
    }
    b.push_back(v);
  }
  if (static_cast<int>(b.size()) != stages) {
    bad(name + "'" + spec + "' gives " + std::to_string(b.size() - 1) +
        " boundaries, but stages=" + std::to_string(stages) + " needs " +
        std::to_string(stages - 1) + " (the first layer of each stage after the first)");
  }
  b.push_back(layers);
  for (size_t i = 1; i < b.size(); ++i) {
    if (b[i] <= b[i - 1]) {
      bad(name + "'" + spec + "': boundaries must rise from 1 to " + std::to_string(layers - 1) +
          " (each stage at least one layer of the " + std::to_string(layers) + "); got " + list(b));
    }
  }
  return b;
}

std::vector<int64_t> balanced_bounds(const std::vector<int64_t>& weight, int stages) {
  const auto layers = static_cast<int64_t>(weight.size());
  std::vector<int64_t> prefix(weight.size() + 1, 0);
  std::partial_sum(weight.begin(), weight.end(), prefix.begin() + 1);
  const double total = static_cast<double>(prefix.back());
  std::vector<int64_t> b{0};
  for (int s = 1; s < stages; ++s) {
    const double target = total * s / stages;
    const int64_t lo = b.back() + 1, hi = layers - (stages - s);  // a layer left for each stage
    int64_t i = lo;
    while (i < hi && static_cast<double>(prefix[i]) < target) ++i;
    if (i > lo &&
        target - static_cast<double>(prefix[i - 1]) <= static_cast<double>(prefix[i]) - target)
      --i;
    b.push_back(i);
  }
  b.push_back(layers);
  return b;
}

}  // namespace

std::string name(Option o, Surface s) {
  for (const auto& row : kOptionNames)
    if (row.option == o) return s == Surface::kApi ? row.api : row.flag;
  return "option " + std::to_string(static_cast<int>(o));
}

const char* strategy_name(ShardingStrategy v, Surface s) {
  const char* n = find_name(v, s);
  return n != nullptr ? n : "unknown";
}

ShardingStrategy parse_strategy(const std::string& text, const std::string& option) {
  for (const auto& row : kStrategyNames)
    if (text == row.flag) return row.value;
  if (text == kZero3) return ShardingStrategy::kFullShard;
  bad(option + " " + text + " is unknown; use " + choices(kStrategyNames, Surface::kFlags) +
      " (zero3 is full)");
}

const char* precision_name(Precision v, Surface s) {
  const char* n = find_name(v, s);
  return n != nullptr ? n : "unknown";
}

Precision parse_precision(const std::string& text, Option o, Surface s) {
  return parse_precision(text, name(o, s), s);
}

Precision parse_precision(const std::string& text, const std::string& option, Surface s) {
  for (const auto& row : kPrecisionNames)
    if (text == row.flag) return row.value;
  bad(option + (s == Surface::kApi ? "=" : " ") + text + " is unknown; use " +
      choices(kPrecisionNames, Surface::kFlags));
}

OffloadDevice parse_offload(const std::string& text, Option o, Surface s) {
  for (const auto& row : kOffloadNames)
    if (text == row.flag) return row.value;
  bad(with(o, text, s) + " is unknown; use " + choices(kOffloadNames, Surface::kFlags));
}

void unsupported_dtype(Option o, const std::string& dtype, Surface s) {
  const std::string use = o == Option::kMasterDtype
                              ? std::string(value_name(Precision::kFp32, s)) +
                                    " (fp32 masters) or " + value_name(Precision::kBf16, s) +
                                    " (pure bf16)"
                              : choices(kPrecisionNames, s);
  bad(with(o, dtype, s) + " is unsupported; use " + use);
}

void validate(const Options& o, Surface s) {
  check_groups(o, s);
  check_quantized(o, s);
  check_offload(o, s);
  check_precision(o, s);
}

Options resolved(const Options& given) {
  Options o = given;
  if (o.cpu_offload) {
    o.cpu_offload = false;
    o.offload_optimizer = o.offload_param = OffloadDevice::kCpu;
  }
  return o;
}

int shard_group_size(const Options& o) {
  switch (o.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
    case ShardingStrategy::kZero2:
    case ShardingStrategy::kZero1:
      return o.world_size;
    case ShardingStrategy::kNoShard:
      return 1;
    case ShardingStrategy::kHybridShard:
      return o.hybrid_group_size == 0 ? o.world_size : o.hybrid_group_size;
  }
  return o.world_size;
}

bool reshards_after_forward(ShardingStrategy s) {
  return s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard;
}

bool keeps_params(ShardingStrategy s) {
  return s == ShardingStrategy::kZero2 || s == ShardingStrategy::kZero1;
}

int64_t precision_bytes(Precision p) { return p == Precision::kFp32 ? 4 : 2; }

namespace {

std::string with(const std::string& option, const std::string& value, Surface s) {
  return option + (s == Surface::kApi ? "=" : " ") + value;
}

}  // namespace

void check_backend(const std::string& text, const std::string& option, Surface s) {
  if (text != "auto" && text != "gloo" && text != "nccl")
    bad(with(option, text, s) +
        " is unknown; use auto (nccl on a GPU, gloo on the CPU), gloo or nccl");
}

void check_pipeline_stages(int stages, int world_size, const std::string& option, Surface s) {
  if (stages < 1) bad(with(option, std::to_string(stages), s) + " must be at least 1");
  if (world_size > 0 && world_size % stages != 0) {
    bad(with(option, std::to_string(stages), s) + " does not divide the world size " +
        std::to_string(world_size) +
        ": the world is stages x data-parallel ranks; use a divisor of " +
        std::to_string(world_size));
  }
}

void check_micro_batches(int micro_batches, const std::string& option, Surface s) {
  if (s == Surface::kApi && micro_batches < 1)
    bad(with(option, std::to_string(micro_batches), s) + " must be at least 1");
  if (s == Surface::kFlags && micro_batches < 0)
    bad(with(option, std::to_string(micro_batches), s) +
        " must be 0 (2 x --pipeline-stages) or positive");
}

void check_positive(int64_t v, const std::string& option, Surface s) {
  if (v <= 0) bad(with(option, std::to_string(v), s) + " is invalid; it must be positive");
}

std::vector<int64_t> pipeline_partition(const std::vector<int64_t>& layer_params, int stages,
                                        const std::string& partition,
                                        const std::string& stages_name,
                                        const std::string& partition_name) {
  const auto layers = static_cast<int64_t>(layer_params.size());
  if (stages < 1) bad(stages_name + std::to_string(stages) + " must be at least 1");
  if (layers < stages) {
    bad(stages_name + std::to_string(stages) + " but the model has " + std::to_string(layers) +
        " layer(s), and each stage needs at least one: use at most " + std::to_string(layers) +
        " stages, or split the model into more layers");
  }
  if (partition == "uniform")
    return balanced_bounds(std::vector<int64_t>(layer_params.size(), 1), stages);
  if (partition == "parameters") {
    // A layer without parameters weighs a little, so stages still split between them.
    std::vector<int64_t> w(layer_params);
    for (auto& x : w) x = std::max<int64_t>(x, 1);
    return balanced_bounds(w, stages);
  }
  return explicit_bounds(partition, layers, stages, partition_name);
}

}  // namespace fsdp::core

namespace fsdp {

// The public names of <fsdp/strategy.h>, from the same tables.
const char* to_string(Precision p) { return core::precision_name(p, core::Surface::kFlags); }

Precision parse_precision(const std::string& name) {
  return core::parse_precision(name, core::Option::kPrecision, core::Surface::kFlags);
}

const char* to_string(OffloadDevice d) {
  const char* n = core::find_name(d, core::Surface::kFlags);
  return n != nullptr ? n : "unknown";
}

}  // namespace fsdp
