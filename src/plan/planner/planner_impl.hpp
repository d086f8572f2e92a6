// The planner's stages as one class over shared state (private to plan/planner/): each stage's
// members are defined in the file named beside its declarations; make_plan.cpp runs the planner
// once per host-memory way and planning into the waits. Torch-free.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "plan/cyclic_ops.hpp"
#include "plan/planner_reference.hpp"
#include "plan/segment_trees.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::plan::detail::planning {

using trace::OpIndex;
using trace::TensorId;

// The bandwidth a committed migration holds on one channel: (op, bytes) items sorted by their
// position in the candidate's period, with prefix sums. The least-stall fallback asks, for every
// committed period around every op it relieves, how much of it lies at or after (or before) that
// op; a scan of the items made that 80% of the planning time on Llama-3.1-405B (reservations in
// the optimizer step's millisecond ops have hundreds of items).
struct Reservation {
  std::vector<Leaf> items;
  std::vector<int> pos;     // items' positions, ascending
  std::vector<double> cum;  // cum[i]: bytes of items[0, i)
};

// One inactive period of a tensor, a candidate migration. Positions count the ops strictly
// inside the period: position 0 is op last_use + 1, position len - 1 is op next_use - 1
// (cyclically).
struct Candidate {
  TensorId tensor = 0;
  std::uint64_t bytes = 0;
  OpIndex last_use = 0;
  OpIndex next_use = 0;
  int len = 0;  // ops strictly between, cyclically
  // The tensor's version: the last op at or before last_use that modifies it (-1: none), and
  // the ops from that op to last_use (cyclically); periods of one version are ordered by it.
  int epoch = -1;
  int after = 0;
  bool done = false;
  // Once committed: it books no write, because an earlier migration of this version went to the
  // same tier and the tier still holds it (PlannerInternals::clean_copies).
  bool clean = false;
  // May go to host memory (HostChoice::kDensest admits only some); with kDensest, an admitted
  // one takes host memory wherever it frees as much as the SSDs.
  bool host_ok = true;
  // May go to the SSDs (HostChoice::kSsdWhereNeeded admits only the periods chosen to cover
  // what host memory cannot hold).
  bool ssd_ok = true;
  // Once committed: where, the positions of its transfers' end buckets, the bandwidth it
  // reserved per op (so that the least-stall fallback can move it), and its two actions.
  Target target = Target::kSsd;
  int offload_end = -1;     // position of the bucket where the offload completes
  int prefetch_start = -1;  // position of the bucket where the prefetch starts
  // Staged (on the SSDs, back through host memory: ActionKind::kStage): the stage's first
  // bucket; host memory holds the tensor from there to the end of the period, and the prefetch
  // reads host memory.
  bool staged = false;
  int stage_start = -1;
  Reservation write_res;
  Reservation read_res;
  Reservation stage_res;         // SSD read bandwidth of the stage
  std::size_t off_action = 0;    // index of its offload in Plan::actions; the prefetch follows
  std::size_t stage_action = 0;  // index of its stage, where staged
};

// Where the transfers of a candidate would go on one target, and what that frees.
struct Choice {
  bool ok = false;
  Target target = Target::kSsd;
  int offload_end = -1;
  int prefetch_start = -1;
  double score = 0;     // compute time of the freed ops that are over the target
  bool clean = false;   // no write: the target holds this version already
  int via = -1;         // the earlier period planned with it to write the version (write_ahead)
  bool staged = false;  // on the SSDs, back through host memory from stage_start
  int stage_start = -1;
};

// A stall that makes a candidate absent at one op (the least-stall fallback).
struct StallOption {
  int cand = -1;
  Target target = Target::kSsd;
  double stall_write = 0;  // seconds before the op so that the offload is out
  double stall_read = 0;   // seconds before next_use so that the prefetch, started after, is in
  double cost = std::numeric_limits<double>::infinity();  // stall per byte of excess relieved
};

// A committed migration as prune() sees it: the migrations of one tensor to one target between
// two ops that modify the tensor form a group, and only the first of a group writes.
struct PruneMember {
  bool host;
  TensorId tensor;
  int epoch;  // the last op at or before the offload that modified the tensor (-1: none)
  int after;  // ops from that op to the offload
  int cand;
};

struct PruneGroup {
  bool host;
  double need;  // compute time over the target, with everything kept, of the ops it frees
  std::uint64_t bytes;
  std::size_t first;  // members[first, last)
  std::size_t last;
};

