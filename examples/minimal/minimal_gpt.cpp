// A sharded GPT training program in one file, to copy: the model (fused attention), built
// already sharded (fsdp::make_sharded), AdamW on the shards, the loop, and a sharded
// checkpoint it resumes from. It includes only <fsdp/...> and LibTorch. (train_gpt is the
// full command line: mixed precision, offload, DeepSpeed configs, data files, tracing.)
//
//   build/bin/fsdp-run --nproc 2 -- build/bin/minimal_gpt --steps 40 --ckpt /tmp/gpt_ckpt
//   build/bin/fsdp-run --nproc 2 -- build/bin/minimal_gpt --steps 80 --ckpt /tmp/gpt_ckpt
//
// The second run resumes at step 40 from the newest checkpoint in /tmp/gpt_ckpt, at any
// world size. Outside this tree, examples/minimal/CMakeLists.txt builds it against the
// installed package (find_package(fsdp)).
#include <fsdp/fsdp.h>

#include <torch/torch.h>

#include <iostream>
#include <optional>
#include <string>

struct Config {
  int64_t vocab = 256, block = 64, layers = 4, heads = 4, width = 128;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c) : heads(c.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    qkv = register_module("qkv", torch::nn::Linear(c.width, 3 * c.width));
    proj = register_module("proj", torch::nn::Linear(c.width, c.width));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    fc = register_module("fc", torch::nn::Linear(c.width, 4 * c.width));
    out = register_module("out", torch::nn::Linear(4 * c.width, c.width));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto q_k_v = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    // Flash, cuDNN or memory-efficient kernels on CUDA, the fused kernel on the CPU.
    auto y = at::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], {}, 0.0,
                                              /*is_causal=*/true);
    x = x + proj(y.transpose(1, 2).reshape({B, T, C}));
    return x + out(torch::gelu(fc(ln2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const Config& c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.width));
    wpe = register_module("wpe", torch::nn::Embedding(c.block, c.width));
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) {
      // A wrap point: a member declared fsdp::FullyShardedModule<...>. make_sharded
      // builds GPT with a construction scope open; each wrap point that the options'
      // auto_wrap_policy picks (every Block, by type, below) shards its module the moment
      // its constructor returns, so a rank never holds more than its shards and the
      // block being built. The rest (embeddings, final norm, head) is the root unit.
      blocks.emplace_back(Block(c));
      list->push_back(blocks.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module("head", torch::nn::Linear(c.width, c.vocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto pos = torch::arange(idx.size(1), idx.options());
    auto x = wte(idx) + wpe(pos);
    for (auto& b : blocks) x = b(x);  // each block gathered just before, freed just after
    return head(ln_f(x));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<fsdp::FullyShardedModule<Block>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

// A task the model can learn: sequences of a fixed random permutation of the vocabulary,
// each starting at a random token. Each rank draws its own rows (seeded by step and rank).
torch::Tensor batch(const Config& c, const torch::Tensor& next, int64_t step, int rank,
                    const torch::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000003 * step + rank);
  auto rows = torch::empty({8, c.block + 1}, torch::kLong);
  rows.select(1, 0).copy_(torch::randint(0, c.vocab, {8}, gen, torch::kLong));
  for (int64_t t = 1; t <= c.block; ++t)
    rows.select(1, t).copy_(next.index({rows.select(1, t - 1)}));
  return rows.to(device);
}

int main(int argc, char** argv) try {
  int64_t steps = 40;
  std::string ckpt, device = "auto";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc || (a != "--steps" && a != "--ckpt" && a != "--device")) {
      std::cerr << "usage: minimal_gpt [--steps N] [--ckpt DIR] [--device auto|cpu|cuda]\n";
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--steps") steps = std::stoll(v);
    if (a == "--ckpt") ckpt = v;
    if (a == "--device") device = v;
  }
  fsdp::ShardingOptions opts;
  opts.device = fsdp::choose_device(device, "--device");
  opts.process_group = fsdp::init_process_group();  // from fsdp-run, torchrun or Slurm
  opts.auto_wrap_policy = fsdp::wrap::module_type_policy<Block>();
  if (opts.device.is_cuda()) {  // bf16 compute, fp32 shards and optimizer
    opts.mixed_precision.param_dtype = torch::kBFloat16;
    opts.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  const int rank = opts.process_group.rank();
  std::cout.precision(9);
  Config c;
  torch::manual_seed(0);  // the same weights at any world size
  auto model = fsdp::make_sharded<GPT>(opts, c);
  fsdp::FusedAdamW opt(model, torch::optim::AdamWOptions(3e-3).weight_decay(0.1));
  const auto next = torch::randperm(c.vocab, at::make_generator<at::CPUGeneratorImpl>(7));

  fsdp::ckpt::TrainingState state;  // step 0, unless a checkpoint says otherwise
  if (const auto latest = ckpt.empty() ? std::nullopt : fsdp::ckpt::latest_checkpoint(ckpt)) {
    fsdp::ckpt::load_sharded_checkpoint(*latest, model, &opt, &state);
    if (rank == 0) std::cout << "resumed from " << *latest << " at step " << state.step << "\n";
  }
  for (; state.step < steps; ++state.step) {
    auto rows = batch(c, next, state.step, rank, opts.device);
    auto logits = model(rows.narrow(1, 0, c.block));
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, c.vocab}),
                                          rows.narrow(1, 1, c.block).reshape({-1}));
    loss.backward();
    fsdp::clip_grad_norm_(model, 1.0);
    opt.step();
    opt.zero_grad();
    if (rank == 0 && (state.step % 10 == 0 || state.step + 1 == steps))
      std::cout << "step " << state.step << " loss " << loss.item<double>() << "\n";
  }
  if (!ckpt.empty()) {
    const std::string path = fsdp::ckpt::save_sharded_checkpoint(ckpt, model, &opt, state);
    if (rank == 0) std::cout << "saved " << path << " at step " << state.step << "\n";
  }
  return 0;
} catch (const c10::Error& e) {
  std::cerr << "minimal_gpt: error: " << e.what_without_backtrace() << "\n";
  return 1;
} catch (const std::exception& e) {
  std::cerr << "minimal_gpt: error: " << e.what() << "\n";
  return 1;
}
