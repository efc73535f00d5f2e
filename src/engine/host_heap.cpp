// Note [Host heap]
// ~~~~~~~~~~~~~~~~
// Where training lives in host memory (a CPU device, or offload_optimizer), the process's
// resident memory is what a memory limit, a cgroup or the OOM killer sees, so it must stay
// near what the engine and LibTorch hold. With glibc's defaults it does not:
//   - glibc serves a block of at least its mmap threshold (128 KiB at start) with its own
//     mmap, returned to the kernel when freed;
//   - but freeing such a block raises the threshold to the block's size (up to 32 MiB on
//     64-bit), and from then on blocks below it come from the heap (brk, or a thread's
//     arena). The per-unit buffers of every step (gathered parameters, their casts, flat
//     gradients) and LibTorch's activations are such blocks. The heap fragments as they
//     come and go, and keeps their pages.
// Measured (docs/benchmarks.md, "Host memory without allocator tuning"): a 114M-parameter
// GPT at world 2 with parameters and optimizer state on NVMe peaked at 2526 MiB for the
// job with glibc's defaults, against 978 MiB with MALLOC_MMAP_THRESHOLD_=65536, the
// variable the memory-limit tests used to set.
//
// That variable alone is no answer: every block of 64 KiB or more is then mapped afresh
// each time it is allocated, and its pages faulted in and cleared by the kernel. The same
// runs took 68% (the NVMe GPT above) and 77% (an 8-block GPT of width 512 in memory)
// longer per step.
//
// So where the shards live in host memory, fully_shard and make_sharded install a block
// allocator as LibTorch's CPU allocator, once per process:
//   - a block of kLargeBlock (64 KiB) or more is mapped for itself (mmap; madvise'd for
//     transparent huge pages from 2 MiB) and never shares pages with another;
//   - a freed block is kept for reuse by an allocation of the same (page-rounded) size,
//     which a training loop makes every step: no fault, no clearing;
//   - what is kept is bounded: the bytes in live blocks plus the bytes kept never exceed
//     the most bytes that were ever live at once (peak_live_bytes). Before mapping a new
//     block the oldest kept ones are unmapped until that holds. So the allocator's resident
//     memory is at most the peak of what tensors held, as without any cache, and at that
//     peak nothing is kept;
//   - smaller blocks go to LibTorch's default allocator (glibc), whose mmap threshold is
//     also fixed at 64 KiB (mallopt M_MMAP_THRESHOLD), so that the non-tensor buffers of
//     64 KiB and more (Gloo's, HDF5's) do not raise it either.
// Why not the alternatives: a pool of the engine's own buffers was built and measured
// before (docs/benchmarks.md, the FSDP2 comparison's kernel-time finding): memory held for
// the engine is memory glibc cannot hand to LibTorch's activations, and glibc's threshold
// rises all the same when LibTorch frees an activation; malloc_trim returns whole free
// pages but walks every arena each call, and the heap still fragments between calls.
//
// It applies only where the shards live in host memory; GPU training keeps LibTorch's
// allocator. The user's choice wins: MALLOC_MMAP_THRESHOLD_ in the environment or glibc's
// malloc.mmap_threshold tunable (glibc applied them before main), or a CPU allocator the
// program installed (c10::SetCPUAllocator with a priority above 0), leaves everything as it
// is, and FSDP_HOST_ALLOCATOR=glibc asks for LibTorch's and glibc's defaults.
#include "host_heap.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp::detail {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

class BlockAllocator final : public c10::Allocator {
 public:
  explicit BlockAllocator(c10::Allocator* small) : small_(small) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < static_cast<size_t>(kLargeBlock)) return small_->allocate(n);
    void* p = take(round_up(n));
    return {p, p, &BlockAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &BlockAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  HostBlockStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // Unmaps every kept block.
  void release_kept() {
    std::vector<std::pair<size_t, void*>> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!kept_.empty()) evicted.push_back(evict_oldest());
      stats_.unmapped += static_cast<int64_t>(evicted.size());
    }
    for (const auto& [n, p] : evicted) munmap(p, n);
  }

  static std::atomic<BlockAllocator*> instance;

 private:
  using Kept = std::list<std::pair<size_t, void*>>;  // oldest first

  static size_t round_up(size_t n) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
  }

  // A block of `bytes`: a kept one of that size, else a new mapping, after unmapping the
  // oldest kept blocks until live + kept stays within the peak of live. The bytes count as
  // live from the start, so that another thread's allocation meanwhile keeps the bound.
  void* take(size_t bytes) {
    std::vector<std::pair<size_t, void*>> evicted;
    int64_t peak_before = 0, peak_now = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peak_before = stats_.peak_live_bytes;
      stats_.live_bytes += static_cast<int64_t>(bytes);
      stats_.peak_live_bytes = peak_now = std::max(stats_.peak_live_bytes, stats_.live_bytes);
      auto it = by_size_.find(bytes);
      if (it != by_size_.end()) {
        Kept::iterator k = it->second.back();  // the most recently freed: warmest
        it->second.pop_back();
        if (it->second.empty()) by_size_.erase(it);
        void* p = k->second;
        kept_.erase(k);
        stats_.cached_bytes -= static_cast<int64_t>(bytes);
        ++stats_.reused;
        live_[p] = bytes;
        return p;
      }
      const int64_t room = stats_.peak_live_bytes - stats_.live_bytes;
      while (stats_.cached_bytes > room) evicted.push_back(evict_oldest());
      stats_.unmapped += static_cast<int64_t>(evicted.size());
    }
    for (const auto& [n, p] : evicted) munmap(p, n);
    void* p = map(bytes);
    if (p != nullptr) {
      try {
        std::lock_guard<std::mutex> lock(mu_);
        live_[p] = bytes;
        ++stats_.mapped;
        return p;
      } catch (...) {  // the map's node could not be allocated
        munmap(p, bytes);
      }
    }
    // Out of memory: the bytes were never live, and the peak they raised is taken back (a
    // raised peak would lift the bound on what is kept for good).
    const int err = errno;
    int64_t live = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.live_bytes -= static_cast<int64_t>(bytes);
      if (stats_.peak_live_bytes == peak_now)
        stats_.peak_live_bytes = std::max(peak_before, stats_.live_bytes);
      live = stats_.live_bytes;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "fsdp's host block allocator: out of memory: tried ",
                     "to allocate ", bytes, " bytes with ", live,
                     " bytes in live blocks (mmap: ", std::strerror(err),
                     "; FSDP_HOST_ALLOCATOR=glibc uses LibTorch's own)");
  }

  // A new mapping, or nullptr: on failure every kept block is unmapped and it tries once more.
  void* map(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      release_kept();
      p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED) return nullptr;
