// Internal: make a device tensor's bytes final before tidal's I/O threads copy them. Kernels run
// asynchronously on the current stream; the store copies on its own streams, so the producing
// work must be complete first. Device-generic (c10), so no CUDA headers are needed here.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <memory>

namespace tidal::torch_layer::detail {

/// Waits for the work queued on `device`'s current stream. No-op for CPU tensors.
inline void sync_current_stream(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  impl.getStream(device).synchronize();
}

/// An event recorded on `device`'s current stream now: complete once the work queued so far
/// (the kernels that produced a tensor) has run. Null for CPU tensors (their bytes are final).
/// Lets the training thread go on where sync_current_stream would make it wait.
inline std::shared_ptr<c10::Event> record_on_current_stream(const c10::Device& device) {
  if (device.is_cpu()) return nullptr;
  c10::impl::VirtualGuardImpl impl(device.type());
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(impl.getStream(device));
  return event;
}

}  // namespace tidal::torch_layer::detail
