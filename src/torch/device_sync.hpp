// Internal: make a device tensor's bytes final before tidal's I/O threads copy them. Kernels run
// asynchronously on the current stream; the store copies on its own streams, so the producing
// work must be complete first. Device-generic (c10), so no CUDA headers are needed here.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

namespace tidal::torch_layer::detail {

/// Waits for the work queued on `device`'s current stream. No-op for CPU tensors.
inline void sync_current_stream(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
}

/// An event recorded on `device`'s current stream now: complete once the work queued so far
/// (the kernels that produced a tensor) has run. Null for CPU tensors (their bytes are final).
/// Lets the training thread go on where sync_current_stream would make it wait. With timing:
/// two such events give the device time between them (c10::Event::elapsedTime), where the
/// host's clock gives only when the work was queued.
inline std::shared_ptr<c10::Event> record_on_current_stream(const c10::Device& device) {
  if (device.is_cpu()) return nullptr;
  c10::impl::VirtualGuardImpl impl(device.type());
  auto event = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  event->record(impl.getStream(device));
  return event;
}

/// The stream that device memory for reads is allocated on: one per device, from the device's
/// stream pool, on which tidal queues no work. The caching allocator hands out a block freed on
/// a stream at once to the next allocation on that stream, trusting stream order, while kernels
/// queued before the free may still read it. tidal's I/O threads fill a read's memory on their
/// own streams (or with cuFile, on none), so memory allocated on the compute stream could be
/// overwritten under such a kernel: the H200 run saw a wrong loss. Allocated here, it is memory
/// that no queued kernel uses.
inline c10::Stream read_allocation_stream(const c10::Device& device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, c10::Stream> streams;
  const std::pair<int, int> key{static_cast<int>(device.type()), device.index()};
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(key);
  if (it == streams.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    it = streams.emplace(key, impl.getStreamFromGlobalPool(device)).first;
  }
  return it->second;
}

/// While alive, device allocations of this thread on `device` come from read_allocation_stream's
/// pool (see there). No-op for CPU memory.
class ReadAllocationScope {
 public:
  explicit ReadAllocationScope(const c10::Device& device) {
    if (device.is_cpu()) return;
    impl_.emplace(device.type());
    previous_ = impl_->exchangeStream(read_allocation_stream(device));
  }
  ~ReadAllocationScope() {
    if (impl_) impl_->exchangeStream(*previous_);
  }
  ReadAllocationScope(const ReadAllocationScope&) = delete;
  ReadAllocationScope& operator=(const ReadAllocationScope&) = delete;

 private:
  std::optional<c10::impl::VirtualGuardImpl> impl_;
  std::optional<c10::Stream> previous_;
};

/// Memory a read filled, now handed to the current stream's kernels: when it is freed, the
/// allocator waits for that stream's queued work before it reuses the block. No-op for CPU
/// memory and for memory of another allocator.
inline void record_use_on_current_stream(const c10::DataPtr& data, const c10::Device& device) {
  if (device.is_cpu() || data.get() == nullptr) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.recordDataPtrOnStream(data, impl.getStream(device));
}

}  // namespace tidal::torch_layer::detail
