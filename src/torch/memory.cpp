#include "tidal/torch/memory.hpp"

#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>  // torch >= 2.9: any device's allocator statistics
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "device_sync.hpp"
#include "tidal/common/env.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

#if defined(TIDAL_TORCH_CUDA)
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace tidal::torch_layer {
namespace {

std::string format_bytes_u(std::uint64_t b) { return format_bytes(static_cast<double>(b)); }

thread_local std::string t_shortfall;  // note_reclaim_shortfall, for the refusal being made
thread_local std::uint64_t t_last_refused = 0;  // take_last_refused_bytes
thread_local int t_host_scopes = 0;             // HostMemoryScope objects alive on this thread

// TIDAL_HUGE_PAGES (default on): tensors of kHugePage or more on transparent huge pages.
bool huge_pages() {
  // Read inside an allocation, which must not throw for a bad TIDAL_* value (a store or session
  // reading the environment says which one): on then.
  static const bool on = [] {
    try {
      return env().huge_pages.value_or(true);
    } catch (const Error&) {
      return true;
    }
  }();
  return on;
}

// The tracking allocator. Sizes live in a side table (the DataPtr deleter only receives one
// pointer), so the counters subtract exactly what they added.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override { return do_allocate(n, t_host_scopes > 0); }
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
    s.refusals = refusals_.load(std::memory_order_relaxed);
    s.reclaimed_bytes = reclaimed_.load(std::memory_order_relaxed);
    s.host_bytes = host_current_.load(std::memory_order_relaxed);
    s.host_peak_bytes = host_peak_.load(std::memory_order_relaxed);
    return s;
  }

  void set_cap(std::uint64_t bytes) { cap_.store(bytes, std::memory_order_release); }
  std::uint64_t cap() const { return cap_.load(std::memory_order_acquire); }

  std::uint64_t set_reclaimer(MemoryReclaimer r) {
    std::lock_guard<std::mutex> lock(reclaimer_mutex_);
    reclaimer_ = r ? std::make_shared<MemoryReclaimer>(std::move(r)) : nullptr;
    return ++reclaimer_token_;
  }
  void clear_reclaimer(std::uint64_t token) {
    std::lock_guard<std::mutex> lock(reclaimer_mutex_);
    if (token == reclaimer_token_) reclaimer_.reset();
  }

  void reset_peak() {
    peak_.store(current_.load(std::memory_order_relaxed));
    host_peak_.store(host_current_.load(std::memory_order_relaxed));
  }

  std::uint64_t size_of(const void* ptr) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    return it == sizes_.end() ? 0 : it->second;
  }

  static bool is_host(const c10::DataPtr& d) { return d.get_deleter() == &release_host; }

  static TrackingCpuAllocator& instance() {
    static TrackingCpuAllocator* a = new TrackingCpuAllocator();  // never destroyed: tensors
    return *a;                                                    // may outlive static teardown
  }

 private:
  // host: a HostMemoryScope is alive on this thread: the bytes are counted apart, the cap and
  // the reclaimer do not apply, and the block's deleter (release_host) says so for its life.
  c10::DataPtr do_allocate(size_t n, bool host) const {
    auto& self = const_cast<TrackingCpuAllocator&>(*this);
    const c10::Device cpu(c10::kCPU);
    const c10::DeleterFnPtr deleter = host ? &release_host : &release;
    if (n == 0) return c10::DataPtr(nullptr, nullptr, deleter, cpu);
    const std::uint64_t padded = align_up(n, kHostAllocationAlignment);
    if (!host && cap() != 0) self.make_room(padded);
    void* p = nullptr;
    if (padded >= kHugePage && huge_pages()) {
      // On a 2 MiB boundary, its whole 2 MiB pages advised onto transparent huge pages before
      // the first touch: the store's direct I/O from and into it goes out in requests of
      // physically contiguous memory. The kernel cuts a direct I/O where its pages stop being
      // contiguous, and from scattered 4 KiB pages the CI machine's disk read 1 MiB requests at
      // 1.8 GB/s against 3.3 GB/s from 2 MiB pages (docs/results.md, section 2). Advice only:
      // where the kernel gives none (THP off), the memory is ordinary pages.
      if (posix_memalign(&p, kHugePage, padded) != 0) p = nullptr;
      if (p != nullptr) (void)::madvise(p, padded / kHugePage * kHugePage, MADV_HUGEPAGE);
    } else {
      p = std::aligned_alloc(kHostAllocationAlignment, padded);
    }
    if (p == nullptr) throw std::bad_alloc();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      self.sizes_.emplace(p, padded);
    }
    self.allocations_.fetch_add(1, std::memory_order_relaxed);
    auto& current = host ? self.host_current_ : self.current_;
    auto& peak = host ? self.host_peak_ : self.peak_;
    const auto now = current.fetch_add(padded, std::memory_order_relaxed) + padded;
    auto seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(p, p, deleter, cpu);
  }

  // The strict meter: `padded` more bytes must fit under the cap, after the reclaimer has had
  // its go, or the allocation is refused as a GPU would refuse it. (Two threads allocating at
  // once may each see room for itself: the cap holds to within one allocation per thread.)
  void make_room(std::uint64_t padded) {
    const std::uint64_t limit = cap();
    const auto fits = [&] { return current_.load(std::memory_order_relaxed) + padded <= limit; };
    if (limit == 0 || fits()) return;
    thread_local bool reclaiming = false;
    if (!reclaiming) {
      std::shared_ptr<MemoryReclaimer> r;
      {
        std::lock_guard<std::mutex> lock(reclaimer_mutex_);
        r = reclaimer_;
      }
      t_shortfall.clear();
      if (r) {
        reclaiming = true;
        try {
          const std::uint64_t over = current_.load(std::memory_order_relaxed) + padded - limit;
          reclaimed_.fetch_add((*r)(over), std::memory_order_relaxed);
        } catch (...) {
          reclaiming = false;
          throw;
        }
        reclaiming = false;
      }
      if (fits()) return;
    }
    refusals_.fetch_add(1, std::memory_order_relaxed);
    t_last_refused = padded;
    const std::uint64_t now = current_.load(std::memory_order_relaxed);
    C10_THROW_ERROR(
        OutOfMemoryError,
        "tidal's strict memory meter refused " + format_bytes_u(padded) + ": the process holds " +
            format_bytes_u(now) + " of tensor memory and its cap is " + format_bytes_u(limit) +
            " (the memory budget). On a GPU with that much memory this allocation would fail "
            "here too." +
            (t_shortfall.empty() ? std::string()
                                 : " Nothing more could be moved out: " + t_shortfall + ".") +
            " Give a larger budget, a smaller batch or sequence, or let tidal move more "
            "of the step's tensors out (plan mode, activation offloading).");
  }

  static void release(void* p) { release_from(p, instance().current_); }
  static void release_host(void* p) { release_from(p, instance().host_current_); }

  static void release_from(void* p, std::atomic<std::uint64_t>& current) {
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
    current.fetch_sub(bytes, std::memory_order_relaxed);
    self.frees_.fetch_add(1, std::memory_order_relaxed);
    std::free(p);
  }

  mutable std::mutex mutex_;
  std::unordered_map<const void*, std::uint64_t> sizes_;
  std::atomic<std::uint64_t> current_{0};
  std::atomic<std::uint64_t> peak_{0};
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<std::uint64_t> frees_{0};
  std::atomic<std::uint64_t> refusals_{0};
  std::atomic<std::uint64_t> reclaimed_{0};
  std::atomic<std::uint64_t> host_current_{0};
  std::atomic<std::uint64_t> host_peak_{0};
  std::atomic<std::uint64_t> cap_{0};
  std::mutex reclaimer_mutex_;
  std::shared_ptr<MemoryReclaimer> reclaimer_;
  std::uint64_t reclaimer_token_ = 0;
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

