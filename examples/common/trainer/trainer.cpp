// The training program of train_gpt and train_llama (examples/llama/): trains the GPT of
// docs/design.md, "Contracts", or the Llama of examples/llama/llama_model.h, sharded over
// every rank of the job. Each program's main is one call of run_training.
//
//   build/bin/train_gpt --steps 200                      # one process
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_gpt  # two ranks on this machine
//   build/bin/train_gpt --device cuda                    # on the GPU (NCCL between ranks)
//
// Without --data it learns a synthetic byte-level task generated from --seed: text from
// a random Markov chain over 32 characters in which each character has two likely
// successors. A model that ignores context cannot beat the unigram entropy printed at
// the start; a model that learns the chain approaches the conditional entropy.
//
// This file is the training program; the rest of the folder is what it reads:
// flags.h (the command line), data.h (the batches), train_log.h (the progress lines and
// the JSONL log), checkpoints.h (resume, saves, --stop-at, the consolidated export).
#include <fsdp/fsdp.h>

#include "../cli.h"
#include "../device.h"
#include "architecture.h"
#include "checkpoints.h"
#include "data.h"
#include "deepspeed_flags.h"
#include "flags.h"
#include "lm_config.h"
#include "train_log.h"
#include "trainer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>

namespace {

using namespace lm;

/// What a training step changes: the sharded model (whichever family: `forward` calls
/// it), its optimizer and, under fp16, the loss scaler.
struct Training : BuiltModel {
  std::unique_ptr<torch::optim::AdamW> opt;
  std::optional<fsdp::LossScaler> scaler;
};

/// Next-token cross-entropy of (B, T, V) logits against (B, T) targets.
torch::Tensor token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

/// Mean next-token cross-entropy on (B, T+1) token rows.
torch::Tensor loss_of(Training& t, const torch::Tensor& rows) {
  return token_loss(t.forward(rows.narrow(1, 0, rows.size(1) - 1)),
                    rows.narrow(1, 1, rows.size(1) - 1));
}

/// The optimizer of a sharded model (the whole model, or a pipeline's stage) as the flags
/// ask. fsdp::FusedAdamW steps shards in host memory (CPU training, or offload) with its
/// SIMD kernels and shards on a GPU with ATen's fused kernel (at::_fused_adamw_). Under
/// bf16 the host step also writes each shard's bf16 copy, which the next gathers send
/// instead of casting the shard again. `rank`: the job's (the groups' description is
/// printed by rank 0; pure bf16's rounding seed).
std::unique_ptr<torch::optim::AdamW> make_optimizer(const Flags& f, fsdp::ShardedModel& model,
                                                    int rank) {
  const auto adamw = torch::optim::AdamWOptions(f.training.lr)
                         .betas({f.training.beta1, f.training.beta2})
                         .eps(f.training.eps)
                         .weight_decay(f.training.weight_decay);
  std::unique_ptr<fsdp::FusedAdamW> opt;
  if (f.training.no_decay_recipe == "standard") {
    // Groups by original parameter over the flat shards (include/fsdp/param_groups.h):
    // biases and norm weights without weight decay, as GPT-2/nanoGPT train.
    fsdp::ShardParamGroups groups(model, fsdp::no_decay_groups(f.training.weight_decay));
    if (rank == 0) {
      std::cout << program() << ": optimizer groups (--no-decay-recipe standard):\n"
                << groups.describe(f.training.lr, f.training.weight_decay) << std::flush;
    }
    opt = std::make_unique<fsdp::FusedAdamW>(groups, adamw);
  } else {
    opt = std::make_unique<fsdp::FusedAdamW>(model, adamw);
  }
  if (f.sharding.options.mixed_precision.master_dtype == torch::kBFloat16) {
    // Pure bf16: each rank rounds with its own random bits.
    opt->set_bf16_rounding(f.sharding.bf16_rounding, f.training.seed + static_cast<uint64_t>(rank));
  }
  return opt;
}

Training make_training(const Flags& f, fsdp::ProcessGroup pg) {
  fsdp::ShardingOptions so = f.sharding.options;
  so.process_group = pg;
  torch::manual_seed(f.training.seed);
  Training t{program_info().build(f.model, so, f.sharding.sharded_construction), nullptr,
             std::nullopt};
  // --init-from: the starting weights come from a consolidated file (written by this
  // program, fsdp-consolidate or another framework with h5py). Loaded before the
  // optimizer exists, so it starts fresh; a --resume that finds a checkpoint replaces them.
  if (!f.checkpoint.init_from.empty()) {
    fsdp::ckpt::import_consolidated(f.checkpoint.init_from, t.model);
    if (pg.rank() == 0)
      std::cout << program() << ": initial weights from " << f.checkpoint.init_from << std::endl;
  }
  if (f.sharding.precision == "fp16") {
    t.scaler.emplace(t.model, f.sharding.loss_scaler);
  }
  t.opt = make_optimizer(f, t.model, pg.rank());
  return t;
}

/// The learning rate of `step` (0-based): constant and cosine: a linear warm-up, then
/// constant or a cosine decay to 10%. warmup and warmup_decay: DeepSpeed's WarmupLR and
/// WarmupDecayLR, stepped as DeepSpeed's engine steps them, once per applied optimizer
/// step (`skipped`: steps skipped so far for fp16 overflow).
double lr_at(const TrainingFlags& t, int64_t step, int64_t skipped) {
  if (t.lr_schedule == "warmup" || t.lr_schedule == "warmup_decay") {
    fsdp::WarmupSchedule w;
    w.warmup_min_lr = t.warmup_min_lr;
    w.warmup_max_lr = t.lr;
    w.warmup_num_steps = t.warmup_steps;
    w.warmup_type = t.warmup_type == "log" ? fsdp::WarmupSchedule::Type::kLog
                                           : fsdp::WarmupSchedule::Type::kLinear;
    w.total_num_steps = t.lr_schedule == "warmup_decay" ? t.steps : 0;
    return w.lr(step - skipped - 1);
  }
  if (step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule != "cosine") return t.lr;
  double progress =
      static_cast<double>(step - t.warmup_steps) / std::max<int64_t>(1, t.steps - t.warmup_steps);
  return t.lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)));
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

