// Pipeline parallelism (Note [Pipeline schedules]): stages over ranks, micro-batches moved
// between them point to point, sharding inside each stage.
#include <fsdp/core/options.h>
#include <fsdp/loss_scaler.h>
#include <fsdp/pipeline.h>

#include "comm/backend.h"
#include "internal/pipeline_view.h"
#include "trace/trace.h"
#include "train/clip_grad.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <stdexcept>

namespace fsdp {

// Note [Pipeline schedules]
// The world is stages × dp ranks; rank r is stage r / dp, data-parallel index r % dp
// (DeepSpeed's pipe-then-data topology), so a stage's neighbours are r - dp and r + dp,
// and each data-parallel replica is its own pipeline. A stage holds the layers
// [bounds[s], bounds[s+1]) behind shard_sequential's wrap points, sharded over its dp ranks
// (the stage group), with their FQNs of the whole model (a layer keeps its name in the
// Sequential), so checkpoints name parameters as the unpipelined model does.
//
// A step splits the batch into M micro-batches. F(m) receives micro-batch m's activation
// from the stage before (the first stage reads the input), runs the stage, and sends its
// output on (the last stage computes the loss). B(m) receives the gradient of that output
// from the stage after (the last stage starts from loss_m / M), runs backward through the
// stage, and sends the input's gradient back. GPipe runs F(0..M-1), then B(0..M-1). 1F1B
// runs min(S - s - 1, M) forwards, then alternates F and B, then drains the backwards, so
// stage s holds at most S - s micro-batches' activations.
//
// Each message is a header (dimensions, dtype, sizes, the sender's clock, its call's
// micro-batch count: 12 int64s) and the data, both sent without waiting (the sends of a
// step are waited for at its end), so two neighbours that send to each other at once do
// not deadlock; receives block. Tags number the micro-batch and the direction; they are
// reused step after step, in the same order on both sides. The messages travel over the
// world group's backend, which no sharding collective uses (the stages shard over their
// own groups).
//
// A receive's wait is split in the trace (Note [Per-unit trace]): until the sender posted
// the message (the header carries the sender's wall clock then), the stage waited for its
// neighbour's compute, the schedule's bubble ("bubble" spans); from then until the data
// arrived, for the link ("wait" spans, like every other exposed communication). The split
// is exact where both ranks read one clock (one host, or namespaces on it) and as good as
// the hosts' clock agreement otherwise. The end of a step's wait for its sends is "wait".
//
// With PipelineOptions::reduce_once (the default) the backwards before the last
// micro-batch's keep their units gathered and their gradients unsharded (no sync), and the
// last reduces each unit once; without it every micro-batch's backward reduces into the
// shards (as gradient accumulation does without no_sync). Either way the step's gradients
// are those of the mean loss over the micro-batches, up to the order of the additions.

namespace {

constexpr int kMaxDims = 8;
constexpr int kSentAt = 2 + kMaxDims;  // the header's slot for the sender's clock
constexpr int kCount = kSentAt + 1;    // the micro-batches of the sender's call
constexpr int kHeader = kCount + 1;    // ndim, dtype, up to 8 sizes, the clock, the count

// Nanoseconds on the wall clock, which ranks on different hosts share (the steady clock
// starts at each host's boot).
int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int tag_of(int micro_batch, int direction, int part) {
  return (1 << 30) + (micro_batch * 2 + direction) * 2 + part;  // Note [Pipeline schedules]
}

detail::Backend& backend_of(const ProcessGroup& pg) { return *detail::GroupAccess::backend(pg); }

// A layer's weight for the "parameters" partition.
int64_t parameter_count(const torch::nn::Module& layer) {
  int64_t n = 0;
  for (const auto& p : layer.parameters()) n += p.numel();
  return n;
}

}  // namespace

PipelineSchedule parse_pipeline_schedule(const std::string& name, const std::string& what) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  TORCH_CHECK(false, what, " '", name, "' is not a pipeline schedule; expected gpipe or 1f1b");
}

