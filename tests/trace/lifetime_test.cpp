#include "tidal/trace/lifetime.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tidal/common/error.hpp"
#include "trace/random_trace.hpp"

namespace tidal::trace {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kGiB = 1ull << 30;

// A hand-built iteration of six ops whose durations are 1, 2, 4, 8, 16, 32 s, so that every
// idle time below is an exact sum.
//
//   op0 fwd  linear         in {X, W}     out {A}
//   op1 fwd  gelu           in {A}        out {T}
//   op2 fwd  linear2+loss   in {T, W}     out {L}
//   op3 bwd  loss.backward  in {L}        out {}
//   op4 bwd  linear.bwd     in {A, X}     out {G}
//   op5 opt  adamw          in {W, G, S}  out {W, S}
//
// W parameter (100 B), X input (10 B), A activation (1000 B), T temporary freed after op 3
// (50 B), L temporary (7 B), G persistent gradient (200 B), S optimizer state (400 B).
enum : TensorId { W, X, A, T, L, G, S };

// Appends an op to t whose duration is 2^(its index), right after the previous one.
void add_op(Trace& t, const char* name, Phase phase, std::vector<TensorId> in,
            std::vector<TensorId> out) {
  const double now = t.ops.empty() ? 0.0 : t.ops.back().end_s;
  const double dur = std::ldexp(1.0, static_cast<int>(t.ops.size()));
  t.ops.push_back(Op{static_cast<OpIndex>(t.ops.size()), name, phase, now, now + dur, std::move(in),
                     std::move(out), 0});
}

Trace hand_trace() {
  Trace t;
  t.model = "hand";
  auto tensor = [&](TensorId id, const char* name, std::uint64_t bytes, TensorClass cls,
                    bool persistent, OpIndex producer, OpIndex freed_after) {
    // Tensor's fields in their order: id, name, bytes, device, class, persistent, producer,
    // output slot, freed after.
    t.tensors.push_back(Tensor{id, name, bytes, "cpu", cls, persistent, producer,
                               producer == kNoOp ? -1 : 0, freed_after});
  };
  tensor(W, "w", 100, TensorClass::kParameter, true, kNoOp, kNoOp);
  tensor(X, "x", 10, TensorClass::kInput, false, kNoOp, kNoOp);
  tensor(A, "a", 1000, TensorClass::kActivation, false, 0, kNoOp);
  tensor(T, "t", 50, TensorClass::kTemporary, false, 1, 3);
  tensor(L, "loss", 7, TensorClass::kTemporary, false, 2, kNoOp);
  tensor(G, "w.grad", 200, TensorClass::kGradient, true, kNoOp, kNoOp);
  tensor(S, "w.exp_avg", 400, TensorClass::kOptimizerState, true, kNoOp, kNoOp);
  add_op(t, "linear", Phase::kForward, {X, W}, {A});
  add_op(t, "gelu", Phase::kForward, {A}, {T});
  add_op(t, "linear2", Phase::kForward, {T, W}, {L});
  add_op(t, "loss.backward", Phase::kBackward, {L}, {});
  add_op(t, "linear.backward", Phase::kBackward, {A, X}, {G});
  add_op(t, "adamw", Phase::kOptimizer, {W, G, S}, {W, S});
  return t;
}

void expect_period(const InactivePeriod& p, TensorId tensor, std::uint64_t bytes, OpIndex last,
                   OpIndex next, bool wraps, double idle) {
  EXPECT_EQ(p.tensor, tensor);
  EXPECT_EQ(p.bytes, bytes);
  EXPECT_EQ(p.last_use, last);
  EXPECT_EQ(p.next_use, next);
  EXPECT_EQ(p.wraps, wraps);
  EXPECT_DOUBLE_EQ(p.idle_seconds, idle);
}

// The deferred optimizer schedule: the update (op 0) reads the gradient G that backward makes
// at op 4 of the previous iteration; G is dead between its update and op 4.
//
//   op0 opt  adamw            in {W, G, S}  out {W, S}
//   op1 fwd  linear           in {X, W}     out {A}
//   op2 fwd  linear2+loss     in {A, W}     out {L}
//   op3 bwd  loss.backward    in {L}        out {}
//   op4 bwd  linear.backward  in {A, X}     out {G}
//   op5 bwd  tail             in {X}        out {}
Trace deferred_trace() {
  Trace t = hand_trace();
  t.ops.clear();
  t.tensors[T].freed_after = kNoOp;  // T is not used in this trace
  t.tensors[T].producer = kNoOp;
  t.tensors[A].producer = 1;
  t.tensors[L].producer = 2;
  t.tensors[G].producer = 4;     // made anew by backward ...
  t.tensors[G].freed_after = 0;  // ... and dead once the update has read it
  add_op(t, "adamw", Phase::kOptimizer, {W, G, S}, {W, S});
  add_op(t, "linear", Phase::kForward, {X, W}, {A});
  add_op(t, "linear2", Phase::kForward, {A, W}, {L});
  add_op(t, "loss.backward", Phase::kBackward, {L}, {});
  add_op(t, "linear.backward", Phase::kBackward, {A, X}, {G});
  add_op(t, "tail", Phase::kBackward, {X}, {});
  return t;
}

TEST(LifetimeHand, AGapTensorIsDeadBetweenItsUpdateAndItsProducer) {
  const Trace t = deferred_trace();
  ASSERT_NO_THROW(validate(t));
  EXPECT_TRUE(t.tensors[G].has_gap());
  EXPECT_FALSE(t.tensors[W].has_gap());
  const LifetimeAnalysis a = analyze_lifetimes(t);
  EXPECT_EQ(a.tensors[G].live_begin, 4);
  EXPECT_EQ(a.tensors[G].live_end, 0);
  // W, S, X always; A over ops 1-4; L over 2-3; G over 4, 5 and 0.
  const std::vector<std::uint64_t> live = {710, 1510, 1517, 1517, 1710, 710};
  EXPECT_EQ(a.live_bytes, live);
  for (OpIndex k = 0; k < 6; ++k) EXPECT_EQ(t.tensors[G].live_at(k), k == 0 || k >= 4) << k;
  // G's only period is the live one, from op 4 over op 5 to the update; 0 -> 4 is its gap.
  ASSERT_EQ(a.tensors[G].periods.size(), 1u);
  expect_period(a.tensors[G].periods[0], G, 200, 4, 0, true, 32);
}

TEST(LifetimeHand, LiveIntervalsAndUses) {
  const LifetimeAnalysis a = analyze_lifetimes(hand_trace());
  ASSERT_EQ(a.tensors.size(), 7u);
  struct Expect {
    OpIndex begin, end;
    std::vector<OpIndex> uses;
  };
  const Expect expect[] = {
      {0, 5, {0, 2, 5}},  // W: persistent, the whole iteration
      {0, 5, {0, 4}},     // X: an input, the whole iteration
      {0, 4, {0, 1, 4}},  // A: producer through last use
      {1, 3, {1, 2}},     // T: producer through freed_after (past its last use)
      {2, 3, {2, 3}},     // L: producer through last use
      {0, 5, {4, 5}},     // G
      {0, 5, {5}},        // S
  };
  for (TensorId i = 0; i < 7; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(a.tensors[i].tensor, i);
    EXPECT_EQ(a.tensors[i].live_begin, expect[i].begin);
    EXPECT_EQ(a.tensors[i].live_end, expect[i].end);
    EXPECT_EQ(a.tensors[i].uses, expect[i].uses);
  }
}

TEST(LifetimeHand, InactivePeriodsIncludingWrapAround) {
  const LifetimeAnalysis a = analyze_lifetimes(hand_trace());
  // W: gaps 0->2 (op 1) and 2->5 (ops 3, 4). It is used by op 0 and op 5, the first and last
  // ops, so no op lies in the wrap-around gap and there is no wrapping period.
  ASSERT_EQ(a.tensors[W].periods.size(), 2u);
  expect_period(a.tensors[W].periods[0], W, 100, 0, 2, false, 2);
  expect_period(a.tensors[W].periods[1], W, 100, 2, 5, false, 8 + 16);
  // X: one gap 0->4; an input does not wrap.
  ASSERT_EQ(a.tensors[X].periods.size(), 1u);
  expect_period(a.tensors[X].periods[0], X, 10, 0, 4, false, 2 + 4 + 8);
  // A: 0->1 is no gap; 1->4 is.
  ASSERT_EQ(a.tensors[A].periods.size(), 1u);
  expect_period(a.tensors[A].periods[0], A, 1000, 1, 4, false, 4 + 8);
  EXPECT_TRUE(a.tensors[T].periods.empty());
  EXPECT_TRUE(a.tensors[L].periods.empty());
  // G: used by ops 4 and 5; the wrap goes from op 5 to op 4 of the next iteration over ops 0-3.
  ASSERT_EQ(a.tensors[G].periods.size(), 1u);
  expect_period(a.tensors[G].periods[0], G, 200, 5, 4, true, 1 + 2 + 4 + 8);
  // S: a single use wraps over every other op.
  ASSERT_EQ(a.tensors[S].periods.size(), 1u);
  expect_period(a.tensors[S].periods[0], S, 400, 5, 5, true, 1 + 2 + 4 + 8 + 16);
}

TEST(LifetimeHand, LiveAndActiveBytesPerOp) {
  const LifetimeAnalysis a = analyze_lifetimes(hand_trace());
  const std::uint64_t always = 100 + 200 + 400 + 10;  // W, G, S, X
  const std::vector<std::uint64_t> live = {always + 1000,          always + 1000 + 50,
                                           always + 1000 + 50 + 7, always + 1000 + 50 + 7,
                                           always + 1000,          always};
  const std::vector<std::uint64_t> active = {10 + 100 + 1000, 1000 + 50,      50 + 100 + 7, 7,
                                             1000 + 10 + 200, 100 + 200 + 400};
  EXPECT_EQ(a.live_bytes, live);
  EXPECT_EQ(a.active_bytes, active);
}

// A measured workspace counts as live and active at its op only, and raises the peak there.
TEST(LifetimeHand, WorkspaceCountsAtItsOpOnly) {
  Trace t = hand_trace();
  const LifetimeAnalysis before = analyze_lifetimes(t);
  t.ops[3].workspace_bytes = 5000;
  const LifetimeAnalysis a = analyze_lifetimes(t);
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    const std::uint64_t extra = k == 3 ? 5000 : 0;
    EXPECT_EQ(a.live_bytes[k], before.live_bytes[k] + extra) << "op " << k;
    EXPECT_EQ(a.active_bytes[k], before.active_bytes[k] + extra) << "op " << k;
  }
  EXPECT_EQ(a.summary.peak_live_op, 3);
  EXPECT_EQ(a.summary.peak_live_bytes, before.live_bytes[3] + 5000);
}