/// This rank's rows of a batch that every rank holds whole, on the compute device.
torch::Tensor my_rows(const torch::Tensor& rows, const fsdp::ProcessGroup& pg,
                      const torch::Device& device) {
  const int64_t n = rows.size(0) / pg.size();
  return rows.narrow(0, pg.rank() * n, n).to(device);
}

/// One optimizer step on the global batch `global`, in --grad-accum micro-batches, each
/// rank its rows of each. Returns the step's loss, the mean over ranks.
double train_step(Training& t, const torch::Tensor& global, const TrainingFlags& f,
                  const fsdp::ProcessGroup& pg, const torch::Device& device) {
  const int64_t accum = f.grad_accum, micro = f.batch_size / accum;
  double loss_sum = 0;
  for (int64_t m = 0; m < accum; ++m) {
    auto mine = my_rows(global.narrow(0, m * micro, micro), pg, device);
    auto loss = loss_of(t, mine) / static_cast<double>(accum);
    (t.scaler ? t.scaler->scale(loss) : loss).backward();
    loss_sum += loss.item<double>();
  }
  if (t.scaler) t.scaler->unscale_();  // before clipping: the norm is of the true gradients
  // (A step whose gradients overflowed is skipped: nothing to clip.)
  if (f.clip_grad > 0 && !(t.scaler && t.scaler->overflowed()))
    fsdp::clip_grad_norm_(t.model, f.clip_grad);
  if (t.scaler) {
    t.scaler->step(*t.opt);  // skipped, on every rank alike, when a gradient is inf or nan
    t.scaler->update();
  } else {
    t.opt->step();
  }
  t.opt->zero_grad();
  // On the compute device: NCCL reduces device tensors only.
  auto l = torch::tensor({loss_sum}, torch::kDouble).to(device);
  pg.all_reduce_sum(l);
  return l.item<double>() / pg.size();
}

/// Validation loss over the held-out part: the same 4 batches every time, each rank its
/// rows, no gradients, dropout off; the mean over ranks and batches. Collective.
double val_loss(Training& t, const Data& data, const Flags& f, const fsdp::ProcessGroup& pg) {
  constexpr int64_t kValBatches = 4;
  const torch::Device device = f.sharding.options.device;
  torch::NoGradGuard no_grad;
  t.model.as_module().eval();
  auto sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(device));
  for (int64_t i = 0; i < kValBatches; ++i) {
    auto rows = data.val_batch(i, f.training.batch_size, f.model.block_size);
    sum += loss_of(t, my_rows(rows, pg, device)).to(torch::kDouble).reshape({1});
  }
  t.model.as_module().train();
  pg.all_reduce_sum(sum);
  return sum.item<double>() / static_cast<double>(pg.size() * kValBatches);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// --steps 0 (a conversion): says so, and what the run will do instead.
