#include "tidal/plan/planner.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <queue>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::TensorId;

namespace {

// Remaining capacity of one channel per op (bytes), with prefix searches. Leaves only shrink
// except where a planned stall adds capacity.
class BucketTree {
 public:
  explicit BucketTree(const std::vector<double>& v) {
    n_ = static_cast<int>(v.size());
    size_ = 1;
    while (size_ < n_) size_ <<= 1;
    t_.assign(2 * static_cast<std::size_t>(size_), 0.0);
    for (int i = 0; i < n_; ++i)
      t_[static_cast<std::size_t>(size_ + i)] = v[static_cast<std::size_t>(i)];
    for (int i = size_ - 1; i >= 1; --i) pull(i);
  }
  double get(int i) const { return t_[static_cast<std::size_t>(size_ + i)]; }
  void set(int i, double v) {
    int x = size_ + i;
    t_[static_cast<std::size_t>(x)] = std::max(0.0, v);
    for (x >>= 1; x >= 1; x >>= 1) pull(x);
  }
  // Adds the (index, value) items to their leaves, then updates each ancestor once per run of
  // neighbouring items (giving back a reservation of m items costs O(m + log n), not m log n).
  void add(const std::pair<int, double>* first, const std::pair<int, double>* last) {
    auto& xs = scratch_;
    xs.clear();
    for (const auto* p = first; p != last; ++p) {
      const int x = size_ + p->first;
      auto& v = t_[static_cast<std::size_t>(x)];
      v = std::max(0.0, v + p->second);
      if (xs.empty() || xs.back() != x) xs.push_back(x);
    }
    while (!xs.empty() && xs.front() > 1) {
      std::size_t out = 0;
      for (const int x : xs) {
        if (out == 0 || xs[out - 1] != x >> 1) xs[out++] = x >> 1;
      }
      xs.resize(out);
      for (const int x : xs) pull(x);
    }
  }
  double sum(int l, int r) const {
    double s = 0;
    if (l > r) return 0;
    for (int a = l + size_, b = r + size_ + 1; a < b; a >>= 1, b >>= 1) {
      if ((a & 1) != 0) s += t_[static_cast<std::size_t>(a++)];
      if ((b & 1) != 0) s += t_[static_cast<std::size_t>(--b)];
    }
    return s;
  }
  // Smallest j in [l, r] with sum(l..j) >= need (need > 0), or -1.
  int find_forward(int l, int r, double need) const {
    if (l > r) return -1;
    const int j = ff(1, 0, size_ - 1, l, r, need);
    return j;
  }
  // Largest j in [l, r] with sum(j..r) >= need, or -1.
  int find_backward(int l, int r, double need) const {
    if (l > r) return -1;
    return fb(1, 0, size_ - 1, l, r, need);
  }
  // Sets [l, r] to zero and appends the (index, value) of every nonzero leaf it cleared.
  void zero(int l, int r, std::vector<std::pair<int, double>>& cleared) {
    if (l <= r) zero(1, 0, size_ - 1, l, r, cleared);
  }

 private:
  void pull(int x) {
    t_[static_cast<std::size_t>(x)] =
        t_[static_cast<std::size_t>(2 * x)] + t_[static_cast<std::size_t>(2 * x + 1)];
  }
  int ff(int x, int nl, int nr, int l, int r, double& need) const {
    const double v = t_[static_cast<std::size_t>(x)];
    if (nr < l || nl > r || v <= 0) return -1;
    if (l <= nl && nr <= r && v < need) {
      need -= v;
      return -1;
    }
    if (nl == nr) return nl;
    const int mid = (nl + nr) / 2;
    const int j = ff(2 * x, nl, mid, l, r, need);
    return j >= 0 ? j : ff(2 * x + 1, mid + 1, nr, l, r, need);
  }
  int fb(int x, int nl, int nr, int l, int r, double& need) const {
    const double v = t_[static_cast<std::size_t>(x)];
    if (nr < l || nl > r || v <= 0) return -1;
    if (l <= nl && nr <= r && v < need) {
      need -= v;
      return -1;
    }
    if (nl == nr) return nl;
    const int mid = (nl + nr) / 2;
    const int j = fb(2 * x + 1, mid + 1, nr, l, r, need);
    return j >= 0 ? j : fb(2 * x, nl, mid, l, r, need);
  }
  void zero(int x, int nl, int nr, int l, int r, std::vector<std::pair<int, double>>& cleared) {
    if (nr < l || nl > r || t_[static_cast<std::size_t>(x)] <= 0) return;
    if (nl == nr) {
      cleared.emplace_back(nl, t_[static_cast<std::size_t>(x)]);
      t_[static_cast<std::size_t>(x)] = 0;
      return;
    }
    const int mid = (nl + nr) / 2;
    zero(2 * x, nl, mid, l, r, cleared);
    zero(2 * x + 1, mid + 1, nr, l, r, cleared);
    pull(x);
  }
  int n_ = 0;
  int size_ = 1;
  std::vector<double> t_;
  std::vector<int> scratch_;
};

// Range add with min and max queries over int64 values.
class RangeTree {
 public:
  explicit RangeTree(const std::vector<std::int64_t>& v) {
    n_ = static_cast<int>(v.size());
    size_ = 1;
    while (size_ < n_) size_ <<= 1;
    mn_.assign(2 * static_cast<std::size_t>(size_), kInf);
    mx_.assign(2 * static_cast<std::size_t>(size_), -kInf);
    lz_.assign(2 * static_cast<std::size_t>(size_), 0);
    for (int i = 0; i < n_; ++i) {
      mn_[static_cast<std::size_t>(size_ + i)] = mx_[static_cast<std::size_t>(size_ + i)] =
          v[static_cast<std::size_t>(i)];
    }
    for (int i = size_ - 1; i >= 1; --i) pull(i);
  }
  static constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max() / 4;

  void add(int l, int r, std::int64_t v) {
    if (l <= r) add(1, 0, size_ - 1, l, r, v);
  }
  std::int64_t max(int l, int r) { return l <= r ? qmax(1, 0, size_ - 1, l, r) : -kInf; }
  std::int64_t get(int i) { return qmax(1, 0, size_ - 1, i, i); }
  void set(int i, std::int64_t v) { set(1, 0, size_ - 1, i, v); }
  // Leftmost index in [l, r] whose value is <= threshold, or -1.
  int first_at_most(int l, int r, std::int64_t threshold) {
    return l <= r ? fam(1, 0, size_ - 1, l, r, threshold) : -1;
  }