TEST(LifetimeHand, Summary) {
  const LifetimeAnalysis a = analyze_lifetimes(hand_trace());
  const LifetimeSummary& s = a.summary;
  EXPECT_EQ(s.peak_live_bytes, 1767u);
  EXPECT_EQ(s.peak_live_op, 2);  // the first op that reaches the peak
  EXPECT_EQ(s.peak_active_bytes, 1210u);
  const double ratio =
      (1110.0 / 1710 + 1050.0 / 1760 + 157.0 / 1767 + 7.0 / 1767 + 1210.0 / 1710 + 700.0 / 710) / 6;
  EXPECT_NEAR(s.mean_active_ratio, ratio, 1e-12);
  ASSERT_EQ(s.size_classes.size(), 5u);
  // All six periods are under 1 MiB: idle times 2, 24, 14, 12, 15, 31.
  EXPECT_EQ(s.size_classes[0].min_bytes, 0u);
  EXPECT_EQ(s.size_classes[0].max_bytes, kMiB);
  EXPECT_EQ(s.size_classes[0].periods, 6);
  EXPECT_DOUBLE_EQ(s.size_classes[0].mean_idle_seconds, (2 + 24 + 14 + 12 + 15 + 31) / 6.0);
  EXPECT_DOUBLE_EQ(s.size_classes[0].median_idle_seconds, (14 + 15) / 2.0);
  EXPECT_EQ(s.size_classes[0].total_bytes, 100u + 100 + 10 + 1000 + 200 + 400);
  for (int c = 1; c < 5; ++c) {
    EXPECT_EQ(s.size_classes[c].periods, 0);
    EXPECT_EQ(s.size_classes[c].total_bytes, 0u);
    EXPECT_EQ(s.size_classes[c].min_bytes, s.size_classes[c - 1].max_bytes);
  }
  EXPECT_EQ(s.size_classes[4].max_bytes, std::numeric_limits<std::uint64_t>::max());
}