void report_no_steps(const Flags& f, bool main_rank) {
  if (f.training.steps != 0 || !main_rank) return;
  const auto& c = f.checkpoint;
  std::cout << program() << ": --steps 0: no training; load, evaluate and write only"
            << (c.save_dir.empty() && c.export_hf.empty() && c.consolidate_to.empty()
                    ? " (nothing will be written: give --save-dir, --export-hf or "
                      "--consolidate-to)"
                    : "")
            << std::endl;
}

/// The training loop: steps [first_step, last_step).
void train(Training& t, const Flags& f, const Data& data, const fsdp::ProcessGroup& pg,
           TrainLog& log, CheckpointPolicy& checkpoints, int64_t first_step, int64_t last_step) {
  const int64_t batch = f.training.batch_size, block = f.model.block_size;
  for (int64_t step = first_step; step < last_step; ++step) {
    StepRecord r;
    r.step = step + 1;
    r.lr = lr_at(f.training, step, t.scaler ? t.scaler->state().skipped_steps : 0);
    set_lr(*t.opt, r.lr);
    const auto start = std::chrono::steady_clock::now();
    {
      fsdp::TraceScope span("train step " + std::to_string(r.step));
      r.loss =
          train_step(t, data.batch(step, batch, block), f.training, pg, f.sharding.options.device);
    }
    r.step_s = seconds_since(start);
    r.tokens_per_s = static_cast<double>(batch * block) / r.step_s;
    read_engine_stats(t.model, r);
    if (data.validates() && log.progress_after(r.step)) r.val_loss = val_loss(t, data, f, pg);
    if (t.scaler) r.loss_scaler = t.scaler->state();
    log.write(r);
    if (checkpoints.due(r.step)) checkpoints.save(r.step);
  }
}

/// --eval-text: the file's bytes as (rows, block_size + 1) token rows, at most 64 rows.
torch::Tensor eval_rows(const std::string& file, int64_t block) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw examples::UsageError("--eval-text " + file + ": cannot open the file");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t rows = std::min<int64_t>(64, static_cast<int64_t>(bytes.size()) / (block + 1));
  if (rows < 1) {
    throw examples::UsageError(
        "--eval-text " + file + " holds " + std::to_string(bytes.size()) +
        " bytes, fewer than one row of --block-size + 1 = " + std::to_string(block + 1));
  }
  auto t = torch::empty({rows, block + 1}, torch::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * (block + 1); ++i) p[i] = static_cast<unsigned char>(bytes[i]);
  return t;
}

/// Prints an --eval-text loss on rank 0, with 9 significant digits.
void print_eval(const Flags& f, int rank, int64_t step, double loss, int64_t rows) {
  if (rank != 0) return;
  std::cout << program() << ": eval loss at step " << step << ": " << std::setprecision(9) << loss
            << std::setprecision(6) << " (" << rows << " rows of " << f.training.eval_text << ")"
            << std::endl;
}

/// The mean next-token loss on the --eval-text rows, every rank all of them (collective:
/// every rank runs the forward), printed by rank 0.
void eval_text(Training& t, const Flags& f, const fsdp::ProcessGroup& pg, int64_t step,
               const torch::Tensor& rows) {
  if (!rows.defined()) return;
  torch::NoGradGuard no_grad;
  t.model.as_module().eval();
  const double loss = loss_of(t, rows.to(f.sharding.options.device)).item<double>();
  t.model.as_module().train();
  print_eval(f, pg.rank(), step, loss, rows.size(0));
}

/// The same through a pipeline: every replica runs all the rows, in as many micro-batches
/// as divide them (at most --micro-batches); the last stage's loss reaches every rank.
void eval_text(fsdp::PipelinedModel& pm, const Flags& f, int64_t step, const torch::Tensor& rows) {
  if (!rows.defined()) return;
  const torch::Device device = f.sharding.options.device;
  torch::NoGradGuard no_grad;
  int64_t m = std::min<int64_t>(std::max(1, f.pipeline.micro_batches), rows.size(0));
  while (rows.size(0) % m != 0) --m;
  pm.stage_model().as_module().eval();
  const auto x = rows.narrow(1, 0, rows.size(1) - 1).to(device);
  const torch::Tensor logits = pm.forward(x, static_cast<int>(m));
  pm.stage_model().as_module().train();
  auto loss = torch::zeros({1}, torch::TensorOptions(torch::kFloat).device(device));
  if (logits.defined())
    loss = token_loss(logits, rows.narrow(1, 1, rows.size(1) - 1).to(device))
               .to(torch::kFloat)
               .reshape({1});
  pm.world().broadcast(loss, (pm.stages() - 1) * pm.data_parallel_size());
  print_eval(f, pm.world().rank(), step, loss.item<double>(), rows.size(0));
}

