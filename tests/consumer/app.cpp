// A user's application: its own model (a residual MLP classifier, not the GPT), sharded
// with fsdp-libtorch as an installed or embedded library. Trains under fsdp-run, saves
// a sharded checkpoint, loads it into a freshly built model and checks that it got back
// exactly what it saved. Exit status 0 only when every check holds.
//
//   fsdp-run --nproc 2 -- ./consumer_app CHECKPOINT_DIR [--device cpu|cuda|cuda:N|auto]
//
// --device (fsdp::choose_device): auto, the default, is the GPU of LOCAL_RANK when each
// rank of the machine has one, else the CPU; collectives go over NCCL on a GPU and Gloo
// on the CPU.
#include <fsdp/fsdp.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

struct ResidualBlockImpl : torch::nn::Module {
  explicit ResidualBlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(ResidualBlock);

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t in, int64_t width, int64_t classes, int depth)
      : embed(register_module("embed", torch::nn::Linear(in, width))),
        head(register_module("head", torch::nn::Linear(width, classes))) {
    for (int i = 0; i < depth; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i),
                          fsdp::FullyShardedModule<ResidualBlock>(ResidualBlock(width))));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    for (auto& b : blocks) x = b(x);  // each block gathered just before, freed just after
    return head(x);
  }
  torch::nn::Linear embed, head;
  std::vector<fsdp::FullyShardedModule<ResidualBlock>> blocks;
};
TORCH_MODULE(Classifier);

namespace {
int failures = 0;
void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::cerr << "consumer: rank " << rank << ": FAILED: " << what << std::endl;
    ++failures;
  }
}
}  // namespace

int main(int argc, char** argv) {
  const bool device_given = argc == 4 && std::string(argv[2]) == "--device";
  if (argc != 2 && !device_given) {
    std::cerr << "usage: consumer_app CHECKPOINT_DIR [--device cpu|cuda|cuda:N|auto] (run it "
                 "under fsdp-run)\n";
    return 2;
  }
  const std::string dir = argv[1];
  fsdp::ShardingOptions opts;
  try {
    opts.device = fsdp::choose_device(device_given ? argv[3] : "auto", "--device");
  } catch (const c10::Error& e) {
    std::cerr << "consumer_app: error: " << e.what_without_backtrace() << std::endl;
    return 2;
  }
  fsdp::ProcessGroupOptions pgo;
  pgo.backend = fsdp::backend_for(opts.device);
  opts.process_group = fsdp::init_process_group(pgo);
  opts.auto_wrap_policy = fsdp::wrap::module_type_policy<ResidualBlock>();
  const int rank = opts.process_group.rank();

  // A fixed random teacher labels the data; every rank trains on its own rows.
  auto teacher = torch::randn({16, 4}, at::detail::createCPUGenerator(7));
  auto batch = [&](int64_t step) {
    auto x = torch::randn({32, 16}, at::detail::createCPUGenerator(1000 * step + rank));
    return std::make_pair(x.to(opts.device), x.matmul(teacher).argmax(1).to(opts.device));
  };

  torch::manual_seed(0);
  auto model = fsdp::fully_shard(Classifier(16, 32, 4, 3), opts);
  fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  const int64_t steps = 30;
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    auto loss = torch::cross_entropy_loss(model(x), y);
    loss.backward();
    fsdp::clip_grad_norm_(model, 1.0);
    opt.step();
    opt.zero_grad();
    auto mean = loss.detach().clone();
    opts.process_group.all_reduce_sum(mean);
    (step == 0 ? first : last) = mean.item<double>() / opts.process_group.size();
  }
  check(last < 0.8 * first,
        "the loss did not fall: " + std::to_string(first) + " -> " + std::to_string(last), rank);
  const auto saved_stats = model.memory_stats();
  check(saved_stats.gathered_params.current == 0, "parameters stayed gathered after the step",
        rank);

  fsdp::ckpt::TrainingState state;
  state.step = steps;
  state.extra["app"] = "consumer";
  const std::string path = fsdp::ckpt::save_sharded_checkpoint(dir, model, &opt, state);
  const auto saved = fsdp::full_state_dict(model);

  // A fresh model (other initial weights) and optimizer, restored from the checkpoint.
  torch::manual_seed(1);
  auto restored = fsdp::fully_shard(Classifier(16, 32, 4, 3), opts);
  fsdp::FusedAdamW opt2(restored, torch::optim::AdamWOptions(3e-3));
  fsdp::ckpt::TrainingState got;
  fsdp::ckpt::load_sharded_checkpoint(dir, restored, &opt2, &got);
  check(got.step == steps && got.extra["app"] == "consumer",
        "the training state did not round-trip", rank);
  const auto loaded = fsdp::full_state_dict(restored);
  check(saved.size() == loaded.size() && !saved.empty(), "parameter count differs after loading",
        rank);
  for (size_t i = 0; i < std::min(saved.size(), loaded.size()); ++i) {
    check(saved[i].first == loaded[i].first && torch::equal(saved[i].second, loaded[i].second),
          "parameter " + saved[i].first + " differs after loading", rank);
  }
  // The next step from the restored optimizer equals the next step from the original.
  auto [x, y] = batch(steps);
  for (auto* m : {&model, &restored}) {
    torch::cross_entropy_loss((*m)(x), y).backward();
  }
  opt.step();
  opt2.step();
  const auto a = fsdp::full_state_dict(model), b = fsdp::full_state_dict(restored);
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    check(torch::equal(a[i].second, b[i].second), "step after resume differs at " + a[i].first,
          rank);
  }
  if (rank == 0) {
    std::cout << "consumer: fsdp " << fsdp::version() << " (headers " << FSDP_VERSION_STRING
              << "), " << opts.process_group.size() << " ranks on " << opts.device.str()
              << ", loss " << first << " -> " << last << ", saved and loaded " << path << ": "
              << (failures == 0 ? "ok" : "FAILED") << std::endl;
  }
  return failures == 0 ? 0 : 1;
}
