#include "tidal/plan/simulator.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <optional>
#include <queue>

#include "plan/int_index.hpp"
#include "plan/simulator/host_timeline.hpp"
#include "plan/simulator/state.hpp"
#include "tidal/common/error.hpp"
#include "tidal/plan/schedule.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::TensorId;

namespace {

using detail::at;
namespace sim = detail::sim;
using sim::Job;
using sim::kCleanOffload;
using sim::State;
using sim::TensorState;

class Simulator {
 public:
  Simulator(const trace::Trace& tr, const Plan* plan, const Hardware& hw, const SimOptions& opt)
      : tr_(tr),
        sched_(compile_schedule(tr, plan)),
        hw_(hw),
        opt_(opt),
        host_(opt_.host_tasks, sched_.num_ops, sched_.num_tensors) {
    const ChannelRates rates = opt.channels ? *opt.channels : hw.channels();
    for (Channel c : kChannels) channel(c).rate = rates[c];
  }

  // Replays the iterations; the last one is reported.
  SimResult run() {
    const auto n = static_cast<OpIndex>(tr_.ops.size());
    start_resident();
    SimResult res;
    res.capacity_bytes = hw_.device_memory;
    res.memory_per_op.assign(static_cast<std::size_t>(n), 0);
    res.stall_per_op.assign(static_cast<std::size_t>(n), 0.0);
    res.busy_per_op.assign(static_cast<std::size_t>(n), {});
    const int iterations = std::max(1, opt_.iterations);
    double t = 0;
    double iter_start = 0;
    std::array<double, kNumChannels> busy0{};
    for (int it = 0; it < iterations; ++it) {
      const bool last = it == iterations - 1;
      if (last) {
        iter_start = t;
        busy0 = start_counting(res, n);
      }
      for (OpIndex k = 0; k < n; ++k) t = run_op(k, it, t, last ? &res : nullptr);
    }
    res.iteration_seconds = t - iter_start;
    report(res, busy0);
    return res;
  }

 private:
  // Every persistent tensor starts in device memory.
  void start_resident() {
    tensors_.assign(tr_.tensors.size(), {});
    for (std::size_t i = 0; i < tr_.tensors.size(); ++i) {
      if (tr_.tensors[i].persistent) {
        tensors_[i].state = State::kResident;
        resident_ += tr_.tensors[i].bytes;
      }
    }
  }

  // Starts the counters of the reported iteration; returns each channel's busy time so far.
  std::array<double, kNumChannels> start_counting(SimResult& res, OpIndex n) {
    std::array<double, kNumChannels> busy{};
    for (Channel c : kChannels) {
      issued_[index_of(c)] = 0;
      busy[index_of(c)] = channel(c).busy;
    }
    if (opt_.record_residency) res.residency.assign(static_cast<std::size_t>(n), {});
    peak_host_ = host_bytes_;
    peak_ssd_ = ssd_bytes_;
    misses_ = forwarded_ = 0;
    host_.start_counting();
    counting_ = true;
    return busy;
  }

