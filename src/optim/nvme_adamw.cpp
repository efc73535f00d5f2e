// FusedAdamW's optimizer state in files (see nvme_adamw.h).
//
// Note [NVMe optimizer state]
// ZeRO-Infinity's offload_optimizer with "device": "nvme". Unless offload_param is nvme
// too (Note [NVMe parameters] in src/engine/flat_param.cpp: then masters, gradients and
// copies are streamed through the same slots), the fp32 shards and their gradients stay
// in host memory, as with offload_optimizer = cpu; Adam's exp_avg and exp_avg_sq (8 bytes per
// trainable shard element) live in one file per optimizer and rank under OffloadConfig::nvme_path,
// reserved with fallocate when the optimizer is built, so a full disk fails then and not
// mid-training. Each tensor has its own region, aligned to 4096 bytes, for O_DIRECT.
//
// A step streams the moments of every parameter it updates as one sequence of chunks of
// chunk_ elements (OffloadConfig::buffer_bytes / 24: three slots of two fp32 moments; no
// more than the largest tensor stepped, rounded up to 1024, so that a small model does not
// allocate a buffer it never fills).
// While the kernel steps chunk k in slot k % 3, the read of chunk k + 1 and the write of
// chunk k - 1 are in flight (io_uring, or the thread pool); chunk k + 1's read waits only
// for the write of chunk k - 2, which held its slot. So host memory is bounded by
// buffer_bytes whatever the model's size, and the disk is kept busy in both directions
// while the CPU computes. The kernel is FusedAdamW's own (adamw_update), on the same
// elements with the same constants; it works element by element, so chunking changes
// no bit: results equal in-memory FusedAdamW exactly.
//
// Checkpoints see ordinary AdamW state: the state map holds, for each parameter, its
// step and exp_avg / exp_avg_sq as tensors over a shared mapping of the file, which
// read the file only when touched (a checkpoint save reads them, the page cache then
// serves; O_DIRECT writes invalidate it). A checkpoint load replaces those tensors with
// in-memory ones; the next step writes them to the file and puts the views back
// (adopt), so host memory holds the loaded state only between the load and that step.
//
// Note [Shared NVMe disk]
// The ranks of a machine usually share its NVMe disk, and each reserves its own file. Each
// checking its own bytes against the free space alone let every rank pass and the last
// to reserve fail (or, with a lucky order, fill the disk). So, given the model's process
// group, the ranks first exchange (machine, file system, bytes needed, bytes free) with
// one all-gather: the machine is the boot id's hash (containers and network namespaces of
// one kernel share it), the file system st_dev. The ranks of each (machine, file system)
// need the sum of their bytes there; when a disk shared by two or more ranks lacks it,
// every rank of the job fails with the same message, naming those ranks, the bytes they
// need together and the bytes free, so no rank is left waiting in a collective. A rank
// whose directory cannot be used joins the exchange anyway (free bytes -1), then fails
// with its own error while the others name it.
#include "nvme_adamw.h"

#include "nvme/io_engine.h"
#include "nvme/state_file.h"
#include "parallel_range.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace fsdp::detail {

