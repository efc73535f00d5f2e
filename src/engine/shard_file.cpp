#include "shard_file.h"

#include "host_heap.h"
#include "nvme/io_engine.h"
#include "nvme/state_file.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace fsdp::detail {
namespace {

// Not named bytes_of: flat_param.cpp has one, and the unity build compiles both in one unit.
int64_t numel_bytes(int64_t numel, at::ScalarType t) {
  return numel * static_cast<int64_t>(c10::elementSize(t));
}

}  // namespace

ShardFile::Layout ShardFile::layout(int64_t shard_numel, bool trainable,
                                    at::ScalarType master_dtype, at::ScalarType param_dtype) {
  Layout l;
  const int64_t region = nvme::io_round_up(numel_bytes(shard_numel, master_dtype));
  l.grad = region;
  l.copy = region + (trainable ? region : 0);
  const bool copy = trainable && param_dtype != master_dtype;
  l.bytes = l.copy + (copy ? nvme::io_round_up(numel_bytes(shard_numel, param_dtype)) : 0);
  return l;
}

ShardFile::ShardFile(const std::string& dir, const at::Tensor& master, bool trainable,
                     at::ScalarType param_dtype, at::Device device,
                     std::shared_ptr<nvme::IoEngine> io, Accounting* acct)
    : shard_numel_(master.numel()),
      master_dtype_(master.scalar_type()),
      param_dtype_(param_dtype),
      device_(device),
      io_(std::move(io)),
      acct_(acct),
      layout_(layout(shard_numel_, trainable, master_dtype_, param_dtype_)) {
  file_ = std::make_unique<nvme::StateFile>(
      dir, layout_.bytes, "ShardingOptions::offload_param.nvme_path", "parameters");
  at::Tensor host = host_buffer(shard_numel_, master_dtype_);
  host.copy_(master);
  write(host, 0);
  Accounting::alloc(acct_->mem.nvme_params, file_->bytes());
}

ShardFile::~ShardFile() {
  try {
    drop_read();
  } catch (const std::exception&) {
    // A failed read leaves nothing in flight.
  }
  try {
    settle_grad_write();
  } catch (const std::exception&) {
    // Nor does a failed write.
  }
  Accounting::release(acct_->mem.nvme_params, file_->bytes());
}

at::Tensor ShardFile::master_view() const { return file_->view(0, {shard_numel_}, master_dtype_); }
at::Tensor ShardFile::grad_view() const {
  return file_->view(layout_.grad, {shard_numel_}, master_dtype_);
}
at::Tensor ShardFile::copy_view() const {
  return file_->view(layout_.copy, {shard_numel_}, param_dtype_);
}

void ShardFile::read_ahead(bool fresh, int64_t version) {
  if (ahead_.ticket >= 0) return;
  ahead_.buf = host_buffer(shard_numel_, fresh ? param_dtype_ : master_dtype_);
  ahead_.fresh = fresh;
  ahead_.version = version;
  ahead_.ticket = io_->submit(nvme::IoOp::kRead, file_->fd(), ahead_.buf.data_ptr(),
                              nvme::io_round_up(static_cast<int64_t>(ahead_.buf.nbytes())),
                              fresh ? layout_.copy : 0, &file_->path());
}

void ShardFile::drop_read() {
  if (ahead_.ticket < 0) return;
  const int64_t ticket = ahead_.ticket;
  ahead_.ticket = -1;
  at::Tensor buf = std::move(ahead_.buf);  // freed only once the read is over
  io_->wait(ticket);
}

at::Tensor ShardFile::take_read(bool fresh, int64_t version) {
  if (ahead_.ticket >= 0 && ahead_.fresh == fresh && ahead_.version == version) {
    at::Tensor buf = ahead_.buf;
    drop_read();  // waits for the read
    acct_->count_nvme(/*read=*/true, nvme::io_round_up(static_cast<int64_t>(buf.nbytes())));
    for (stats::CommStats* c : {&acct_->comm.step, &acct_->comm.total}) ++c->nvme_reads_ahead;
    return buf;
  }
  drop_read();  // read before the shard or its copy changed: not what is current
  return read(fresh ? layout_.copy : 0, shard_numel_, fresh ? param_dtype_ : master_dtype_);
}