  // Runs op k of iteration `it` from time t (when the previous op ended): waits for what it
  // needs, runs it, issues the migrations due after it and frees what dies. Returns the time
  // it ended; records it in `report` (the reported iteration) unless null.
  double run_op(OpIndex k, int it, double t, SimResult* report) {
    const auto n = static_cast<OpIndex>(tr_.ops.size());
    const auto kk = static_cast<std::size_t>(k);
    const double g = static_cast<double>(it) * n + k;
    if (report != nullptr && opt_.record_residency) report->residency[kk] = residency();
    // Every channel has been served up to t (the previous op ended with advance_all(t)).
    std::array<double, kNumChannels> busy_before{};
    for (Channel c : kChannels) busy_before[index_of(c)] = channel(c).busy;
    for (TensorId id : sched_.created[kk]) create(id);
    // What this op waits for: reads of what it uses, and offloads due before it.
    std::vector<int> waits;
    for (TensorId id : sched_.uses[kk]) {
      TensorState& s = state(id);
      if (host_.pending(id, t)) {
        waits.push_back(read_refreshed(id, k, g, t));
        continue;
      }
      if (s.state == State::kWriting) {
        s.state = State::kResident;  // still in memory: keep it
      } else if (s.state == State::kOffloaded) {
        ++misses_;
        issue_read(id, g - 0.5, t);
        waits.push_back(s.job);
      } else if (s.state == State::kReading) {
        waits.push_back(s.job);
      }
    }
    double start = t;
    // Offloads and stages due by this op are done before it (a stage's deadline is its
    // prefetch's trigger op; the SSD reads due by now that are not stages are of tensors this op
    // uses, waited for anyway).
    for (Channel c : kChannels) {
      if (is_write(c) || c == Channel::kSsdRead) start = std::max(start, run_until_key(c, g));
    }
    for (int j : waits) start = std::max(start, run_until_done(j));
    advance_to(start);
    if (report != nullptr) report->stall_per_op[kk] = start - t;
    t = start;
    for (TensorId id : tr_.ops[kk].outputs) ++state(id).version;
    if (report != nullptr) report->memory_per_op[kk] = resident_;
    // The op, and the compute the transfers started since the last op take from it.
    t += tr_.op_seconds(kk) + io_compute_;
    if (report != nullptr) report->io_compute_seconds += io_compute_;
    io_compute_ = 0;
    advance_to(t);
    host_.mark_refreshes(k);
    for (std::int32_t m : sched_.issued_after[kk]) fire(at(sched_.migrations, m), it, n, t);
    queue_host_tasks(k, t);
    for (TensorId id : sched_.freed[kk]) release(id);
    if (report != nullptr) {
      for (Channel c : kChannels) {
        report->busy_per_op[kk][index_of(c)] = channel(c).busy - busy_before[index_of(c)];
      }
    }
    return t;
  }

  // Fills the rest of the result from the reported iteration's counters.
  void report(SimResult& res, const std::array<double, kNumChannels>& busy0) const {
    res.compute_seconds = tr_.compute_seconds();
    res.stall_seconds =
        std::max(0.0, res.iteration_seconds - res.compute_seconds - res.io_compute_seconds);
    for (std::size_t k = 0; k < res.memory_per_op.size(); ++k) {
      if (res.memory_per_op[k] > res.peak_bytes) {
        res.peak_bytes = res.memory_per_op[k];
        res.peak_op = static_cast<OpIndex>(k);
      }
    }
    res.fits = res.peak_bytes <= res.capacity_bytes;
    res.ssd_bytes_written = issued_[index_of(Channel::kSsdWrite)];
    res.ssd_bytes_read = issued_[index_of(Channel::kSsdRead)];
    res.host_bytes_written = issued_[index_of(Channel::kHostWrite)];
    res.host_bytes_read = issued_[index_of(Channel::kHostRead)];
    res.peak_host_bytes = peak_host_;
    res.peak_ssd_bytes = peak_ssd_;
    res.misses = misses_;
    res.forwarded = forwarded_;
    res.host_task_seconds = host_.seconds();
    res.refresh_waits = host_.waits();
    const auto util = [&](Channel c) {
      if (res.iteration_seconds <= 0) return 0.0;
      return std::min(1.0, (channel(c).busy - busy0[index_of(c)]) / res.iteration_seconds);
    };
    res.ssd_write_utilisation = util(Channel::kSsdWrite);
    res.ssd_read_utilisation = util(Channel::kSsdRead);
    res.host_write_utilisation = util(Channel::kHostWrite);
    res.host_read_utilisation = util(Channel::kHostRead);
    if (res.ssd_bytes_written > 0 && hw_.ssd_tbw > 0 && hw_.ssd_count > 0) {
      res.ssd_lifetime_iterations =
          hw_.ssd_tbw * hw_.ssd_count / static_cast<double>(res.ssd_bytes_written);
      res.ssd_lifetime_days = res.ssd_lifetime_iterations * res.iteration_seconds / 86400.0;
    }
  }

