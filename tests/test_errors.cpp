// Every remaining bad-input path of the library API, each with its exact message.
#include "support/models.h"
#include "support/toy_models.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/loss_scaler.h>

#include <gtest/gtest.h>

using namespace fsdp;
using namespace fsdp::testing;

// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_errors_cases {

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

struct ErrorCase {
  const char* name;
  std::function<void()> call;
  std::string message;
};
// Names the case in test listings (ctest shows it).
void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class BadInput : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(BadInput, FailsWithAMessageThatNamesTheValueAndTheFix) {
  EXPECT_EQ(error_of(GetParam().call), GetParam().message);
}

ShardingOptions with(std::function<void(ShardingOptions&)> f) {
  ShardingOptions o;
  f(o);
  return o;
}

INSTANTIATE_TEST_SUITE_P(
    Api, BadInput,
    ::testing::Values(
        ErrorCase{"ClipNonPositiveMaxNorm",
                  [] {
                    auto m = fully_shard(MlpNet());
                    clip_grad_norm_(m, 0.0);
                  },
                  "clip_grad_norm_: max_norm=0 must be positive"},
        ErrorCase{
            "ChooseDeviceUnknownBackend", [] { choose_device("cpu", "--device", "mpi"); },
            "backend mpi is unknown; use auto (nccl on a GPU, gloo on the CPU), gloo or nccl"},
        ErrorCase{"BackendForUnknownChoice", [] { backend_for(torch::kCPU, "mpi", "--backend"); },
                  "--backend mpi is unknown; use auto (nccl on a GPU, gloo on the CPU), gloo or "
                  "nccl"},
        ErrorCase{"BackendForNcclOnTheCpu", [] { backend_for(torch::kCPU, "nccl", "--backend"); },
                  "--backend nccl needs a GPU, but the device is cpu; use --backend gloo (or "
                  "auto) on the CPU"},
        ErrorCase{"CheckpointEmptyFunction",
                  [] { activation_checkpoint(ActivationCheckpointFn(), {torch::ones({1})}); },
                  "activation_checkpoint: the function is empty"},
        ErrorCase{
            "ModuleTypePolicyWithoutNames",
            [] { wrap::module_type_policy(std::vector<std::string>{}); },
            "module_type_policy: no type names given; list module classes such as \"BlockImpl\""},
        ErrorCase{"PredicatePolicyEmpty", [] { wrap::predicate_policy(nullptr); },
                  "predicate_policy: the predicate is empty"},
        ErrorCase{"AnyPolicyWithAnEmptyPolicy", [] { wrap::any_policy({nullptr}); },
                  "any_policy: policy #0 is empty"},
        ErrorCase{"AllPolicyWithAnEmptyPolicy",
                  [] {
                    wrap::all_policy({wrap::always_wrap_policy(), nullptr});
                  },
                  "all_policy: policy #1 is empty"},
        ErrorCase{
            "EmptyAutoWrapPolicy",
            [] { fully_shard(MlpNet(), with([](auto& o) { o.auto_wrap_policy = nullptr; })); },
            "ShardingOptions::auto_wrap_policy is empty; use fsdp::wrap::never_wrap_policy() to "
            "shard "
            "everything as one unit"},
        ErrorCase{"DoubleParamDtype",
                  [] {
                    fully_shard(MlpNet(), with([](auto& o) {
                                  o.mixed_precision.param_dtype = torch::kDouble;
                                }));
                  },
                  "MixedPrecision::param_dtype=Double is unsupported; use Float, BFloat16 or Half"},
        ErrorCase{
            "WrapPointAlreadyInAShardedModel",
            [] {
              Nested n;
              fully_shard(n->inner);
              fully_shard(n);
            },
            "fully_shard: the wrap point 'inner' is already part of a sharded model; shard each "
            "model once, from its root"},
        ErrorCase{"EmptySequential", [] { shard_sequential(torch::nn::Sequential(nullptr)); },
                  "shard_sequential: the Sequential is empty (nullptr holder)"},
        ErrorCase{"ScalerUpdateBeforeStep",
                  [] {
                    auto m = fully_shard(MlpNet());
                    LossScaler s(m);
                    s.update();
                  },
                  "LossScaler::update() was called before step() or unscale_() in this step"},
        ErrorCase{"ScalerNegativeStaticScale",
                  [] {
                    auto m = fully_shard(MlpNet());
                    LossScalerOptions so;
                    so.loss_scale = -1;
                    LossScaler s(m, so);
                  },
                  "LossScalerOptions::loss_scale=-1 must be 0 (dynamic) or positive (static)"},
        ErrorCase{"ScalerZeroWindow",
                  [] {
                    auto m = fully_shard(MlpNet());
                    LossScalerOptions so;
                    so.loss_scale_window = 0;
                    LossScaler s(m, so);
                  },
                  "LossScalerOptions::loss_scale_window=0 must be at least 1"},
        ErrorCase{"ScalerInitialScaleBelowMinimum",
                  [] {
                    auto m = fully_shard(MlpNet());
                    LossScalerOptions so;
                    so.initial_scale_power = 0;
                    so.min_loss_scale = 2;
                    LossScaler s(m, so);
                  },
                  "LossScalerOptions: the initial scale 2^0 is below min_loss_scale=2"},
        ErrorCase{"AllGatherWrongSize",
                  [] { ProcessGroup().all_gather(torch::zeros({3}), torch::zeros({2})); },
                  "all_gather: full has 3 elements but needs 2 (shard 2 x 1 ranks)"},
        ErrorCase{
            "AllGatherDtypeMismatch",
            [] { ProcessGroup().all_gather(torch::zeros({2}), torch::zeros({2}, torch::kDouble)); },
            "all_gather: full is Float but shard is Double; they must match"},
        ErrorCase{"ReduceScatterWrongSize",
                  [] { ProcessGroup().reduce_scatter_sum(torch::zeros({3}), torch::zeros({2})); },
                  "reduce_scatter_sum: full has 3 elements but needs 2"},
        ErrorCase{"BroadcastBadRoot", [] { ProcessGroup().broadcast(torch::zeros({2}), 1); },
                  "broadcast: invalid root=1 for a group of size 1"},
        ErrorCase{
            "SplitRankOutsideTheWorld",
            [] {
              ProcessGroup().split({{0, 3}});
            },
            "ProcessGroup::split: rank 3 is outside the world of size 1; ranks run from 0 to 0"},
        ErrorCase{"SplitEmptyGroup", [] { ProcessGroup().split({{}}); },
                  "ProcessGroup::split: an empty rank list was given; every group needs ranks"},
        ErrorCase{"SplitNotCoveringTheWorld", [] { ProcessGroup().split({}); },
                  "ProcessGroup::split: the groups cover 0 of 1 ranks; every rank must be in "
                  "exactly one group"},
        ErrorCase{
            "UnknownBackend",
            [] {
              ProcessGroupOptions o;
              o.backend = "mpi";
              init_process_group(o);
            },
            "ProcessGroupOptions::backend=mpi is unknown; use auto (nccl on a GPU, gloo on the "
            "CPU), gloo or nccl"},
        ErrorCase{"NonPositiveTimeout",
                  [] {
                    ProcessGroupOptions o;
                    o.timeout_s = 0;
                    init_process_group(o);
                  },
                  "ProcessGroupOptions::timeout_s=0 must be positive"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace

}  // namespace test_errors_cases