#ifdef MADV_HUGEPAGE
    if (bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: fewer faults
#endif
    return p;
  }

  // The oldest kept block, out of the cache (mu_ held); it is also the oldest of its size.
  std::pair<size_t, void*> evict_oldest() {
    auto victim = kept_.front();
    auto it = by_size_.find(victim.first);
    it->second.pop_front();
    if (it->second.empty()) by_size_.erase(it);
    kept_.pop_front();
    stats_.cached_bytes -= static_cast<int64_t>(victim.first);
    return victim;
  }

  static void release(void* p) {
    if (p == nullptr) return;
    BlockAllocator& self = *instance.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.live_.find(p);
      if (it != self.live_.end()) {
        const size_t bytes = it->second;
        self.live_.erase(it);
        self.stats_.live_bytes -= static_cast<int64_t>(bytes);
        self.stats_.cached_bytes += static_cast<int64_t>(bytes);
        self.kept_.emplace_back(bytes, p);
        self.by_size_[bytes].push_back(std::prev(self.kept_.end()));
        return;
      }
    }
    // A small block: the default allocator's (raw_deallocate comes here for both).
    self.small_->raw_deallocate(p);
  }

  c10::Allocator* small_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> live_;
  Kept kept_;
  // Kept blocks by size, oldest first; no entry for a size with none.
  std::unordered_map<size_t, std::deque<Kept::iterator>> by_size_;
  HostBlockStats stats_;
};

std::atomic<BlockAllocator*> BlockAllocator::instance{nullptr};

// Installs the block allocator unless the options or the user say otherwise; whether it did.
bool install_block_allocator(const ShardingOptions& o) {
  const bool host_shards = o.offload_optimizer.device != OffloadDevice::kNone || o.device.is_cpu();
  if (!host_shards) return false;  // the shards live on the device
  const char* want = std::getenv("FSDP_HOST_ALLOCATOR");
  const std::string choice = want != nullptr ? want : "blocks";
  TORCH_CHECK(choice == "blocks" || choice == "glibc", "FSDP_HOST_ALLOCATOR='", choice,
              "' is neither blocks (the default: fsdp's block allocator for host memory) nor "
              "glibc (LibTorch's and glibc's own); unset it or set one of them (Note [Host heap])");
  if (choice == "glibc") return false;
  // The user's glibc settings, or a CPU allocator the program installed, are left.
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      (tunables != nullptr && std::strstr(tunables, "malloc.mmap_threshold") != nullptr))
    return false;
  if (c10::GetCPUAllocator() != c10::GetDefaultCPUAllocator()) return false;
  static BlockAllocator* blocks = [] {
    auto* a = new BlockAllocator(c10::GetDefaultCPUAllocator());  // never destroyed
    BlockAllocator::instance.store(a, std::memory_order_release);
    return a;
  }();
  // SetCPUAllocator writes LibTorch's table without a lock: other threads allocating now
  // read either allocator, and either is right for the blocks it hands out.
  c10::SetCPUAllocator(blocks, /*priority=*/0);
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kLargeBlock));
#endif
  return true;
}

}  // namespace

void bound_host_heap(const ShardingOptions& options) {
  // Once installed it stays for the process (tensors hold its blocks); until then a later
  // model whose shards are in host memory may still install it.
  static std::mutex mu;
  static bool installed = false;
  std::lock_guard<std::mutex> lock(mu);
  if (!installed) installed = install_block_allocator(options);
}

HostBlockStats host_block_stats() {
  BlockAllocator* a = BlockAllocator::instance.load(std::memory_order_acquire);
  return a != nullptr ? a->stats() : HostBlockStats{};
}

bool host_blocks_installed() {
  BlockAllocator* a = BlockAllocator::instance.load(std::memory_order_acquire);
  return a != nullptr && c10::GetCPUAllocator() == a;
}

void release_host_blocks() {
  if (BlockAllocator* a = BlockAllocator::instance.load(std::memory_order_acquire))
    a->release_kept();
}

}  // namespace fsdp::detail
