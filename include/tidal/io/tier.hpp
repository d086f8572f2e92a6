// Where offloaded bytes go: the SSD tensor store (store.hpp) or the host memory pool
// (host_pool.hpp). Both move a tensor's bytes asynchronously under a Ticket, with the same calls,
// so that the plan executor treats a plan's two destinations alike.
#pragma once

#include <cstdint>

namespace tidal::io {

/// Requests with a higher priority are started first: urgent (the computation waits for it) >
/// prefetch (needed soon) > offload (freeing memory). Ops already in flight are not preempted.
enum class Priority : std::uint8_t { kOffload = 0, kPrefetch = 1, kUrgent = 2 };

/// Names one tensor's bytes in a tier, from write() until free(). Plain value, copyable.
struct Ticket {
  std::uint64_t id = 0;
  [[nodiscard]] bool valid() const { return id != 0; }
  friend bool operator==(Ticket a, Ticket b) { return a.id == b.id; }
};

/// The calls the plan executor makes on a destination. Every member function is thread-safe.
/// Buffers passed to write() and read() are borrowed until the request completes.
class Tier {
 public:
  virtual ~Tier() = default;
  /// Starts writing `bytes` from src. Never blocks on I/O. When the tier has no room the ticket
  /// is already failed (wait() throws tidal::IoError saying so) and the tier stays usable.
  virtual Ticket write(const void* src, std::uint64_t bytes, Priority priority) = 0;
  /// Starts reading the ticket's bytes into dst (size(ticket) bytes).
  virtual void read(Ticket ticket, void* dst, Priority priority) = 0;
  /// True when no request of this ticket is in flight.
  [[nodiscard]] virtual bool ready(Ticket ticket) const = 0;
  /// Waits for the ticket's request; throws tidal::IoError when it failed (reported once).
  virtual void wait(Ticket ticket) = 0;
  /// Raises the priority of the ticket's requests that have not started yet.
  virtual void prioritize(Ticket ticket, Priority priority) = 0;
  /// Waits for the ticket's request, then releases its space (errors are not reported).
  virtual void free(Ticket ticket) = 0;
  /// Drops a write none of whose parts has started: returns true, and the ticket is gone as
  /// after free() (the source buffer is no longer borrowed). Returns false, changing nothing,
  /// when the ticket has no write waiting to start (some of it runs, or it is done).
  virtual bool cancel_write(Ticket ticket) = 0;
  /// Free bytes now.
  [[nodiscard]] virtual std::uint64_t free_bytes() const = 0;
};

}  // namespace tidal::io