/// --eval-text's rows, or an undefined tensor without it.
torch::Tensor eval_rows_of(const Flags& f) {
  return f.training.eval_text.empty() ? torch::Tensor()
                                      : eval_rows(f.training.eval_text, f.model.block_size);
}

/// --export-hf DIR: the weights as transformers saves them (model.safetensors, or shards
/// and an index, under the model's own names, which are transformers'), and config.json.
/// Collective; `model` is the sharded model (rank 0 writes, one unit's full parameters at
/// a time) or the pipeline (Note [Pipelined exports]: through a sharded checkpoint).
template <class Model>
void export_hf(const Model& model, const Flags& f, const fsdp::ProcessGroup& pg, int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  const std::string& d = f.checkpoint.export_dtype;
  fsdp::ckpt::TrainingState st;
  st.step = step;
  st.model_attrs = architecture_attrs(f.model);
  // export_safetensors writes it as config.json beside the weights, with their dtype.
  auto config = nlohmann::json::parse(program_info().hf_config_json(f.model));
  config["torch_dtype"] = config["dtype"] = d == "bf16"   ? "bfloat16"
                                            : d == "fp16" ? "float16"
                                                          : "float32";
  st.model_attrs["hf_config"] = config.dump(2) + "\n";
  fsdp::ckpt::SafetensorsOptions o;
  o.dtype = d == "bf16" ? torch::kBFloat16 : d == "fp16" ? torch::kHalf : torch::kFloat;
  if (program_info().hf_layout) program_info().hf_layout(o);
  fsdp::ckpt::export_safetensors(f.checkpoint.export_hf, model, st, o);
  if (pg.rank() == 0) {
    std::cout << program() << ": wrote a Hugging Face model (" << d << ") to "
              << f.checkpoint.export_hf << " in " << seconds_since(start) << " s" << std::endl;
  }
}

/// This data-parallel replica's rows of a global batch, split into inputs and targets.
std::pair<torch::Tensor, torch::Tensor> replica_rows(const torch::Tensor& rows,
                                                     const fsdp::PipelinedModel& pm,
                                                     const torch::Device& device) {
  const int64_t n = rows.size(0) / pm.data_parallel_size();
  auto mine = rows.narrow(0, pm.data_parallel_rank() * n, n).to(device);
  return {mine.narrow(1, 0, mine.size(1) - 1), mine.narrow(1, 1, mine.size(1) - 1)};
}

/// Validation loss through the pipeline: the same batches as val_loss, the mean over the
/// replicas, on every rank.
/// Every rank reports: skipping is agreed across ranks (and stages), so these lines match.
void report_fp16_skips(const fsdp::LossScaler& scaler, int rank, int64_t steps) {
  std::cout << program() << ": rank " << rank << ": fp16 skipped " << scaler.state().skipped_steps
            << " of " << steps << " steps, loss scale "
            << static_cast<int64_t>(scaler.state().scale) << std::endl;
}

double pipelined_val_loss(fsdp::PipelinedModel& pm, const Data& data, const Flags& f) {
  constexpr int64_t kValBatches = 4;
  const torch::Device device = f.sharding.options.device;
  torch::NoGradGuard no_grad;
  pm.stage_model().as_module().eval();
  auto sum = torch::zeros({1}, torch::TensorOptions(torch::kFloat).device(device));
  for (int64_t i = 0; i < kValBatches; ++i) {
    auto [x, y] =
        replica_rows(data.val_batch(i, f.training.batch_size, f.model.block_size), pm, device);
    torch::Tensor logits = pm.forward(x);
    if (logits.defined()) sum += token_loss(logits, y).to(torch::kFloat).reshape({1});
  }
  pm.stage_model().as_module().train();
  const bool last = pm.stage() + 1 == pm.stages();
  if (last) pm.stage_group().all_reduce_sum(sum);
  pm.world().broadcast(sum, (pm.stages() - 1) * pm.data_parallel_size());
  return sum.item<double>() / static_cast<double>(pm.data_parallel_size() * kValBatches);
}

