// The thread-pool I/O engine (see io_engine.h): the fallback without io_uring.
#include "io_engine.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace fsdp::detail::nvme {

void transfer_sync(IoOp op, int fd, void* buf, int64_t bytes, int64_t offset,
                   const std::string& what) {
  auto* p = static_cast<char*>(buf);
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t r = op == IoOp::kRead ? ::pread(fd, p + done, bytes - done, offset + done)
                                        : ::pwrite(fd, p + done, bytes - done, offset + done);
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "NVMe offload: ", op == IoOp::kRead ? "reading " : "writing ", bytes,
                " bytes at offset ", offset, " of ", what, " failed: ",
                r == 0 ? std::string("unexpected end of file") : std::string(std::strerror(errno)),
                kCheckTheDisk);
    done += r;
  }
}

namespace {

class ThreadEngine final : public IoEngine {
 public:
  explicit ThreadEngine(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    queued_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int64_t submit(IoOp op, int fd, void* buf, int64_t bytes, int64_t offset,
                 const std::string* what) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_++;
    queue_.push_back(Job{id, op, fd, buf, bytes, offset, what});
    queued_.notify_one();
    return id;
  }

  void wait(int64_t ticket) override {
    std::unique_lock<std::mutex> lock(mu_);
    finished_.wait(lock, [&] { return done_.count(ticket) != 0; });
    std::string error = std::move(done_[ticket]);
    done_.erase(ticket);
    TORCH_CHECK(error.empty(), error);
  }

  const char* name() const override { return "threads"; }

 private:
  struct Job {
    int64_t id;
    IoOp op;
    int fd;
    void* buf;
    int64_t bytes, offset;
    const std::string* what;
  };

  void work() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> lock(mu_);
        queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        j = queue_.front();
        queue_.pop_front();
      }
      std::string error;
      try {
        transfer_sync(j.op, j.fd, j.buf, j.bytes, j.offset, *j.what);
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_[j.id] = std::move(error);
      }
      finished_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable queued_, finished_;
  std::deque<Job> queue_;
  std::unordered_map<int64_t, std::string> done_;  ///< ticket -> error ("" when fine)
  int64_t next_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_engine(int threads) {
  return std::make_unique<ThreadEngine>(threads);
}

std::unique_ptr<IoEngine> make_io_engine(unsigned depth) {
  const char* env = std::getenv("FSDP_NVME_IO");
  const std::string forced = env ? env : "";
  TORCH_CHECK(forced.empty() || forced == "threads" || forced == "io_uring",
              "FSDP_NVME_IO=", forced, " is unknown; use io_uring, threads, or leave it unset");
  if (forced != "threads") {
    std::string why;
    if (auto e = make_uring_engine(depth, &why)) return e;
    TORCH_CHECK(forced.empty(), "FSDP_NVME_IO=io_uring: io_uring is unavailable here: ", why);
  }
  // Read ahead and write behind: two of each in flight (m and v of one chunk).
  return make_thread_engine(4);
}

}  // namespace fsdp::detail::nvme
