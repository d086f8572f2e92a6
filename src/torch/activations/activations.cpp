#include "tidal/torch/activations.hpp"

#include "torch/activations/activations_impl.hpp"

namespace tidal::torch_layer {

// TBA's adaptive rule on this step's timeline: walking saved tensors in pack order, the first n
// with (bytes before n + 2 x bytes of n) / (3 x forward time - 2 x time before n) > write
// bandwidth, and everything after it, stay in memory next step (backward ~ 2x forward).
// A second witness needs no bandwidth: a write dropped unstarted because backward released its
// tensor first did not hide behind forward, so that tensor and every later one stay in memory
// next step too. That one never keeps the first tensor, so that a write is always going and
// the bandwidth keeps being measured (on a loaded machine the store's thread may not start a
// single write in a short forward, and the rule would otherwise have nothing to go on).
void ActivationOffloader::Impl::calibrate_locked() {
  const io::StoreStats st = store->stats();
  const double busy = st.busy_seconds - busy_at_start;
  const auto moved = static_cast<double>(st.bytes_written + st.bytes_read - moved_at_start);
  // Only a step that kept the store busy says something about its bandwidth.
  if (busy > 1e-3 && moved > 0) {
    const double measured = moved / busy;
    bandwidth = bandwidth > 0 ? 0.5 * bandwidth + 0.5 * measured : measured;
  }
  if (!opt.adaptive) return;
  if (bandwidth > 0 && forward_seconds > 0) {  // otherwise the last decision stands
    keep_from = -1;
    double before = 0;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (!order[i] || on_host(*order[i])) continue;  // the rule is the SSDs': the host is fast
      const double bytes = static_cast<double>(order[i]->nbytes);
      const double window = 3 * forward_seconds - 2 * order[i]->packed_at;
      if (window <= 0 || (before + 2 * bytes) / window > bandwidth) {
        keep_from = static_cast<std::int64_t>(i);
        break;
      }
      before += bytes;
    }
  }
  if (first_cancelled >= 0) {
    const std::int64_t from = std::max<std::int64_t>(1, first_cancelled);
    if (keep_from < 0 || from < keep_from) keep_from = from;
  }
}

// On a GPU: forward's time and each pack's, from the device's events (see start_event). Waits
// for the device to reach backward's start, which the end of a step has queued long before. A
// pack on another stream, not yet reached, keeps its host time; so does everything when the
// events cannot be timed.
void ActivationOffloader::Impl::device_times_locked() {
  if (!start_event || !backward_event) return;
  try {
    backward_event->synchronize();
    forward_seconds = start_event->elapsedTime(*backward_event) / 1e3;
    for (auto& r : order) {
      if (!r || !r->packed_event || !r->packed_event->query()) continue;
      r->packed_at = start_event->elapsedTime(*r->packed_event) / 1e3;
    }
  } catch (const c10::Error&) {
    // Host times stand.
  }
  for (auto& r : order) {
    if (r) r->packed_event.reset();
  }
}

void ActivationOffloader::Impl::note_cancelled_locked(const Record& r) {
  ++stats.cancelled_writes;
  const auto i = static_cast<std::int64_t>(r.index);
  if (first_cancelled < 0 || i < first_cancelled) first_cancelled = i;
}

// The last saved variable of `r` is gone: a write not yet started is dropped (its memory goes
// back now, as it would without offloading), and bytes in the store are freed.
void ActivationOffloader::Impl::release(Record& r) {
  std::lock_guard<std::mutex> lock(mu);
  if (--r.alive > 0) return;
  switch (r.state) {
    case Record::State::kQueued:  // never handed to the store: its memory goes back now
      r.ready.reset();
      r.state = Record::State::kKept;
      r.storage = c10::Storage();
      note_cancelled_locked(r);
      return;
    case Record::State::kWriting:
      if (r.tier->cancel_write(r.ticket)) {
        record_end(r, false);
        r.ticket = io::Ticket{};
        r.state = Record::State::kKept;
        r.storage = c10::Storage();
        note_cancelled_locked(r);
        return;
      }
      {
        // Part of it runs. Without offloading the memory would go back now, so wait for the
        // write (ahead of every read) rather than hold it longer: a stall, never a higher peak.
        r.tier->prioritize(r.ticket, io::Priority::kUrgent);
        const auto t0 = Clock::now();
        finish_write_locked(r);  // frees the ticket (alive == 0), or keeps the bytes on failure
        stats.stall_seconds += since(t0);
        record_stall(plan::StallKind::kBudget, channel(r, plan::Direction::kWrite), r, t0);
        r.storage = c10::Storage();
      }
      return;
    case Record::State::kOffloaded:
      if (r.ticket.valid()) r.tier->free(r.ticket);
      r.ticket = io::Ticket{};
      return;
    case Record::State::kReading:
      return;  // the read fills r.storage: end_step lets it go
    case Record::State::kKept:
    case Record::State::kRestored:
      r.storage = c10::Storage();
      return;
  }
}

ActivationOffloader::ActivationOffloader(std::shared_ptr<io::TensorStore> store,
                                         ActivationOptions options)
    : impl_(std::make_shared<Impl>()) {
  TIDAL_EXPECT(store != nullptr, "ActivationOffloader needs a TensorStore");
  impl_->store = std::move(store);
  impl_->opt = options;
  install_autograd_engine();
}