NvmeAdamState::NvmeAdamState(const OffloadConfig& config, const std::vector<torch::Tensor>& params,
                             const std::string& field, const ProcessGroup* group,
                             int64_t param_buffer_bytes) {
  const std::string buf_field = field.substr(0, field.rfind('.')) + ".buffer_bytes";
  // Note [NVMe parameters]: shards that are views of the engine's parameter files stream
  // through the same slots (master, gradient and the param_dtype copy beside the moments).
  for (const auto& p : params) {
    if (p.defined() && p.numel() > 0 &&
        nvme::find_file(p.data_ptr(), 4 * p.numel()).file != nullptr)
      stream_params_ = true;
  }
  // The largest tensor stepped: a chunk larger than it would be allocated and never used.
  int64_t largest = 1;
  for (const auto& p : params) largest = std::max<int64_t>(largest, p.defined() ? p.numel() : 0);
  if (stream_params_) {
    // Note [NVMe parameters]: the slots hold 18 bytes per element instead of 8, so the
    // parameters' own buffer (offload_param.buffer_bytes) joins the optimizer's, and the
    // chunks (and the disk's transfers) stay near the size they have without parameters.
    const int64_t buffer = config.buffer_bytes + std::max<int64_t>(0, param_buffer_bytes);
    constexpr int64_t kLeast = 3 * (kParamSlotBytes * 2048 + kParamSlotExtra);
    TORCH_CHECK(buffer >= kLeast, buf_field, "=", config.buffer_bytes,
                (param_buffer_bytes > 0
                     ? " with offload_param.buffer_bytes=" + std::to_string(param_buffer_bytes)
                     : std::string()),
                " is too small: with offload_param=nvme the optimizer streams three chunks of "
                "the masters, gradients, exp_avg, exp_avg_sq and 16-bit copies through it, at "
                "least 2048 elements each (",
                kLeast, " bytes); use 64 MiB (the default)");
    chunk_ = (buffer / 3 - kParamSlotExtra) / kParamSlotBytes / 2048 * 2048;
    chunk_ = std::min(chunk_, (largest + 2047) / 2048 * 2048);
  } else {
    TORCH_CHECK(config.buffer_bytes >= 24 * 1024, buf_field, "=", config.buffer_bytes,
                " is too small: the optimizer streams three chunks of exp_avg and exp_avg_sq "
                "through it, at least 1024 elements each (24576 bytes); use 64 MiB (the default)");
    chunk_ = config.buffer_bytes / 24 / 1024 * 1024;
    chunk_ = std::min(chunk_, (largest + 1023) / 1024 * 1024);
  }
  int64_t bytes = 0, elements = 0;
  for (const auto& p : params) {
    if (regions_.count(p.unsafeGetTensorImpl())) continue;
    TORCH_CHECK(p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous(),
                "NVMe optimizer state needs contiguous fp32 CPU parameters (the engine's shards "
                "with offload_optimizer); got ",
                p.toString());
    Region r;
    r.numel = p.numel();
    r.m = bytes;
    bytes += nvme::io_round_up(4 * r.numel);
    r.v = bytes;
    bytes += nvme::io_round_up(4 * r.numel);
    elements += r.numel;
    regions_.emplace(p.unsafeGetTensorImpl(), r);
  }
  if (group != nullptr && group->size() > 1) {
    nvme::check_shared_free_space(*group, config.nvme_path, field, bytes,
                                  "its optimizer state (exp_avg and exp_avg_sq, 8 bytes for "
                                  "each trainable shard element, each tensor aligned to 4096 "
                                  "bytes)",
                                  "its optimizer state");
  }
  nvme::check_nvme_dir(config.nvme_path, field, bytes,
                       "the optimizer state of this rank (exp_avg and exp_avg_sq, 8 bytes "
                       "for each of its " +
                           std::to_string(elements) +
                           " trainable shard elements, each tensor aligned to 4096 bytes)");
  file_ = std::make_unique<nvme::StateFile>(config.nvme_path, bytes, field);
  io_ = nvme::make_io_engine(16);
  buffers_ = std::make_unique<nvme::AlignedBuffer>(3 * slot_bytes());
}

NvmeAdamState::~NvmeAdamState() = default;

const char* NvmeAdamState::io_engine_name() const { return io_->name(); }
bool NvmeAdamState::direct_io() const { return file_->direct(); }

NvmeAdamState::Region& NvmeAdamState::region(const torch::Tensor& p) {
  auto it = regions_.find(p.unsafeGetTensorImpl());
  TORCH_CHECK(it != regions_.end(), "FusedAdamW with NVMe state: a parameter (", p.toString(),
              " of ", p.numel(),
              " elements) was not among those the optimizer was built with, so it has no room "
              "in the state file. Build the optimizer over every parameter it will step");
  return it->second;
}