HostMemoryScope::HostMemoryScope(bool active) : active_(active) {
  if (!active_) return;
  install_tracking_cpu_allocator();
  ++t_host_scopes;
}

HostMemoryScope::~HostMemoryScope() {
  if (active_) --t_host_scopes;
}

bool host_tier_storage(const c10::StorageImpl& storage) {
  return TrackingCpuAllocator::is_host(storage.data_ptr());
}

std::uint64_t tracked_allocation_bytes(const void* ptr) {
  return TrackingCpuAllocator::instance().size_of(ptr);
}

void set_cpu_memory_cap(std::uint64_t bytes) {
  install_tracking_cpu_allocator();
  TrackingCpuAllocator::instance().set_cap(bytes);
}

std::uint64_t cpu_memory_cap() { return TrackingCpuAllocator::instance().cap(); }

std::uint64_t set_cpu_memory_reclaimer(MemoryReclaimer reclaimer) {
  return TrackingCpuAllocator::instance().set_reclaimer(std::move(reclaimer));
}

void clear_cpu_memory_reclaimer(std::uint64_t token) {
  TrackingCpuAllocator::instance().clear_reclaimer(token);
}

void note_reclaim_shortfall(std::string why) { t_shortfall = std::move(why); }

ScopedCpuMemoryCap::ScopedCpuMemoryCap(std::uint64_t bytes)
    : previous_(cpu_memory_cap()), bytes_(bytes) {
  set_cpu_memory_cap(bytes);
}