  struct Queue {
    double rate = 0;
    double now = 0;
    double busy = 0;
    std::vector<int> heap;
  };

  [[nodiscard]] bool later(int a, int b) const {
    const Job& x = job(a);
    const Job& y = job(b);
    return x.key != y.key ? x.key > y.key : x.seq > y.seq;
  }
  Queue& channel(Channel c) { return queues_[index_of(c)]; }
  Job& job(int j) { return at(jobs_, j); }
  [[nodiscard]] const Job& job(int j) const { return at(jobs_, j); }
  TensorState& state(TensorId id) { return at(tensors_, id); }
  [[nodiscard]] std::uint64_t bytes_of(TensorId id) const { return at(tr_.tensors, id).bytes; }
  [[nodiscard]] const Queue& channel(Channel c) const { return queues_[index_of(c)]; }

  // The state of every tensor, in the vocabulary the executor reports too.
  [[nodiscard]] std::vector<Residency> residency() const {
    // By State: absent, resident, writing, offloaded, reading.
    constexpr Residency kResidencyOf[] = {Residency::kAbsent, Residency::kResident,
                                          Residency::kLeaving, Residency::kAway,
                                          Residency::kArriving};
    std::vector<Residency> r(tensors_.size(), Residency::kAbsent);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      r[i] = kResidencyOf[static_cast<std::size_t>(tensors_[i].state)];
    }
    return r;
  }

  // A channel's queue is a heap with the most urgent job on top.
  [[nodiscard]] auto most_urgent_on_top() const {
    return [this](int a, int b) { return later(a, b); };
  }
  void push(Channel c, int j) {
    auto& h = channel(c).heap;
    h.push_back(j);
    std::push_heap(h.begin(), h.end(), most_urgent_on_top());
  }
  int pop(Channel c) {
    auto& h = channel(c).heap;
    std::pop_heap(h.begin(), h.end(), most_urgent_on_top());
    const int j = h.back();
    h.pop_back();
    return j;
  }

  // Serves channel c up to time t (earliest deadline first, fluid).
  void advance(Channel c, double t) {
    Queue& ch = channel(c);
    while (!ch.heap.empty() && ch.now < t) {
      Job& j = job(ch.heap.front());
      const double need = j.remaining / ch.rate;
      if (ch.now + need <= t) {
        ch.now += need;
        ch.busy += need;
        job(ch.heap.front()).end = ch.now;
        complete(pop(c));
      } else {
        j.remaining -= (t - ch.now) * ch.rate;
        ch.busy += t - ch.now;
        ch.now = t;
      }
    }
    ch.now = std::max(ch.now, t);
  }
  void advance_all(double t) {
    for (Channel c : kChannels) advance(c, t);
  }
  // Runs channel c (no new arrivals) until no job due at or before `key` is left; returns the
  // time that happened.
  double run_until_key(Channel c, double key) {
    Queue& ch = channel(c);
    while (!ch.heap.empty() && job(ch.heap.front()).key <= key) {
      serve_head(c);
    }
    return ch.now;
  }
  double run_until_done(int j) {
    const Channel c = job(j).channel;
    while (!job(j).done) serve_head(c);
    return channel(c).now;
  }
  // Runs channel c's most urgent job to its end.
  void serve_head(Channel c) {
    Queue& ch = channel(c);
    const double need = job(ch.heap.front()).remaining / ch.rate;
    ch.now += need;
    ch.busy += need;
    job(ch.heap.front()).end = ch.now;
    complete(pop(c));
  }

