// Datasets whose bytes bypass HDF5 and the page cache (see h5.h, DirectDatasets and
// DirectReader).
#include "../crc32c.h"
#include "h5_detail.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace fsdp::h5 {

// Note [Direct I/O]
// A checkpoint's bytes are almost all a few large fp32 datasets (flat parameters and
// optimizer moments). Written through HDF5, they went through write(2) into the page
// cache: the kernel's copy into fresh page-cache pages was 2.1 of a 2.5 s save on the
// benchmark's virtual machine, and the disk then wrote them again at fsync. So they
// are written as the disk's own raw write would be:
//   - HDF5 writes the file's structure only. Each large dataset is created contiguous,
//     its space allocated at once (H5D_ALLOC_TIME_EARLY) and never filled
//     (H5D_FILL_TIME_NEVER); the file aligns every object of 64 KiB or more to 4 KiB
//     (H5Pset_alignment), so each dataset starts on a page. H5Dget_offset says where.
//   - The bytes go to that offset through a second descriptor opened with O_DIRECT,
//     copied into page-aligned staging buffers (kStagingBuffers of kStagingBytes, kept
//     for the process's next save or load) by the caller's thread while one I/O thread
//     writes the last one. A dataset's unaligned tail (the end of its last page) goes
//     through an ordinary descriptor: O_DIRECT and buffered writes never share a page.
//   - The checksums (Note [Block checksums]) are computed block by block as the bytes
//     are copied, and written as attributes before HDF5 closes the file; the file is
//     then fsynced as before.
// The files are the same HDF5 files, read by h5py and by older readers: only where the
// datasets lie changed, so no format version changes. A file system without O_DIRECT
// (tmpfs) gets ordinary writes through the same path.
//
// Reads (RangeReader) take the same route back: O_DIRECT preads of the file's pages into
// staging buffers, two requests in flight ahead of the caller's copy out of them, so that
// reading one piece overlaps placing and checking the last. A load reads a rank file's
// datasets in the order they were written, so the reader stays between calls that go
// forward in the same file, and the read-ahead of one dataset serves the next;
// end_read_ahead() stops it. FSDP_CHECKPOINT_O_DIRECT=0 turns all of this off.
//
// What HDF5 still reads through the page cache is the structure: object headers, tables,
// attributes. Left to its defaults, it put them in 2 KiB blocks between the datasets, all
// over the file, and a cold load made ~480 small reads per rank spread over 300 MB: 0.43
// of a 1.4 s load at world 4, where every rank reads rank 0's file too. So create_file
// asks for 1 MiB metadata and small-data blocks (H5Pset_meta_block_size,
// H5Pset_small_data_block_size): the structure lies in the file's first 2 MiB, and the
// same load's metadata took 0.08-0.1 s. Nor does a load advise the kernel to read whole
// rank files ahead (layout.cpp's will_read) when their data is read past the cache.