/// One pipelined training step: the micro-batches through the stages, clipping, and
/// the optimizer (skipped on every stage alike under fp16 when a gradient overflowed).
double pipelined_step(fsdp::PipelinedModel& pm, torch::optim::Optimizer& opt,
                      fsdp::LossScaler* scaler, const Flags& f, const torch::Tensor& rows) {
  auto [x, y] = replica_rows(rows, pm, f.sharding.options.device);
  const double scale = scaler ? scaler->state().scale : 1.0;
  const double loss = pm.train_step(x, y,
                                    [&](const torch::Tensor& out, const torch::Tensor& target) {
                                      auto l = token_loss(out, target);
                                      return scaler ? scaler->scale(l) : l;
                                    })
                          .item<double>() /
                      scale;
  if (scaler) scaler->unscale_();  // before clipping: the norm is of the true gradients
  if (f.training.clip_grad > 0 && !(scaler && scaler->overflowed()))
    fsdp::clip_grad_norm_(pm, f.training.clip_grad);
  if (scaler) {
    scaler->step(opt);
    scaler->update();
  } else {
    opt.step();
  }
  opt.zero_grad();
  return loss;
}

/// The stages as the flags ask, on `pg` (--init-from's weights loaded when given).
fsdp::PipelinedModel build_pipeline(const Flags& f, const fsdp::ProcessGroup& pg) {
  fsdp::PipelineOptions po;
  po.stages = f.pipeline.stages;
  po.micro_batches = f.pipeline.micro_batches;
  po.schedule = f.pipeline.schedule;
  po.partition = f.pipeline.partition;
  po.sharding = f.sharding.options;
  po.sharding.process_group = pg;
  po.parameter_names = program_info().layer_names;  // checkpoints under the model's names
  torch::manual_seed(f.training.seed);
  fsdp::PipelinedModel pm = fsdp::pipeline(program_info().layers(f.model), po);
  if (!f.checkpoint.init_from.empty()) {  // each stage reads its own names
    fsdp::ckpt::import_consolidated(f.checkpoint.init_from, pm);
    if (pg.rank() == 0)
      std::cout << program() << ": initial weights from " << f.checkpoint.init_from << std::endl;
  }
  if (pg.rank() == 0) {
    std::cout << program() << ": pipeline of " << pm.stages() << " stages ("
              << (f.pipeline.schedule == fsdp::PipelineSchedule::kGPipe ? "gpipe" : "1f1b") << ", "
              << f.pipeline.micro_batches << " micro-batches), " << pm.data_parallel_size()
              << " data-parallel rank(s) a stage; layers by stage:";
    const auto& b = pm.boundaries();
    for (size_t s = 0; s + 1 < b.size(); ++s) std::cout << " [" << b[s] << ", " << b[s + 1] << ")";
    std::cout << std::endl;
  }
  return pm;
}