  int new_job(Channel c, TensorId id, double key) {
    TIDAL_EXPECT_AS(InvalidArgument, channel(c).rate > 0, "the plan moves tensor ", id,
                    " over the ", tier_of(c) == Tier::kSsd ? "SSD" : "host-memory",
                    " channel, but that channel has no bandwidth on this hardware model");
    Job j;
    j.bytes = bytes_of(id);
    j.remaining = static_cast<double>(j.bytes);
    j.key = key;
    j.seq = seq_++;
    j.tensor = id;
    j.channel = c;
    j.version = state(id).version;
    jobs_.push_back(j);
    const int index = static_cast<int>(jobs_.size()) - 1;
    if (counting_) issued_[index_of(c)] += j.bytes;
    io_compute_ += static_cast<double>(j.bytes) * hw_.compute_seconds_per_byte[index_of(c)];
    if (j.bytes == 0) {
      job(index).end = channel(c).now;
      complete(index);
    } else {
      push(c, index);
    }
    return index;
  }

  void complete(int index) {
    Job& j = job(index);
    j.done = true;
    if (j.tensor < 0) return;  // its tensor instance is gone
    TensorState& s = state(j.tensor);
    const std::uint64_t bytes = bytes_of(j.tensor);
    if (s.stage_job == index) {
      // The SSD copy is in host memory now; the tensor's prefetch reads it from there. (A stage
      // still in flight when the tensor was wanted became its read: issue_read; one whose
      // tensor died was detached: drop_stage.)
      s.stage_job = -1;
      hold(s.staging, false, bytes, host_bytes_, peak_host_);
      if (s.state == State::kOffloaded && s.on_ssd && s.version == j.version) {
        hold(s.on_host, true, bytes, host_bytes_, peak_host_);
        copy_of(s, Tier::kHost) = static_cast<std::int64_t>(j.version);
      }
      return;
    }
    const bool write = is_write(j.channel);
    if (s.job == index) s.job = -1;
    if (write) {
      if (s.state == State::kWriting) {
        resident_ -= bytes;
        if (s.dead) {
          s.state = State::kAbsent;
          return;
        }
        s.state = State::kOffloaded;
        set_away(j.tensor, tier_of(j.channel));
      }
      if (!s.dead && s.version == j.version) {
        copy_of(s, tier_of(j.channel)) = static_cast<std::int64_t>(j.version);
      }
    } else if (s.state == State::kReading) {
      s.state = State::kResident;
      set_away(j.tensor, std::nullopt);
    }
  }

  static std::int64_t& copy_of(TensorState& s, Tier tier) {
    return s.copy_version[tier == Tier::kHost ? 1 : 0];
  }

  // Where a tensor's only copy is while it is away from device memory (none: it is not away,
  // and a stage of it in flight no longer matters).
  void set_away(TensorId id, std::optional<Tier> tier) {
    TensorState& s = state(id);
    const std::uint64_t bytes = bytes_of(id);
    if (!tier) drop_stage(id);
    hold(s.on_host, tier == Tier::kHost, bytes, host_bytes_, peak_host_);
    hold(s.on_ssd, tier == Tier::kSsd, bytes, ssd_bytes_, peak_ssd_);
  }
  // Sets whether one tier holds a tensor (`on`), counting its bytes in what the tier holds and,
  // in the reported iteration, in the peak.
  void hold(bool& on, bool want, std::uint64_t bytes, std::uint64_t& held,
            std::uint64_t& peak) const {
    if (on == want) return;
    on = want;
    if (want) {
      held += bytes;
      if (counting_) peak = std::max(peak, held);
    } else {
      held -= bytes;
    }
  }

  // Forgets the stage of `id` in flight, if any: its bytes keep the SSD channel busy but land
  // nowhere, and the host memory it took is given back.
  void drop_stage(TensorId id) {
    TensorState& s = state(id);
    if (s.stage_job < 0) return;
    job(s.stage_job).tensor = -1;
    s.stage_job = -1;
    hold(s.staging, false, bytes_of(id), host_bytes_, peak_host_);
  }