TEST(Lifetime, SizeClassBoundaries) {
  // One op per tensor and one idle op: every persistent tensor gets one wrapping period.
  const std::uint64_t sizes[] = {kMiB - 1, kMiB, 10 * kMiB - 1, 10 * kMiB, 100 * kMiB,
                                 kGiB - 1, kGiB, 5 * kGiB,      0};
  const int expect_class[] = {0, 1, 1, 2, 3, 3, 4, 4, 0};
  Trace t;
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    Tensor x;
    x.id = static_cast<TensorId>(i);
    x.bytes = sizes[i];
    x.persistent = true;
    x.cls = TensorClass::kParameter;
    t.tensors.push_back(x);
    t.ops.push_back(Op{
        static_cast<OpIndex>(i), "op", Phase::kForward, double(i), double(i) + 1, {x.id}, {}, -1});
  }
  const LifetimeAnalysis a = analyze_lifetimes(t);
  std::int64_t count[5] = {};
  std::uint64_t bytes[5] = {};
  for (std::size_t i = 0; i < std::size(sizes); ++i) {
    ++count[expect_class[i]];
    bytes[expect_class[i]] += sizes[i];
  }
  for (int c = 0; c < 5; ++c) {
    EXPECT_EQ(a.summary.size_classes[c].periods, count[c]) << "class " << c;
    EXPECT_EQ(a.summary.size_classes[c].total_bytes, bytes[c]) << "class " << c;
    // Every op lasts 1 s and each wrap skips all ops but one.
    EXPECT_DOUBLE_EQ(a.summary.size_classes[c].median_idle_seconds,
                     count[c] > 0 ? std::size(sizes) - 1.0 : 0.0);
  }
}

