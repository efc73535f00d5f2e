// The io_uring I/O engine (see io_engine.h), through liburing. Built only when CMake
// found liburing (FSDP_HAVE_LIBURING); no_uring_io_engine.cpp stands in otherwise.
#include "io_engine.h"

#include <c10/util/Exception.h>

#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <unordered_map>

namespace fsdp::detail::nvme {
namespace {

class UringEngine final : public IoEngine {
 public:
  /// 0, or the negative errno of io_uring_queue_init (then the object is unusable).
  int init(unsigned depth) {
    const int r = io_uring_queue_init(depth, &ring_, 0);
    ready_ = r == 0;
    return r;
  }
  ~UringEngine() override {
    if (!ready_) return;
    // Drain what is still in flight: the kernel must not write into freed buffers.
    while (!pending_.empty()) {
      try {
        reap_one();
      } catch (...) {
        break;
      }
    }
    io_uring_queue_exit(&ring_);
  }

  int64_t submit(IoOp op, int fd, void* buf, int64_t bytes, int64_t offset,
                 const std::string* what) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // queue full: make room
      reap_one();
      sqe = io_uring_get_sqe(&ring_);
    }
    const int64_t id = next_++;
    if (op == IoOp::kRead) {
      io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(bytes), offset);
    } else {
      io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(bytes), offset);
    }
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(id));
    pending_.emplace(id, Pending{op, fd, buf, bytes, offset, what});
    const int r = io_uring_submit(&ring_);
    TORCH_CHECK(r >= 0, "NVMe offload: io_uring_submit failed: ", std::strerror(-r));
    return id;
  }

  void wait(int64_t ticket) override {
    while (done_.count(ticket) == 0) reap_one();
    std::string error = std::move(done_[ticket]);
    done_.erase(ticket);
    TORCH_CHECK(error.empty(), error);
  }

  const char* name() const override { return "io_uring"; }

 private:
  struct Pending {
    IoOp op;
    int fd;
    void* buf;
    int64_t bytes, offset;
    const std::string* what;
  };

  // Takes one completion. A short transfer (the end of a file without O_DIRECT's
  // padding, a signal) finishes synchronously: rare, and correct either way.
  void reap_one() {
    io_uring_cqe* cqe = nullptr;
    int r = io_uring_wait_cqe(&ring_, &cqe);
    while (r == -EINTR) r = io_uring_wait_cqe(&ring_, &cqe);
    TORCH_CHECK(r == 0, "NVMe offload: io_uring_wait_cqe failed: ", std::strerror(-r));
    const auto id = static_cast<int64_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    auto it = pending_.find(id);
    TORCH_INTERNAL_ASSERT(it != pending_.end(), "io_uring completion of an unknown ticket");
    const Pending p = it->second;
    pending_.erase(it);
    std::string error;
    try {
      if (res < 0) {
        TORCH_CHECK(false, "NVMe offload: ", p.op == IoOp::kRead ? "reading " : "writing ", p.bytes,
                    " bytes at offset ", p.offset, " of ", *p.what,
                    " failed: ", std::strerror(-res), kCheckTheDisk);
      }
      if (res < p.bytes)
        transfer_sync(p.op, p.fd, static_cast<char*>(p.buf) + res, p.bytes - res, p.offset + res,
                      *p.what);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    done_[id] = std::move(error);
  }

  io_uring ring_{};
  bool ready_ = false;
  std::unordered_map<int64_t, Pending> pending_;
  std::unordered_map<int64_t, std::string> done_;  ///< ticket -> error ("" when fine)
  int64_t next_ = 0;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(unsigned depth, std::string* why) {
  auto e = std::make_unique<UringEngine>();
  const int r = e->init(depth);
  if (r < 0) {
    if (why) *why = std::string("io_uring_queue_init: ") + std::strerror(-r);
    return nullptr;
  }
  return e;
}

}  // namespace fsdp::detail::nvme