  void create(TensorId id) {
    TensorState& s = state(id);
    if (s.state == State::kResident || s.state == State::kWriting || s.state == State::kReading) {
      // A transfer of last iteration's instance still runs; it no longer matters.
      if (s.state != State::kResident) s.dead = true;
      if (s.state != State::kResident) resident_ -= bytes_of(id);
    }
    set_away(id, std::nullopt);
    TensorState fresh;
    fresh.version = s.version + 1;
    fresh.state = State::kResident;
    if (s.job >= 0 && !job(s.job).done) {
      // Detach the stale job: it keeps using bandwidth but changes nothing when it completes.
      job(s.job).tensor = -1;
    }
    s = fresh;
    resident_ += bytes_of(id);
  }

  void release(TensorId id) {
    TensorState& s = state(id);
    const std::uint64_t bytes = bytes_of(id);
    switch (s.state) {
      case State::kResident:
        resident_ -= bytes;
        s.state = State::kAbsent;
        break;
      case State::kWriting:
        s.dead = true;  // memory comes back when the write completes
        break;
      case State::kReading:
        resident_ -= bytes;
        s.dead = true;
        s.state = State::kAbsent;
        break;
      case State::kOffloaded:
        s.state = State::kAbsent;
        break;
      case State::kAbsent:
        break;
    }
    set_away(id, std::nullopt);
  }

  void issue_read(TensorId id, double key, double now) {
    TensorState& s = state(id);
    advance_all(now);
    if (s.stage_job >= 0) {
      // Wanted before its stage is done: the read waits for the stage and then crosses the host
      // link, as one job on the SSD channel (at the read's urgency, if that is greater) that
      // takes the host link's time for the tensor on top of the stage's rest. The bytes moved
      // are those of a stage and a host read whatever the timing.
      const int j = s.stage_job;
      Job& stage = job(j);
      const Channel c = stage.channel;
      const double host_rate = channel(Channel::kHostRead).rate;
      TIDAL_EXPECT_AS(InvalidArgument, host_rate > 0, "the plan stages tensor ", id,
                      " into host memory, but the host-memory channel has no bandwidth on this "
                      "hardware model");
      stage.remaining += static_cast<double>(stage.bytes) * channel(c).rate / host_rate;
      if (counting_) issued_[index_of(Channel::kHostRead)] += stage.bytes;
      io_compute_ += static_cast<double>(stage.bytes) *
                     hw_.compute_seconds_per_byte[index_of(Channel::kHostRead)];
      stage.key = std::min(stage.key, key);
      auto& h = channel(c).heap;
      std::make_heap(h.begin(), h.end(), most_urgent_on_top());
      s.stage_job = -1;
      hold(s.staging, false, bytes_of(id), host_bytes_, peak_host_);
      s.state = State::kReading;
      resident_ += bytes_of(id);
      s.job = j;
      return;
    }
    const Channel c = channel_of(s.on_host ? Tier::kHost : Tier::kSsd, Direction::kRead);
    s.state = State::kReading;
    resident_ += bytes_of(id);
    s.job = new_job(c, id, key);
  }

  void fire(const Migration& m, int it, OpIndex n, double now) {
    TensorState& s = state(m.tensor);
    const double key = static_cast<double>(it) * n + static_cast<double>(m.due);
    if (m.kind == ActionKind::kOffload) {
      if (s.state != State::kResident) return;
      if (opt_.skip_clean_writes && copy_of(s, m.tier) == static_cast<std::int64_t>(s.version)) {
        s.state = State::kOffloaded;
        resident_ -= m.bytes;
        set_away(m.tensor, m.tier);
        s.drain_job = m.tier == Tier::kHost ? kCleanOffload : -1;
        return;
      }
      advance_all(now);
      s.state = State::kWriting;
      s.job = new_job(m.channel, m.tensor, key);
      s.drain_job = s.job;
    } else if (m.kind == ActionKind::kStage) {
      if (s.state != State::kOffloaded || !s.on_ssd || s.on_host || s.stage_job >= 0) return;
      advance_all(now);
      hold(s.staging, true, m.bytes, host_bytes_, peak_host_);
      s.stage_job = new_job(m.channel, m.tensor, key);
    } else {
      if (host_.pending(m.tensor, now)) {
        host_.defer(m.tensor, key);
      } else if (s.state == State::kWriting) {
        s.state = State::kResident;
        ++forwarded_;
      } else if (s.state == State::kOffloaded) {
        issue_read(m.tensor, key, now);
      }
    }
  }