void ShardFile::store_grad(const at::Tensor& grad, bool first) {
  settle_grad_write();  // an earlier gradient of this shard, to add to
  at::Tensor host = first ? host_buffer(shard_numel_, master_dtype_) : read_grad();
  if (first) {
    host.copy_(grad);  // the gradient as it is, as CommContext keeps it in memory
  } else {
    host.add_(grad.to(at::kCPU));  // as CommContext adds in memory
  }
  const int64_t bytes = nvme::io_round_up(static_cast<int64_t>(host.nbytes()));
  if (bytes > 0) {
    grad_write_.ticket = io_->submit(nvme::IoOp::kWrite, file_->fd(), host.data_ptr(), bytes,
                                     layout_.grad, &file_->path());
    grad_write_.buf = host;
    acct_->count_nvme(/*read=*/false, bytes);
  }
}

void ShardFile::settle_grad_write() {
  if (grad_write_.ticket < 0) return;
  const int64_t ticket = std::exchange(grad_write_.ticket, -1);
  at::Tensor buf = std::move(grad_write_.buf);  // freed only once the write is over
  io_->wait(ticket);
}

at::Tensor ShardFile::read_grad() const { return read(layout_.grad, shard_numel_, master_dtype_); }

void ShardFile::write_grad(const at::Tensor& host) const { write(host, layout_.grad); }

at::Tensor ShardFile::host_buffer(int64_t numel, at::ScalarType dtype) const {
  const int64_t bytes = numel_bytes(numel, dtype);
  Accounting* acct = acct_;
  // Note [NVMe parameters]: the buffer comes from LibTorch's host allocator when that
  // hands out blocks aligned for O_DIRECT: on a GPU the pinned one (ATen's host allocator,
  // so disk -> host -> device and back run as DMA without a staging copy in the driver), on
  // the CPU fsdp's block allocator (Note [Host heap]: whole pages, reused by the next read
  // of the same size instead of mapped and faulted in afresh). Otherwise (a small buffer,
  // another host allocator: LibTorch's default aligns to 64 bytes) an aligned buffer of its own.
  const int64_t padded = nvme::io_round_up(std::max<int64_t>(bytes, 1));
  const bool pinned = device_.is_cuda();
  at::Tensor block;
  if (pinned || (host_blocks_installed() && padded >= kLargeBlock))
    block = at::empty({padded}, at::TensorOptions(at::kByte).pinned_memory(pinned));
  if (block.defined() && reinterpret_cast<uintptr_t>(block.data_ptr()) % nvme::kIoAlign == 0) {
    auto* base = static_cast<char*>(block.data_ptr());
    std::memset(base + bytes, 0, static_cast<size_t>(padded - bytes));
    Accounting::alloc(acct->mem.offload_buffers, padded);
    // The deleter holds the block: it returns to its allocator with this tensor
    // (Transfers::to_device keeps a tensor it copies from alive until the copy is done).
    return at::from_blob(
        base, {numel},
        [block, acct, padded](void*) { Accounting::release(acct->mem.offload_buffers, padded); },
        at::TensorOptions(dtype));
  }
  block = at::Tensor();  // an unaligned pinned block: back to its cache
  auto buf = std::make_shared<nvme::AlignedBuffer>(bytes);
  if (buf->bytes() > bytes)
    std::memset(buf->data() + bytes, 0, static_cast<size_t>(buf->bytes() - bytes));
  Accounting::alloc(acct->mem.offload_buffers, buf->bytes());
  return at::from_blob(
      buf->data(), {numel},
      [buf, acct](void*) { Accounting::release(acct->mem.offload_buffers, buf->bytes()); },
      at::TensorOptions(dtype));
}

at::Tensor ShardFile::read(int64_t offset, int64_t numel, at::ScalarType dtype) const {
  at::Tensor host = host_buffer(numel, dtype);
  const int64_t bytes = nvme::io_round_up(static_cast<int64_t>(host.nbytes()));
  if (bytes > 0)
    nvme::transfer_sync(nvme::IoOp::kRead, file_->fd(), host.data_ptr(), bytes, offset,
                        file_->path());
  acct_->count_nvme(/*read=*/true, bytes);
  return host;
}

void ShardFile::write(const at::Tensor& host, int64_t offset) const {
  const int64_t bytes = nvme::io_round_up(static_cast<int64_t>(host.nbytes()));
  if (bytes == 0) return;
  nvme::transfer_sync(nvme::IoOp::kWrite, file_->fd(), host.data_ptr(), bytes, offset,
                      file_->path());
  acct_->count_nvme(/*read=*/false, bytes);
}

}  // namespace fsdp::detail