ActivationOffloader::~ActivationOffloader() {
  if (g_engine.active.load() == impl_.get()) end_step(0);
}

void ActivationOffloader::begin_step(std::int64_t /*step*/,
                                     const std::vector<torch::Tensor>& /*inputs*/) {
  {
    std::lock_guard<std::mutex> lock(g_engine.active_mu);
    TIDAL_EXPECT(g_engine.active_owner == nullptr || g_engine.active_owner == impl_,
                 "another ActivationOffloader is active; end its step first");
    g_engine.active_owner = impl_;
    g_engine.active.store(impl_.get(), std::memory_order_release);
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats = ActivationStats{};
  impl_->stats.keep_from = impl_->keep_from;
  if (impl_->lookahead == 0) impl_->lookahead = impl_->opt.lookahead_bytes;
  impl_->stats.lookahead_bytes = impl_->lookahead;
  impl_->first_pack = true;
  impl_->step_start = Clock::now();
  impl_->in_backward = false;
  impl_->prefetch_cursor = -1;
  impl_->prefetch_in_flight = 0;
  impl_->forward_seconds = 0;
  impl_->start_event.reset();
  impl_->backward_event.reset();
  impl_->first_cancelled = -1;
  const io::StoreStats st = impl_->store->stats();
  impl_->busy_at_start = st.busy_seconds;
  impl_->moved_at_start = st.bytes_written + st.bytes_read;
}

void ActivationOffloader::begin_phase(trace::Phase phase) {
  if (phase == trace::Phase::kBackward) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->begin_backward_locked();
  }
}

void ActivationOffloader::end_step(std::int64_t /*step*/) {
  {
    std::lock_guard<std::mutex> lock(g_engine.active_mu);
    if (g_engine.active_owner == impl_) {
      g_engine.active.store(nullptr, std::memory_order_release);
      g_engine.active_owner.reset();
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.poll_writes_locked(true);
  // Records of this step may still be referenced by a graph the caller kept; their tickets are
  // freed here, and such a graph's offloaded tensors can no longer be unpacked.
  for (auto& r : m.order) {
    if (!r || !r->ticket.valid()) continue;
    if (r->state == Record::State::kReading) {
      bool failed = false;
      try {
        r->tier->wait(r->ticket);
      } catch (const IoError&) {
        failed = true;
      }
      m.record_end(*r, failed);
    }
    r->tier->free(r->ticket);
    r->ticket = io::Ticket{};
  }
  m.device_times_locked();
  m.stats.forward_seconds = m.forward_seconds;
  m.calibrate_locked();
  // Read-ahead: as little as keeps backward from waiting.
  const double step_seconds = since(m.step_start);
  // At step scale: when reads still stall the step after the read-ahead had three steps to
  // adapt, offload half as many tensors (the first ones of forward, which backward needs last,
  // keep going). When none is left, say so once: offloading does not pay here.
  m.slow_steps = m.stats.stall_seconds > 0.1 * step_seconds ? m.slow_steps + 1 : 0;
  if (m.slow_steps >= 3 && m.opt.adaptive) {
    const std::int64_t n =
        m.limit_from >= 0 ? m.limit_from : static_cast<std::int64_t>(m.order.size());
    m.limit_from = n / 2;
    m.slow_steps = 0;
  }
  if (m.limit_from >= 0 && (m.keep_from < 0 || m.limit_from < m.keep_from)) {
    m.keep_from = m.limit_from;
  }
  if (m.opt.adaptive && m.keep_from == 0 && m.notice.empty() && !m.order.empty()) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "activation offloading does not pay here: the store (%.2f GB/s measured) "
                  "cannot hide this step's writes behind a %.1f ms forward pass, or reads kept "
                  "stalling backward; saved tensors stay in memory",
                  m.bandwidth / 1e9, 1e3 * m.forward_seconds);
    m.notice = line;
  }
  // Only a wait that cost time widens it: a miss of a few milliseconds each step (the first
  // record backward needs, written just before it) is not cured by reading further ahead, and
  // doubling the read-ahead for it every step would hold ever more of the step in memory.
  const bool waited = m.stats.stall_seconds > 0.01 * step_seconds;
  const double next = static_cast<double>(m.lookahead) * (waited ? 2.0 : 0.75);
  m.lookahead = std::clamp<std::uint64_t>(static_cast<std::uint64_t>(next),
                                          m.opt.min_lookahead_bytes, m.opt.max_lookahead_bytes);
  m.last = m.stats;
  m.order.clear();
  m.by_storage.clear();
  m.writing.clear();
}

void ActivationOffloader::keep_storages_of(const std::vector<torch::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage()) {
      impl_->persistent.emplace(t.storage().unsafeGetStorageImpl(),
                                t.storage().getWeakStorageImpl());
    }
  }
}

void ActivationOffloader::set_timeline(std::shared_ptr<plan::Timeline> timeline,
                                       std::function<std::uint64_t()> current_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->timeline = std::move(timeline);
  impl_->current_bytes = std::move(current_bytes);
}

std::string ActivationOffloader::notice() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->notice;
}

ActivationStats ActivationOffloader::last_step() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last;
}

}  // namespace tidal::torch_layer