  // Host tasks (plan/simulator/host_timeline.hpp).

  [[nodiscard]] std::function<sim::JobView(int)> job_view() const {
    return [this](int j) { return sim::JobView{job(j).done, job(j).end}; };
  }
  void resolve_host() { host_.resolve(job_view()); }

  // Queues the host tasks that follow op k (ended at t) and starts what can start.
  void queue_host_tasks(OpIndex k, double t) {
    if (!host_.active()) return;
    host_.queue(
        k, t,
        [&](TensorId id) {
          const int j = state(id).drain_job;
          TIDAL_EXPECT_AS(InvalidArgument,
                          j == kCleanOffload || (j >= 0 && job(j).channel == Channel::kHostWrite),
                          "a host task after op ", k, " reads tensor ", id, " ('",
                          at(tr_.tensors, id).name,
                          "'), which the plan does not write to host memory by then");
          return j;
        },
        counting_);
    resolve_host();
  }

  // Op k (iteration position g, its turn at t) needs tensor `id` that a host task is still
  // rewriting: the read starts when the task ends. Returns the read's job.
  int read_refreshed(TensorId id, OpIndex k, double g, double t) {
    const int r = host_.run_of(id);
    TensorState& s = state(id);
    if (s.state == State::kWriting) run_until_done(s.job);  // its first offload is still out
    TIDAL_EXPECT_AS(InvalidArgument, s.state == State::kOffloaded, "op ", k, " uses tensor ", id,
                    " ('", at(tr_.tensors, id).name, "'), which host task '", host_.task_name(r),
                    "' rewrites, but the plan keeps its stale copy in device memory");
    const double end = host_.force(r, job_view(), [this](int j) { run_until_done(j); });
    host_.forget(id);
    if (!host_.take_deferred(id)) ++misses_;
    if (counting_) host_.count_wait();
    const double when = std::max(t, end);
    advance_all(when);
    issue_read(id, g - 0.5, when);
    return s.job;
  }

  // Serves the channels up to t, issuing each held-back read when the task it waits for ends.
  void advance_to(double t) {
    while (host_.active()) {
      resolve_host();
      const auto ready = host_.next_ready(t);
      if (!ready) break;
      advance_all(ready->second);
      const TensorId id = ready->first.tensor;
      if (state(id).state == State::kOffloaded) issue_read(id, ready->first.key, ready->second);
    }
    advance_all(t);
  }

  const trace::Trace& tr_;
  const Schedule sched_;
  const Hardware& hw_;
  SimOptions opt_;
  std::array<Queue, kNumChannels> queues_;
  std::vector<Job> jobs_;
  std::int64_t seq_ = 0;
  std::vector<TensorState> tensors_;
  std::uint64_t resident_ = 0;
  std::uint64_t host_bytes_ = 0;
  std::uint64_t peak_host_ = 0;
  std::uint64_t ssd_bytes_ = 0;
  std::uint64_t peak_ssd_ = 0;
  std::array<std::uint64_t, kNumChannels> issued_{};
  std::int64_t misses_ = 0;
  std::int64_t forwarded_ = 0;
  double io_compute_ = 0;  // Hardware::compute_seconds_per_byte of the transfers since the last op
  bool counting_ = false;
  sim::HostTimeline host_;
};

}  // namespace

SimResult simulate(const trace::Trace& trace, const Plan* plan, const Hardware& hw,
                   const SimOptions& options) {
  Simulator sim(trace, plan, hw, options);
  return sim.run();
}

}  // namespace tidal::plan
