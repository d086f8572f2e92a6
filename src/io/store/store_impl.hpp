// Internal to io/store/: the tensor store's state, shared by its files. Setup (options, files,
// staging, backends), layout (striping and extents), dispatch (lanes to backends) and completions
// each live in their own file; the public TensorStore forwards to Impl. Backends only move
// aligned blocks; everything a user can get wrong is here.
#pragma once

#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/checksum_pool.hpp"
#include "io/store/stripes.hpp"
#include "tidal/common/aligned_buffer.hpp"
#include "tidal/common/error.hpp"
#include "tidal/io/backend.hpp"
#include "tidal/io/extent_allocator.hpp"
#include "tidal/io/store.hpp"

namespace tidal::io {
namespace detail {

// One preallocated file in one directory.
struct StoreFile {
  std::string dir;
  int fd = -1;
  bool tmpfile = false;
  std::unique_ptr<ExtentAllocator> extents;

  StoreFile() = default;
  StoreFile(const StoreFile&) = delete;
  StoreFile& operator=(const StoreFile&) = delete;
  ~StoreFile() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace detail

// One stripe run of a tensor: `length` tensor bytes at `tensor_offset` stored at `file_offset`.
struct Piece {
  int file = 0;
  std::uint64_t file_offset = 0;
  std::uint64_t tensor_offset = 0;
  std::uint32_t length = 0;
  std::uint64_t checksum = 0;
};

struct Entry;

// One op of a request: queued in a lane, then in flight in a backend.
struct OpSlot {
  IoOp io;
  TensorStore::Impl* store = nullptr;
  Entry* entry = nullptr;
  std::uint32_t piece = 0;
  Priority priority = Priority::kOffload;
  std::uint64_t seq = 0;
  int staging = -1;
  // Parts of the op still running, guarded by mu: its I/O, and for a checksummed write the hash
  // of its source, which runs beside the I/O. A read's check runs after its I/O, as the same
  // part. The piece is done (its staging buffer free, its request one op closer) at zero.
  int parts = 0;
  bool queued = false;
  const Backend* backend = nullptr;  // where the op went (for its failure message)
};

struct Entry {
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;
  std::vector<Piece> pieces;
  std::vector<std::pair<int, Extent>> extents;
  bool has_data = false;  // a write completed successfully
  bool checksummed = false;
  // The request in flight (at most one per ticket).
  bool busy = false;
  bool writing = false;
  bool device = false;
  char* user = nullptr;
  int pending = 0;
  int err = 0;
  bool corrupt = false;  // err is a checksum mismatch
  int waiters = 0;       // threads waiting for this request (completions wake only those)
  std::string err_msg;
  std::vector<OpSlot> slots;
};

struct LaneKey {
  bool operator()(const OpSlot* a, const OpSlot* b) const {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->seq < b->seq;
  }
};

struct TensorStore::Impl {
  StoreOptions opt;
  std::vector<std::unique_ptr<detail::StoreFile>> files;
  std::unique_ptr<Backend> host_backend;
  std::unique_ptr<Backend> device_backend;  // cuFile, when in use
  // Host backends that broke while running, kept until the store closes: their threads may
  // still deliver completions.
  std::vector<std::unique_ptr<Backend>> retired_backends;
  std::vector<int> fds;
  std::string backend_name;

  // Staging pool: fixed aligned buffers of stripe_unit bytes in one arena, pinned when a GPU
  // exists.
  AlignedBuffer staging_arena;
  std::vector<unsigned char*> staging;
  std::vector<int> staging_free;
  bool staging_pinned = false;

  mutable std::mutex mu;
  std::condition_variable dispatch_cv;
  std::condition_variable done_cv;
  std::vector<std::set<OpSlot*, LaneKey>> lanes;
  std::vector<int> in_flight;
  std::unordered_map<std::uint64_t, std::unique_ptr<Entry>> entries;
  std::uint64_t next_id = 1;
  std::uint64_t next_seq = 0;
  std::uint64_t rotate = 0;
  int busy_entries = 0;
  bool closing = false;  // the destructor waits for busy_entries to reach 0
  // One thread at a time submits to the backends: the dispatcher thread, or a caller that
  // submits its own request's ops (kick).
  bool dispatching = false;
  int ops_in_flight = 0;  // over all files, for busy_seconds
  std::chrono::steady_clock::time_point busy_start;
  bool stop = false;
  StoreStats counters;
  std::atomic<std::uint64_t> checksum_ns{0};  // summed over the threads that hash
  // Hashes stripes beside the I/O (null without checksums); see checksum_pool.hpp.
  std::unique_ptr<detail::ChecksumPool> checksum_pool;
  std::thread dispatcher;

  explicit Impl(StoreOptions o);
  ~Impl();

  // The constructor's stages, after the options are resolved.
  void open_files(std::uint64_t per_file);
  std::vector<std::pair<void*, std::size_t>> make_staging();
  void open_host_backend(const std::vector<std::pair<void*, std::size_t>>& regions);
  void open_device_backend();

  Entry& find(Ticket t) const {
    auto it = entries.find(t.id);
    TIDAL_EXPECT(it != entries.end(), "ticket ", t.id, " is not in the store (freed already?)");
    return *it->second;
  }
  [[nodiscard]] bool fits_direct(const char* p, std::uint32_t len, bool device) const;
  bool layout(Entry& e);
  // With mu held: one extent per file for its run of need[f] bytes (none where 0), into run and
  // e.extents; false at the first file without room (the extents taken stay in e.extents).
  bool allocate_runs(Entry& e, const std::vector<std::uint64_t>& need, std::vector<Extent>& run);
  // With mu held: one extent per stripe, on its file or the next with room; false (nothing
  // taken) when a stripe fits nowhere.
  bool place_each_stripe(Entry& e, const std::vector<detail::Stripe>& stripes);
  void release_extents(Entry& e);
  void start_request(Entry& e, char* user, bool write, Priority prio, bool device);
  void throw_pending_error(Entry& e);
  void wait_idle(std::unique_lock<std::mutex>& lock, Entry& e);
  [[nodiscard]] bool ops_queued() const;
  void dispatch_loop();
  bool collect(std::vector<OpSlot*>& batch, bool direct_only);
  void submit_batch(const std::vector<OpSlot*>& batch);
  void kick(std::unique_lock<std::mutex>& lock);
  void prepare_and_submit(OpSlot* s);
  std::unique_ptr<Backend> make_posix() const;
  void fall_back_if_broken();
  static void on_complete(IoOp* io, long result);
  // On the checksum pool: hash a write's source, check a read's data against its checksum.
  static void hash_written(void* slot);
  static void check_read(void* slot);
  // Where the op's data sits in host memory for hashing: its staging buffer, or the caller's
  // buffer; null for device memory that cuFile moves (not checksummed).
  [[nodiscard]] const char* hashed_data(const OpSlot* s) const;
  // XXH3 of a stripe, its time added to checksum_ns.
  std::uint64_t hash(const char* data, std::uint32_t length) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t h = XXH3_64bits(data, length);
    checksum_ns.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - t0)
                                       .count()),
        std::memory_order_relaxed);
    return h;
  }
  // With mu held: the op's I/O is over, so its queue slot is free for the next op.
  void release_queue_slot(OpSlot* s);
  // With mu held: one part of the op is over (err 0, or its failure).
  void finish_part(OpSlot* s, int err, std::string msg, bool corrupt = false);
  // Without mu: both of the above, for an op that has no part left after its I/O.
  void complete(OpSlot* s, int err, std::string msg, bool corrupt = false);
  void count_failure(const Entry& e);
};

}  // namespace tidal::io
