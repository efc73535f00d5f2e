#pragma once
// A CPU allocator that counts live bytes, installed over LibTorch's default one, so that
// tests can measure exactly what a forward keeps alive for backward.

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace fsdp::testing {

class CountingCpuAllocator : public at::Allocator {
 public:
  /// Installs the counter as LibTorch's CPU allocator (once per process) and returns it.
  static CountingCpuAllocator& install() {
    static CountingCpuAllocator* a = [] {
      auto* c = new CountingCpuAllocator(c10::GetDefaultCPUAllocator());
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *a;
  }

  at::DataPtr allocate(size_t n) override { return counted_allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  at::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }

  /// Bytes currently allocated through this allocator.
  int64_t live() const { return live_.load(); }
  /// The most bytes allocated at once since the last reset_peak().
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_ = live_.load(); }

 private:
  at::DataPtr counted_allocate(size_t n) const {
    void* p = base_->raw_allocate(n);
    {
      std::lock_guard<std::mutex> g(mu_);
      sizes_[p] = n;
    }
    const int64_t now = live_ += static_cast<int64_t>(n);
    for (int64_t p = peak_.load(); now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    // data == context, as raw_allocate() callers require.
    return at::DataPtr(p, p, &CountingCpuAllocator::release, at::Device(at::kCPU));
  }
  explicit CountingCpuAllocator(at::Allocator* base) : base_(base) { self_ = this; }
  static void release(void* p) {
    if (p == nullptr) return;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> g(self_->mu_);
      auto it = self_->sizes_.find(p);
      if (it != self_->sizes_.end()) {
        n = it->second;
        self_->sizes_.erase(it);
      }
    }
    self_->live_ -= static_cast<int64_t>(n);
    self_->base_->raw_deallocate(p);
  }

  static inline CountingCpuAllocator* self_ = nullptr;
  at::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, size_t> sizes_;
};

}  // namespace fsdp::testing