 private:
  void pull(int x) {
    const auto a = static_cast<std::size_t>(2 * x);
    mn_[static_cast<std::size_t>(x)] = std::min(mn_[a], mn_[a + 1]);
    mx_[static_cast<std::size_t>(x)] = std::max(mx_[a], mx_[a + 1]);
  }
  void apply(int x, std::int64_t v) {
    const auto i = static_cast<std::size_t>(x);
    if (mn_[i] < kInf) mn_[i] += v;
    if (mx_[i] > -kInf) mx_[i] += v;
    lz_[i] += v;
  }
  void push(int x) {
    const auto i = static_cast<std::size_t>(x);
    if (lz_[i] != 0) {
      apply(2 * x, lz_[i]);
      apply(2 * x + 1, lz_[i]);
      lz_[i] = 0;
    }
  }
  void add(int x, int nl, int nr, int l, int r, std::int64_t v) {
    if (nr < l || nl > r) return;
    if (l <= nl && nr <= r) {
      apply(x, v);
      return;
    }
    push(x);
    const int mid = (nl + nr) / 2;
    add(2 * x, nl, mid, l, r, v);
    add(2 * x + 1, mid + 1, nr, l, r, v);
    pull(x);
  }
  std::int64_t qmax(int x, int nl, int nr, int l, int r) {
    if (nr < l || nl > r) return -kInf;
    if (l <= nl && nr <= r) return mx_[static_cast<std::size_t>(x)];
    push(x);
    const int mid = (nl + nr) / 2;
    return std::max(qmax(2 * x, nl, mid, l, r), qmax(2 * x + 1, mid + 1, nr, l, r));
  }
  void set(int x, int nl, int nr, int i, std::int64_t v) {
    if (nl == nr) {
      mn_[static_cast<std::size_t>(x)] = mx_[static_cast<std::size_t>(x)] = v;
      return;
    }
    push(x);
    const int mid = (nl + nr) / 2;
    if (i <= mid) {
      set(2 * x, nl, mid, i, v);
    } else {
      set(2 * x + 1, mid + 1, nr, i, v);
    }
    pull(x);
  }
  int fam(int x, int nl, int nr, int l, int r, std::int64_t th) {
    if (nr < l || nl > r || mn_[static_cast<std::size_t>(x)] > th) return -1;
    if (nl == nr) return nl;
    push(x);
    const int mid = (nl + nr) / 2;
    const int j = fam(2 * x, nl, mid, l, r, th);
    return j >= 0 ? j : fam(2 * x + 1, mid + 1, nr, l, r, th);
  }
  int n_ = 0;
  int size_ = 1;
  std::vector<std::int64_t> mn_, mx_, lz_;
};

class Fenwick {
 public:
  explicit Fenwick(int n) : t_(static_cast<std::size_t>(n) + 1, 0.0) {}
  void add(int i, double v) {
    for (++i; i < static_cast<int>(t_.size()); i += i & -i) t_[static_cast<std::size_t>(i)] += v;
  }
  double prefix(int i) const {  // sum of [0, i]
    double s = 0;
    for (++i; i > 0; i -= i & -i) s += t_[static_cast<std::size_t>(i)];
    return s;
  }
  double sum(int l, int r) const { return l > r ? 0 : prefix(r) - (l > 0 ? prefix(l - 1) : 0); }

 private:
  std::vector<double> t_;
};

// The bandwidth a committed migration holds on one channel: (op, bytes) items sorted by their
// position in the candidate's period, with prefix sums. The least-stall fallback asks, for every
// committed period around every op it relieves, how much of it lies at or after (or before) that
// op; a scan of the items made that 80% of the planning time on Llama-3.1-405B (reservations in
// the optimizer step's millisecond ops have hundreds of items).
struct Reservation {
  std::vector<std::pair<int, double>> items;
  std::vector<int> pos;     // items' positions, ascending
  std::vector<double> cum;  // cum[i]: bytes of items[0, i)
};

struct Candidate {
  TensorId tensor = 0;
  std::uint64_t bytes = 0;
  OpIndex a = 0;  // last use
  OpIndex b = 0;  // next use
  int len = 0;    // ops strictly between, cyclically
  bool done = false;
  // Once committed: where, the positions of its transfers' end buckets, the bandwidth it
  // reserved per op (so that the least-stall fallback can move it), and its two actions.
  Target target = Target::kSsd;
  int pe = -1;
  int pp = -1;
  Reservation wres;
  Reservation rres;
  std::size_t off_action = 0;
};

struct Segment {
  int l, r;
};

struct Choice {
  bool ok = false;
  Target target = Target::kSsd;
  int pe = -1;  // position (0 = op a+1) of the bucket where the offload completes
  int pp = -1;  // position of the bucket where the prefetch starts
  double score = 0;
};

class Planner {
 public:
  Planner(const trace::Trace& tr, const Hardware& hw, const PlannerOptions& opt)
      : tr_(tr), hw_(hw), opt_(opt), n_(static_cast<int>(tr.ops.size())) {}

