#include "tidal/plan/simulator.hpp"

#include <algorithm>
#include <queue>

#include "tidal/common/error.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::TensorId;

namespace {

enum class State : std::uint8_t { kAbsent, kResident, kWriting, kOffloaded, kReading };

// Channels: 0 SSD write, 1 SSD read, 2 host write, 3 host read.
int channel_of(Target target, bool write) {
  return (target == Target::kHost ? 2 : 0) + (write ? 0 : 1);
}

struct Job {
  double remaining = 0;  // bytes
  double key = 0;        // deadline as a global op number; earliest first
  std::int64_t seq = 0;
  TensorId tensor = 0;
  int channel = 0;
  std::uint64_t bytes = 0;
  std::uint64_t version = 0;
  bool done = false;
};

struct TensorState {
  State state = State::kAbsent;
  std::uint64_t version = 0;
  int copy_channel = -1;  // write channel holding a copy, -1: none
  std::uint64_t copy_version = 0;
  bool dead = false;  // freed by the program while a transfer was in flight
  bool on_host = false;
  int job = -1;  // the transfer in flight
};

class Simulator {
 public:
  Simulator(const trace::Trace& tr, const Plan* plan, const Hardware& hw, const SimOptions& opt)
      : tr_(tr), plan_(plan), hw_(hw), opt_(opt) {
    rates_ = opt.channels ? *opt.channels : hw.channels();
    const double r[4] = {rates_.ssd_write, rates_.ssd_read, rates_.host_write, rates_.host_read};
    for (int c = 0; c < 4; ++c) channels_[c].rate = r[c];
  }

