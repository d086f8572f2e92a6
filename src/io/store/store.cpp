// The tensor store's public face: each call takes the store's lock and hands the request to Impl.
#include <algorithm>
#include <cerrno>
#include <chrono>

#include "io/host_copy.hpp"
#include "io/store/store_impl.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/text.hpp"
#include "tidal/common/units.hpp"

namespace tidal::io {

using detail::is_device_memory;

TensorStore::TensorStore(StoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

TensorStore::~TensorStore() = default;

Ticket TensorStore::write(const void* src, std::uint64_t bytes, Priority priority) {
  TIDAL_EXPECT(src != nullptr || bytes == 0, "TensorStore::write: null source buffer");
  const bool device = bytes > 0 && is_device_memory(src);
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto entry = std::make_unique<Entry>();
  Entry& e = *entry;
  e.id = impl_->next_id++;
  e.bytes = bytes;
  e.checksummed = impl_->opt.checksum && (!device || impl_->device_backend == nullptr);
  impl_->entries.emplace(e.id, std::move(entry));
  if (bytes > 0 && !impl_->layout(e)) {
    std::uint64_t free = 0;
    std::uint64_t largest = 0;
    for (const auto& f : impl_->files) {
      free += f->extents->free_bytes();
      largest = std::max(largest, f->extents->largest_free());
    }
    e.err = ENOSPC;
    e.err_msg = ::tidal::detail::concat(
        "the store is full: the tensor needs ", format_bytes(static_cast<double>(bytes)),
        " but only ", format_bytes(static_cast<double>(free)), " of ",
        format_bytes(static_cast<double>(impl_->counters.capacity)),
        " is free (largest free extent ", format_bytes(static_cast<double>(largest)),
        "); free tickets or open the store with a larger capacity");
    e.writing = true;
    impl_->count_failure(e);
    return Ticket{e.id};
  }
  impl_->start_request(e, static_cast<char*>(const_cast<void*>(src)), true, priority, device);
  const Ticket t{e.id};
  impl_->kick(lock);  // e may be gone after this (a failed op completes, another thread frees)
  return t;
}

void TensorStore::read(Ticket ticket, void* dst, Priority priority) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  TIDAL_EXPECT(dst != nullptr || e.bytes == 0, "TensorStore::read: null destination buffer");
  impl_->wait_idle(lock, e);
  impl_->throw_pending_error(e);
  TIDAL_EXPECT(e.has_data, "ticket ", ticket.id,
               " holds no data: its write failed, so there is nothing to read back");
  const bool device = e.bytes > 0 && is_device_memory(dst);
  impl_->start_request(e, static_cast<char*>(dst), false, priority, device);
  impl_->kick(lock);
}

bool TensorStore::ready(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->find(ticket).busy;
}

std::uint64_t TensorStore::size(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->find(ticket).bytes;
}

void TensorStore::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  impl_->wait_idle(lock, e);
  impl_->throw_pending_error(e);
}

void TensorStore::prioritize(Ticket ticket, Priority priority) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  if (!e.busy) return;
  for (OpSlot& s : e.slots) {
    if (!s.queued || s.priority >= priority) continue;
    auto& lane = impl_->lanes[static_cast<std::size_t>(e.pieces[s.piece].file)];
    lane.erase(&s);
    s.priority = priority;
    lane.insert(&s);
  }
  impl_->dispatch_cv.notify_one();
}

void TensorStore::free(Ticket ticket) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  impl_->wait_idle(lock, e);
  impl_->release_extents(e);
  impl_->entries.erase(ticket.id);
}

bool TensorStore::cancel_write(Ticket ticket) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Entry& e = impl_->find(ticket);
  if (!e.busy || !e.writing) return false;
  for (const OpSlot& s : e.slots) {
    if (!s.queued) return false;
  }
  for (OpSlot& s : e.slots) {
    impl_->lanes[static_cast<std::size_t>(e.pieces[s.piece].file)].erase(&s);
  }
  e.busy = false;
  --impl_->busy_entries;
  impl_->release_extents(e);
  impl_->entries.erase(ticket.id);
  impl_->done_cv.notify_all();
  return true;
}

StoreStats TensorStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  StoreStats s = impl_->counters;
  if (impl_->ops_in_flight > 0) {
    s.busy_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - impl_->busy_start).count();
  }
  s.used_bytes = 0;
  for (const auto& f : impl_->files) {
    s.file_used_bytes.push_back(f->extents->used_bytes());
    s.used_bytes += f->extents->used_bytes();
  }
  s.tickets = impl_->entries.size();
  s.checksum_seconds = static_cast<double>(impl_->checksum_ns.load()) * 1e-9;
  return s;
}

const StoreOptions& TensorStore::options() const { return impl_->opt; }

std::uint64_t TensorStore::free_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::uint64_t n = 0;
  for (const auto& f : impl_->files) n += f->extents->free_bytes();
  return n;
}

}  // namespace tidal::io