void NvmeAdamState::write_through(const float* src, int64_t numel, int64_t offset) {
  char* buf = buffers_->data();
  for (int64_t b = 0; b < numel; b += chunk_) {
    const int64_t n = std::min(chunk_, numel - b);
    const int64_t bytes = nvme::io_round_up(4 * n);
    std::memcpy(buf, src + b, 4 * n);
    std::memset(buf + 4 * n, 0, bytes - 4 * n);
    io_->wait(
        io_->submit(nvme::IoOp::kWrite, file_->fd(), buf, bytes, offset + 4 * b, &file_->path()));
  }
}

std::unique_ptr<torch::optim::AdamWParamState> NvmeAdamState::fresh_state(const torch::Tensor& p) {
  Region& r = region(p);
  if (!r.zero) {  // a state dropped and begun again: its region holds old moments
    const std::vector<float> zeros(static_cast<size_t>(std::min(chunk_, r.numel)), 0.0f);
    for (int64_t off : {r.m, r.v}) {
      for (int64_t b = 0; b < r.numel; b += chunk_)
        write_through(zeros.data(), std::min(chunk_, r.numel - b), off + 4 * b);
    }
  }
  r.zero = false;
  auto st = std::make_unique<torch::optim::AdamWParamState>();
  st->step(0);
  st->exp_avg(file_->view(r.m, p.sizes()));
  st->exp_avg_sq(file_->view(r.v, p.sizes()));
  return st;
}

void NvmeAdamState::adopt(const torch::Tensor& p, torch::optim::AdamWParamState& st) {
  Region& r = region(p);
  r.zero = false;
  for (int which = 0; which < 2; ++which) {
    const int64_t off = which == 0 ? r.m : r.v;
    const torch::Tensor& t = which == 0 ? st.exp_avg() : st.exp_avg_sq();
    if (t.defined() && t.data_ptr() == file_->address(off)) continue;
    TORCH_CHECK(!t.defined() || t.numel() == r.numel, "FusedAdamW with NVMe state: the ",
                which == 0 ? "exp_avg" : "exp_avg_sq", " given for a parameter of ", r.numel,
                " elements has ", t.defined() ? t.numel() : 0);
    if (t.defined()) {
      const torch::Tensor c = t.to(torch::kCPU, torch::kFloat).contiguous();
      write_through(c.data_ptr<float>(), r.numel, off);
    } else {
      const std::vector<float> zeros(static_cast<size_t>(std::min(chunk_, r.numel)), 0.0f);
      for (int64_t b = 0; b < r.numel; b += chunk_)
        write_through(zeros.data(), std::min(chunk_, r.numel - b), off + 4 * b);
    }
    if (which == 0) {
      st.exp_avg(file_->view(off, p.sizes()));
    } else {
      st.exp_avg_sq(file_->view(off, p.sizes()));
    }
  }
}

void NvmeAdamState::queue(const torch::Tensor& p, torch::Tensor g, const AdamWConstants& c,
                          uint16_t* out, CopyOutDtype kind,
                          std::shared_ptr<std::atomic<int64_t>> written) {
  jobs_.push_back(Job{p, std::move(g), &region(p), c, out, kind, std::move(written)});
}

int64_t NvmeAdamState::slot_bytes() const {
  // m, v; with streamed parameters also p, g and the 16-bit copy, each with two pages of
  // room for a range that starts and ends inside pages.
  return stream_params_ ? kParamSlotBytes * chunk_ + kParamSlotExtra : 8 * chunk_;
}

