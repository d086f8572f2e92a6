#include "tidal/plan/policies.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <sstream>
#include <string>

#include "plan/policies/policies_impl.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

namespace {

constexpr EnumName<Policy> kPolicyNames[] = {
    {Policy::kIdeal, "ideal"},
    {Policy::kKeepAll, "keep-all"},
    {Policy::kRecompute, "recompute"},
    {Policy::kActivations, "activations"},
    {Policy::kZeroOffload, "zero-offload"},
    {Policy::kZeroInfinity, "zero-infinity"},
    {Policy::kTidal, "tidal"},
};

}  // namespace

// The helpers policies_impl.hpp declares.
namespace detail::policy {

trace::Trace gaps_in_durations(const trace::Trace& t) {
  trace::Trace out = t;
  for (std::size_t k = 0; k < out.ops.size(); ++k) {
    out.ops[k].end_s = out.ops[k].start_s + t.op_seconds(k);
  }
  return out;
}

void retime(trace::Trace& t) {
  double now = 0;
  for (auto& op : t.ops) {
    const double d = op.duration();
    op.start_s = now;
    now += d;
    op.end_s = now;
  }
}

void set_action(PlanAction& a, TensorId id, std::uint64_t bytes, ActionKind kind, OpIndex trigger,
                OpIndex deadline, Target target) {
  a.tensor = id;
  a.bytes = bytes;
  a.kind = kind;
  a.trigger = trigger;
  a.deadline = deadline;
  a.target = target;
  a.wraps = deadline <= trigger;
}

Plan empty_plan(const trace::Trace& t, const Hardware& hw) {
  Plan p;
  p.model = t.model;
  p.hardware = hw.name;
  p.num_ops = static_cast<std::int32_t>(t.ops.size());
  p.num_tensors = static_cast<std::int32_t>(t.tensors.size());
  p.summary.capacity_bytes = hw.device_memory;
  p.summary.compute_seconds = t.compute_seconds();
  return p;
}

void sort_actions(Plan& p) {
  std::sort(p.actions.begin(), p.actions.end(), [](const PlanAction& x, const PlanAction& y) {
    if (x.trigger != y.trigger) return x.trigger < y.trigger;
    if (x.kind != y.kind) return x.kind < y.kind;
    return x.tensor < y.tensor;
  });
}

std::vector<int> pass_of_ops(const trace::Trace& t) {
  std::vector<int> pass_of(std::max<std::size_t>(1, t.ops.size()), 0);
  int pass = 0;
  bool in_backward = false;
  for (const auto& op : t.ops) {
    if (op.phase == Phase::kBackward) in_backward = true;
    if (op.phase == Phase::kForward && in_backward) {
      ++pass;
      in_backward = false;
    }
    pass_of[static_cast<std::size_t>(op.index)] = pass;
  }
  return pass_of;
}

}  // namespace detail::policy

using detail::policy::empty_plan;
using detail::policy::gaps_in_durations;
using detail::policy::pass_of_ops;
using detail::policy::retime;
using detail::policy::run_zero;
using detail::policy::set_action;
using detail::policy::sort_actions;

const char* to_string(Policy p) { return enum_name(kPolicyNames, p); }

Policy policy_from_string(const std::string& s) {
  for (const auto& n : kPolicyNames) {
    if (s == n.name) return n.value;
  }
  TIDAL_FAIL_AS(InvalidArgument, "unknown policy '", s,
                "'; choose one of: ", enum_names(kPolicyNames), " or all");
}

std::vector<Policy> all_policies() {
  std::vector<Policy> v;
  for (const auto& n : kPolicyNames) v.push_back(n.value);
  return v;
}

