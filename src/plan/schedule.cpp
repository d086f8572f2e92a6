#include "tidal/plan/schedule.hpp"

#include <algorithm>
#include <tuple>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::TensorId;

TIDAL_ENUM_TO_STRING(Residency, {Residency::kAbsent, "absent"}, {Residency::kResident, "resident"},
                     {Residency::kLeaving, "leaving"}, {Residency::kAway, "away"},
                     {Residency::kArriving, "arriving"})

Schedule compile_schedule(const trace::Trace& trace, const Plan* plan, bool strict) {
  const auto n = static_cast<OpIndex>(trace.ops.size());
  const auto n_tensors = static_cast<TensorId>(trace.tensors.size());
  Schedule s;
  s.num_ops = n;
  s.num_tensors = n_tensors;
  const auto nn = static_cast<std::size_t>(n);
  s.issued_after.resize(nn);
  s.uses.resize(nn);
  s.created.resize(nn);
  s.freed.resize(nn);
  s.new_bytes.assign(nn, 0);
  s.uses_of.resize(trace.tensors.size());

  if (plan != nullptr) {
    if (strict) {
      validate_plan(*plan, trace);
    } else {
      TIDAL_EXPECT_AS(InvalidArgument, plan->num_ops == n && plan->num_tensors == n_tensors,
                      "the plan was made for a trace of ", plan->num_ops, " ops and ",
                      plan->num_tensors, " tensors, not this one (", n, " ops, ", n_tensors,
                      " tensors); plan this trace again");
    }
  }

  trace::LifetimeAnalysis la = trace::analyze_lifetimes(trace);
  for (std::size_t k = 0; k < nn; ++k) s.new_bytes[k] = trace.ops[k].workspace_bytes;
  for (std::size_t i = 0; i < trace.tensors.size(); ++i) {
    const trace::Tensor& t = trace.tensors[i];
    const auto id = static_cast<TensorId>(i);
    auto& life = la.tensors[i];
    if (t.producer >= 0 && t.producer < n)
      s.new_bytes[static_cast<std::size_t>(t.producer)] += t.bytes;
    for (OpIndex u : life.uses) s.uses[static_cast<std::size_t>(u)].push_back(id);
    // A persistent tensor lives across iterations, unless it has a gap (dead after freed_after,
    // made anew by its producer); any other tensor lives from its first to its last op.
    const bool comes_and_goes = t.persistent ? t.has_gap() : life.live_begin != trace::kNoOp;
    if (comes_and_goes) {
      s.created[static_cast<std::size_t>(life.live_begin)].push_back(id);
      s.freed[static_cast<std::size_t>(life.live_end)].push_back(id);
    }
    s.uses_of[i] = std::move(life.uses);
  }

  if (plan == nullptr) return s;
  s.migrations.reserve(plan->actions.size());
  for (const PlanAction& a : plan->actions) {
    if (a.tensor < 0 || a.tensor >= n_tensors || a.trigger < 0 || a.trigger >= n ||
        a.deadline < 0 || a.deadline >= n || (a.target != Tier::kSsd && a.target != Tier::kHost)) {
      continue;  // only when not strict: validate_plan refused these
    }
    Migration m;
    m.tensor = a.tensor;
    m.kind = a.kind;
    m.issue = a.trigger;
    m.deadline = a.deadline;
    m.wraps = a.deadline <= a.trigger;
    m.tier = a.target;
    // A stage reads the SSDs (into host memory); the others move bytes to or from device memory.
    m.channel = a.kind == ActionKind::kStage
                    ? Channel::kSsdRead
                    : channel_of(a.target, a.kind == ActionKind::kOffload ? Direction::kWrite
                                                                          : Direction::kRead);
    m.bytes = trace.tensors[static_cast<std::size_t>(a.tensor)].bytes;
    m.due = m.deadline + (m.wraps ? n : 0);
    s.migrations.push_back(m);
    s.planned_bytes[index_of(m.channel)] += m.bytes;
  }
  std::stable_sort(s.migrations.begin(), s.migrations.end(),
                   [](const Migration& x, const Migration& y) {
                     return std::tie(x.issue, x.due, x.kind, x.tensor) <
                            std::tie(y.issue, y.due, y.kind, y.tensor);
                   });
  for (std::size_t i = 0; i < s.migrations.size(); ++i) {
    s.issued_after[static_cast<std::size_t>(s.migrations[i].issue)].push_back(
        static_cast<std::int32_t>(i));
  }
  return s;
}

}  // namespace tidal::plan