// What prune() works on: memory per op with every kept migration, and the groups.
struct PruneState {
  RangeTree memory;
  std::vector<PruneMember> members;
  std::vector<PruneGroup> groups;
  std::vector<char> dropped;  // per plan action
};

// How the planner spends host memory. kByScore: a period goes to host memory when its channels
// free more over-target time than the SSDs' (on a tie, the SSDs). kDensest: before the greedy,
// host memory is promised to the periods that save the most SSD traffic per byte-second of host
// memory (two SSD transfers of s bytes for s bytes held over the period: the shortest periods
// first), as long as the promises fit in it at every op; those take host memory wherever it
// frees as much as the SSDs, the others only the SSDs. kSsdWhereNeeded: the SSDs only for the
// longest periods over the ops where host memory cannot hold what must leave; host memory
// wherever it frees as much as the SSDs.
enum class HostChoice : std::uint8_t { kByScore, kDensest, kSsdWhereNeeded };

// Thrown by a Planner whose cancel flag was set (Planner::cancel_on).
struct Cancelled {};

// One planning pass over a trace: the stages, in run()'s order, over state they share. Not
// thread-safe; it reads the trace and the hardware, which must outlive it.
class Planner {
 public:
  Planner(const trace::Trace& tr, const Hardware& hw, PlannerOptions opt,
          const detail::PlannerInternals& in, HostChoice host_choice = HostChoice::kByScore)
      : tr_(tr),
        hw_(hw),
        opt_(std::move(opt)),
        host_choice_(host_choice),
        n_(static_cast<int>(tr.ops.size())),
        cycle_(n_),
        in_(in) {}

  // Planning stops with Cancelled soon after *flag turns true (a plan no longer wanted).
  void cancel_on(const std::atomic<bool>* flag) { cancel_ = flag; }
  // The plan: the stages in order (setup.cpp). Throws Cancelled once the cancel flag is set,
  // tidal::InvalidArgument where the plan cannot fit.
  Plan run();
  // Whether a migration went to the SSDs for want of room in host memory (after run()).
  [[nodiscard]] bool host_short() const { return host_short_; }

 private:
  [[nodiscard]] bool clean_copies() const { return in_.clean_copies && opt_.clean_copies; }

  // Whether c would book no write on `target` (PlannerInternals::clean_copies): an earlier
  // migration of its version went there, and the tier keeps that copy until the tensor changes.
  [[nodiscard]] bool clean_on(const Candidate& c, Target target) const {
    return clean_copies() && neighbours(c, target).first >= 0;
  }

  // The number of ops as a container size.
  [[nodiscard]] std::size_t ops() const { return static_cast<std::size_t>(n_); }

  // Zero-time ops still count a little, so that an op over capacity always has a weight.
  [[nodiscard]] double weight(int k) const { return at(op_seconds_, k) + 1e-9; }

  // The op at position pos of c's interior, the position of op k, and the op ranges covering
  // positions [p0, p1] of c's interior, in order.
  [[nodiscard]] int op_at(const Candidate& c, int pos) const {
    return cycle_.op_at(c.last_use, pos);
  }

  [[nodiscard]] int pos_of(const Candidate& c, int k) const { return cycle_.pos_of(c.last_use, k); }

  int segments(const Candidate& c, int p0, int p1, Segment out[2]) const {
    return cycle_.segments(c.last_use, p0, p1, out);
  }

  template <class Fn>
  void for_each_segment(const Candidate& c, int p0, int p1, Fn&& fn) const {
    Segment s[2];
    const int ns = segments(c, p0, p1, s);
    for (int i = 0; i < ns; ++i) fn(s[i]);
  }

  // Ops still over the target hold their planned memory in over_memory_; the others kInf.
  bool is_over(int k) { return over_memory_->get(k) < RangeTree::kInf / 2; }

  int first_over(int l, int r) { return over_memory_->first_at_most(l, r, RangeTree::kInf / 2); }

  // The tensors planned away to `target` at each op (bytes), and the tier's capacity (0: none).
  RangeTree& away(Target target) { return *away_bytes_[target == Target::kHost ? 1 : 0]; }

  [[nodiscard]] std::uint64_t tier_capacity(Target target) const {
    return target == Target::kHost ? hw_.host_memory : hw_.ssd_capacity;
  }

  // Host memory is always bounded (0: no host tier); an SSD capacity of 0 means no bound, and
  // then nothing is tracked for the SSDs (the fallback moves migrations hundreds of thousands
  // of times on a 70B trace).
  [[nodiscard]] bool bounded(Target target) const {
    return target == Target::kHost || hw_.ssd_capacity > 0;
  }

