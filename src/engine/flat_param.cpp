#include "flat_param.h"

#include "comm/collective_ring.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <utility>

namespace fsdp::detail {
namespace {

// Note [Freeing storage in place]
// Gathered parameters are views into one full buffer. To free and restore the bytes
// without touching the views, resize the buffer's StorageImpl itself: tensors that
// autograd saved in forward share that StorageImpl and see the restored data in
// backward (docs/design.md, "LibTorch facts"). The storage's own allocator serves CPU and CUDA
// alike.
void free_storage(const at::Tensor& t) { t.storage().unsafeGetStorageImpl()->reset(); }

void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::DeviceGuard on_device(t.device());  // the CUDA allocator serves the current device
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

int64_t bytes_of(int64_t numel, at::ScalarType t) {
  return numel * static_cast<int64_t>(c10::elementSize(t));
}

}  // namespace

FlatParam::FlatParam(std::vector<ParamSlot> slots, bool trainable, const FlatConfig& cfg,
                     const SyncFromRank0& sync)
    : slots_(std::move(slots)), trainable_(trainable), cfg_(cfg) {
  at::NoGradGuard no_grad;
  for (auto& s : slots_) {
    s.offset = numel_;
    s.numel = s.param.numel();
    s.shape = s.param.sizes().vec();
    numel_ += s.numel;
  }
  const int64_t g = cfg_.shard_group->size();
  padded_ = (numel_ + g - 1) / g * g;
  shard_numel_ = padded_ / g;

  // Note [Flatten in place]
  // The shard is filled parameter by parameter, and each original's bytes go as soon as
  // its part is copied (unless something else holds them): flattening a unit needs the
  // unit's parameters plus its shard, never a second full copy of the unit. That bounds
  // make_sharded's construction peak by the shards built so far plus the unit being
  // built (docs/design.md, "Sharded construction"). Under sync_module_states each
  // parameter is broadcast from rank 0 before its part is taken.
  auto fp32 = at::TensorOptions().dtype(at::kFloat).device(cfg_.device);
  auto master = fp32.dtype(cfg_.master_dtype);
  shard_ = at::zeros({shard_numel_}, master);
  const int64_t lo = cfg_.shard_group->rank() * shard_numel_, hi = lo + shard_numel_;
  for (auto& s : slots_) {
    at::Tensor v = s.param.detach().reshape({-1}).to(fp32).contiguous();
    if (sync) sync(v, label());  // comm_context.cpp's broadcast_from_rank0
    const int64_t a = std::max(lo, s.offset), b = std::min(hi, s.offset + s.numel);
    if (a < b) shard_.narrow(0, a - lo, b - a).copy_(v.narrow(0, a - s.offset, b - a));
    s.param.set_data(at::empty({0}, s.param.options()));
  }
  if (!cfg_.nvme_path.empty()) {
    // Note [NVMe parameters]: master, gradient and (16-bit compute) the optimizer's copy,
    // each region aligned for O_DIRECT, in a file of this flat parameter's.
    file_ = std::make_unique<ShardFile>(cfg_.nvme_path, shard_, trainable_, cfg_.param_dtype,
                                        cfg_.device, cfg_.nvme_io, cfg_.acct);
    shard_ = file_->master_view();
  } else if (cfg_.offload) {
    // Host memory, pinned when the device is a GPU so copies can run asynchronously.
    at::Tensor host =
        at::empty({shard_numel_}, master.device(at::kCPU).pinned_memory(cfg_.device.is_cuda()));
    host.copy_(shard_);
    shard_ = host;
  }
  shard_.set_requires_grad(trainable_);
  if (!file_)
    Accounting::alloc(cfg_.acct->mem.sharded_params, bytes_of(shard_numel_, cfg_.master_dtype));

  // Point every original parameter at its view of the full buffer, then free the
  // buffer: the originals' own storage goes with the old data.
  // Note [Group of one]
  // With nobody to gather from (world size 1, or NO_SHARD) and fp32 compute, the shard
  // is the full parameter: the views point into the shard itself, gathers and frees are
  // no-ops, and the optimizer's in-place updates are what the model computes with.
  // At world size 1 the gradient needs no reduction either, so the originals' .grad()
  // are views into the fp32 gradient shard and autograd accumulates into it in place
  // (GradBuffer::direct()).
  alias_ = g == 1 && cfg_.param_dtype == cfg_.master_dtype && !cfg_.offload;
  full_ = alias_ ? shard_.detach() : at::empty({padded_}, fp32.dtype(cfg_.param_dtype));
  for (auto& s : slots_) s.param.set_data(full_.narrow(0, s.offset, s.numel).view(s.shape));
  if (!alias_) free_storage(full_);
}

void FlatParam::set_names(const std::string& prefix, const std::string& label) {
  auto join = [&](const std::string& n) { return prefix.empty() ? n : prefix + "." + n; };
  for (auto& s : slots_) {
    s.fqn = join(s.fqn);
    for (auto& a : s.aliases) a = join(a);
  }
  cfg_.label = label;
}

FlatParam::~FlatParam() {
  release();
  // file_ (ShardFile) waits for its transfers in flight and releases its own count.
  if (!file_)
    Accounting::release(cfg_.acct->mem.sharded_params, bytes_of(shard_numel_, cfg_.master_dtype));
  Accounting::release(cfg_.acct->mem.grad_shards, counted_grad_bytes_);
  if (device_params_.defined())
    Accounting::release(cfg_.acct->mem.device_param_shards,
                        bytes_of(shard_numel_, cfg_.param_dtype));
}

FlatParam::GatherInput FlatParam::gather_input() {
  GatherInput in;
  if (alias_) {
    in.done = true;
    return in;
  }
  if (!full_allocated()) {
    alloc_storage(full_, static_cast<size_t>(full_bytes()));
    Accounting::alloc(cfg_.acct->mem.gathered_params, full_bytes());
  }
  at::NoGradGuard no_grad;
  gathered_version_ = shard_._version();
  if (slice_.defined()) {
    // Note [Post-forward slices]: the slice goes once the gather has run.
    in.input = std::move(slice_);
    slice_ = at::Tensor();
    in.from_slice = true;
    in.counter = &cfg_.acct->mem.post_forward_params;
    in.held_bytes = bytes_of(in.input.numel(), cfg_.param_dtype);
    return in;
  }
  at::Tensor input = shard_.detach();
  // The optimizer's param_dtype copy, written in its update pass, saves the cast while
  // the shard has not changed since (its version counter says so).
  const bool fresh = lowp_.defined() && lowp_version_->load() == shard_._version();
  if (fresh) {
    input = lowp_;
    ++copy_out_gathers_;
  }
  if (file_) {
    // Note [NVMe parameters]: the gather's input is read from the file (the optimizer's
    // copy while fresh, else the master), never through the mapping.
    input = file_->take_read(fresh, shard_._version());
  }
  // The gather's input in param_dtype on the device: a cast (mixed precision) or, with
  // offload, the host-to-device copy on the transfer stream (an explicit copy even when
  // host is the device; Note [Offload transfers]). The collective's work keeps it alive.
  stats::MemoryCounter* counter =
      cfg_.offload ? &cfg_.acct->mem.offload_buffers : &cfg_.acct->mem.comm_buffers;
  if (cfg_.offload && cfg_.keep_device_params) {
    // Note [Offload granularity]: the device copy stays; it is copied again only once
    // the host shard changed (an optimizer step on the host, a checkpoint load).
    const int64_t bytes = bytes_of(shard_numel_, cfg_.param_dtype);
    if (!device_params_.defined() || device_params_version_ != shard_._version()) {
      if (!device_params_.defined()) Accounting::alloc(cfg_.acct->mem.device_param_shards, bytes);
      device_params_ = cfg_.transfers->to_device(input, cfg_.param_dtype);
      device_params_version_ = shard_._version();
      cfg_.acct->count_offload(/*to_device=*/true, bytes);
      in.copied = device_params_;
    }
    input = device_params_;
  } else if (cfg_.offload) {
    in.staging = cfg_.transfers->to_device(input, cfg_.param_dtype);
    cfg_.acct->count_offload(/*to_device=*/true, bytes_of(shard_numel_, cfg_.param_dtype));
    input = in.staging;
  } else if (cfg_.param_dtype != cfg_.master_dtype && !fresh) {
    // Note [Gather in place]
    // The cast writes this rank's part of the full buffer itself, and the all-gather
    // takes that part as its input in place (as FSDP2's all_gather_copy_in does): no
    // cast buffer, and no copy of the input into the output (the whole of a gather at
    // world size 1). Every backend allows an input inside its output at its own offset.
    const int64_t rank = cfg_.shard_group->rank();
    TORCH_INTERNAL_ASSERT(shard_numel_ * cfg_.shard_group->size() == padded_);
    at::Tensor own = full_.narrow(0, rank * shard_numel_, shard_numel_);
    own.copy_(input);
    input = own;
  }
  if (in.staging.defined()) {
    in.counter = counter;
    in.held_bytes = bytes_of(shard_numel_, cfg_.param_dtype);
    Accounting::alloc(*counter, in.held_bytes);
  }
  in.input = input;
  return in;
}

void FlatParam::count_grad(bool grow) {
  const at::Tensor& g = shard_.grad();
  // A gradient in the file (Note [NVMe parameters]) holds no memory.
  const int64_t now = g.defined() && !file_ ? static_cast<int64_t>(g.nbytes()) : 0;
  if (now < counted_grad_bytes_) {
    Accounting::release(cfg_.acct->mem.grad_shards, counted_grad_bytes_ - now);
  } else if (now > counted_grad_bytes_ && grow) {
    Accounting::alloc(cfg_.acct->mem.grad_shards, now - counted_grad_bytes_);
  } else {
    return;
  }
  counted_grad_bytes_ = now;
}

// Note [Post-forward slices]
// With ShardingOptions::reshard_after_forward_group_size = k (FSDP2's
// reshard_after_forward=int, ZeRO++ hpZ), a unit resharding after its training forward
// keeps this rank's 1/k of the full buffer: k consecutive ranks of the shard group (one
// node, typically) together hold the full parameters in param_dtype. Backward's gather
// then runs over those k ranks only, out of the slices, with the bits forward computed
// with, so the gradients equal FULL_SHARD's. The padded length is a multiple of the
// shard group size, so of k. A slice lives from the forward's reshard to the backward
// gather (or the next reshard without keep_slice: the end of backward, a new iteration's
// forward, ShardedModel::reshard), so no optimizer step comes between.
void FlatParam::release(bool keep_slice) {
  if (alias_) return;  // aliased: the buffer is the shard itself
  if (!keep_slice || !cfg_.reshard_group) drop_slice();
  if (!full_allocated()) return;
  if (keep_slice && cfg_.reshard_group && !slice_.defined()) {
    const int64_t n = padded_ / cfg_.reshard_group->size();
    slice_ = full_.detach().narrow(0, cfg_.reshard_group->rank() * n, n).clone();
    Accounting::alloc(cfg_.acct->mem.post_forward_params, bytes_of(n, cfg_.param_dtype));
  }
  free_storage(full_);
  Accounting::release(cfg_.acct->mem.gathered_params, full_bytes());
}

void FlatParam::drop_slice() {
  if (!slice_.defined()) return;
  Accounting::release(cfg_.acct->mem.post_forward_params,
                      bytes_of(slice_.numel(), cfg_.param_dtype));
  slice_ = at::Tensor();
}

std::pair<at::Tensor, std::shared_ptr<std::atomic<int64_t>>> FlatParam::copy_out_target() {
  if (!trainable_ || cfg_.param_dtype == cfg_.master_dtype || !shard_.is_cpu()) return {};
  if (!lowp_.defined() && file_) {
    lowp_ = file_->copy_view();  // Note [NVMe parameters]
    lowp_version_ = std::make_shared<std::atomic<int64_t>>(-1);
  } else if (!lowp_.defined()) {
    // Pinned on a GPU build's offload, like the shard: it is the source of the gathers' copies.
    lowp_ = at::empty({shard_numel_}, shard_.options()
                                          .dtype(cfg_.param_dtype)
                                          .requires_grad(false)
                                          .pinned_memory(cfg_.device.is_cuda()));
    lowp_version_ = std::make_shared<std::atomic<int64_t>>(-1);
  }
  return {lowp_, lowp_version_};
}

// Note [NVMe parameters]
// ZeRO-Infinity's offload_param with "device": "nvme" (ShardingOptions::offload_param,
// with offload_optimizer on NVMe too, under kFullShard or kHybridShard). Each flat
// parameter keeps its fp32 master shard, the shard's gradient and, when it computes in
// 16 bits, the optimizer's param_dtype copy of the shard in one file of its own under
// offload_param.nvme_path: regions aligned to 4096 bytes, reserved with fallocate when the
// flat parameter is built (after one collective check that the ranks sharing a disk fit
// together, Note [Shared NVMe disk]), unlinked at once. The tensors the rest of LibTorch
// sees (the shard, a leaf the optimizer steps; its .grad(); the copy) are views of a
// shared mapping of the file, so checkpoints, clipping and state dicts read and write
// them as ordinary tensors, through the page cache.
//
// Training moves the bytes with the file's descriptor instead (O_DIRECT where the file
// system allows it), so the page cache does not fill with the model:
// - a gather reads the copy (or, after a load, the master, cast) into an aligned host
//   buffer, which becomes the all-gather's input like an offloaded shard's copy. The
//   read is queued one unit ahead of the gathers: when the runtime prefetches unit i+1,
//   unit i+2 queues its reads (read_ahead), which run beside unit i's compute; the gather
//   waits for them (and reads anew if the shard or its copy changed since);
// - a reduced gradient shard is written to the file (added to what is there under
//   gradient accumulation, through one aligned buffer of the shard's size). The write is
//   queued and runs beside the next units' backward: CommContext waits for the oldest
//   when more than kGradWritesInFlight are queued, and for all at the end of backward,
//   before anything reads a gradient through the mapping;
// - FusedAdamW streams masters and gradients with the moments through its three slots
//   (Note [NVMe optimizer state]) and writes the masters and the copy back in the same pass.
// On a GPU those host buffers are pinned: disk -> pinned host -> device for each gather (the
// host-to-device copy on the transfer stream, Note [Offload transfers]) and device ->
// pinned host -> disk for each gradient.
// The kernel's page cache keeps the mapping and those transfers coherent: an O_DIRECT read
// writes dirty mapped pages back first, an O_DIRECT write invalidates them. The arithmetic
// is the in-memory engine's, on the same bits in the same order: training equals
// offload_param = cpu bit for bit.
//
// Host memory per rank is then the buffers and what computes, not the model: the gathered
// units (at most max_gathered_units + 1 full flat parameters in param_dtype), their flat
// gradients awaiting reduction (comm_buffers), one shard-sized read or gradient buffer per
// flat parameter in flight, kGradWritesInFlight gradients' writes and one unit's read
// ahead (offload_buffers), FusedAdamW's buffer_bytes,
// and the activations. MemoryStats::sharded_params and grad_shards stay 0; nvme_params counts the
// files (docs/design.md, "Bigger than memory").
void FlatParam::read_ahead() {
  if (!file_ || full_allocated() || slice_.defined() || shard_numel_ == 0) return;
  const bool fresh = lowp_.defined() && lowp_version_->load() == shard_._version();
  file_->read_ahead(fresh, shard_._version());
}

void FlatParam::store_grad(const at::Tensor& grad) {
  TORCH_INTERNAL_ASSERT(file_ && grad.numel() == shard_numel_);
  at::NoGradGuard no_grad;
  const bool first = !shard_.grad().defined();
  file_->store_grad(grad, first);  // waits first for an earlier gradient's write, to add to
  if (first) {
    shard_.mutable_grad() = file_->grad_view();
  } else {
    shard_.mutable_grad().unsafeGetTensorImpl()->bump_version();
  }
}

void FlatParam::settle_grad_write() {
  if (file_) file_->settle_grad_write();
}

void FlatParam::visit_grad(bool write, const std::function<void(at::Tensor&)>& fn) {
  at::Tensor g = shard_.grad();
  if (!file_) {
    fn(g);
    return;
  }
  file_->settle_grad_write();
  at::Tensor host = file_->read_grad();
  fn(host);
  if (!write) return;
  file_->write_grad(host);
  g.unsafeGetTensorImpl()->bump_version();
}

// Note [Writes the version counter misses]
// Persistent units (kZero2, kZero1, persistence_threshold_numel) keep their full
// parameters across optimizer steps and gather again once the shards changed. The
// version counter sees in-place writes to the shard itself (FusedAdamW, torch::optim::AdamW)
// but not those through Tensor::data(), whose result counts its own versions: LibTorch's
// SGD steps that way, and so does a program that copies weights in through .data(). So
// the check also compares this rank's part of the full buffer with what a gather of the
// shard would put there now: the shard (or the optimizer's param_dtype copy, while fresh)
// in param_dtype, quantized and dequantized as the gather would under qwZ. That costs a
// read of the shard per unit and forward. A rank may see a change where another does not
// (its part changed, theirs not), so the runtime agrees over the shard group before
// regathering (Runtime::pre_forward). Host shards (offload) and parameter files are
// stepped by FusedAdamW, which bumps the version, and are not read here.
bool FlatParam::changed_since_gather() const {
  if (alias_ || !full_allocated()) return false;
  if (stale()) return true;
  if (cfg_.offload || file_ || shard_numel_ == 0) return false;
  at::NoGradGuard no_grad;
  const bool fresh = lowp_.defined() && lowp_version_->load() == shard_._version();
  at::Tensor expected = fresh ? lowp_ : shard_.detach().to(cfg_.param_dtype);
  if (cfg_.quantize_weights && cfg_.shard_group->size() > 1) {
    const QuantizeSpec& q = *cfg_.quantize_weights;
    expected = dequantize_blocks(quantize_blocks(expected, q.block, q.bits, q.scale_dtype),
                                 cfg_.param_dtype);
  }
  const at::Tensor mine = full_.narrow(0, cfg_.shard_group->rank() * shard_numel_, shard_numel_);
  return !at::equal(mine, expected.to(mine.device()));
}

}  // namespace fsdp::detail