TEST(Lifetime, UnusedTensorsAndInputsFreedEarly) {
  Trace t;
  t.tensors.resize(3);
  for (int i = 0; i < 3; ++i) {
    t.tensors[i].id = i;
    t.tensors[i].bytes = 1u << (4 * i);  // 1, 16, 256
  }
  t.tensors[0].cls = TensorClass::kTemporary;  // never used, never produced: never live
  t.tensors[1].cls = TensorClass::kInput;      // freed after op 1
  t.tensors[1].freed_after = 1;
  t.tensors[2].cls = TensorClass::kInput;  // never used, still live the whole iteration
  for (int k = 0; k < 3; ++k) t.ops.push_back(Op{k, "op", Phase::kOther, 0, 0, {}, {}, -1});
  t.ops[0].inputs = {1};
  const LifetimeAnalysis a = analyze_lifetimes(t);
  EXPECT_EQ(a.tensors[0].live_begin, kNoOp);
  EXPECT_EQ(a.tensors[0].live_end, kNoOp);
  EXPECT_EQ(a.tensors[1].live_begin, 0);
  EXPECT_EQ(a.tensors[1].live_end, 1);
  EXPECT_EQ(a.tensors[2].live_begin, 0);
  EXPECT_EQ(a.tensors[2].live_end, 2);
  EXPECT_EQ(a.live_bytes, (std::vector<std::uint64_t>{272, 272, 256}));
  EXPECT_EQ(a.active_bytes, (std::vector<std::uint64_t>{16, 0, 0}));
  // Op 0 counts, ops 1 and 2 have live > 0 and active 0.
  EXPECT_DOUBLE_EQ(a.summary.mean_active_ratio, (16.0 / 272) / 3);
}