namespace {

// An activation that the activations policy may offload: its last forward use `a`, its first
// backward use `b` and the layer that made it.
struct ActivationCandidate {
  TensorId id;
  OpIndex a, b;
  int layer;
};

// The activations made in the layers' forward pass, at least opt.activation_min_bytes, with at
// least one op between their last forward use and first backward use.
std::vector<ActivationCandidate> activation_candidates(const trace::Trace& t,
                                                       const trace::LifetimeAnalysis& la,
                                                       const PolicyOptions& opt) {
  std::vector<ActivationCandidate> cands;
  for (const auto& x : t.tensors) {
    if (x.cls != TensorClass::kActivation || x.persistent || x.bytes < opt.activation_min_bytes ||
        x.producer == trace::kNoOp) {
      continue;
    }
    const auto& prod = t.ops[static_cast<std::size_t>(x.producer)];
    if (prod.phase != Phase::kForward || prod.layer < 0) continue;  // loss/embedding/head skipped
    OpIndex a = trace::kNoOp;
    OpIndex b = trace::kNoOp;
    for (OpIndex u : la.tensors[static_cast<std::size_t>(x.id)].uses) {
      const auto ph = t.ops[static_cast<std::size_t>(u)].phase;
      if (ph == Phase::kForward) a = u;
      if (ph == Phase::kBackward && b == trace::kNoOp) b = u;
    }
    if (a == trace::kNoOp || b == trace::kNoOp || b - a < 2) continue;
    cands.push_back({x.id, a, b, prod.layer});
  }
  return cands;
}

// Adaptive keep (SSDTrain): scopes are blocks in forward order; backward takes 2x forward. The
// first layer whose activations, with those of the layers before it, would need more than the
// SSDs' write bandwidth; that layer and the later ones keep theirs. -1 when every layer offloads.
int adaptive_keep_from(const trace::Trace& t, const Hardware& hw,
                       const std::vector<ActivationCandidate>& cands) {
  std::map<int, double> bytes;
  std::map<int, double> time;
  std::vector<int> order;
  double forward = 0;
  for (std::size_t k = 0; k < t.ops.size(); ++k) {
    const auto& op = t.ops[k];
    if (op.phase != Phase::kForward) continue;
    const double seconds = t.op_seconds(k);
    forward += seconds;
    if (op.layer < 0) continue;
    if (time.find(op.layer) == time.end()) order.push_back(op.layer);
    time[op.layer] += seconds;
  }
  for (const auto& c : cands)
    bytes[c.layer] += static_cast<double>(t.tensors[static_cast<std::size_t>(c.id)].bytes);
  const double bw = hw.ssd_write_total();
  double before_b = 0;
  double before_t = 0;
  for (int l : order) {
    const double denom = 3 * forward - 2 * before_t;
    if (denom <= 0 || (before_b + 2 * bytes[l]) / denom > bw) return l;
    before_b += bytes[l];
    before_t += time[l];
  }
  return -1;
}

}  // namespace

Plan activation_plan(const trace::Trace& t, const Hardware& hw, const PolicyOptions& opt,
                     std::string* note) {
  Plan p = empty_plan(t, hw);
  const auto la = trace::analyze_lifetimes(t);
  const std::vector<ActivationCandidate> cands = activation_candidates(t, la, opt);
  const int keep_from = opt.adaptive_keep ? adaptive_keep_from(t, hw, cands) : -1;
  for (const auto& c : cands) {
    if (keep_from >= 0 && c.layer >= keep_from) continue;  // kept in device memory
    const std::uint64_t bytes = t.tensors[static_cast<std::size_t>(c.id)].bytes;
    PlanAction off;
    set_action(off, c.id, bytes, ActionKind::kOffload, c.a, c.b, Target::kSsd);
    PlanAction pre;
    const OpIndex trig = std::max<OpIndex>(c.a + 1, c.b - 1 - opt.activation_lookahead_ops);
    set_action(pre, c.id, bytes, ActionKind::kPrefetch, trig, c.b, Target::kSsd);
    p.actions.push_back(off);
    p.actions.push_back(pre);
    p.summary.bytes_to_ssd += bytes;
    ++p.summary.offloads_ssd;
  }
  sort_actions(p);
  if (note != nullptr) {
    std::ostringstream s;
    s << p.summary.offloads_ssd << " activations offloaded";
    if (keep_from >= 0) s << "; adaptive keep from block " << keep_from;
    *note = s.str();
  }
  return p;
}

namespace {

// PolicyOptions::optimizer_step auto: the plan with the step on the host too, where the hardware
// gives the host CPU's rates; the faster plan that fits is kept, with the lower of the two
// placements' bounds (no plan of either beats it).
PolicyResult faster_placement(PolicyResult device, const trace::Trace& tr, const Hardware& hw,
                              const PolicyOptions& opt) {
  if (hw.cpu_adam_rate <= 0 || hw.cpu_accumulate_rate <= 0) return device;
  PolicyResult host;
  try {
    host = detail::policy::run_host_step(tr, hw, opt);
  } catch (const InvalidArgument& e) {
    device.note += std::string("; the optimizer step cannot run on the host: ") + e.what();
    return device;
  }
  const StallBound device_bound = device.bound ? *device.bound : stall_lower_bound(tr, hw);
  const StallBound& host_bound = *host.bound;
  const bool host_wins =
      host.fits && (!device.fits || host.sim.iteration_seconds < device.sim.iteration_seconds);
  PolicyResult& kept = host_wins ? host : device;
  const PolicyResult& other = host_wins ? device : host;
  kept.note += std::string("; with the optimizer step on the ") + (host_wins ? "device" : "host") +
               ": " + format_seconds(other.sim.iteration_seconds) +
               (other.fits ? "" : ", does not fit");
  const bool host_lower =
      host_bound.no_fit_op < 0 && (device_bound.no_fit_op >= 0 ||
                                   host_bound.iteration_seconds < device_bound.iteration_seconds);
  kept.bound = host_lower ? host_bound : device_bound;
  return std::move(kept);
}

}  // namespace