  // The first position at which a stage starting at position `stage` holds host memory: the op
  // after which it is issued (the reads in flight then may still hold theirs: the host memory of
  // a read is given back when it completes, before the next op). It holds it to the use.
  static int staged_host_from(int stage) { return stage - 1; }

  // The tier c's prefetch reads: host memory for a staged one, else the one it went to.
  static Target read_tier(const Candidate& c) { return c.staged ? Target::kHost : c.target; }

  BucketTree& bucket(Target t, Direction d) { return buckets_[index_of(channel_of(t, d))]; }

  [[nodiscard]] const BucketTree& bucket(Target t, Direction d) const {
    return buckets_[index_of(channel_of(t, d))];
  }

  // Periods move from the SSDs to host memory after the plan where both tiers are usable
  // (PlannerInternals::retarget_to_host).
  [[nodiscard]] bool retargeting() const {
    return in_.retarget_to_host && rates_.usable(Target::kSsd) && rates_.usable(Target::kHost);
  }

  // Stages where the host link reads more than twice as fast as the SSDs: where the SSDs read
  // about as fast as the host link's rest, a stage's host memory and second transfer cost more
  // than its faster read gains.
  [[nodiscard]] bool staging() const {
    return in_.stage_via_host && opt_.stage_via_host && rates_.usable(Target::kSsd) &&
           rates_.usable(Target::kHost) &&
           rates_[Channel::kSsdRead] < 0.5 * rates_[Channel::kHostRead];
  }

  // Calls fn(j) for each period j of c's version before c.
  template <class Fn>
  void for_each_earlier(const Candidate& c, Fn&& fn) const {
    for (int j : at(periods_of_, c.tensor)) {
      const Candidate& m = at(candidates_, j);
      if (m.epoch == c.epoch && m.after < c.after) fn(j);
    }
  }

  [[nodiscard]] bool is_first_of_version(const Candidate& c) const {
    bool first = true;
    for_each_earlier(c, [&](int) { first = false; });
    return first;
  }

  void check_cancel() const {
    if (cancel_ != nullptr && cancel_->load(std::memory_order_relaxed)) throw Cancelled{};
  }

  // ---- setup.cpp: the stages in order, and the state they start from
  Plan empty_plan();
  void setup_channels();
  void collect_candidates(const trace::LifetimeAnalysis& la);
  void promise_host();
  void admit_ssd(const trace::LifetimeAnalysis& la);
  void track_over_target(const trace::LifetimeAnalysis& la);
  void check_active_fit(const trace::LifetimeAnalysis& la);
  [[nodiscard]] std::pair<int, int> version_of(TensorId tensor, int k) const;
  [[nodiscard]] std::pair<int, int> neighbours(const Candidate& c, Target target) const;

  // ---- periods.cpp: a period's ops, memory over the target, tiers, reservations
  [[nodiscard]] double period_seconds(const Candidate& c) const;
  [[nodiscard]] double bucket_sum(const BucketTree& t, const Candidate& c, int p0, int p1) const;
  std::int64_t span_max(RangeTree& tree, const Candidate& c, int p0, int p1) const;
  void span_add(RangeTree& tree, const Candidate& c, int p0, int p1, std::int64_t v) const;
  [[nodiscard]] int fill(const BucketTree& t, const Candidate& c, int p0, int p1, double need,
                         Scan scan) const;
  [[nodiscard]] double over_time(const Candidate& c, int p0, int p1) const;
  void add_planned(const Segment& s, std::int64_t bytes);
  void free_span(const Candidate& c, int p0, int p1);
  void mark_away(const Candidate& c, Target target, std::int64_t bytes, int p0 = 0, int p1 = -1);
  void mark_all_away(const Candidate& c, std::int64_t bytes);
  bool room(const Candidate& c, Target target, int p0 = 0, int p1 = -1);
  void reserve(BucketTree& t, const Candidate& c, int p0, int p1, double need, Scan scan,
               Reservation& res);
  void index(const Candidate& c, Reservation& res) const;
  static std::pair<std::size_t, std::size_t> span_of(const Reservation& res, int p0, int p1);
  static double reserved(const Reservation& res, int p0, int p1);
  double release(BucketTree& t, const Candidate& c, Reservation& res, int p0, int p1);