// Note [NVMe parameters]: bytes [s, e) of a parameter file between it and a slot. A
// tensor that is a whole region of the file (a shard, its gradient, its copy) moves by
// O_DIRECT alone, rounded up to whole pages (the region's own padding). A part of one (a
// parameter group's segment) shares its first and last pages with its neighbours, which
// the same step may be updating: its whole pages go by O_DIRECT and the partial pages at
// either end through the file's page mapping (StateFile::page_access, which reads only the
// pages it touches; the page cache keeps both coherent), so no
// transfer carries a neighbour's stale bytes. `buf` is page-aligned; byte s lands at
// buf + s % kIoAlign. Returns the O_DIRECT ticket, or -1.
int64_t NvmeAdamState::move(nvme::IoOp op, const nvme::FileSpan& f, bool whole, int64_t s,
                            int64_t e, char* buf) {
  constexpr int64_t A = nvme::kIoAlign;
  const std::string* what = &f.file->path();
  const int fd = f.file->fd();
  if (whole) {
    const int64_t bytes = nvme::io_round_up(e - s);
    io_bytes_ += bytes;
    return io_->submit(op, fd, buf, bytes, f.offset + s, what);
  }
  s += f.offset;
  e += f.offset;
  char* data = buf + s % A;  // byte s
  int64_t as = (s + A - 1) / A * A, ae = e / A * A;
  if (as >= ae) as = ae = e;  // no whole page: all through the mapping
  char* map = f.file->page_access(0);
  auto copy = [&](int64_t from, int64_t to) {
    if (to <= from) return;
    if (op == nvme::IoOp::kRead) {
      std::memcpy(data + (from - s), map + from, static_cast<size_t>(to - from));
    } else {
      std::memcpy(map + from, data + (from - s), static_cast<size_t>(to - from));
    }
  };
  copy(s, std::min(as, e));
  copy(std::max(ae, as), e);
  if (as >= ae) return -1;
  io_bytes_ += ae - as;
  return io_->submit(op, fd, data + (as - s), ae - as, as, what);
}

std::vector<NvmeAdamState::Places> NvmeAdamState::place_jobs() const {
  std::vector<Places> places(jobs_.size());
  for (size_t i = 0; i < jobs_.size(); ++i) {
    const Job& j = jobs_[i];
    const int64_t n = j.region->numel;
    if (!stream_params_ || n == 0) continue;
    Places& pl = places[i];
    pl.p = nvme::find_file(j.p.data_ptr(), 4 * n);
    pl.g = nvme::find_file(j.g.data_ptr(), 4 * n);
    if (j.out != nullptr) pl.out = nvme::find_file(j.out, 2 * n);
    auto aligned = [](const nvme::FileSpan& f) {
      return f.file == nullptr || f.offset % nvme::kIoAlign == 0;
    };
    pl.whole = j.p.storage_offset() == 0 && j.p.nbytes() == j.p.storage().nbytes() &&
               aligned(pl.p) && aligned(pl.g) && aligned(pl.out);
  }
  return places;
}

char* NvmeAdamState::stream_at(size_t k, int which) const {
  // Slot k % 3, page-aligned streams: m, v, then (streamed parameters) p, g and the
  // 16-bit copy, each with two pages of room (move()).
  const int64_t room = 2 * nvme::kIoAlign;
  const int64_t offsets[kStreams] = {0, 4 * chunk_, 8 * chunk_, 12 * chunk_ + room,
                                     16 * chunk_ + 2 * room};
  return buffers_->data() + static_cast<int64_t>(k % 3) * slot_bytes() + offsets[which];
}

char* NvmeAdamState::data_at(size_t k, int which, const nvme::FileSpan& f, int64_t begin, int esize,
                             bool whole) const {
  return stream_at(k, which) + (whole ? 0 : (f.offset + esize * begin) % nvme::kIoAlign);
}

NvmeAdamState::Tickets NvmeAdamState::issue(nvme::IoOp op, const Chunk& ch, size_t k) {
  const int64_t bytes = nvme::io_round_up(4 * ch.n), at = 4 * ch.begin;
  Tickets t;
  t.id[0] =
      io_->submit(op, file_->fd(), stream_at(k, 0), bytes, ch.job->region->m + at, &file_->path());
  t.id[1] =
      io_->submit(op, file_->fd(), stream_at(k, 1), bytes, ch.job->region->v + at, &file_->path());
  io_bytes_ += 2 * bytes;
  const Places& pl = *ch.at;
  auto stream = [&](int which, const nvme::FileSpan& f, int esize) {
    const int64_t s = esize * ch.begin, e = s + esize * ch.n;
    t.id[which] = move(op, f, pl.whole, s, e, stream_at(k, which));
  };
  if (pl.p.file) stream(2, pl.p, 4);
  // The gradient is only read; the 16-bit copy only written.
  if (pl.g.file && op == nvme::IoOp::kRead) stream(3, pl.g, 4);
  if (pl.out.file && op == nvme::IoOp::kWrite) stream(4, pl.out, 2);
  return t;
}

