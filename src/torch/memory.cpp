#include "tidal/torch/memory.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>  // torch >= 2.9: any device's allocator statistics
#include <torch/version.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

#include "tidal/common/units.hpp"

namespace tidal::torch_layer {
namespace {

// The tracking allocator. Sizes live in a side table (the DataPtr deleter only receives one
// pointer), so the counters subtract exactly what they added.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override { return do_allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  MemoryStats stats() const {
    MemoryStats s;
    s.current_bytes = current_.load(std::memory_order_relaxed);
    s.peak_bytes = peak_.load(std::memory_order_relaxed);
    s.allocations = allocations_.load(std::memory_order_relaxed);
    s.frees = frees_.load(std::memory_order_relaxed);
    return s;
  }

  void reset_peak() { peak_.store(current_.load(std::memory_order_relaxed)); }

  std::uint64_t size_of(const void* ptr) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    return it == sizes_.end() ? 0 : it->second;
  }

  static TrackingCpuAllocator& instance() {
    static TrackingCpuAllocator* a = new TrackingCpuAllocator();  // never destroyed: tensors
    return *a;                                                    // may outlive static teardown
  }

 private:
  c10::DataPtr do_allocate(size_t n) const {
    auto& self = const_cast<TrackingCpuAllocator&>(*this);
    const c10::Device cpu(c10::kCPU);
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &release, cpu);
    const std::uint64_t padded = align_up(n, kHostAllocationAlignment);
    void* p = std::aligned_alloc(kHostAllocationAlignment, padded);
    if (p == nullptr) throw std::bad_alloc();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      self.sizes_.emplace(p, padded);
    }
    self.allocations_.fetch_add(1, std::memory_order_relaxed);
    const auto now = self.current_.fetch_add(padded, std::memory_order_relaxed) + padded;
    auto peak = self.peak_.load(std::memory_order_relaxed);
    while (now > peak && !self.peak_.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(p, p, &release, cpu);
  }

  static void release(void* p) {
    if (p == nullptr) return;
    auto& self = instance();
    std::uint64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.sizes_.find(p);
      if (it != self.sizes_.end()) {
        bytes = it->second;
        self.sizes_.erase(it);
      }
    }
    self.current_.fetch_sub(bytes, std::memory_order_relaxed);
    self.frees_.fetch_add(1, std::memory_order_relaxed);
    std::free(p);
  }

  mutable std::mutex mutex_;
  std::unordered_map<const void*, std::uint64_t> sizes_;
  std::atomic<std::uint64_t> current_{0};
  std::atomic<std::uint64_t> peak_{0};
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<std::uint64_t> frees_{0};
};

// c10 keeps the allocator with the highest priority; the built-in one registers with 0.
constexpr std::uint8_t kTrackingPriority = 100;

}  // namespace

void install_tracking_cpu_allocator() {
  static std::once_flag once;
  std::call_once(
      once, [] { c10::SetCPUAllocator(&TrackingCpuAllocator::instance(), kTrackingPriority); });
}

bool tracking_cpu_allocator_active() {
  return c10::GetCPUAllocator() == &TrackingCpuAllocator::instance();
}

std::uint64_t tracked_allocation_bytes(const void* ptr) {
  return TrackingCpuAllocator::instance().size_of(ptr);
}

MemoryMeter::MemoryMeter(c10::Device device) : device_(device) {
  if (device_.is_cpu()) install_tracking_cpu_allocator();
}

MemoryStats MemoryMeter::stats() const {
  if (device_.is_cpu()) return TrackingCpuAllocator::instance().stats();
  if (device_.is_cuda()) {
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    const auto s = allocator->getDeviceStats(device_.has_index() ? device_.index() : 0);
    const auto& bytes = s.allocated_bytes[0];  // StatType::AGGREGATE
    MemoryStats out;
    out.current_bytes = static_cast<std::uint64_t>(bytes.current);
    out.peak_bytes = static_cast<std::uint64_t>(bytes.peak);
    out.allocations = static_cast<std::uint64_t>(s.allocation[0].allocated);
    out.frees = static_cast<std::uint64_t>(s.allocation[0].freed);
    return out;
  }
  return {};
}

void MemoryMeter::reset_peak() {
  if (device_.is_cpu()) {
    TrackingCpuAllocator::instance().reset_peak();
    return;
  }
  if (device_.is_cuda()) {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)
        ->resetPeakStats(device_.has_index() ? device_.index() : 0);
  }
}

}  // namespace tidal::torch_layer