namespace {

constexpr size_t kAlign = 4096;
constexpr size_t kStagingBytes = size_t{8} << 20;
constexpr int kStagingBuffers = 4;

uint64_t align_down(uint64_t x) { return x / kAlign * kAlign; }
uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Page-aligned staging buffers, kept for the process's next save or load. Never
// destroyed: a reader left reading ahead (stream()) gives its buffers back when it ends,
// which may be after static destruction began.
std::mutex pool_mutex;
std::vector<uint8_t*>& pool() {
  static auto* p = new std::vector<uint8_t*>();
  return *p;
}

uint8_t* take_buffer() {
  {
    std::lock_guard<std::mutex> g(pool_mutex);
    if (!pool().empty()) {
      uint8_t* b = pool().back();
      pool().pop_back();
      return b;
    }
  }
  void* p = nullptr;
  TORCH_CHECK(::posix_memalign(&p, kAlign, kStagingBytes) == 0,
              "checkpoint I/O: cannot allocate a staging buffer of ", kStagingBytes, " bytes");
  return static_cast<uint8_t*>(p);
}

void give_buffer(uint8_t* b) {
  std::lock_guard<std::mutex> g(pool_mutex);
  pool().push_back(b);
}

std::string os_error(const char* what, const std::string& path, uint64_t offset, int err) {
  return std::string("cannot ") + what + " " + path + " at byte " + std::to_string(offset) + ": " +
         std::strerror(err);
}

// All `n` bytes, retried over short transfers; "" or the error. A read may stop at the
// end of the file once `need` bytes are in (an O_DIRECT read of a file's last page).
std::string transfer(bool write, int fd, uint8_t* p, size_t n, uint64_t off,
                     const std::string& path, size_t need = SIZE_MAX) {
  const size_t want = std::min(need, n);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = write ? ::pwrite(fd, p + done, n - done, static_cast<off_t>(off + done))
                            : ::pread(fd, p + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return os_error(write ? "write" : "read", path, off + done, errno);
    if (r == 0 && done >= want) return "";
    if (r == 0) {
      return "cannot read " + path + " at byte " + std::to_string(off + done) +
             ": the file ends there (truncated?)";
    }
    done += static_cast<size_t>(r);
  }
  return "";
}

// A staging buffer and the file range it holds.
struct Piece {
  uint8_t* p = nullptr;
  uint64_t off = 0;
  size_t len = 0;
  size_t need = SIZE_MAX;  ///< reads: the bytes the caller uses (the rest may lie past the end)
};

// One I/O thread working through pieces in order; the caller hands them over and takes
// them back (Note [Direct I/O]).
class IoThread {
 public:
  IoThread(bool write, int fd, std::string path)
      : write_(write), fd_(fd), path_(std::move(path)), thread_([this] { run(); }) {}
  ~IoThread() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void submit(Piece p) {
    {
      std::lock_guard<std::mutex> g(m_);
      todo_.push_back(p);
    }
    cv_.notify_all();
  }
  // The oldest piece once its transfer is done; throws the first failure.
  Piece next_done() {
    std::unique_lock<std::mutex> g(m_);
    cv_.wait(g, [&] { return !done_.empty() || !error_.empty(); });
    TORCH_CHECK(error_.empty(), error_, write_ ? ". Is the disk full?" : "");
    Piece p = done_.front();
    done_.pop_front();
    return p;
  }
  // Every piece handed over, once the thread is idle, whether or not it failed.
  std::deque<Piece> drain() {
    std::unique_lock<std::mutex> g(m_);
    cv_.wait(g, [&] { return todo_.empty() && busy_ == 0; });
    return std::exchange(done_, {});
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(m_);
    while (true) {
      cv_.wait(g, [&] { return stop_ || !todo_.empty(); });
      if (todo_.empty()) return;
      Piece p = todo_.front();
      todo_.pop_front();
      ++busy_;
      g.unlock();
      std::string err = transfer(write_, fd_, p.p, p.len, p.off, path_, p.need);
      g.lock();
      --busy_;
      if (!err.empty() && error_.empty()) error_ = err;
      done_.push_back(p);
      cv_.notify_all();
    }
  }
  const bool write_;
  const int fd_;
  const std::string path_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Piece> todo_, done_;
  int busy_ = 0;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;  // last: starts once the rest is built
};

// Opens `path` with O_DIRECT when its file system allows it; -1 otherwise, and always
// under FSDP_CHECKPOINT_O_DIRECT=0 (ordinary reads and writes through the page cache:
// for a file system whose O_DIRECT is slow, and to measure what bypassing it gains).
int open_direct(const std::string& path, int flags) {
  static const bool off = [] {
    const char* v = std::getenv("FSDP_CHECKPOINT_O_DIRECT");
    return v != nullptr && std::string(v) == "0";
  }();
  if (off) return -1;
  const int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC);
  return fd;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Streams bytes to positions of one file (Note [Direct I/O]): whole aligned pages through
// O_DIRECT from staging buffers, on the I/O thread; the rest through `plain`.
class DirectWriter {
 public:
  explicit DirectWriter(const std::string& path)
      : path_(path),
        plain_(::open(path.c_str(), O_WRONLY | O_CLOEXEC)),
        direct_(open_direct(path, O_WRONLY)) {
    TORCH_CHECK(plain_.get() >= 0, os_error("open", path, 0, errno));
    if (direct_.get() >= 0) io_.emplace(true, direct_.get(), path);
  }
  ~DirectWriter() {
    // After a failure too: every buffer goes back to the pool.
    if (io_) {
      for (const Piece& p : io_->drain()) give_buffer(p.p);
    }
    if (cur_.p) give_buffer(cur_.p);
  }
  void put(uint64_t off, const uint8_t* src, size_t n) {
    if (!io_) {
      check(transfer(true, plain_.get(), const_cast<uint8_t*>(src), n, off, path_));
      return;
    }
    while (n > 0) {
      if (cur_.p && off != cur_.off + cur_.len) close_piece();
      if (!cur_.p) {
        const uint64_t a = align_up(off);
        if (a != off) {  // a head before the next page: ordinary write
          const size_t h = std::min<uint64_t>(n, a - off);
          check(transfer(true, plain_.get(), const_cast<uint8_t*>(src), h, off, path_));
          off += h, src += h, n -= h;
          continue;
        }
        cur_ = Piece{free_buffer(), off, 0};
      }
      const size_t c = std::min(n, kStagingBytes - cur_.len);
      std::memcpy(cur_.p + cur_.len, src, c);
      cur_.len += c;
      off += c, src += c, n -= c;
      if (cur_.len == kStagingBytes) submit();
    }
  }
  // Writes what is left and waits for every transfer; throws the first failure.
  void finish() {
    if (!io_) return;
    if (cur_.p) close_piece();
    while (in_hand_ > 0) {
      give_buffer(io_->next_done().p);
      --in_hand_;
    }
  }