/// --pipeline-stages N > 1: the model's layers in stages over the ranks (fsdp::pipeline),
/// each stage sharded over its world/N ranks; the same steps, logs, progress lines,
/// checkpoints, evaluations and exports.
int run_pipelined(const Flags& f, const fsdp::ProcessGroup& pg, const Data& data,
                  const std::string& deepspeed) {
  const bool main_rank = pg.rank() == 0;
  if (main_rank && !deepspeed.empty()) std::cout << deepspeed << std::endl;
  fsdp::PipelinedModel pm = build_pipeline(f, pg);
  auto opt = make_optimizer(f, pm.stage_model(), pg.rank());
  // fp16: the loss scaled in the last stage, the skip agreed by every stage.
  std::optional<fsdp::LossScaler> scaler;
  if (f.sharding.precision == "fp16") scaler.emplace(pm, f.sharding.loss_scaler);
  CheckpointPolicy checkpoints(f, pm, *opt, scaler ? &*scaler : nullptr, pg);
  const int64_t first_step = checkpoints.resume();
  const int64_t last_step = checkpoints.last_step(first_step);
  TrainLog log(f.output, f.training.steps, main_rank);
  log.start(first_step, last_step);
  report_no_steps(f, main_rank);
  const torch::Tensor eval = eval_rows_of(f);
  eval_text(pm, f, first_step, eval);
  const int64_t batch = f.training.batch_size, block = f.model.block_size;
  for (int64_t step = first_step; step < last_step; ++step) {
    StepRecord r;
    r.step = step + 1;
    r.lr = lr_at(f.training, step, scaler ? scaler->state().skipped_steps : 0);
    set_lr(*opt, r.lr);
    const auto start = std::chrono::steady_clock::now();
    {
      fsdp::TraceScope span("train step " + std::to_string(r.step));
      r.loss =
          pipelined_step(pm, *opt, scaler ? &*scaler : nullptr, f, data.batch(step, batch, block));
    }
    if (scaler) r.loss_scaler = scaler->state();
    r.step_s = seconds_since(start);
    r.tokens_per_s = static_cast<double>(batch * block) / r.step_s;
    read_engine_stats(pm.stage_model(), r);
    if (data.validates() && log.progress_after(r.step))
      r.val_loss = pipelined_val_loss(pm, data, f);
    log.write(r);
    if (checkpoints.due(r.step)) checkpoints.save(r.step);
  }
  const int64_t final_step = std::max(first_step, last_step);
  if (final_step != first_step) eval_text(pm, f, final_step, eval);  // else printed above
  checkpoints.finish(final_step);
  if (!f.checkpoint.export_hf.empty()) export_hf(pm, f, pg, final_step);
  if (scaler) report_fp16_skips(*scaler, pg.rank(), final_step);
  if (main_rank) {
    std::cout << program() << ": peak RSS of rank 0 (stage 0): " << peak_rss_mib() << " MiB\n"
              << program() << ": done" << std::endl;
  }
  return 0;
}

int run(const Program& prog, int argc, char** argv) {
  std::optional<Flags> flags = parse_flags(prog, argc, argv);
  if (!flags) return 0;  // --help
  const fsdp::ProcessGroup pg =
      examples::init_process_group_for(flags->sharding.options.device, flags->sharding.backend);
  const std::string deepspeed = apply_deepspeed_config(*flags, pg.size());
  const Flags& f = *flags;
  check_pipeline_flags(f);
  const Data data(f.training.seed, f.training.data, f.training.val_fraction);
  data.check(f.model.block_size);
  check_batch_for_world(f.training, pg.size(), f.pipeline);
  check_checkpoint_flags(f.checkpoint, f.training.steps);
  if (f.pipeline.stages > 1) return run_pipelined(f, pg, data, deepspeed);
  const bool main_rank = pg.rank() == 0;

  Training t = make_training(f, pg);
  CheckpointPolicy checkpoints(f, t.model, *t.opt, t.scaler ? &*t.scaler : nullptr, pg);
  const int64_t first_step = checkpoints.resume();
  const int64_t last_step = checkpoints.last_step(first_step);
  TrainLog log(f.output, f.training.steps, main_rank);
  if (main_rank && !deepspeed.empty()) std::cout << deepspeed << std::endl;
  if (main_rank) print_summary(t.model, f, data, pg.size());
  log.start(first_step, last_step);
  report_no_steps(f, main_rank);
  const torch::Tensor eval = eval_rows_of(f);
  eval_text(t, f, pg, first_step, eval);
  train(t, f, data, pg, log, checkpoints, first_step, last_step);

  const int64_t final_step = std::max(first_step, last_step);
  if (final_step != first_step) eval_text(t, f, pg, final_step, eval);  // else printed above
  checkpoints.finish(final_step);
  if (!f.checkpoint.export_hf.empty()) export_hf(t.model, f, pg, final_step);
  if (t.scaler) report_fp16_skips(*t.scaler, pg.rank(), final_step);
  if (main_rank) {
    std::cout << program() << ": peak RSS of rank 0: " << peak_rss_mib() << " MiB\n";
    if (f.sharding.options.device.is_cuda()) {
      const fsdp::stats::DeviceMemory m = fsdp::stats::device_memory(f.sharding.options.device);
      std::cout << program() << ": peak GPU memory of rank 0: " << m.peak_allocated / 1048576
                << " MiB allocated, " << m.peak_reserved / 1048576 << " MiB reserved\n";
    }
    std::cout << program() << ": done" << std::endl;
  }
  return 0;
}

}  // namespace

namespace lm {

int run_training(const Program& program, int argc, char** argv) {
  return examples::program_main(program.name.c_str(), [&] { return run(program, argc, argv); });
}

}  // namespace lm
