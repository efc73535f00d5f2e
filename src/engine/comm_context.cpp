#include "comm_context.h"

#include "comm/collective_ring.h"
#include "comm/quantize.h"

#include <algorithm>

namespace fsdp::detail {

CommContext::CommContext(Accounting* acct, std::shared_ptr<Transfers> transfers)
    : acct_(acct), transfers_(std::move(transfers)) {}

CommContext::~CommContext() {
  for (auto& [unit, work] : gathers_) {
    try {
      work->wait();
    } catch (const std::exception&) {
      // A failed collective (e.g. a peer died) leaves nothing in flight to wait for.
    }
  }
}

void CommContext::add_gathers(const Unit& unit, std::vector<std::shared_ptr<Work>> works) {
  for (auto& w : works) gathers_.emplace_back(&unit, std::move(w));
}

void CommContext::wait_gathers(const Unit& unit) {
  // In issue order; a gather leaves the list once waited for (a failed one stays for
  // the destructor).
  for (auto it = gathers_.begin(); it != gathers_.end();) {
    if (it->first != &unit) {
      ++it;
      continue;
    }
    it->second->wait();
    it = gathers_.erase(it);
  }
}

// Note [Collectives in one place]
// The engine's collectives are issued here, as FSDP2 keeps them in _fsdp_collectives.py:
// the all-gather of each flat parameter (its input prepared by FlatParam::gather_input,
// which keeps storage and casting), the reduce-scatter and all-reduce of its gradient.
// The few others are below: sync_module_states' broadcast, the exports' gathers, the
// change check's and clipping's all-reduces, the trace's barrier.
std::shared_ptr<Work> CommContext::all_gather(FlatParam& flat) {
  FlatParam::GatherInput in = flat.gather_input();
  if (in.done) return std::make_shared<DoneWork>();
  const FlatConfig& cfg = flat.config();
  at::NoGradGuard no_grad;
  CollectiveLabel label(flat.label());
  std::shared_ptr<Work> work;
  std::function<void()> join;
  const int64_t full_bytes = flat.full_bytes();
  const auto dtype = flat.full().scalar_type();
  if (in.from_slice) {  // Note [Post-forward slices]: unquantized (Note [Quantized training])
    acct_->count_reshard_group_gather(
        full_bytes, cfg.reshard_group->wire_bytes(WireOp::kAllGather, full_bytes, dtype, 0));
    work = cfg.reshard_group->all_gather(flat.full(), in.input);
  } else {
    Backend& group = *cfg.shard_group;
    const bool quantized = cfg.quantize_weights.has_value() && group.size() > 1;
    auto issue = [&]() {
      if (!quantized) {
        work = group.all_gather(flat.full(), in.input);
        return;
      }
      int64_t wire = 0;
      work = quantized_all_gather(group, flat.full(), in.input, *cfg.quantize_weights, &wire);
      acct_->count(Collective::kAllGather, full_bytes, wire, /*quantized=*/true);
    };
    if (group.size() > 1 && !quantized)
      acct_->count(Collective::kAllGather, full_bytes,
                   group.wire_bytes(WireOp::kAllGather, full_bytes, dtype, 0));
    if (in.staging.defined() && cfg.offload) {
      join = cfg.transfers->on_stream(issue, in.staging);
    } else if (in.copied.defined()) {
      join = cfg.transfers->on_stream(issue, in.copied);
    } else {
      issue();
    }
  }
  if (in.counter == nullptr) {
    if (!join) return work;
    return std::make_shared<ThenWork>(work, [join]() { join(); });
  }
  // The input is freed with this function object, once the work has run it.
  stats::MemoryCounter* counter = in.counter;
  const int64_t bytes = in.held_bytes;
  at::Tensor held = in.input;
  return std::make_shared<ThenWork>(work, [counter, join, bytes, held]() {
    if (join) join();
    Accounting::release(*counter, bytes);
  });
}

void CommContext::reduce(FlatParam& flat, at::Tensor grad) {
  if (grad.defined()) {
    // An earlier reduction of this flat parameter adds into the same gradient shard
    // first (then it is the only one in flight).
    const auto same = [&](const Reduction& r) { return r.flat == &flat; };
    if (std::any_of(reductions_.begin(), reductions_.end(), same)) {
      while (!same(reductions_.front())) {
        FlatParam* previous = reductions_.front().flat;
        finish_oldest();
        park(*previous);
      }
      finish_oldest();
    }
    // Note [Overlapped reduction]
    // The reduce-scatter is issued here and finished when the next flat parameter has
    // issued its own (or at the end of backward), so the collective runs while backward
    // computes the next unit. The flat gradient stays alive (and counted in
    // comm_buffers) until then.
    const FlatConfig& cfg = flat.config();
    Reduction r{&flat, grad, grad, nullptr};
    if (cfg.shard_group->size() > 1) {
      issue_reduction(r);
    } else {
      r.work = std::make_shared<DoneWork>();
    }
    reductions_.push_back(std::move(r));
  }
  // The reduction issued before, by another flat parameter, finishes while this one runs.
  // A two-stage one (hierarchical qgZ) issues its second stage now instead, and finishes
  // once the next one has been issued: each stage overlaps a unit's backward.
  while (!reductions_.empty() && reductions_.front().flat != &flat) {
    Reduction& oldest = reductions_.front();
    if (oldest.two_stage && !oldest.advanced) {
      CollectiveLabel label(oldest.flat->label());
      oldest.work->progress();
      oldest.advanced = true;
      // The second stage reads its own buffers: the flat gradient goes now.
      Accounting::release(acct_->mem.comm_buffers, static_cast<int64_t>(oldest.in.nbytes()));
      oldest.in = at::Tensor();
      break;
    }
    FlatParam* previous = oldest.flat;
    finish_oldest();
    park(*previous);
  }
  park(flat);  // its own earlier reduction may have finished above
}

// Note [Quantized training]: with qgZ the reduction travels quantized, flat or
// hierarchical, and sums into an fp32 shard.
void CommContext::issue_reduction(Reduction& r) {
  FlatParam& flat = *r.flat;
  const FlatConfig& cfg = flat.config();
  at::NoGradGuard no_grad;
  CollectiveLabel label(flat.label());
  const auto bytes = static_cast<int64_t>(r.in.nbytes());
  if (!cfg.quantize_gradients) {
    r.out = at::empty({flat.shard_numel()}, r.in.options());
    acct_->count(Collective::kReduceScatter, bytes,
                 cfg.shard_group->wire_bytes(WireOp::kReduceScatter, bytes, r.in.scalar_type(), 0));
    r.work = cfg.shard_group->reduce_scatter_sum(r.in, r.out);
    return;
  }
  r.out = at::empty({flat.shard_numel()}, r.in.options().dtype(at::kFloat));
  int64_t wire = 0, outer = 0;
  if (cfg.hierarchy_outer) {
    r.two_stage = true;
    r.work = hierarchical_quantized_reduce_scatter(*cfg.hierarchy_inner, *cfg.hierarchy_outer, r.in,
                                                   r.out, *cfg.quantize_gradients, &wire, &outer);
    acct_->count_hierarchical_outer(outer);
  } else {
    r.work =
        quantized_reduce_scatter(*cfg.shard_group, r.in, r.out, *cfg.quantize_gradients, &wire);
  }
  acct_->count(Collective::kReduceScatter, bytes, wire, /*quantized=*/true);
}

void CommContext::finish_oldest() {
  Reduction r = std::move(reductions_.front());
  reductions_.erase(reductions_.begin());
  {
    CollectiveLabel label(r.flat->label());  // a two-stage reduction issues its second here
    r.work->wait();
  }
  FlatParam& flat = *r.flat;
  const FlatConfig& cfg = flat.config();
  at::NoGradGuard no_grad;
  at::Tensor out = std::move(r.out);
  if (Backend& across = *cfg.replicate_group; across.size() > 1) {
    const auto bytes = static_cast<int64_t>(out.nbytes());
    CollectiveLabel label(flat.label());
    if (cfg.quantize_gradients) {  // Note [Quantized training]
      acct_->count(Collective::kAllReduce, bytes,
                   quantized_all_reduce(across, out, *cfg.quantize_gradients));
    } else {
      acct_->count(Collective::kAllReduce, bytes,
                   across.wire_bytes(WireOp::kAllReduce, bytes, out.scalar_type(), 0));
      across.all_reduce(out, ReduceKind::kSum)->wait();
    }
  }
  if (r.in.defined()) {
    Accounting::release(acct_->mem.comm_buffers, static_cast<int64_t>(r.in.nbytes()));
    r.in = at::Tensor();
  }

  at::Tensor g = out.to(at::kFloat);
  if (cfg.world_size > 1) g.div_(static_cast<double>(cfg.world_size));
  if (cfg.master_dtype != at::kFloat) g = g.to(cfg.master_dtype);  // pure bf16
  const at::Tensor& shard = flat.shard();
  if (flat.in_file()) {  // Note [NVMe parameters]: to the file, through a host buffer
    acct_->count_offload(/*to_device=*/false, static_cast<int64_t>(g.nbytes()));
    flat.store_grad(g);
    flat.count_grad();
    grad_writes_.push_back(&flat);
    while (grad_writes_.size() > kGradWritesInFlight) {
      grad_writes_.front()->settle_grad_write();
      grad_writes_.pop_front();
    }
    return;
  }
  if (transfers_) {
    // The fp32 gradient shard goes back to the host on the transfer stream (an explicit
    // copy on a CPU device). A first gradient becomes the gradient shard as it is; one
    // that must be added waits for land() (Note [Offload transfers]).
    Transfers::HostCopy host = transfers_->to_host(g);
    acct_->count_offload(/*to_device=*/false, static_cast<int64_t>(g.nbytes()));
    if (!shard.grad().defined()) {
      shard.mutable_grad() = host.value;
      flat.count_grad();
      landing_of(flat).first = std::move(host.wait);
    } else {
      Accounting::alloc(acct_->mem.offload_buffers, static_cast<int64_t>(g.nbytes()));
      landing_of(flat).to_add.push_back(std::move(host));
    }
    return;
  }
  if (!shard.grad().defined()) {
    shard.mutable_grad() = g;
    flat.count_grad();
  } else {
    shard.mutable_grad().add_(g);
  }
}

CommContext::Landing& CommContext::landing_of(FlatParam& flat) {
  auto it = std::find_if(landing_.begin(), landing_.end(),
                         [&](const Landing& l) { return l.flat == &flat; });
  if (it != landing_.end()) return *it;
  landing_.push_back(Landing{&flat, {}, {}});
  return landing_.back();
}

void CommContext::park(FlatParam& flat) {
  auto it = std::find_if(landing_.begin(), landing_.end(),
                         [&](const Landing& l) { return l.flat == &flat; });
  if (it == landing_.end() || it->to_add.empty()) return;
  if (parked_ != nullptr && parked_ != &flat) {
    auto p = std::find_if(landing_.begin(), landing_.end(),
                          [&](const Landing& l) { return l.flat == parked_; });
    TORCH_INTERNAL_ASSERT(p != landing_.end());
    land(*p);
    landing_.erase(p);
  }
  parked_ = &flat;
}

void CommContext::land(Landing& l) {
  if (l.first) {
    l.first();
    l.first = {};
  }
  at::NoGradGuard no_grad;
  const at::Tensor& shard = l.flat->shard();
  for (auto& copy : l.to_add) {
    if (copy.wait) copy.wait();
    shard.mutable_grad().add_(copy.value);
    Accounting::release(acct_->mem.offload_buffers, static_cast<int64_t>(copy.value.nbytes()));
  }
  l.to_add.clear();
}

void CommContext::finish_backward() {
  while (!reductions_.empty()) finish_oldest();
  for (; !grad_writes_.empty(); grad_writes_.pop_front()) grad_writes_.front()->settle_grad_write();
  if (!transfers_) return;
  // Offloaded gradients: every copy lands before an optimizer step can read them.
  transfers_->wait_host();
  for (auto& l : landing_) land(l);
  landing_.clear();
  parked_ = nullptr;
}

void CommContext::wait_transfers() {
  if (transfers_) transfers_->wait_host();
}

void broadcast_from_rank0(Backend& group, at::Tensor& v, Accounting& acct,
                          const std::string& label) {
  CollectiveLabel scope(label);
  group.broadcast(v, 0);
  const int64_t bytes = v.numel() * static_cast<int64_t>(sizeof(float));
  acct.count(Collective::kBroadcast, bytes,
             group.wire_bytes(WireOp::kBroadcast, bytes, at::kFloat, 0));
}

at::Tensor gather_like(const FlatParam& flat, const at::Tensor& shard_like) {
  TORCH_CHECK(shard_like.numel() == flat.shard_numel(), "gather: expected a tensor of ",
              flat.shard_numel(), " elements laid out like the shard, got ", shard_like.numel());
  at::NoGradGuard no_grad;
  const FlatConfig& cfg = flat.config();
  // On the compute device, where the collectives run (with offload the shard is on the host).
  auto opts = at::TensorOptions().dtype(at::kFloat).device(cfg.device);
  at::Tensor out = at::empty({flat.padded_numel()}, opts);
  if (cfg.shard_group->size() > 1) {
    const int64_t bytes = flat.padded_numel() * static_cast<int64_t>(sizeof(float));
    cfg.acct->count(Collective::kAllGather, bytes,
                    cfg.shard_group->wire_bytes(WireOp::kAllGather, bytes, at::kFloat, 0));
  }
  CollectiveLabel label(flat.label());
  cfg.shard_group->all_gather(out, shard_like.detach().to(opts).contiguous())->wait();
  return out;
}

void all_reduce(Backend& group, const at::Tensor& tensor, ReduceKind kind, Accounting* acct,
                const std::string& label) {
  if (acct != nullptr && group.size() > 1) {
    const auto bytes = static_cast<int64_t>(tensor.nbytes());
    acct->count(Collective::kAllReduce, bytes,
                group.wire_bytes(WireOp::kAllReduce, bytes, tensor.scalar_type(), 0));
  }
  CollectiveLabel scope(label);
  group.all_reduce(tensor, kind)->wait();
}

void barrier(Backend& group) { group.barrier(); }

}  // namespace fsdp::detail