std::vector<int64_t> partition_layers(const std::vector<int64_t>& params,
                                      const PipelineOptions& options) {
  try {  // the options core's, so that fsdp-estimate splits as the engine does
    return core::pipeline_partition(params, options.stages, options.partition,
                                    "PipelineOptions::stages=", "PipelineOptions::partition=");
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

PipelinedModel PipelinedModel::place(const std::vector<int64_t>& layer_params,
                                     const PipelineOptions& options) {
  const ProcessGroup& world = options.sharding.process_group;
  const int w = world.size(), stages = options.stages;
  try {  // the options core's rules (Note [Options core])
    core::check_pipeline_stages(stages, w, "PipelineOptions::stages", core::Surface::kApi);
    core::check_micro_batches(options.micro_batches, "PipelineOptions::micro_batches",
                              core::Surface::kApi);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  TORCH_CHECK(options.schedule != PipelineSchedule::k1F1B || options.micro_batches >= stages,
              "PipelineOptions::micro_batches=", options.micro_batches,
              " is fewer than stages=", stages,
              " under the 1F1B schedule, which needs one micro-batch per stage to fill "
              "the pipeline: use at least ",
              stages, " micro-batches, or the gpipe schedule");
  PipelinedModel m;
  m.world_ = world;
  m.options_ = options;
  m.stages_ = stages;
  m.dp_size_ = w / stages;
  m.stage_ = world.rank() / m.dp_size_;
  m.dp_rank_ = world.rank() % m.dp_size_;
  std::vector<std::vector<int>> groups(static_cast<size_t>(stages));
  for (int r = 0; r < w; ++r) groups[static_cast<size_t>(r / m.dp_size_)].push_back(r);
  m.stage_group_ = stages == 1 ? world : world.split(groups);
  m.bounds_ = partition_layers(layer_params, options);
  m.first_ = m.bounds_[static_cast<size_t>(m.stage_)];
  m.last_ = m.bounds_[static_cast<size_t>(m.stage_) + 1];
  return m;
}

void PipelinedModel::adopt(Sharded<torch::nn::Sequential> seq) {
  seq_ = std::make_shared<Sharded<torch::nn::Sequential>>(std::move(seq));
  model_ = *seq_;
  if (options_.parameter_names) detail::rename_parameters(model_, options_.parameter_names);
  if (detail::trace::on()) {
    // The stages' models met at barriers of their own groups; the merge aligns the ranks'
    // clocks at their last common mark, which must be one barrier of the whole world.
    world_.barrier();
    detail::trace::mark_sync();
  }
}

PipelinedModel pipeline(const torch::nn::Sequential& layers, const PipelineOptions& options) {
  TORCH_CHECK(!layers.is_empty() && layers->size() > 0,
              "pipeline: the Sequential is empty; give it the model's layers in order");
  const auto children = layers->named_children();
  std::vector<int64_t> params;
  for (const auto& c : children) params.push_back(parameter_count(*c.value()));
  PipelinedModel m = PipelinedModel::place(params, options);
  torch::OrderedDict<std::string, torch::nn::AnyModule> mine;
  for (int64_t i = m.first_; i < m.last_; ++i)
    mine.insert(children[static_cast<size_t>(i)].key(), *(layers->begin() + i));
  ShardingOptions sharding = options.sharding;
  sharding.process_group = m.stage_group_;
  m.adopt(shard_sequential(torch::nn::Sequential(std::move(mine)), sharding));
  return m;
}

namespace {

// Note [Building one stage]
// A layer's initial weights are drawn from the default CPU generator, in layer order: the
// factory's layer i draws what building the whole model draws for it, after layers
// 0 .. i-1. So a rank makes the layers before its stage and drops each at once (their
// draws move the generator on), makes its own under sharded construction, and sets the
// generator to the state after the last layer, which it learned by making every layer
// once when the "parameters" partition needed their sizes (that pass saves the state
// before each layer, so the second one starts at the stage's first), or by making the
// layers after its stage and dropping them too.

using Generator = at::Generator;

Generator cpu_generator() { return at::detail::getDefaultCPUGenerator(); }

at::Tensor rng_state() {
  Generator g = cpu_generator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_rng_state(const at::Tensor& state) {
  Generator g = cpu_generator();
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// Makes layer i and drops it; returns its trainable parameter count.
int64_t make_and_drop(const PipelineLayers& layers, int64_t i) {
  auto [name, module] = layers.make(i);
  detail::check_layer_made(module, i, name);
  return parameter_count(*module.ptr());
}

}  // namespace

PipelinedModel pipeline(const PipelineLayers& layers, const PipelineOptions& options) {
  TORCH_CHECK(layers.count >= 1 && layers.make, "pipeline: PipelineLayers needs count >= 1 (got ",
              layers.count, ") and a factory `make` for layer 0 .. count - 1");
  TORCH_CHECK(layers.params.empty() || static_cast<int64_t>(layers.params.size()) == layers.count,
              "pipeline: PipelineLayers::params has ", layers.params.size(), " entries for ",
              layers.count, " layers; give one count per layer, or none");
  // Note [Building one stage]
  std::vector<int64_t> params = layers.params;
  std::vector<at::Tensor> before;  // the generator's state before each layer (counting pass)
  if (params.empty()) {
    if (options.partition == "parameters") {
      for (int64_t i = 0; i < layers.count; ++i) {
        before.push_back(rng_state());
        params.push_back(make_and_drop(layers, i));
      }
      before.push_back(rng_state());
    } else {
      params.assign(static_cast<size_t>(layers.count), 1);  // only their number matters
    }
  }
  PipelinedModel m = PipelinedModel::place(params, options);
  if (before.empty()) {
    for (int64_t i = 0; i < m.first_; ++i) make_and_drop(layers, i);
  } else {
    set_rng_state(before[static_cast<size_t>(m.first_)]);
  }
  ShardingOptions sharding = options.sharding;
  sharding.process_group = m.stage_group_;
  m.adopt(detail::shard_layers_as_built(m.first_, m.last_, layers.make, sharding));
  if (before.empty()) {
    for (int64_t i = m.last_; i < layers.count; ++i) make_and_drop(layers, i);
  } else {
    set_rng_state(before.back());
  }
  return m;
}

namespace {
// The message for a tensor of `dims` dimensions, more than a header holds.
std::string dims_error(const char* what, int64_t dims) {
  return std::string(what) + " has " + std::to_string(dims) + " dimensions; at most " +
         std::to_string(kMaxDims) +
         " travel between stages: flatten it in the layer that makes it and restore the shape "
         "in the next stage's first layer";
}
}  // namespace

// fp16 over a pipeline: the stage's gradients, the skip agreed by every stage.
LossScaler::LossScaler(PipelinedModel& model, LossScalerOptions options)
    : LossScaler(model.stage_model(), options) {
  agree_ = model.world();
}

// One step on one rank: the stage's messages and what its backwards need.
struct PipelinedModel::Step {
  PipelinedModel& m;
  detail::Backend& world;
  int prev, next;  // world ranks of the neighbours (-1: none)
  struct Pending {
    std::shared_ptr<detail::Work> work;
    torch::Tensor keep;  // the tensor the send reads
  };
  std::vector<Pending> pending;
  std::vector<torch::Tensor> inputs, outputs;  // per micro-batch, until its backward
  int in_flight = 0;
  int micro_batches;  // this call's, which every message carries

  Step(PipelinedModel& model, int micro)
      : m(model),
        world(backend_of(model.world_)),
        prev(model.stage_ > 0 ? model.world_.rank() - model.dp_size_ : -1),
        next(model.stage_ + 1 < model.stages_ ? model.world_.rank() + model.dp_size_ : -1),
        micro_batches(micro) {
    m.peak_in_flight_ = 0;
  }
  ~Step() {
    for (auto& p : pending) {
      try {
        p.work->wait();
      } catch (...) {  // the step's own error is the one to report
      }
    }
  }

  void send(const torch::Tensor& t, int peer, int mb, int dir) {
    auto header = torch::zeros({kHeader}, torch::TensorOptions(torch::kLong).device(t.device()));
    std::vector<int64_t> h(kHeader, 0);
    const bool fits = t.dim() <= kMaxDims;
    // A tensor the header cannot describe: the header says so (-1, its dimensions), so
    // that the receiver fails with this rank instead of waiting for data that never comes.
    h[0] = fits ? t.dim() : -1;
    h[1] = fits ? static_cast<int64_t>(t.scalar_type()) : t.dim();
    for (int64_t d = 0; fits && d < t.dim(); ++d) h[static_cast<size_t>(d + 2)] = t.size(d);
    h[kSentAt] = wall_ns();
    h[kCount] = micro_batches;
    header.copy_(torch::tensor(h, torch::kLong));
    if (!fits) {
      pending.push_back({world.send(header, peer, tag_of(mb, dir, 0)), header});
      TORCH_CHECK(false, "pipeline: a stage's ",
                  dims_error(dir == 0 ? "output" : "input gradient", t.dim()));
    }
    torch::Tensor data = t.detach().contiguous();
    pending.push_back({world.send(header, peer, tag_of(mb, dir, 0)), header});
    pending.push_back({world.send(data, peer, tag_of(mb, dir, 1)), data});
  }

  torch::Tensor recv(int peer, int mb, int dir, const torch::Device& device) {
    auto name = [&]() {
      return std::string(dir == 0 ? "recv activation " : "recv gradient ") + std::to_string(mb);
    };
    const bool tracing = detail::trace::on();
    std::optional<detail::trace::Scope> range;  // the profiler's range when only it listens
    if (!tracing) range.emplace("wait", name);
    const int64_t began = tracing ? detail::trace::now_ns() : 0;
    auto header = torch::empty({kHeader}, torch::TensorOptions(torch::kLong).device(device));
    world.recv(header, peer, tag_of(mb, dir, 0))->wait();
    const auto h = header.cpu();
    const int64_t* v = h.data_ptr<int64_t>();
    TORCH_CHECK(v[0] >= 0, "pipeline: rank ", peer, " could not send micro-batch ", mb,
                ": its stage's ", dims_error(dir == 0 ? "output" : "input gradient", v[1]));
    TORCH_CHECK(v[kCount] == micro_batches, "pipeline: rank ", peer, " runs this step in ",
                v[kCount], " micro-batches and this rank in ", micro_batches,
                ": every rank must split the step alike (PipelinedModel::forward's "
                "micro_batches, the same on every rank)");
    std::vector<int64_t> sizes(v + 2, v + 2 + v[0]);
    auto data = torch::empty(
        sizes, torch::TensorOptions(static_cast<torch::ScalarType>(v[1])).device(device));
    world.recv(data, peer, tag_of(mb, dir, 1))->wait();
    if (tracing) trace_wait(name(), began, v[kSentAt]);
    return data;
  }

  // The wait [began, now) as the bubble until the sender posted (`sent_wall`, its wall
  // clock), and the link after (Note [Pipeline schedules]).
  static void trace_wait(const std::string& name, int64_t began, int64_t sent_wall) {
    const int64_t now = detail::trace::now_ns();
    const int64_t sent = std::clamp(sent_wall - (wall_ns() - now), began, now);
    if (sent > began)
      detail::trace::span("bubble: " + name, "bubble", detail::trace::Track::kCompute, began, sent);
    detail::trace::span(name, "wait", detail::trace::Track::kCompute, sent, now);
  }

  // The step's sends, done before it returns.
  void finish_sends() {
    detail::trace::Scope waiting("wait", [] { return std::string("pipeline sends"); });
    for (auto& p : pending) p.work->wait();
    pending.clear();
  }
};

torch::Tensor PipelinedModel::train_step(const torch::Tensor& input, const torch::Tensor& target,
                                         const PipelineLossFn& loss_fn) {
  TORCH_CHECK(seq_, "PipelinedModel::train_step: an empty model; build it with fsdp::pipeline");
  const int M = options_.micro_batches;
  const bool first = stage_ == 0, last = stage_ + 1 == stages_;
  const auto in_chunks = first ? input.chunk(M, 0) : std::vector<torch::Tensor>{};
  const auto tgt_chunks = last ? target.chunk(M, 0) : std::vector<torch::Tensor>{};
  TORCH_CHECK(!first || (input.dim() > 0 && input.size(0) % M == 0),
              "PipelinedModel::train_step: the input's ", input.dim() ? input.size(0) : 0,
              " rows do not split into micro_batches=", M,
              " equal parts: give a batch whose first dimension is a multiple of ", M);
  TORCH_CHECK(!last || (target.dim() > 0 && target.size(0) % M == 0),
              "PipelinedModel::train_step: the target's ", target.dim() ? target.size(0) : 0,
              " rows do not split into micro_batches=", M,
              " equal parts: give a batch whose first dimension is a multiple of ", M);
  const torch::Device device = options_.sharding.device;
  Step st(*this, M);
  st.inputs.resize(static_cast<size_t>(M));
  st.outputs.resize(static_cast<size_t>(M));
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(torch::kFloat).device(device));

  // Each micro-batch's forward and backward is a span ("F3 stage 1"), so a trace shows
  // the schedule and its bubble.
  auto span = [&](const char* what, int mb) {
    return [what, mb, this]() {
      return what + std::to_string(mb) + " stage " + std::to_string(stage_);
    };
  };
  auto forward_mb = [&](int mb) {
    detail::trace::Scope f("pipeline", span("F", mb));
    torch::Tensor x = first ? in_chunks[static_cast<size_t>(mb)]
                            : st.recv(st.prev, mb, 0, device).requires_grad_(true);
    torch::Tensor out = (*seq_)(x);
    if (last) {
      torch::Tensor loss = loss_fn(out, tgt_chunks[static_cast<size_t>(mb)]);
      loss_sum += loss.detach().to(torch::kFloat);
      out = loss / M;
    } else {
      st.send(out, st.next, mb, 0);
    }
    st.inputs[static_cast<size_t>(mb)] = x;
    st.outputs[static_cast<size_t>(mb)] = out;
    peak_in_flight_ = std::max(peak_in_flight_, ++st.in_flight);
  };
  auto backward_mb = [&](int mb) {
    detail::trace::Scope b("pipeline", span("B", mb));
    // Both schedules end with micro-batch M - 1's backward: it reduces (reduce_once).
    const bool reduce = !options_.reduce_once || mb == M - 1;
    model_.set_requires_gradient_sync(reduce);
    model_.set_reshard_after_backward(reduce);
    torch::Tensor out = std::move(st.outputs[static_cast<size_t>(mb)]);
    if (last) {
      out.backward();
    } else {
      out.backward(st.recv(st.next, mb, 1, device).to(out.scalar_type()));
    }
    torch::Tensor x = std::move(st.inputs[static_cast<size_t>(mb)]);
    if (!first) st.send(x.grad(), st.prev, mb, 1);
    --st.in_flight;
  };

  if (options_.schedule == PipelineSchedule::kGPipe) {
    for (int mb = 0; mb < M; ++mb) forward_mb(mb);
    for (int mb = 0; mb < M; ++mb) backward_mb(mb);
  } else {
    const int warmup = std::min(stages_ - stage_ - 1, M);
    for (int mb = 0; mb < warmup; ++mb) forward_mb(mb);
    for (int i = 0; i + warmup < M; ++i) {
      forward_mb(i + warmup);
      backward_mb(i);
    }
    for (int mb = M - warmup; mb < M; ++mb) backward_mb(mb);
  }
  st.finish_sends();

  // The mean loss: over the micro-batches on the last stage, over its data-parallel
  // replicas, then to every rank from the last stage's first rank.
  torch::Tensor loss = (loss_sum / M).reshape({1});  // collectives take one dimension or more
  if (last && dp_size_ > 1) {
    stage_group_.all_reduce_sum(loss);
    loss /= dp_size_;
  }
  if (stages_ > 1) world_.broadcast(loss, (stages_ - 1) * dp_size_);
  return loss.reshape({});
}

double clip_grad_norm_(PipelinedModel& pm, double max_norm, double norm_type) {
  // Each stage's norm arrives from each of its data-parallel ranks: summed over the
  // world, it is counted dp times.
  return detail::clip_grad_norm_across(pm.stage_model(), max_norm, norm_type,
                                       [&pm](at::Tensor& local, bool inf) {
                                         if (pm.stages() == 1) return;
                                         if (inf) {
                                           pm.world().all_reduce_max(local);
                                         } else {
                                           pm.world().all_reduce_sum(local);
                                           local /= pm.data_parallel_size();
                                         }
                                       });
}

torch::Tensor PipelinedModel::forward(const torch::Tensor& input, int micro_batches) {
  TORCH_CHECK(seq_, "PipelinedModel::forward: an empty model; build it with fsdp::pipeline");
  TORCH_CHECK(micro_batches >= 0, "PipelinedModel::forward: micro_batches=", micro_batches,
              " must be 0 (PipelineOptions::micro_batches) or positive");
  torch::NoGradGuard no_grad;
  const int M = micro_batches > 0 ? micro_batches : options_.micro_batches;
  const bool first = stage_ == 0, last = stage_ + 1 == stages_;
  const auto in_chunks = first ? input.chunk(M, 0) : std::vector<torch::Tensor>{};
  TORCH_CHECK(!first || (input.dim() > 0 && input.size(0) % M == 0),
              "PipelinedModel::forward: the input's ", input.dim() ? input.size(0) : 0,
              " rows do not split into micro_batches=", M,
              " equal parts: give a batch whose first dimension is a multiple of ", M);
  Step st(*this, M);
  std::vector<torch::Tensor> outs;
  for (int mb = 0; mb < M; ++mb) {
    torch::Tensor x = first ? in_chunks[static_cast<size_t>(mb)]
                            : st.recv(st.prev, mb, 0, options_.sharding.device);
    torch::Tensor out = (*seq_)(x);
    if (last) {
      outs.push_back(out);
    } else {
      st.send(out, st.next, mb, 0);
    }
  }
  st.finish_sends();
  return last ? torch::cat(outs, 0) : torch::Tensor();
}

}  // namespace fsdp
