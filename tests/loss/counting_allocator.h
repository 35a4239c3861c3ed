#pragma once

// A CPU allocator that counts live bytes and their peak (tests/loss and
// bench_loss measure the losses' memory with it). Every CPU tensor storage goes
// through it; scratch memory that ATen kernels take with malloc directly
// (small, per thread, also oneDNN/MKL GEMM workspaces) is not seen.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>

namespace distill {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    auto* ctx = new Ctx{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = live_.fetch_add(ctx->n) + ctx->n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, ctx, &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void resetPeak() { peak_.store(live_.load()); }

 private:
  struct Ctx {
    c10::DataPtr inner;
    int64_t n;
    CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->live_.fetch_sub(ctx->n);
    delete ctx;
  }
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// Installs the counting allocator for the test's scope (it must outlive every
// tensor it made, hence static).
inline CountingAllocator& counting() {
  static CountingAllocator* a = new CountingAllocator(c10::GetCPUAllocator());
  return *a;
}

} // namespace distill