  SimResult run() {
    const auto n = static_cast<OpIndex>(tr_.ops.size());
    const trace::LifetimeAnalysis la = trace::analyze_lifetimes(tr_);
    created_at_.assign(static_cast<std::size_t>(n), {});
    freed_at_.assign(static_cast<std::size_t>(n), {});
    used_.assign(static_cast<std::size_t>(n), {});
    tensors_.assign(tr_.tensors.size(), {});
    for (std::size_t i = 0; i < tr_.tensors.size(); ++i) {
      const auto& life = la.tensors[i];
      for (OpIndex u : life.uses)
        used_[static_cast<std::size_t>(u)].push_back(static_cast<TensorId>(i));
      if (tr_.tensors[i].persistent) {
        tensors_[i].state = State::kResident;
        resident_ += tr_.tensors[i].bytes;
        if (tr_.tensors[i].has_gap()) {  // dead after freed_after, made anew by its producer
          created_at_[static_cast<std::size_t>(life.live_begin)].push_back(
              static_cast<TensorId>(i));
          freed_at_[static_cast<std::size_t>(life.live_end)].push_back(static_cast<TensorId>(i));
        }
      } else if (life.live_begin != trace::kNoOp) {
        created_at_[static_cast<std::size_t>(life.live_begin)].push_back(static_cast<TensorId>(i));
        freed_at_[static_cast<std::size_t>(life.live_end)].push_back(static_cast<TensorId>(i));
      }
    }
    actions_at_.assign(static_cast<std::size_t>(n), {});
    if (plan_ != nullptr) {
      validate_plan(*plan_, tr_);
      for (std::size_t i = 0; i < plan_->actions.size(); ++i) {
        actions_at_[static_cast<std::size_t>(plan_->actions[i].trigger)].push_back(i);
      }
    }

    SimResult res;
    res.capacity_bytes = hw_.device_memory;
    res.memory_per_op.assign(static_cast<std::size_t>(n), 0);
    res.stall_per_op.assign(static_cast<std::size_t>(n), 0.0);
    const int iterations = std::max(1, opt_.iterations);
    double t = 0;
    double iter_start = 0;
    double busy0[4] = {0, 0, 0, 0};
    for (int it = 0; it < iterations; ++it) {
      const bool last = it == iterations - 1;
      if (last) {
        iter_start = t;
        for (int c = 0; c < 4; ++c) {
          issued_[c] = 0;
          busy0[c] = channels_[c].busy;
        }
        peak_host_ = host_bytes_;
        misses_ = forwarded_ = 0;
        counting_ = true;
      }
      for (OpIndex k = 0; k < n; ++k) {
        const auto kk = static_cast<std::size_t>(k);
        const double g = static_cast<double>(it) * n + k;
        for (TensorId id : created_at_[kk]) create(id);
        // What this op waits for: reads of what it uses, and offloads due before it.
        std::vector<int> waits;
        for (TensorId id : used_[kk]) {
          TensorState& s = tensors_[static_cast<std::size_t>(id)];
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
        for (int c : {0, 2}) start = std::max(start, run_until_key(c, g));
        for (int j : waits) start = std::max(start, run_until_done(j));
        advance_all(start);
        if (last) res.stall_per_op[kk] = start - t;
        t = start;
        for (TensorId id : tr_.ops[kk].outputs) ++tensors_[static_cast<std::size_t>(id)].version;
        if (last) res.memory_per_op[kk] = resident_;
        t += tr_.ops[kk].duration();
        advance_all(t);
        for (std::size_t a : actions_at_[kk]) fire(plan_->actions[a], it, n, t);
        for (TensorId id : freed_at_[kk]) release(id);
      }
    }
    res.iteration_seconds = t - iter_start;
    res.compute_seconds = tr_.compute_seconds();
    res.stall_seconds = std::max(0.0, res.iteration_seconds - res.compute_seconds);
    for (std::size_t k = 0; k < res.memory_per_op.size(); ++k) {
      if (res.memory_per_op[k] > res.peak_bytes) {
        res.peak_bytes = res.memory_per_op[k];
        res.peak_op = static_cast<OpIndex>(k);
      }
    }
    res.fits = res.peak_bytes <= res.capacity_bytes;
    res.ssd_bytes_written = issued_[0];
    res.ssd_bytes_read = issued_[1];
    res.host_bytes_written = issued_[2];
    res.host_bytes_read = issued_[3];
    res.peak_host_bytes = peak_host_;
    res.misses = misses_;
    res.forwarded = forwarded_;
    double util[4] = {0, 0, 0, 0};
    if (res.iteration_seconds > 0) {
      for (int c = 0; c < 4; ++c) {
        util[c] = std::min(1.0, (channels_[c].busy - busy0[c]) / res.iteration_seconds);
      }
    }
    res.ssd_write_utilisation = util[0];
    res.ssd_read_utilisation = util[1];
    res.host_write_utilisation = util[2];
    res.host_read_utilisation = util[3];
    if (res.ssd_bytes_written > 0 && hw_.ssd_tbw > 0 && hw_.ssd_count > 0) {
      res.ssd_lifetime_iterations =
          hw_.ssd_tbw * hw_.ssd_count / static_cast<double>(res.ssd_bytes_written);
      res.ssd_lifetime_days = res.ssd_lifetime_iterations * res.iteration_seconds / 86400.0;
    }
    return res;
  }

 private:
  struct Channel {
    double rate = 0;
    double now = 0;
    double busy = 0;
    std::vector<int> heap;
  };

  bool later(int a, int b) const {
    const Job& x = jobs_[static_cast<std::size_t>(a)];
    const Job& y = jobs_[static_cast<std::size_t>(b)];
    return x.key != y.key ? x.key > y.key : x.seq > y.seq;
  }
  void push(int c, int j) {
    auto& h = channels_[c].heap;
    h.push_back(j);
    std::push_heap(h.begin(), h.end(), [this](int a, int b) { return later(a, b); });
  }
  int pop(int c) {
    auto& h = channels_[c].heap;
    std::pop_heap(h.begin(), h.end(), [this](int a, int b) { return later(a, b); });
    const int j = h.back();
    h.pop_back();
    return j;
  }

  // Serves channel c up to time t (earliest deadline first, fluid).
  void advance(int c, double t) {
    Channel& ch = channels_[c];
    while (!ch.heap.empty() && ch.now < t) {
      Job& j = jobs_[static_cast<std::size_t>(ch.heap.front())];
      const double need = j.remaining / ch.rate;
      if (ch.now + need <= t) {
        ch.now += need;
        ch.busy += need;
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
    for (int c = 0; c < 4; ++c) advance(c, t);
  }
  // Runs channel c (no new arrivals) until no job due at or before `key` is left; returns the
  // time that happened.
  double run_until_key(int c, double key) {
    Channel& ch = channels_[c];
    while (!ch.heap.empty() && jobs_[static_cast<std::size_t>(ch.heap.front())].key <= key) {
      serve_head(c);
    }
    return ch.now;
  }
  double run_until_done(int job) {
    const int c = jobs_[static_cast<std::size_t>(job)].channel;
    while (!jobs_[static_cast<std::size_t>(job)].done) serve_head(c);
    return channels_[c].now;
  }
  // Runs channel c's most urgent job to its end.
  void serve_head(int c) {
    Channel& ch = channels_[c];
    const double need = jobs_[static_cast<std::size_t>(ch.heap.front())].remaining / ch.rate;
    ch.now += need;
    ch.busy += need;
    complete(pop(c));
  }

  int new_job(int c, TensorId id, double key) {
    TIDAL_EXPECT_AS(InvalidArgument, channels_[c].rate > 0, "the plan moves tensor ", id,
                    " over the ", c < 2 ? "SSD" : "host-memory",
                    " channel, but that channel has no bandwidth on this hardware model");
    Job j;
    j.bytes = tr_.tensors[static_cast<std::size_t>(id)].bytes;
    j.remaining = static_cast<double>(j.bytes);
    j.key = key;
    j.seq = seq_++;
    j.tensor = id;
    j.channel = c;
    j.version = tensors_[static_cast<std::size_t>(id)].version;
    jobs_.push_back(j);
    const int index = static_cast<int>(jobs_.size()) - 1;
    if (counting_) issued_[c] += j.bytes;
    if (j.bytes == 0) {
      complete(index);
    } else {
      push(c, index);
    }
    return index;
  }

  void complete(int job) {
    Job& j = jobs_[static_cast<std::size_t>(job)];
    j.done = true;
    if (j.tensor < 0) return;  // its tensor instance is gone
    TensorState& s = tensors_[static_cast<std::size_t>(j.tensor)];
    const std::uint64_t bytes = tr_.tensors[static_cast<std::size_t>(j.tensor)].bytes;
    const bool write = j.channel % 2 == 0;
    if (s.job == job) s.job = -1;
    if (write) {
      if (s.state == State::kWriting) {
        resident_ -= bytes;
        if (s.dead) {
          s.state = State::kAbsent;
          return;
        }
        s.state = State::kOffloaded;
        set_host(j.tensor, j.channel == 2);
      }
      if (!s.dead && s.version == j.version) {
        s.copy_channel = j.channel;
        s.copy_version = j.version;
      }
    } else if (s.state == State::kReading) {
      s.state = State::kResident;
      set_host(j.tensor, false);
    }
  }

  void set_host(TensorId id, bool on) {
    TensorState& s = tensors_[static_cast<std::size_t>(id)];
    if (s.on_host == on) return;
    const std::uint64_t bytes = tr_.tensors[static_cast<std::size_t>(id)].bytes;
    s.on_host = on;
    if (on) {
      host_bytes_ += bytes;
      if (counting_) peak_host_ = std::max(peak_host_, host_bytes_);
    } else {
      host_bytes_ -= bytes;
    }
  }

  void create(TensorId id) {
    TensorState& s = tensors_[static_cast<std::size_t>(id)];
    if (s.state == State::kResident || s.state == State::kWriting || s.state == State::kReading) {
      // A transfer of last iteration's instance still runs; it no longer matters.
      if (s.state != State::kResident) s.dead = true;
      if (s.state != State::kResident) resident_ -= tr_.tensors[static_cast<std::size_t>(id)].bytes;
    }
    set_host(id, false);
    TensorState fresh;
    fresh.version = s.version + 1;
    fresh.state = State::kResident;
    if (s.job >= 0 && !jobs_[static_cast<std::size_t>(s.job)].done) {
      // Detach the stale job: it keeps using bandwidth but changes nothing when it completes.
      jobs_[static_cast<std::size_t>(s.job)].tensor = -1;
    }
    s = fresh;
    resident_ += tr_.tensors[static_cast<std::size_t>(id)].bytes;
  }

  void release(TensorId id) {
    TensorState& s = tensors_[static_cast<std::size_t>(id)];
    const std::uint64_t bytes = tr_.tensors[static_cast<std::size_t>(id)].bytes;
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
    set_host(id, false);
  }

  void issue_read(TensorId id, double key, double now) {
    TensorState& s = tensors_[static_cast<std::size_t>(id)];
    advance_all(now);
    const int c = (s.copy_channel >= 0 ? s.copy_channel : 0) + 1;
    s.state = State::kReading;
    resident_ += tr_.tensors[static_cast<std::size_t>(id)].bytes;
    s.job = new_job(c, id, key);
  }

  void fire(const PlanAction& a, int it, OpIndex n, double now) {
    TensorState& s = tensors_[static_cast<std::size_t>(a.tensor)];
    const double key = static_cast<double>(a.deadline > a.trigger ? it : it + 1) * n + a.deadline;
    if (a.kind == ActionKind::kOffload) {
      if (s.state != State::kResident) return;
      const int c = channel_of(a.target, true);
      if (opt_.skip_clean_writes && s.copy_channel == c && s.copy_version == s.version) {
        s.state = State::kOffloaded;
        resident_ -= a.bytes;
        set_host(a.tensor, c == 2);
        return;
      }
      advance_all(now);
      s.state = State::kWriting;
      s.job = new_job(c, a.tensor, key);
    } else {
      if (s.state == State::kWriting) {
        s.state = State::kResident;
        ++forwarded_;
      } else if (s.state == State::kOffloaded) {
        issue_read(a.tensor, key, now);
      }
    }
  }

  const trace::Trace& tr_;
  const Plan* plan_;
  const Hardware& hw_;
  SimOptions opt_;
  ChannelRates rates_;
  Channel channels_[4];
  std::vector<Job> jobs_;
  std::int64_t seq_ = 0;
  std::vector<TensorState> tensors_;
  std::vector<std::vector<TensorId>> created_at_, freed_at_, used_;
  std::vector<std::vector<std::size_t>> actions_at_;
  std::uint64_t resident_ = 0;
  std::uint64_t host_bytes_ = 0;
  std::uint64_t peak_host_ = 0;
  std::uint64_t issued_[4] = {0, 0, 0, 0};
  std::int64_t misses_ = 0;
  std::int64_t forwarded_ = 0;
  bool counting_ = false;
};

}  // namespace

SimResult simulate(const trace::Trace& trace, const Plan* plan, const Hardware& hw,
                   const SimOptions& options) {
  Simulator sim(trace, plan, hw, options);
  return sim.run();
}

}  // namespace tidal::plan