TEST(Lifetime, EmptyTraceAndInvalidTrace) {
  const LifetimeAnalysis a = analyze_lifetimes(Trace{});
  EXPECT_TRUE(a.tensors.empty());
  EXPECT_TRUE(a.live_bytes.empty());
  EXPECT_EQ(a.summary.peak_live_bytes, 0u);
  EXPECT_EQ(a.summary.size_classes.size(), 5u);
  Trace bad = hand_trace();
  bad.ops[2].inputs.push_back(42);
  EXPECT_THROW(analyze_lifetimes(bad), Error);
}

// ---- invariants on random traces, against brute force -------------------------------------

struct Reference {
  std::vector<std::vector<OpIndex>> uses;
  std::vector<std::vector<bool>> live;  // [tensor][op]
};

Reference brute_force(const Trace& t) {
  const std::size_t n = t.ops.size();
  Reference r;
  r.uses.resize(t.tensors.size());
  r.live.assign(t.tensors.size(), std::vector<bool>(n, false));
  for (const Tensor& x : t.tensors) {
    for (const Op& op : t.ops) {
      const bool in = std::find(op.inputs.begin(), op.inputs.end(), x.id) != op.inputs.end();
      const bool out = std::find(op.outputs.begin(), op.outputs.end(), x.id) != op.outputs.end();
      if (in || out) r.uses[x.id].push_back(op.index);
    }
    const auto& u = r.uses[x.id];
    for (std::size_t k = 0; k < n; ++k) {
      const auto kk = static_cast<OpIndex>(k);
      bool live = false;
      if (x.persistent) {
        live = true;
      } else if (x.cls == TensorClass::kInput) {
        live = kk >= (x.producer == kNoOp ? 0 : x.producer) &&
               (x.freed_after == kNoOp || kk <= x.freed_after);
      } else if (!u.empty()) {
        const OpIndex b = x.producer == kNoOp ? u.front() : x.producer;
        const OpIndex e = x.freed_after == kNoOp ? u.back() : x.freed_after;
        live = kk >= b && kk <= e;
      }
      r.live[x.id][k] = live;
    }
  }
  return r;
}

// Compute time of the ops strictly between a and b, walking forward and wrapping past the end.
double idle_between(const Trace& t, OpIndex a, OpIndex b) {
  const auto n = static_cast<OpIndex>(t.ops.size());
  double s = 0;
  for (OpIndex k = (a + 1) % n; k != b; k = (k + 1) % n)
    s += t.op_seconds(static_cast<std::size_t>(k));
  return s;
}