  // ---- greedy.cpp: choosing and committing migrations; the greedy
  Choice evaluate_target(const Candidate& c, Target target, bool ahead = true);
  void write_ahead(const Candidate& c, Target target, int start, Choice& ch);
  Choice evaluate_staged(const Candidate& c);
  Choice evaluate(const Candidate& c);
  static void count_offload(PlanSummary& sum, const Candidate& c, bool add);
  void commit(Plan& plan, Candidate& c, const Choice& ch);
  void add_stage_action(Plan& plan, Candidate& c);
  void clean_later(Plan& plan, const Candidate& c);
  void report_progress();
  void set_times(Plan& plan, const Candidate& c) const;
  void note_host_short(const Candidate& c, Target target);
  void greedy(Plan& plan);

  // ---- host_passes.cpp: periods moved to or staged through host memory
  void retarget_pass(Plan& plan);
  void drop_dead_actions(Plan& plan);
  static void remove_actions(Plan& plan, const std::vector<char>& dead);
  void stage_pass(Plan& plan);

  // ---- fallback.cpp: the least-stall fallback
  void add_stall(int bucket, double seconds);
  StallOption option_for(int i, int k, std::int64_t excess);
  void fallback(Plan& plan);
  void relieve(Plan& plan, int k, bool committed);
  [[noreturn]] void fail_to_relieve(int k) const;
  int sweep_start();
  void apply(Plan& plan, const StallOption& best, int k);
  void track_present(int i);
  void move_clear_of(Candidate& c, int pk, Direction dir);

  // ---- prune.cpp: dropping what the others make unnecessary; stalls, summary
  void prune(Plan& plan, const trace::LifetimeAnalysis& la);
  RangeTree planned_memory(const trace::LifetimeAnalysis& la, std::vector<double>& over_prefix);
  [[nodiscard]] std::vector<PruneMember> prune_members() const;
  [[nodiscard]] std::vector<PruneGroup> prune_groups(const std::vector<PruneMember>& members,
                                                     const std::vector<double>& over_prefix) const;
  void drop_group(Plan& plan, PruneState& st, const PruneGroup& g);
  void drop_readers(Plan& plan, PruneState& st, const PruneGroup& g);
  bool can_drop(PruneState& st, const Candidate& c);
  void drop(Plan& plan, PruneState& st, Candidate& c);
  void stall_summary(Plan& plan) const;
  void summarize(Plan& plan, const trace::LifetimeAnalysis& la);

  const trace::Trace& tr_;
  const Hardware& hw_;
  PlannerOptions opt_;
  HostChoice host_choice_;
  int n_;
  CyclicOps cycle_;
  std::int64_t target_ = 0;  // bytes of device memory the plan may use
  ChannelRates rates_;
  std::vector<double> op_seconds_;
  std::vector<double> seconds_before_;  // compute time of ops 0..k-1
  std::vector<BucketTree> buckets_;     // remaining capacity per op, one per Channel (index_of)
  std::vector<Candidate> candidates_;
  std::vector<std::vector<OpIndex>> writes_;  // per tensor, the ops that modify it, in order
  std::vector<std::vector<int>> periods_of_;  // per tensor, its candidates
  std::unique_ptr<Fenwick> over_time_;        // compute time of the ops still over the target
  std::unique_ptr<RangeTree> over_memory_;    // memory of the ops over the target, kInf: fits
  std::unique_ptr<RangeTree> away_bytes_[2];  // bytes planned away per op: [0] SSD, [1] host
  std::unique_ptr<RangeTree> promised_;  // HostChoice::kDensest: host memory promised, and staged
  std::vector<std::int64_t> planned_delta_;     // planned memory change, as differences per op
  std::vector<double> stall_at_;                // seconds of stall added per bucket
  std::vector<std::pair<double, int>> ranked_;  // the fallback's options for one op
  double initial_over_time_ = 0;
  std::int64_t commits_ = 0;
  bool host_short_ = false;
  // Actions to remove when the plan is done (the stages of periods moved to host memory).
  std::vector<std::size_t> dead_actions_;
  bool any_ssd_ = false;  // the fallback's last resort: any period may take the SSDs
  const std::atomic<bool>* cancel_ = nullptr;  // set: stop with Cancelled
  std::int64_t steps_ = 0;                     // greedy pops, for the cancel check
  detail::PlannerInternals in_;
  std::unique_ptr<IntervalStab> present_;  // the fallback's index of where candidates can go
  std::vector<std::uint32_t> version_;     // per candidate, its entries' version in present_
};

}  // namespace tidal::plan::detail::planning