PolicyResult run_policy(Policy policy, const trace::Trace& tr, const Hardware& hw,
                        const PolicyOptions& opt, double ideal_seconds) {
  PolicyResult r;
  r.policy = policy;
  switch (policy) {
    case Policy::kIdeal: {
      r.sim = simulate(tr, nullptr, hw, opt.sim);
      r.fits = true;
      r.note = "unlimited device memory";
      break;
    }
    case Policy::kKeepAll: {
      r.sim = simulate(tr, nullptr, hw, opt.sim);
      r.fits = r.sim.fits;
      break;
    }
    case Policy::kRecompute: {
      const trace::Trace rt = recompute_trace(tr);
      r.sim = simulate(rt, nullptr, hw, opt.sim);
      r.fits = r.sim.fits;
      r.note = rt.ops.size() == tr.ops.size() ? "no layer information: nothing recomputed"
                                              : "layer-wise activation checkpointing";
      break;
    }
    case Policy::kActivations: {
      Plan p = activation_plan(tr, hw, opt, &r.note);
      SimOptions so = opt.sim;
      ChannelRates rates;
      rates[Channel::kSsdWrite] = hw.ssd_write_total();
      rates[Channel::kSsdRead] = hw.ssd_read_total();
      so.channels = rates;
      r.sim = simulate(tr, &p, hw, so);
      r.fits = r.sim.fits;
      r.plan = std::move(p);
      break;
    }
    case Policy::kZeroOffload:
    case Policy::kZeroInfinity:
      r = run_zero(tr, hw, opt, policy == Policy::kZeroInfinity);
      break;
    case Policy::kTidal: {
      if (opt.optimizer_step == OptimizerPlacement::kHost) {
        r = detail::policy::run_host_step(tr, hw, opt);
        break;
      }
      try {
        Plan p = make_plan(tr, hw, opt.planner, &r.bound);
        r.planning_seconds = p.summary.planning_seconds;
        r.sim = simulate(tr, &p, hw, opt.sim);
        r.fits = r.sim.fits;
        std::ostringstream s;
        s << p.summary.offloads_ssd << " offloads to SSD, " << p.summary.offloads_host
          << " to host";
        if (p.summary.planned_stall_seconds > 0) {
          s << "; planned stall " << format_seconds(p.summary.planned_stall_seconds);
        }
        r.note = s.str();
        r.plan = std::move(p);
      } catch (const InvalidArgument& e) {
        r.sim = simulate(tr, nullptr, hw, opt.sim);
        r.fits = false;
        r.note = e.what();
      }
      if (opt.optimizer_step == OptimizerPlacement::kAuto) {
        r = faster_placement(std::move(r), tr, hw, opt);
      }
      break;
    }
  }
  if (ideal_seconds > 0 && r.sim.iteration_seconds > 0) {
    r.fraction_of_ideal = ideal_seconds / r.sim.iteration_seconds;
  }
  return r;
}

std::vector<PolicyResult> run_policies(const std::vector<Policy>& policies, const trace::Trace& tr,
                                       const Hardware& hw, const PolicyOptions& opt) {
  const PolicyResult ideal = run_policy(Policy::kIdeal, tr, hw, opt);
  const double ideal_s = ideal.sim.iteration_seconds;
  std::vector<PolicyResult> out;
  for (Policy p : policies) {
    if (p == Policy::kIdeal) {
      PolicyResult r = ideal;
      r.fraction_of_ideal = ideal_s > 0 ? 1.0 : 0;
      out.push_back(std::move(r));
    } else {
      out.push_back(run_policy(p, tr, hw, opt, ideal_s));
    }
  }
  return out;
}

}  // namespace tidal::plan