void NvmeAdamState::wait(Tickets& t) {
  for (int64_t& id : t.id) {
    if (id < 0) continue;
    const int64_t ticket = id;
    id = -1;
    io_->wait(ticket);
  }
}

void NvmeAdamState::step_chunk(const Chunk& ch, size_t k, KernelIsa isa) {
  const Job& j = *ch.job;
  const Places& pl = *ch.at;
  auto* mp = reinterpret_cast<float*>(stream_at(k, 0));
  auto* vp = reinterpret_cast<float*>(stream_at(k, 1));
  float* pp = pl.p.file ? reinterpret_cast<float*>(data_at(k, 2, pl.p, ch.begin, 4, pl.whole))
                        : j.p.data_ptr<float>() + ch.begin;
  const float* gp = pl.g.file
                        ? reinterpret_cast<const float*>(data_at(k, 3, pl.g, ch.begin, 4, pl.whole))
                        : j.g.data_ptr<float>() + ch.begin;
  uint16_t* out = nullptr;
  if (pl.out.file) {
    out = reinterpret_cast<uint16_t*>(data_at(k, 4, pl.out, ch.begin, 2, pl.whole));
  } else if (j.out != nullptr) {
    out = j.out + ch.begin;
  }
  // Over the intra-op threads (parallel_range.h: at::parallel_for would run on one).
  for_each_range(torch::from_blob(mp, {ch.n}, torch::kFloat), [&](int64_t b, int64_t e) {
    adamw_update(isa, j.c, pp + b, gp + b, mp + b, vp + b, e - b, out ? out + b : nullptr, j.kind);
  });
}

void NvmeAdamState::run(KernelIsa isa) {
  // Where each job's parameter, gradient and 16-bit copy live: in a parameter file
  // (streamed through the slots, Note [NVMe parameters]) or in memory (used in place).
  const std::vector<Places> places = place_jobs();
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < jobs_.size(); ++i) {
    const Job& j = jobs_[i];
    for (int64_t b = 0; b < j.region->numel; b += chunk_)
      chunks.push_back(Chunk{&j, &places[i], b, std::min(chunk_, j.region->numel - b)});
  }
  const size_t k_end = chunks.size();
  std::vector<Tickets> reads(k_end), writes(k_end);
  try {
    if (k_end > 0) reads[0] = issue(nvme::IoOp::kRead, chunks[0], 0);
    for (size_t k = 0; k < k_end; ++k) {
      if (k + 1 < k_end) {
        if (k >= 2) wait(writes[k - 2]);  // slot (k + 1) % 3 held chunk k - 2
        reads[k + 1] = issue(nvme::IoOp::kRead, chunks[k + 1], k + 1);
      }
      wait(reads[k]);
      step_chunk(chunks[k], k, isa);
      writes[k] = issue(nvme::IoOp::kWrite, chunks[k], k);
    }
    for (auto& w : writes) wait(w);
  } catch (...) {
    // Nothing may still write into the buffers once this returns.
    for (auto* ts : {&reads, &writes}) {
      for (auto& t : *ts) {
        try {
          wait(t);
        } catch (...) {
        }
      }
    }
    jobs_.clear();
    throw;
  }
  for (const Job& j : jobs_) {
    // Written through raw pointers: tell the version counter, as in-place ops do.
    j.p.unsafeGetTensorImpl()->bump_version();
    if (j.written) j.written->store(j.p._version());
  }
  jobs_.clear();
}

}  // namespace fsdp::detail