ScopedCpuMemoryCap::~ScopedCpuMemoryCap() {
  if (cpu_memory_cap() == bytes_) set_cpu_memory_cap(previous_);
}

std::uint64_t take_last_refused_bytes() {
  const std::uint64_t b = t_last_refused;
  t_last_refused = 0;
  return b;
}

bool set_device_memory_wall(const c10::Device& device, std::uint64_t bytes) {
  if (device.is_cpu()) {
    set_cpu_memory_cap(bytes);
    return true;
  }
#if defined(TIDAL_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
    (void)at::empty({0}, at::TensorOptions().device(c10::Device(c10::kCUDA, index)));
    auto* allocator = c10::cuda::CUDACachingAllocator::get();
    const std::size_t total = allocator->getMemoryInfo(index).second;
    if (total == 0) return false;
    static std::once_flag observer_once;
    std::call_once(observer_once, [] {
      // The caching allocator counts the wall in reserved segments, and a segment it cut from
      // cudaMalloc stays reserved while any block of it is in use: memory the executor frees
      // could not be used for another size, and the wall would refuse well under the budget.
      // Expandable segments map 2 MiB pages and give back what is free. Unless the user chose
      // the allocator's settings (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF), they are turned
      // on here; segments made before stay as they are.
      if (std::getenv("PYTORCH_CUDA_ALLOC_CONF") == nullptr &&
          std::getenv("PYTORCH_ALLOC_CONF") == nullptr) {
        c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
      }
      // Called on the allocating thread just before the caching allocator throws.
      c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
          [](std::int64_t, std::size_t allocated, std::size_t, std::size_t) {
            t_last_refused = allocated;
          });
    });
    const double fraction =
        bytes == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total));
    allocator->setMemoryFraction(fraction, index);
    return true;
  }
#endif
  return false;
}

DeviceMemory measure_device_memory(const c10::Device& device) {
  DeviceMemory d;
#if defined(TIDAL_TORCH_CUDA)
  if (device.is_cuda()) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
    const auto on_device = at::TensorOptions().device(c10::Device(c10::kCUDA, index));
    {
      // The CUDA context and cuBLAS's handle and workspace exist once a matmul ran.
      const at::Tensor a = at::ones({64, 64}, on_device);
      (void)at::matmul(a, a);
      detail::sync_current_stream(c10::Device(c10::kCUDA, index));
    }
    auto* allocator = c10::cuda::CUDACachingAllocator::get();
    const auto [free, total] = allocator->getMemoryInfo(index);
    const auto stats = allocator->getDeviceStats(index);
    d.total = total;
    d.free = free;
    d.allocated = static_cast<std::uint64_t>(stats.allocated_bytes[0].current);
    d.reserved = static_cast<std::uint64_t>(stats.reserved_bytes[0].current);
  }
#else
  (void)device;
#endif
  return d;
}

MemoryMeter::MemoryMeter(c10::Device device) : device_(device) {
  if (device_.is_cpu()) {
    install_tracking_cpu_allocator();
  } else {
    // A device's caching allocator exists only once torch has initialized the device (its
    // first tensor there): before that, asking it for statistics throws "Invalid device
    // argument". An empty tensor on the device initializes it.
    (void)at::empty({0}, at::TensorOptions().device(device_));
  }
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