  Plan run() {
    const auto t0 = std::chrono::steady_clock::now();
    Plan plan;
    plan.model = tr_.model;
    plan.hardware = hw_.name;
    plan.num_ops = n_;
    plan.num_tensors = static_cast<std::int32_t>(tr_.tensors.size());
    PlanSummary& sum = plan.summary;
    sum.capacity_bytes = hw_.device_memory;
    target_ = static_cast<std::int64_t>(static_cast<double>(hw_.device_memory) *
                                        (1.0 - hw_.memory_margin));
    sum.target_bytes = static_cast<std::uint64_t>(target_);
    sum.compute_seconds = tr_.compute_seconds();
    if (n_ == 0) {
      sum.fits = true;
      return plan;
    }
    const trace::LifetimeAnalysis la = trace::analyze_lifetimes(tr_);
    for (std::uint64_t v : la.live_bytes)
      sum.peak_before_bytes = std::max(sum.peak_before_bytes, v);

    rates_ = hw_.channels();
    if (!opt_.use_host || hw_.host_memory == 0) {
      rates_[Channel::kHostWrite] = rates_[Channel::kHostRead] = 0;
    }
    tau_.resize(static_cast<std::size_t>(n_));
    for (int k = 0; k < n_; ++k)
      tau_[static_cast<std::size_t>(k)] = tr_.op_seconds(static_cast<std::size_t>(k));
    for (Channel c : kChannels) {  // buckets_ in Channel order
      std::vector<double> cap(static_cast<std::size_t>(n_));
      for (int k = 0; k < n_; ++k)
        cap[static_cast<std::size_t>(k)] = rates_[c] * tau_[static_cast<std::size_t>(k)];
      buckets_.emplace_back(cap);
    }

    // Candidates: every inactive period of a tensor worth moving.
    for (const auto& life : la.tensors) {
      for (const auto& p : life.periods) {
        if (p.bytes == 0 || p.bytes < opt_.min_bytes) continue;
        Candidate c;
        c.tensor = p.tensor;
        c.bytes = p.bytes;
        c.a = p.last_use;
        c.b = p.next_use;
        c.len = p.wraps ? (n_ - 1 - p.last_use) + p.next_use : p.next_use - p.last_use - 1;
        if (c.len < 3) continue;  // nothing can be freed between the transfers
        cands_.push_back(c);
      }
    }
    sum.candidates = static_cast<std::int64_t>(cands_.size());

    check_active_fit(la);

    // Ops over the target, with their compute time as weight.
    std::vector<std::int64_t> m(static_cast<std::size_t>(n_));
    fenwick_ = std::make_unique<Fenwick>(n_);
    for (int k = 0; k < n_; ++k) {
      const auto v = static_cast<std::int64_t>(la.live_bytes[static_cast<std::size_t>(k)]);
      const bool over = v > target_;
      m[static_cast<std::size_t>(k)] = over ? v : RangeTree::kInf;
      if (over) fenwick_->add(k, weight(k));
    }
    over_ = std::make_unique<RangeTree>(m);
    for (auto& tree : away_) {
      tree =
          std::make_unique<RangeTree>(std::vector<std::int64_t>(static_cast<std::size_t>(n_), 0));
    }
    diff_.assign(static_cast<std::size_t>(n_) + 1, 0);
    stall_at_.assign(static_cast<std::size_t>(n_), 0.0);
    initial_over_ = fenwick_->sum(0, n_ - 1);

    greedy(plan);
    if (over_->first_at_most(0, n_ - 1, RangeTree::kInf / 2) >= 0 && opt_.allow_stalls) {
      fallback(plan);
    }
    if (opt_.prune) prune(plan, la);

    stall_summary(plan);

    // The planned memory per op, and the summary.
    std::int64_t run = 0;
    for (int k = 0; k < n_; ++k) {
      run += diff_[static_cast<std::size_t>(k)];
      const std::int64_t v =
          static_cast<std::int64_t>(la.live_bytes[static_cast<std::size_t>(k)]) + run;
      if (static_cast<std::uint64_t>(v) > sum.peak_after_bytes) {
        sum.peak_after_bytes = static_cast<std::uint64_t>(v);
        sum.peak_after_op = k;
      }
    }
    sum.peak_host_bytes =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, away(Target::kHost).max(0, n_ - 1)));
    sum.fits = sum.peak_after_bytes <= hw_.device_memory;
    for (const auto& [op, s] : plan.stalls) sum.planned_stall_seconds += s;
    std::sort(plan.actions.begin(), plan.actions.end(),
              [](const PlanAction& x, const PlanAction& y) {
                if (x.trigger != y.trigger) return x.trigger < y.trigger;
                if (x.kind != y.kind) return x.kind < y.kind;
                return x.tensor < y.tensor;
              });
    if (opt_.progress) opt_.progress(1.0);
    sum.planning_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return plan;
  }

 private:
  // Zero-time ops still count a little, so that an op over capacity always has a weight.
  double weight(int k) const { return tau_[static_cast<std::size_t>(k)] + 1e-9; }

  // Positions and ops are within one iteration of each other, so a compare replaces the modulo
  // (these two run tens of millions of times on a 70B trace).
  int op_at(const Candidate& c, int pos) const {
    const int k = c.a + 1 + pos;
    return k >= n_ ? k - n_ : (k < 0 ? k + n_ : k);
  }
  int pos_of(const Candidate& c, int k) const { return k > c.a ? k - c.a - 1 : k - c.a - 1 + n_; }

  // The op ranges covering positions [p0, p1] of c's interior, in order.
  int segments(const Candidate& c, int p0, int p1, Segment out[2]) const {
    if (p0 > p1) return 0;
    const int l = op_at(c, p0);
    const int len = p1 - p0;
    if (l + len < n_) {
      out[0] = {l, l + len};
      return 1;
    }
    out[0] = {l, n_ - 1};
    out[1] = {0, l + len - n_};
    return 2;
  }

  double bucket_sum(const BucketTree& t, const Candidate& c, int p0, int p1) const {
    Segment s[2];
    const int ns = segments(c, p0, p1, s);
    double v = 0;
    for (int i = 0; i < ns; ++i) v += t.sum(s[i].l, s[i].r);
    return v;
  }

  // Position where filling `need` bytes forward from p0 completes, or -1.
  int fill_forward(const BucketTree& t, const Candidate& c, int p0, int p1, double need) const {
    Segment s[2];
    const int ns = segments(c, p0, p1, s);
    for (int i = 0; i < ns; ++i) {
      const double have = t.sum(s[i].l, s[i].r);
      if (have >= need) {
        int j = t.find_forward(s[i].l, s[i].r, need);
        if (j < 0) j = s[i].r;  // rounding
        return pos_of(c, j);
      }
      need -= have;
    }
    return -1;
  }
  int fill_backward(const BucketTree& t, const Candidate& c, int p0, int p1, double need) const {
    Segment s[2];
    const int ns = segments(c, p0, p1, s);
    for (int i = ns - 1; i >= 0; --i) {
      const double have = t.sum(s[i].l, s[i].r);
      if (have >= need) {
        int j = t.find_backward(s[i].l, s[i].r, need);
        if (j < 0) j = s[i].l;
        return pos_of(c, j);
      }
      need -= have;
    }
    return -1;
  }

  double over_time(const Candidate& c, int p0, int p1) const {
    Segment s[2];
    const int ns = segments(c, p0, p1, s);
    double v = 0;
    for (int i = 0; i < ns; ++i) v += fenwick_->sum(s[i].l, s[i].r);
    return v;
  }

  // The tensors planned away to `target` at each op (bytes), and the tier's capacity (0: none).
  RangeTree& away(Target target) { return *away_[target == Target::kHost ? 1 : 0]; }
  [[nodiscard]] std::uint64_t tier_capacity(Target target) const {
    return target == Target::kHost ? hw_.host_memory : hw_.ssd_capacity;
  }

  // Host memory is always bounded (0: no host tier); an SSD capacity of 0 means no bound, and
  // then nothing is tracked for the SSDs (the fallback moves migrations hundreds of thousands
  // of times on a 70B trace).
  [[nodiscard]] bool bounded(Target target) const {
    return target == Target::kHost || hw_.ssd_capacity > 0;
  }

  // Adds `bytes` (negative: removes) to what `target` holds over c's inactive period.
  void mark_away(const Candidate& c, Target target, std::int64_t bytes) {
    if (!bounded(target)) return;
    Segment all[2];
    const int na = segments(c, 0, c.len - 1, all);
    for (int i = 0; i < na; ++i) away(target).add(all[i].l, all[i].r, bytes);
  }

  // Whether `target` can hold c over its whole inactive period.
  bool room(const Candidate& c, Target target) {
    if (!bounded(target)) return true;
    const std::uint64_t cap = tier_capacity(target);
    Segment s[2];
    const int ns = segments(c, 0, c.len - 1, s);
    std::int64_t used = 0;
    for (int i = 0; i < ns; ++i) used = std::max(used, away(target).max(s[i].l, s[i].r));
    return used + static_cast<std::int64_t>(c.bytes) <= static_cast<std::int64_t>(cap);
  }

  Choice evaluate_target(const Candidate& c, Target target) {
    Choice ch;
    if (!rates_.usable(target)) return ch;
    if (!room(c, target)) return ch;
    const auto need = static_cast<double>(c.bytes);
    const int pe = fill_forward(bucket(target, Direction::kWrite), c, 0, c.len - 1, need);
    if (pe < 0) return ch;
    const int pp = fill_backward(bucket(target, Direction::kRead), c, 0, c.len - 1, need);
    if (pp < 0 || pe + 1 > pp - 1) return ch;
    ch.ok = true;
    ch.target = target;
    ch.pe = pe;
    ch.pp = pp;
    ch.score = over_time(c, pe + 1, pp - 1);
    return ch;
  }

  // The target whose channels free more over-target time for this period; on a tie the SSDs
  // (host memory is the scarcer resource), or host memory with options.prefer_host (fewer SSD
  // writes); SSD alone when host memory is off or full. Taking SSD
  // whenever it had any room (the first version) left the optimizer step of the after-backward
  // schedule reading almost everything from the SSDs while the host channels idled: on
  // Llama3-70B b16, 916 of 1,037 GB read in the step came from the SSDs, at 26.8 GB/s instead
  // of the link's 55 GB/s (35 s of stall instead of 26 s).
  Choice evaluate(const Candidate& c) {
    Choice ssd = evaluate_target(c, Target::kSsd);
    if (!ssd.ok || ssd.score <= 0) ssd = Choice{};
    Choice host = evaluate_target(c, Target::kHost);
    if (host.ok && host.score > 0 &&
        (host.score > ssd.score || (opt_.prefer_host && host.score >= ssd.score))) {
      return host;
    }
    return ssd;
  }

  // Takes `need` bytes from the buckets at positions 0..pe (all of 0..pe-1, the rest from pe).
  void consume_forward(BucketTree& t, const Candidate& c, int pe, double need, Reservation& res) {
    consume_forward_range(t, c, 0, pe, need, res);
  }
  // Takes `need` bytes from positions pp..len-1 (all of pp+1.., the rest from pp).
  void consume_backward(BucketTree& t, const Candidate& c, int pp, int last, double need,
                        Reservation& res) {
    Segment s[2];
    const int ns = segments(c, pp + 1, last, s);
    take(t, c, s, ns, op_at(c, pp), need, res);
  }

  // Empties the buckets of the segments into res, then takes what is still needed from op k.
  void take(BucketTree& t, const Candidate& c, const Segment* s, int ns, int k, double need,
            Reservation& res) {
    auto& items = res.items;
    const std::size_t first = items.size();
    for (int i = 0; i < ns; ++i) t.zero(s[i].l, s[i].r, items);
    double took = 0;
    for (std::size_t i = first; i < items.size(); ++i) took += items[i].second;
    const double part = std::min(t.get(k), std::max(0.0, need - took));
    t.set(k, t.get(k) - part);
    if (part > 0) items.emplace_back(k, part);
    index(c, res);
  }

  // Sorts res's items by position in c's period and rebuilds the positions and prefix sums.
  void index(const Candidate& c, Reservation& res) const {
    auto& items = res.items;
    const auto by_pos = [&](const auto& x, const auto& y) {
      return pos_of(c, x.first) < pos_of(c, y.first);
    };
    if (!std::is_sorted(items.begin(), items.end(), by_pos)) {
      std::stable_sort(items.begin(), items.end(), by_pos);
    }
    res.pos.resize(items.size());
    res.cum.assign(items.size() + 1, 0.0);
    for (std::size_t i = 0; i < items.size(); ++i) {
      res.pos[i] = pos_of(c, items[i].first);
      res.cum[i + 1] = res.cum[i] + items[i].second;
    }
  }

  // The items of res at positions [p0, p1], as a half-open index range.
  static std::pair<std::size_t, std::size_t> span_of(const Reservation& res, int p0, int p1) {
    const auto i = std::lower_bound(res.pos.begin(), res.pos.end(), p0) - res.pos.begin();
    const auto j = std::upper_bound(res.pos.begin(), res.pos.end(), p1) - res.pos.begin();
    return {static_cast<std::size_t>(i), static_cast<std::size_t>(std::max(i, j))};
  }

  // Lowers M' by the candidate's bytes over positions [p0, p1] and retires ops that now fit.
  void free_span(const Candidate& c, int p0, int p1) {
    const auto s = static_cast<std::int64_t>(c.bytes);
    Segment seg[2];
    const int ns = segments(c, p0, p1, seg);
    for (int i = 0; i < ns; ++i) {
      over_->add(seg[i].l, seg[i].r, -s);
      for (int k = over_->first_at_most(seg[i].l, seg[i].r, target_); k >= 0;
           k = over_->first_at_most(seg[i].l, seg[i].r, target_)) {
        over_->set(k, RangeTree::kInf);
        fenwick_->add(k, -weight(k));
      }
      diff_[static_cast<std::size_t>(seg[i].l)] -= s;
      diff_[static_cast<std::size_t>(seg[i].r) + 1] += s;
    }
  }

  void commit(Plan& plan, Candidate& c, const Choice& ch) {
    c.done = true;
    c.target = ch.target;
    c.pe = ch.pe;
    c.pp = ch.pp;
    const auto need = static_cast<double>(c.bytes);
    consume_forward(bucket(ch.target, Direction::kWrite), c, ch.pe, need, c.wres);
    consume_backward(bucket(ch.target, Direction::kRead), c, ch.pp, c.len - 1, need, c.rres);
    free_span(c, ch.pe + 1, ch.pp - 1);
    PlanSummary& sum = plan.summary;
    mark_away(c, ch.target, static_cast<std::int64_t>(c.bytes));
    if (ch.target == Target::kHost) {
      ++sum.offloads_host;
      sum.bytes_to_host += c.bytes;
    } else {
      ++sum.offloads_ssd;
      sum.bytes_to_ssd += c.bytes;
    }
    PlanAction off;
    off.tensor = c.tensor;
    off.kind = ActionKind::kOffload;
    off.target = ch.target;
    off.bytes = c.bytes;
    PlanAction pre = off;
    pre.kind = ActionKind::kPrefetch;
    c.off_action = plan.actions.size();
    plan.actions.push_back(off);
    plan.actions.push_back(pre);
    set_times(plan, c);
    if (opt_.progress && (++commits_ & 255) == 0 && initial_over_ > 0) {
      opt_.progress(1.0 - fenwick_->sum(0, n_ - 1) / initial_over_);
    }
  }

  // The actions' trigger and deadline ops from the candidate's transfer positions.
  void set_times(Plan& plan, const Candidate& c) const {
    PlanAction& off = plan.actions[c.off_action];
    PlanAction& pre = plan.actions[c.off_action + 1];
    off.trigger = c.a;
    off.deadline = op_at(c, c.pe + 1);
    off.wraps = off.deadline <= off.trigger;
    pre.trigger = op_at(c, c.pp - 1);
    pre.deadline = c.b;
    pre.wraps = pre.deadline <= pre.trigger;
  }

  void greedy(Plan& plan) {
    struct Entry {
      double score;
      std::uint64_t bytes;
      int cand;
      bool operator<(const Entry& o) const {
        return score != o.score ? score < o.score : bytes < o.bytes;
      }
    };
    std::priority_queue<Entry> heap;
    for (std::size_t i = 0; i < cands_.size(); ++i) {
      const Choice ch = evaluate(cands_[i]);
      if (ch.ok) heap.push({ch.score, cands_[i].bytes, static_cast<int>(i)});
    }
    while (!heap.empty() && fenwick_->sum(0, n_ - 1) > 0) {
      const Entry top = heap.top();
      heap.pop();
      Candidate& c = cands_[static_cast<std::size_t>(top.cand)];
      if (c.done) continue;
      const Choice ch = evaluate(c);
      if (!ch.ok) continue;
      if (!heap.empty() && ch.score < heap.top().score * (1 - 1e-12)) {
        heap.push({ch.score, c.bytes, top.cand});  // scores only shrink: re-queue, look again
        continue;
      }
      commit(plan, c, ch);
    }
  }

  // A stall of `seconds` in bucket `bucket` gives every channel that much more time there.
  // The op that waits is the next one; the stalls are merged per bucket in stall_summary().
  void add_stall(int bucket, double seconds) {
    for (Channel c : kChannels) {
      BucketTree& t = buckets_[index_of(c)];
      t.set(bucket, t.get(bucket) + rates_[c] * seconds);
    }
    stall_at_[static_cast<std::size_t>(bucket)] += seconds;
  }

  // The stalls the plan needs: the channels run at once, so a stall in bucket k serves all of
  // them and only has to be as long as the channel that uses most of it needs (its reservations
  // there beyond the op's own time, over its rate), not the sum of the stalls that were added
  // there one channel at a time. The reservations stay feasible with these stalls.
  void stall_summary(Plan& plan) const {
    for (int k = 0; k < n_; ++k) {
      const double added = stall_at_[static_cast<std::size_t>(k)];
      if (added <= 0) continue;
      double need = 0;
      for (Channel c : kChannels) {
        const double rate = rates_[c];
        if (rate <= 0) continue;
        const double own = rate * tau_[static_cast<std::size_t>(k)];
        const double used = own + rate * added - buckets_[index_of(c)].get(k);
        need = std::max(need, (used - own) / rate);
      }
      need = std::min(added, need);
      if (need > 0) plan.stalls.emplace_back((k + 1) % n_, need);
    }
  }

  // Bytes of a reservation at positions [p0, p1] of c's interior.
  static double reserved(const Reservation& res, int p0, int p1) {
    const auto [i, j] = span_of(res, p0, p1);
    return res.cum[j] - res.cum[i];
  }

  // Gives back the part of a reservation at positions [p0, p1]; returns its bytes.
  double release(BucketTree& t, const Candidate& c, Reservation& res, int p0, int p1) {
    const auto [i, j] = span_of(res, p0, p1);
    const double v = res.cum[j] - res.cum[i];
    t.add(res.items.data() + i, res.items.data() + j);
    res.items.erase(res.items.begin() + static_cast<std::ptrdiff_t>(i),
                    res.items.begin() + static_cast<std::ptrdiff_t>(j));
    index(c, res);
    return v;
  }

  struct Option {
    int cand = -1;
    Target target = Target::kSsd;
    double stall_w = 0;  // seconds before op k so that the offload is out
    double stall_r = 0;  // seconds before op b so that the prefetch, started after k, is in
    double cost = std::numeric_limits<double>::infinity();
  };

  // The stall that makes candidate c absent at op k (position pk): for a new candidate, both
  // transfers squeezed around k; for a committed one, its offload finished before k or its
  // prefetch started after k.
  Option option_for(int i, int k, std::int64_t excess) {
    Option best;
    const Candidate& c = cands_[static_cast<std::size_t>(i)];
    const int pk = pos_of(c, k);
    if (pk < 1 || pk > c.len - 2) return best;
    const auto s = static_cast<double>(c.bytes);
    const double denom = std::min(s, static_cast<double>(std::max<std::int64_t>(excess, 1)));
    for (Target target : {Target::kSsd, Target::kHost}) {
      if (c.done && target != c.target) continue;
      if (!rates_.usable(target)) continue;
      if (!c.done && !room(c, target)) continue;
      const BucketTree& tw = bucket(target, Direction::kWrite);
      const BucketTree& tr = bucket(target, Direction::kRead);
      double dw = 0;
      double dr = 0;
      if (!c.done) {
        dw = std::max(0.0, s - bucket_sum(tw, c, 0, pk - 1));
        dr = std::max(0.0, s - bucket_sum(tr, c, pk + 1, c.len - 1));
      } else if (pk <= c.pe) {
        dw = std::max(0.0, reserved(c.wres, pk, c.len - 1) - bucket_sum(tw, c, 0, pk - 1));
      } else if (pk >= c.pp) {
        dr = std::max(0.0, reserved(c.rres, 0, pk) - bucket_sum(tr, c, pk + 1, c.len - 1));
      } else {
        continue;  // already absent at k
      }
      Option o;
      o.cand = i;
      o.target = target;
      o.stall_w = dw / rates_[channel_of(target, Direction::kWrite)];
      o.stall_r = dr / rates_[channel_of(target, Direction::kRead)];
      o.cost = (o.stall_w + o.stall_r) / denom;
      if (o.cost < best.cost) best = o;
    }
    return best;
  }

  // Least-stall choice for each op still over the target, leftmost first: the options that
  // free the op are ranked by stall per byte once, then taken in that order (each re-evaluated
  // just before it is applied) until the op fits. Migrations not yet planned are preferred;
  // moving committed ones is the last resort.
  //
  // The sweep is cyclic and starts at the first op over the target after the longest run of
  // ops that fit: the iteration wraps around, and a sweep from op 0 would price the stalls of
  // the first ops (waiting for offloads issued at the end of the previous iteration) before
  // the stalls just before them in time, which give the same channels their capacity.
  void fallback(Plan& plan) {
    std::vector<std::pair<double, int>> ranked;
    const int start = sweep_start();
    for (;;) {
      int k = over_->first_at_most(start, n_ - 1, RangeTree::kInf / 2);
      if (k < 0) k = over_->first_at_most(0, n_ - 1, RangeTree::kInf / 2);
      if (k < 0) break;
      for (int pass = 0; pass < 2 && over_->get(k) < RangeTree::kInf / 2; ++pass) {
        ranked.clear();
        const std::int64_t excess = over_->get(k) - target_;
        for (std::size_t i = 0; i < cands_.size(); ++i) {
          if (cands_[i].done != (pass == 1)) continue;
          const Option o = option_for(static_cast<int>(i), k, excess);
          if (o.cand >= 0) ranked.emplace_back(o.cost, o.cand);
        }
        std::sort(ranked.begin(), ranked.end(), [&](const auto& x, const auto& y) {
          if (x.first != y.first) return x.first < y.first;
          return cands_[static_cast<std::size_t>(x.second)].bytes >
                 cands_[static_cast<std::size_t>(y.second)].bytes;
        });
        for (const auto& [cost, i] : ranked) {
          if (over_->get(k) >= RangeTree::kInf / 2) break;
          const Option o = option_for(i, k, over_->get(k) - target_);
          if (o.cand >= 0) apply(plan, o, k);
        }
      }
      if (over_->get(k) < RangeTree::kInf / 2) {
        // Without a bound on the SSDs some migration always relieves an op (the feasibility
        // check saw to that); with one, the SSDs and host memory may both be full there.
        TIDAL_EXPECT_AS(InvalidArgument, hw_.ssd_capacity == 0, "the plan cannot fit: at op ", k,
                        " '", tr_.ops[static_cast<std::size_t>(k)].name,
                        "' the tensors that could leave device memory find no room in the SSD "
                        "store (",
                        format_bytes(static_cast<double>(hw_.ssd_capacity)),
                        " usable) or in host memory (",
                        format_bytes(static_cast<double>(hw_.host_memory)),
                        "): give the store more capacity, or allow more host memory");
        TIDAL_FAIL("planner: no migration can relieve op ", k, " (",
                   tr_.ops[static_cast<std::size_t>(k)].name, "); this is a bug");
      }
    }
  }

  // Drops the committed migrations that the others make unnecessary. The greedy scores a period
  // by the time it frees while the ops are over the target, but commits the whole period; the
  // later commits then cover the ops the early ones were taken for, and the planned peak ends
  // far under the target (Llama3-8B in-backward: 25 GiB against 86.7 GiB). A migration can go
  // when M' (memory per op with all the others) plus its bytes stays at or under the target over
  // the ops it frees; dropping it gives back its bandwidth, so the planned stall can only shrink.
  //
  // What a drop saves depends on the tensor's other migrations: a tensor unchanged since its
  // last write to a target is not written there again (the store keeps the copy; the simulator
  // models this), so of the migrations of one tensor to one target between two ops that modify
  // it (a "group") only the first writes. Dropping one member of a group saves a read and no
  // write, and dropping the first moves the write to the next member, later than the planner's
  // deadlines assumed it. So: first whole groups, where every member can go (their periods are
  // disjoint, so each member is checked on its own); then, in what is left, single members
  // other than the one that writes. SSD before host memory (SSD writes wear the drives); within
  // a pass, least relief needed first (compute time over the target, with everything kept, of
  // the ops a group frees; zero for ops that never exceeded it), then the largest. M' only grows
  // as migrations go, so each pass is maximal for its order.
  void prune(Plan& plan, const trace::LifetimeAnalysis& la) {
    std::vector<std::int64_t> m(static_cast<std::size_t>(n_));
    std::vector<double> over_prefix(static_cast<std::size_t>(n_) + 1, 0.0);
    std::int64_t run = 0;
    for (int k = 0; k < n_; ++k) {
      const auto kk = static_cast<std::size_t>(k);
      run += diff_[kk];
      const auto live = static_cast<std::int64_t>(la.live_bytes[kk]);
      m[kk] = live + run;
      over_prefix[kk + 1] = over_prefix[kk] + (live > target_ ? weight(k) : 0.0);
    }
    RangeTree mem(m);

    // The ops that modify each tensor, in order.
    std::vector<std::vector<OpIndex>> writes(tr_.tensors.size());
    for (const auto& op : tr_.ops) {
      for (TensorId id : op.outputs) writes[static_cast<std::size_t>(id)].push_back(op.index);
    }
    struct Member {
      bool host;
      TensorId tensor;
      int epoch;  // the last op at or before the offload that modified the tensor (-1: none)
      int after;  // ops from that op to the offload
      int cand;
    };
    std::vector<Member> members;
    for (std::size_t i = 0; i < cands_.size(); ++i) {
      const Candidate& c = cands_[i];
      if (!c.done) continue;
      const auto& w = writes[static_cast<std::size_t>(c.tensor)];
      const auto it = std::upper_bound(w.begin(), w.end(), c.a);
      const int epoch = it != w.begin() ? *(it - 1) : (w.empty() ? -1 : w.back());
      const int after = epoch < 0 ? c.a : ((c.a - epoch) % n_ + n_) % n_;
      members.push_back({c.target == Target::kHost, c.tensor, epoch, after, static_cast<int>(i)});
    }
    std::sort(members.begin(), members.end(), [](const Member& x, const Member& y) {
      if (x.host != y.host) return !x.host;
      if (x.tensor != y.tensor) return x.tensor < y.tensor;
      if (x.epoch != y.epoch) return x.epoch < y.epoch;
      return x.after < y.after;
    });
    struct Group {
      bool host;
      double need;
      std::uint64_t bytes;
      std::size_t first;  // members[first, last)
      std::size_t last;
    };
    std::vector<Group> groups;
    for (std::size_t i = 0; i < members.size();) {
      std::size_t j = i;
      Group g{members[i].host, 0.0, 0, i, i};
      while (j < members.size() && members[j].host == members[i].host &&
             members[j].tensor == members[i].tensor && members[j].epoch == members[i].epoch) {
        const Candidate& c = cands_[static_cast<std::size_t>(members[j].cand)];
        Segment seg[2];
        const int ns = segments(c, c.pe + 1, c.pp - 1, seg);
        for (int q = 0; q < ns; ++q) {
          g.need += over_prefix[static_cast<std::size_t>(seg[q].r) + 1] -
                    over_prefix[static_cast<std::size_t>(seg[q].l)];
        }
        g.bytes += c.bytes;
        ++j;
      }
      g.last = j;
      groups.push_back(g);
      i = j;
    }
    std::sort(groups.begin(), groups.end(), [](const Group& x, const Group& y) {
      if (x.host != y.host) return !x.host;
      if (x.need != y.need) return x.need < y.need;
      if (x.bytes != y.bytes) return x.bytes > y.bytes;
      return x.first < y.first;
    });

    auto can_drop = [&](const Candidate& c) {
      Segment seg[2];
      const int ns = segments(c, c.pe + 1, c.pp - 1, seg);
      for (int q = 0; q < ns; ++q) {
        if (mem.max(seg[q].l, seg[q].r) + static_cast<std::int64_t>(c.bytes) > target_) {
          return false;
        }
      }
      return true;
    };
    std::vector<char> dropped(plan.actions.size(), 0);
    auto drop = [&](Candidate& c) {
      const auto s = static_cast<std::int64_t>(c.bytes);
      Segment seg[2];
      const int ns = segments(c, c.pe + 1, c.pp - 1, seg);
      for (int q = 0; q < ns; ++q) {
        mem.add(seg[q].l, seg[q].r, s);
        diff_[static_cast<std::size_t>(seg[q].l)] += s;
        diff_[static_cast<std::size_t>(seg[q].r) + 1] -= s;
      }
      for (Direction dir : {Direction::kWrite, Direction::kRead}) {
        BucketTree& t = bucket(c.target, dir);
        Reservation& res = dir == Direction::kWrite ? c.wres : c.rres;
        t.add(res.items.data(), res.items.data() + res.items.size());
        res = Reservation{};
      }
      PlanSummary& sum = plan.summary;
      mark_away(c, c.target, -s);
      if (c.target == Target::kHost) {
        --sum.offloads_host;
        sum.bytes_to_host -= c.bytes;
      } else {
        --sum.offloads_ssd;
        sum.bytes_to_ssd -= c.bytes;
      }
      c.done = false;
      dropped[c.off_action] = dropped[c.off_action + 1] = 1;
    };

    for (bool host : {false, true}) {
      for (const Group& g : groups) {  // whole groups
        if (g.host != host) continue;
        bool all = true;
        for (std::size_t i = g.first; i < g.last && all; ++i) {
          all = can_drop(cands_[static_cast<std::size_t>(members[i].cand)]);
        }
        if (!all) continue;
        for (std::size_t i = g.first; i < g.last; ++i) {
          drop(cands_[static_cast<std::size_t>(members[i].cand)]);
        }
      }
      for (const Group& g : groups) {  // the members that only read
        if (g.host != host) continue;
        std::size_t writer = g.first;
        while (writer < g.last && !cands_[static_cast<std::size_t>(members[writer].cand)].done) {
          ++writer;
        }
        for (std::size_t i = writer + 1; i < g.last; ++i) {
          Candidate& c = cands_[static_cast<std::size_t>(members[i].cand)];
          if (c.done && can_drop(c)) drop(c);
        }
      }
    }
    std::size_t out = 0;
    for (std::size_t i = 0; i < plan.actions.size(); ++i) {
      if (dropped[i] == 0) plan.actions[out++] = plan.actions[i];
    }
    plan.actions.resize(out);
  }

  int sweep_start() {
    int first = -1;
    int prev = -1;
    int best_gap = -1;
    int start = 0;
    for (int k = over_->first_at_most(0, n_ - 1, RangeTree::kInf / 2); k >= 0;
         k = k + 1 < n_ ? over_->first_at_most(k + 1, n_ - 1, RangeTree::kInf / 2) : -1) {
      if (first < 0) first = k;
      if (prev >= 0 && k - prev > best_gap) {
        best_gap = k - prev;
        start = k;
      }
      prev = k;
    }
    if (first >= 0 && n_ - prev + first > best_gap) start = first;  // the gap across the wrap
    return start;
  }

  void apply(Plan& plan, const Option& best, int k) {
    Candidate& c = cands_[static_cast<std::size_t>(best.cand)];
    const int pk = pos_of(c, k);
    // A hair more than the deficit, so that rounding cannot leave it short.
    if (best.stall_w > 0) add_stall(op_at(c, pk - 1), best.stall_w * (1 + 1e-9) + 1e-12);
    if (best.stall_r > 0) add_stall(op_at(c, c.len - 1), best.stall_r * (1 + 1e-9) + 1e-12);
    BucketTree& tw = bucket(best.target, Direction::kWrite);
    BucketTree& tr = bucket(best.target, Direction::kRead);
    if (!c.done) {
      Choice ch = evaluate_target(c, best.target);
      TIDAL_EXPECT(ch.ok && ch.pe < pk && ch.pp > pk, "planner: the stall for op ", k,
                   " did not make room; this is a bug");
      commit(plan, c, ch);
    } else if (pk <= c.pe) {
      // Finish the offload before k: the bytes it moved from k on move to the ops before.
      const double moved = release(tw, c, c.wres, pk, c.len - 1);
      const int from = fill_backward(tw, c, 0, pk - 1, moved);
      TIDAL_EXPECT(from >= 0, "planner: the stall for op ", k, " did not make room; a bug");
      consume_backward(tw, c, from, pk - 1, moved, c.wres);
      const int old_pe = c.pe;
      c.pe = pk - 1;
      free_span(c, pk, old_pe);
      set_times(plan, c);
    } else {
      // Start the prefetch after k.
      const double moved = release(tr, c, c.rres, 0, pk);
      const int to = fill_forward(tr, c, pk + 1, c.len - 1, moved);
      TIDAL_EXPECT(to >= 0, "planner: the stall for op ", k, " did not make room; a bug");
      consume_forward_range(tr, c, pk + 1, to, moved, c.rres);
      const int old_pp = c.pp;
      c.pp = pk + 1;
      free_span(c, old_pp, pk);
      set_times(plan, c);
    }
  }

  // Takes `need` bytes from positions p0..pe of c (all of p0..pe-1, the rest from pe).
  void consume_forward_range(BucketTree& t, const Candidate& c, int p0, int pe, double need,
                             Reservation& res) {
    Segment s[2];
    const int ns = segments(c, p0, pe - 1, s);
    take(t, c, s, ns, op_at(c, pe), need, res);
  }

  void check_active_fit(const trace::LifetimeAnalysis& la) {
    // Bytes that may leave at op k: periods that cover it away from their ends.
    std::vector<std::int64_t> movable(static_cast<std::size_t>(n_) + 1, 0);
    for (const Candidate& c : cands_) {
      Segment s[2];
      const int ns = segments(c, 1, c.len - 2, s);
      for (int i = 0; i < ns; ++i) {
        movable[static_cast<std::size_t>(s[i].l)] += static_cast<std::int64_t>(c.bytes);
        movable[static_cast<std::size_t>(s[i].r) + 1] -= static_cast<std::int64_t>(c.bytes);
      }
    }
    std::int64_t run = 0;
    std::int64_t worst = 0;
    int worst_op = -1;
    for (int k = 0; k < n_; ++k) {
      run += movable[static_cast<std::size_t>(k)];
      const std::int64_t pinned =
          static_cast<std::int64_t>(la.live_bytes[static_cast<std::size_t>(k)]) - run;
      if (pinned - target_ > worst) {
        worst = pinned - target_;
        worst_op = k;
      }
    }
    if (worst_op < 0) return;
    const auto& op = tr_.ops[static_cast<std::size_t>(worst_op)];
    const auto kk = static_cast<std::size_t>(worst_op);
    TIDAL_EXPECT_AS(
        InvalidArgument, false, "the plan cannot fit: op ", worst_op, " '", op.name, "' (",
        trace::to_string(op.phase), ") needs ", format_bytes(static_cast<double>(worst + target_)),
        " of tensors that cannot leave device memory around it (",
        format_bytes(static_cast<double>(la.active_bytes[kk])), " used by the op itself), but ",
        format_bytes(static_cast<double>(target_)), " is available (",
        format_bytes(static_cast<double>(hw_.device_memory)), " less the ", hw_.memory_margin * 100,
        "% margin): ", format_bytes(static_cast<double>(worst)),
        " short. Use a smaller batch or sequence, or ", opt_.more_memory_hint, ".");
  }

  const trace::Trace& tr_;
  const Hardware& hw_;
  PlannerOptions opt_;
  int n_;
  std::int64_t target_ = 0;
  ChannelRates rates_;
  std::vector<double> tau_;
  std::vector<BucketTree> buckets_;  // remaining capacity per op, one per Channel (index_of)
  BucketTree& bucket(Target t, Direction d) { return buckets_[index_of(channel_of(t, d))]; }
  const BucketTree& bucket(Target t, Direction d) const {
    return buckets_[index_of(channel_of(t, d))];
  }
  std::vector<Candidate> cands_;
  std::unique_ptr<Fenwick> fenwick_;
  std::unique_ptr<RangeTree> over_;
  std::unique_ptr<RangeTree> away_[2];  // bytes planned away per op: [0] SSD, [1] host
  std::vector<std::int64_t> diff_;
  std::vector<double> stall_at_;  // seconds of stall added per bucket
  double initial_over_ = 0;
  std::int64_t commits_ = 0;
};

}  // namespace

Plan make_plan(const trace::Trace& trace, const Hardware& hw, const PlannerOptions& options) {
  TIDAL_EXPECT_AS(InvalidArgument, hw.device_memory > 0,
                  "the hardware model has no device memory capacity; give --gpu-mem");
  Planner p(trace, hw, options);
  return p.run();
}

}  // namespace tidal::plan