void check_invariants(const Trace& t) {
  const LifetimeAnalysis a = analyze_lifetimes(t);
  const Reference r = brute_force(t);
  const std::size_t n = t.ops.size();
  ASSERT_EQ(a.tensors.size(), t.tensors.size());
  ASSERT_EQ(a.live_bytes.size(), n);
  ASSERT_EQ(a.active_bytes.size(), n);

  std::vector<const InactivePeriod*> all_periods;
  for (const Tensor& x : t.tensors) {
    SCOPED_TRACE(testing::Message() << "tensor " << x.id);
    const TensorLifetime& life = a.tensors[x.id];
    EXPECT_EQ(life.tensor, x.id);
    EXPECT_EQ(life.uses, r.uses[x.id]);
    // The live interval is exactly the brute-force live set, and holds every use.
    for (std::size_t k = 0; k < n; ++k) {
      const auto kk = static_cast<OpIndex>(k);
      const bool in = life.live_begin != kNoOp && kk >= life.live_begin && kk <= life.live_end;
      EXPECT_EQ(in, r.live[x.id][k]) << "op " << k;
    }
    for (OpIndex u : life.uses) {
      EXPECT_LE(life.live_begin, u);
      EXPECT_GE(life.live_end, u);
    }
    if (x.producer != kNoOp) {
      EXPECT_LE(life.live_begin, x.producer);
    }

    // Periods: one per gap of >= 1 op between consecutive uses, then the wrap.
    const auto& u = life.uses;
    std::size_t p = 0;
    for (std::size_t i = 0; i + 1 < u.size(); ++i) {
      if (u[i + 1] - u[i] < 2) continue;
      ASSERT_LT(p, life.periods.size());
      const InactivePeriod& q = life.periods[p++];
      EXPECT_EQ(q.last_use, u[i]);
      EXPECT_EQ(q.next_use, u[i + 1]);
      EXPECT_FALSE(q.wraps);
    }
    const bool wraps =
        x.persistent && !u.empty() && (u.front() > 0 || u.back() < static_cast<OpIndex>(n) - 1);
    if (wraps) {
      ASSERT_LT(p, life.periods.size());
      const InactivePeriod& q = life.periods[p++];
      EXPECT_TRUE(q.wraps);
      EXPECT_EQ(q.last_use, u.back());
      EXPECT_EQ(q.next_use, u.front());
      EXPECT_LE(q.next_use, q.last_use);
    }
    EXPECT_EQ(p, life.periods.size());
    for (std::size_t i = 0; i < life.periods.size(); ++i) {
      const InactivePeriod& q = life.periods[i];
      EXPECT_EQ(q.tensor, x.id);
      EXPECT_EQ(q.bytes, x.bytes);
      EXPECT_NEAR(q.idle_seconds, idle_between(t, q.last_use, q.next_use),
                  1e-9 * (1 + t.compute_seconds()));
      EXPECT_GE(q.idle_seconds, 0);
      if (!q.wraps) EXPECT_GE(q.next_use - q.last_use, 2);
      // Ordered and disjoint: each period starts at or after the previous one ends.
      if (i > 0) EXPECT_LE(life.periods[i - 1].next_use, q.last_use);
      all_periods.push_back(&q);
    }
  }

  // Live and active bytes per op against a recount.
  for (std::size_t k = 0; k < n; ++k) {
    std::uint64_t live = 0;
    for (const Tensor& x : t.tensors) {
      if (r.live[x.id][k]) live += x.bytes;
    }
    std::vector<TensorId> touched = t.ops[k].inputs;
    touched.insert(touched.end(), t.ops[k].outputs.begin(), t.ops[k].outputs.end());
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    std::uint64_t active = 0;
    for (TensorId id : touched) active += t.tensors[id].bytes;
    EXPECT_EQ(a.live_bytes[k], live) << "op " << k;
    EXPECT_EQ(a.active_bytes[k], active) << "op " << k;
    EXPECT_LE(a.active_bytes[k], a.live_bytes[k]) << "op " << k;
  }

  // Summary against a recount.
  const LifetimeSummary& s = a.summary;
  if (n > 0) {
    const auto peak = std::max_element(a.live_bytes.begin(), a.live_bytes.end());
    EXPECT_EQ(s.peak_live_bytes, *peak);
    EXPECT_EQ(s.peak_live_op, peak - a.live_bytes.begin());
    EXPECT_EQ(s.peak_active_bytes, *std::max_element(a.active_bytes.begin(), a.active_bytes.end()));
  }
  double ratio = 0;
  int ratio_ops = 0;
  for (std::size_t k = 0; k < n; ++k) {
    if (a.live_bytes[k] == 0) continue;
    ratio += static_cast<double>(a.active_bytes[k]) / static_cast<double>(a.live_bytes[k]);
    ++ratio_ops;
  }
  EXPECT_NEAR(s.mean_active_ratio, ratio_ops ? ratio / ratio_ops : 0, 1e-12);
  EXPECT_GE(s.mean_active_ratio, 0);
  EXPECT_LE(s.mean_active_ratio, 1);
  ASSERT_EQ(s.size_classes.size(), 5u);
  std::int64_t periods = 0;
  for (const auto& c : s.size_classes) {
    std::vector<double> idle;
    std::uint64_t bytes = 0;
    for (const InactivePeriod* q : all_periods) {
      if (q->bytes >= c.min_bytes && q->bytes < c.max_bytes) {
        idle.push_back(q->idle_seconds);
        bytes += q->bytes;
      }
    }
    EXPECT_EQ(c.periods, static_cast<std::int64_t>(idle.size()));
    EXPECT_EQ(c.total_bytes, bytes);
    periods += c.periods;
    if (idle.empty()) continue;
    std::sort(idle.begin(), idle.end());
    const std::size_t m = idle.size() / 2;
    const double median = idle.size() % 2 ? idle[m] : (idle[m - 1] + idle[m]) / 2;
    double sum = 0;
    for (double v : idle) sum += v;
    EXPECT_DOUBLE_EQ(c.median_idle_seconds, median);
    EXPECT_NEAR(c.mean_idle_seconds, sum / idle.size(), 1e-12 * (1 + sum));
  }
  EXPECT_EQ(periods, static_cast<std::int64_t>(all_periods.size()));
}