 private:
  static void check(const std::string& err) {
    TORCH_CHECK(err.empty(), err, ". Is the disk full?");
  }
  uint8_t* free_buffer() {
    if (in_hand_ < kStagingBuffers) {
      ++in_hand_;
      return take_buffer();
    }
    return io_->next_done().p;  // reused at once: in_hand_ stays
  }
  void submit() {
    io_->submit(cur_);
    cur_ = Piece{};
  }
  // The piece's whole pages go to the I/O thread, its tail through `plain`.
  void close_piece() {
    const size_t whole = align_down(cur_.len);
    if (whole < cur_.len) {
      check(
          transfer(true, plain_.get(), cur_.p + whole, cur_.len - whole, cur_.off + whole, path_));
    }
    cur_.len = whole;
    if (whole > 0) return submit();
    give_buffer(cur_.p);
    --in_hand_;
    cur_ = Piece{};
  }

  std::string path_;
  Fd plain_, direct_;
  std::optional<IoThread> io_;
  Piece cur_;
  int in_hand_ = 0;  // staging buffers taken from the pool: current, queued or done
};

// Reads a file forward from a place (Note [Direct I/O]): the I/O thread fills staging
// buffers with its pages through O_DIRECT, up to kStagingBuffers ahead of the caller, who
// copies out of them, up to the end of the file. A load reads a rank file's datasets in
// the order they were written, so the read-ahead of one dataset serves the next: the
// reader is kept (read_pieces) while the reads go forward.
class RangeReader {
 public:
  RangeReader(const std::string& path, uint64_t off)
      : path_(path),
        fd_(open_direct(path, O_RDONLY)),
        // Without O_DIRECT the caller's buffer is read into directly.
        plain_(fd_.get() < 0 ? ::open(path.c_str(), O_RDONLY | O_CLOEXEC) : -1),
        next_(align_down(off)),
        pos_(off) {
    const int fd = fd_.get() >= 0 ? fd_.get() : plain_.get();
    TORCH_CHECK(fd >= 0, os_error("open", path, 0, errno));
    struct stat st {};
    TORCH_CHECK(::fstat(fd, &st) == 0, os_error("stat", path, 0, errno));
    end_ = static_cast<uint64_t>(st.st_size);
    dev_ = st.st_dev, ino_ = st.st_ino;
    if (fd_.get() < 0) return;
    for (auto& io : io_) io.emplace(false, fd_.get(), path);
    for (int i = 0; i < kStagingBuffers; ++i) spare_.push_back(take_buffer());
  }
  ~RangeReader() {
    for (auto& io : io_) {
      if (io) {
        for (const Piece& p : io->drain()) give_buffer(p.p);
      }
    }
    if (cur_.p) give_buffer(cur_.p);
    for (uint8_t* b : spare_) give_buffer(b);
  }
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;
  // Whether a read of `path` from `off` can go on from here: the same file (not one put
  // in its place since), at or after the caller's place, and within the read-ahead or
  // just past it (the few KiB of metadata between two datasets).
  bool serves(const std::string& path, uint64_t off) const {
    struct stat st {};
    return io_[0] && path == path_ && off >= pos_ && off <= next_ + kGap &&
           ::stat(path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_;
  }
  // Reads ahead up to byte `limit` (at most the file's end).
  void extend(uint64_t limit) {
    limit_ = std::max(limit_, std::min(limit, end_));
    while (!spare_.empty() && next_ < limit_) {
      submit(spare_.back());
      spare_.pop_back();
    }
  }
  // The next `n` bytes from `off` (at or after the caller's place) into `dst`; null `dst`
  // skips them.
  void read(uint64_t off, uint8_t* dst, size_t n) {
    TORCH_CHECK(off + n <= end_, "cannot read ", path_, " at byte ", off,
                ": the file ends at byte ", end_, " (truncated?)");
    if (!io_[0]) {
      check(transfer(false, plain_.get(), dst, n, off, path_));
      return;
    }
    if (off > pos_) read(pos_, nullptr, off - pos_);
    while (n > 0) {
      if (!cur_.p || pos_ >= cur_.off + cur_.len) {
        if (cur_.p) spare_.push_back(cur_.p);
        cur_ = Piece{};
        extend(limit_);  // the freed buffer reads on
        cur_ = io_[taken_++ % io_.size()]->next_done();
      }
      const size_t c = std::min<uint64_t>(n, cur_.off + cur_.len - pos_);
      if (dst) std::memcpy(dst, cur_.p + (pos_ - cur_.off), c), dst += c;
      pos_ += c, n -= c;
    }
  }

 private:
  static void check(const std::string& err) { TORCH_CHECK(err.empty(), err); }
  // Bytes of metadata two consecutive datasets may have between them.
  static constexpr uint64_t kGap = uint64_t{1} << 20;
  void submit(uint8_t* buf) {
    const size_t len = std::min<uint64_t>(kStagingBytes, align_up(end_) - next_);
    io_[given_++ % io_.size()]->submit(
        Piece{buf, next_, len, std::min<uint64_t>(len, end_ - next_)});
    next_ += len;
  }
  std::string path_;
  Fd fd_, plain_;
  // Two reads in flight, one thread each, taking pieces in turn, as the benchmark's raw
  // O_DIRECT read keeps two queued: a disk reads faster with the next request waiting.
  std::array<std::optional<IoThread>, 2> io_;
  size_t given_ = 0, taken_ = 0;  // pieces submitted and taken back, in turn over io_
  // The next page to read, how far to read ahead, the file's end, the caller's place.
  uint64_t next_, limit_ = 0, end_ = 0, pos_;
  std::vector<uint8_t*> spare_;  // staging buffers not reading
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  Piece cur_;
};

// The reader the last read_pieces left, for the next one to go on with. Never destroyed
// at exit (its threads are simply ended with the process): a destructor there could run
// after the buffer pool's.
std::mutex stream_mutex;
std::unique_ptr<RangeReader>& stream() {
  static auto* r = new std::unique_ptr<RangeReader>();
  return *r;
}

}  // namespace

namespace detail {

void read_pieces(const std::string& path, uint64_t off, uint8_t* dst,
                 const std::vector<size_t>& pieces, const std::function<void(size_t)>& after,
                 const std::string& failed) {
  size_t total = 0;
  for (size_t n : pieces) total += n;
  std::lock_guard<std::mutex> g(stream_mutex);
  std::unique_ptr<RangeReader>& r = stream();
  if (r && r->serves(path, off)) {
    // Going on where the last read ended: read ahead past this range too, since the
    // next one likely follows (a load's datasets in the file's order).
    r->extend(off + total + kStagingBytes * 2);
  } else {
    // A read somewhere new (resharding reads ranges of several files): only its range,
    // so that a jump elsewhere wastes no reads.
    r.reset();  // waits for its reads ahead
    r = std::make_unique<RangeReader>(path, off);
    r->extend(off + total);
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    try {
      r->read(off, dst, pieces[i]);
    } catch (const c10::Error& e) {
      r.reset();
      TORCH_CHECK(false, failed, " (", e.what_without_backtrace(), ")");
    }
    try {
      after(i);
    } catch (...) {
      r.reset();
      throw;
    }
    off += pieces[i];
    dst += pieces[i];
  }
}

}  // namespace detail

bool direct_reads(const std::string& path) {
  const int fd = open_direct(path, O_RDONLY);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

void end_read_ahead() {
  std::lock_guard<std::mutex> g(stream_mutex);
  stream().reset();
}

void DirectDatasets::add(hid_t loc, const std::string& name, const void* data, Elem file,
                         const std::vector<int64_t>& shape, const std::string& where) {
  add_segments(loc, name, {Segment{0, numel_of(shape, where, name), data}}, file, shape, where);
}

void DirectDatasets::add_segments(hid_t loc, const std::string& name, std::vector<Segment> segments,
                                  Elem file, const std::vector<int64_t>& shape,
                                  const std::string& where) {
  const int64_t numel = numel_of(shape, where, name);
  int64_t end = 0;
  for (const Segment& s : segments) {
    TORCH_CHECK(s.first >= end && s.count >= 0 && s.first + s.count <= numel,
                "internal: segments of '", name, "' overlap, are out of order or out of range");
    end = s.first + s.count;
  }
  Obj ds = detail::create_dataset(loc, name, file, shape, /*early=*/true, where);
  const size_t elem = H5Tget_size(file_type(file));
  const haddr_t offset = numel > 0 ? H5Dget_offset(ds) : 0;
  TORCH_CHECK(numel == 0 || offset != HADDR_UNDEF, where, ": dataset '", name,
              "' has no place in the file yet (", reason(), ")");
  pending_.push_back(Pending{std::move(ds),
                             std::move(segments),
                             numel,
                             elem,
                             static_cast<uint64_t>(offset),
                             where,
                             name,
                             {}});
}

namespace {

// Calls f(bytes, n) over elements [from, to) of a dataset in order: the segments' bytes,
// and zeros where none covers them.
template <class F>
void for_each_run(const std::vector<DirectDatasets::Segment>& segments, size_t elem, int64_t from,
                  int64_t to, const F& f) {
  static const std::vector<uint8_t> zeros(size_t{64} << 10);
  auto gap = [&](int64_t a, int64_t b) {
    for (size_t n = static_cast<size_t>(b - a) * elem; n > 0;) {
      const size_t k = std::min(n, zeros.size());
      f(zeros.data(), k);
      n -= k;
    }
  };
  int64_t pos = from;
  for (const auto& s : segments) {
    const int64_t a = std::max(pos, s.first), b = std::min(to, s.first + s.count);
    if (a >= b) continue;
    if (a > pos) gap(pos, a);
    f(static_cast<const uint8_t*>(s.data) + static_cast<size_t>(a - s.first) * elem,
      static_cast<size_t>(b - a) * elem);
    pos = b;
  }
  if (pos < to) gap(pos, to);
}

}  // namespace

int64_t DirectDatasets::write_all(const std::string& path) {
  int64_t bytes = 0;
  {
    DirectWriter w(path);
    for (Pending& d : pending_) {
      if (d.numel == 0) continue;
      const detail::Blocks b = detail::blocks_for_write(d.numel, d.elem);
      uint64_t at = d.offset;
      for (int64_t k = 0; k < b.count(); ++k) {
        BlockCrc crc;
        for_each_run(d.segments, d.elem, b.first(k), b.first(k) + b.size(k),
                     [&](const uint8_t* p, size_t n) {
                       w.put(at, p, n);
                       crc.update(p, n);
                       at += n;
                     });
        d.crcs.push_back(crc.value());
      }
      bytes += static_cast<int64_t>(at - d.offset);
    }
    w.finish();
  }
  for (Pending& d : pending_) {
    if (d.numel > 0)
      detail::write_checksums(d.ds, detail::blocks_for_write(d.numel, d.elem), d.crcs, d.where,
                              d.name);
  }
  pending_.clear();
  return bytes;
}

}  // namespace fsdp::h5