TEST(LifetimeRandom, InvariantsHoldOnRandomTraces) {
  for (std::uint64_t seed = 0; seed < 150; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    testutil::RandomTraceOptions opt;
    std::mt19937_64 shape(seed * 7919 + 1);
    opt.layers = 1 + static_cast<int>(shape() % 6);
    opt.params_per_layer = 1 + static_cast<int>(shape() % 4);
    opt.forward_ops_per_layer = 1 + static_cast<int>(shape() % 5);
    opt.backward_ops_per_layer = 1 + static_cast<int>(shape() % 5);
    opt.optimizer_states_per_param = static_cast<int>(shape() % 3);
    opt.freed_after_probability = (shape() % 5) / 4.0;
    opt.save_probability = (shape() % 5) / 4.0;
    const Trace t = testutil::random_trace(seed, opt);
    ASSERT_NO_THROW(validate(t));
    check_invariants(t);
    if (HasFatalFailure()) return;
  }
}

TEST(LifetimeRandom, ActivationsAreSmallFractionOfLiveButPositive) {
  // A sanity check that the generator exercises what the analysis is for: persistent tensors
  // make live bytes exceed active bytes on most ops, and periods exist in several size classes.
  std::int64_t classes_hit[5] = {};
  for (std::uint64_t seed = 0; seed < 30; ++seed) {
    const LifetimeAnalysis a = analyze_lifetimes(testutil::random_trace(seed));
    EXPECT_GT(a.summary.peak_live_bytes, a.summary.peak_active_bytes);
    EXPECT_GT(a.summary.mean_active_ratio, 0);
    EXPECT_LT(a.summary.mean_active_ratio, 1);
    for (int c = 0; c < 5; ++c) classes_hit[c] += a.summary.size_classes[c].periods;
  }
  for (int c = 0; c < 5; ++c) EXPECT_GT(classes_hit[c], 0) << "size class " << c;
}

}  // namespace
}  // namespace tidal::trace
