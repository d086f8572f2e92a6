// The optimizer step on the host (host_step.hpp): the trace rewritten for it, its plan and its
// lower bound.
#include "tidal/plan/host_step.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "plan/policies/policies_impl.hpp"
#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/plan/planner.hpp"
#include "tidal/trace/lifetime.hpp"

namespace tidal::plan {

using trace::OpIndex;
using trace::Phase;
using trace::TensorClass;
using trace::TensorId;

namespace {

std::string meta_of(const trace::Trace& t, const std::string& key) {
  const auto it = t.meta.find(key);
  return it == t.meta.end() ? std::string() : it->second;
}

// A parameter and its gradient as the optimizer step updates them (the given trace's ids).
struct Updated {
  TensorId weight = -1;
  TensorId gradient = -1;
};

// The parameters the optimizer ops update with their gradients: each op's parameters and
// gradients, paired in the order the op lists them.
std::vector<Updated> updated_parameters(const trace::Trace& t) {
  std::vector<Updated> out;
  std::vector<bool> seen(t.tensors.size(), false);
  for (const auto& op : t.ops) {
    if (op.phase != Phase::kOptimizer) continue;
    std::vector<TensorId> weights;
    std::vector<TensorId> grads;
    for (TensorId id : op.inputs) {
      const TensorClass cls = t.tensors[static_cast<std::size_t>(id)].cls;
      if (cls == TensorClass::kParameter) weights.push_back(id);
      if (cls == TensorClass::kGradient) grads.push_back(id);
    }
    TIDAL_EXPECT_AS(InvalidArgument, weights.size() == grads.size(), "optimizer op ", op.index,
                    " ('", op.name, "') reads ", weights.size(), " parameters and ", grads.size(),
                    " gradients: the optimizer step on the host needs them in pairs");
    for (std::size_t i = 0; i < weights.size(); ++i) {
      if (seen[static_cast<std::size_t>(weights[i])]) continue;
      seen[static_cast<std::size_t>(weights[i])] = true;
      out.push_back({weights[i], grads[i]});
    }
  }
  TIDAL_EXPECT_AS(InvalidArgument, !out.empty(), "the trace",
                  t.model.empty() ? "" : " of " + t.model,
                  " has no optimizer op that updates a parameter with its gradient, so there is "
                  "no optimizer step to run on the host");
  return out;
}

// The last op that uses each tensor (kNoOp: none).
std::vector<OpIndex> last_uses(const trace::Trace& t) {
  std::vector<OpIndex> last(t.tensors.size(), trace::kNoOp);
  for (const auto& op : t.ops) {
    for (const auto* ids : {&op.inputs, &op.outputs}) {
      for (TensorId id : *ids) last[static_cast<std::size_t>(id)] = op.index;
    }
  }
  return last;
}

// The first op of each forward/backward pass.
std::vector<OpIndex> pass_starts(const std::vector<int>& pass) {
  std::vector<OpIndex> first;
  for (std::size_t k = 0; k < pass.size(); ++k) {
    if (pass[k] >= static_cast<int>(first.size())) first.push_back(static_cast<OpIndex>(k));
  }
  return first;
}

// The host's tasks for one parameter: an accumulation per pass before the last, and the last
// pass's accumulation with the Adam step, which refreshes the 16-bit copy.
void add_tasks(HostStepModel& m, const std::string& name, TensorId weight,
               std::vector<std::pair<OpIndex, TensorId>> grads, double elements, const Hardware& hw,
               const std::vector<int>& pass, const std::vector<OpIndex>& first_of_pass,
               bool on_host) {
  std::sort(grads.begin(), grads.end());
  // An fp32 gradient accumulated on the device lands as it is; a 16-bit one is widened.
  const double accumulate = on_host ? elements / hw.cpu_accumulate_rate : 0.0;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto [after, g] = grads[i];
    const int p = pass[static_cast<std::size_t>(after)];
    const bool last = i + 1 == grads.size();
    m.drained.push_back(g);
    const auto next = static_cast<std::size_t>(p) + 1;  // the next pass, if any
    m.drain_deadline.push_back(next < first_of_pass.size() ? first_of_pass[next] : 0);
    HostTask task;
    task.after = after;
    task.inputs = {g};
    if (last) {
      task.name = "adamw." + name;
      task.seconds = accumulate + elements / hw.cpu_adam_rate;
      task.refreshes = {weight};
      m.refreshed.push_back(weight);
      m.refresh_task.push_back(m.tasks.size());
    } else {
      task.name = "accumulate." + name + ".pass" + std::to_string(p);
      task.seconds = accumulate;
    }
    m.host_seconds += task.seconds;
    m.tasks.push_back(std::move(task));
  }
}

// Replaces the planner's actions on a refreshed parameter over the iteration's end with its
// way out to host memory after its last use `a` and back by its first use `b`, read no earlier
// than the end of op `task_after`, after which its host task is queued (the planner's trigger
// where that is later).
void route_refresh_through_host(Plan& p, TensorId w, std::uint64_t bytes, OpIndex a, OpIndex b,
                                OpIndex task_after) {
  const auto n = static_cast<OpIndex>(p.num_ops);
  const auto in_wrap = [&](OpIndex k) { return k >= a || k < b; };
  // Position in the span from a over the iteration's end to b.
  const auto from_a = [&](OpIndex k) { return (k - a + n) % n; };
  OpIndex trigger = task_after;
  std::vector<PlanAction> kept;
  for (const PlanAction& x : p.actions) {
    const bool wrap_prefetch = x.tensor == w && x.kind == ActionKind::kPrefetch && x.deadline == b;
    // The planner brought it back in time from there.
    if (wrap_prefetch && from_a(x.trigger) > from_a(task_after)) trigger = x.trigger;
    if (x.tensor != w || (!wrap_prefetch && !in_wrap(x.trigger))) kept.push_back(x);
  }
  p.actions = std::move(kept);
  PlanAction off;
  detail::policy::set_action(off, w, bytes, ActionKind::kOffload, a, (a + 1) % n, Target::kHost);
  PlanAction pre;
  detail::policy::set_action(pre, w, bytes, ActionKind::kPrefetch, trigger, b, Target::kHost);
  p.actions.push_back(off);
  p.actions.push_back(pre);
}

}  // namespace

TIDAL_ENUM_NAMES(OptimizerPlacement, optimizer_placement_from_string, "optimizer step placement",
                 {OptimizerPlacement::kDevice, "device"}, {OptimizerPlacement::kHost, "host"},
                 {OptimizerPlacement::kAuto, "auto"})

TIDAL_ENUM_TO_STRING(GradientAccumulation, {GradientAccumulation::kHost, "host"},
                     {GradientAccumulation::kDevice, "device"})

HostStepModel host_step_model(const trace::Trace& tr, const Hardware& hw,
                              GradientAccumulation accumulation) {
  TIDAL_EXPECT_AS(InvalidArgument, hw.cpu_adam_rate > 0 && hw.cpu_accumulate_rate > 0,
                  "the optimizer step on the host needs the host CPU's Adam and gradient "
                  "accumulation rates, and hardware '",
                  hw.name, "' lacks one");
  const ChannelRates rates = hw.channels();
  TIDAL_EXPECT_AS(InvalidArgument, rates[Channel::kHostWrite] > 0 && rates[Channel::kHostRead] > 0,
                  "the optimizer step on the host sends gradients and weights over the host link, "
                  "but on hardware '",
                  hw.name, "' the SSDs take all of it (link ", format_bandwidth(hw.host_link_bw),
                  ", SSDs ", format_bandwidth(hw.ssd_write_total()), " write, ",
                  format_bandwidth(hw.ssd_read_total()),
                  " read) or there is no host memory: give a faster host link, fewer SSDs or "
                  "host memory");
  const std::vector<Updated> updated = updated_parameters(tr);
  namespace pol = detail::policy;
  std::vector<OpIndex> op_remap;
  std::vector<TensorId> remap;
  HostStepModel m;
  m.accumulation = accumulation;
  const bool on_host = accumulation == GradientAccumulation::kHost;
  m.device = pol::without_optimizer(pol::gaps_in_durations(tr), op_remap, &remap);
  std::vector<TensorId> origin;
  if (on_host) {
    pol::split_gradients_per_pass(m.device, &origin);
  } else {
    origin.resize(m.device.tensors.size());
    std::iota(origin.begin(), origin.end(), TensorId{0});
  }
  pol::fix_zero_tensors(m.device, op_remap);
  pol::retime(m.device);
  m.device.meta["optimizer_step"] = "host";
  trace::validate(m.device);

  const bool mixed = meta_of(tr, "precision") == "bf16-mixed";
  const bool accumulates_on_device =
      meta_of(tr, "micro_batch_order") == "layer-major" && meta_of(tr, "micro_batches") != "";
  const double element_bytes = pol::parameter_element_bytes(tr);
  const std::vector<OpIndex> last = last_uses(m.device);
  const std::vector<int> pass = pol::pass_of_ops(m.device);
  const std::vector<OpIndex> first_of_pass = pass_starts(pass);
  // The per-pass gradients of each given gradient.
  std::vector<std::vector<TensorId>> per_pass(m.device.tensors.size());
  for (std::size_t i = 0; i < origin.size(); ++i) {
    if (m.device.tensors[i].cls == TensorClass::kGradient) {
      per_pass[static_cast<std::size_t>(origin[i])].push_back(static_cast<TensorId>(i));
    }
  }
  for (const Updated& u : updated) {
    const TensorId w = remap[static_cast<std::size_t>(u.weight)];
    const TensorId g = remap[static_cast<std::size_t>(u.gradient)];
    if (w < 0 || g < 0) continue;
    trace::Tensor& weight = m.device.tensors[static_cast<std::size_t>(w)];
    const double elements = static_cast<double>(weight.bytes) / element_bytes;
    const auto elements_u = static_cast<std::uint64_t>(elements);
    if (mixed) weight.bytes = 2 * elements_u;
    std::vector<std::pair<OpIndex, TensorId>> grads;
    for (TensorId x : per_pass[static_cast<std::size_t>(g)]) {
      if (last[static_cast<std::size_t>(x)] == trace::kNoOp) continue;
      if (on_host && mixed && !accumulates_on_device)
        m.device.tensors[static_cast<std::size_t>(x)].bytes = 2 * elements_u;
      grads.emplace_back(last[static_cast<std::size_t>(x)], x);
    }
    if (grads.empty()) continue;
    add_tasks(m, weight.name, w, std::move(grads), elements, hw, pass, first_of_pass, on_host);
    m.parameters += static_cast<std::int64_t>(elements_u);
    m.host_state_bytes += 16 * elements_u;
  }
  trace::validate(m.device);
  return m;
}

Plan host_step_plan(const HostStepModel& m, const Hardware& hw, const PlannerOptions& options,
                    std::uint64_t reserve) {
  Hardware planned = hw;
  planned.device_memory = hw.device_memory > reserve ? hw.device_memory - reserve : 0;
  // The step's state, and the weights' copies, which the plan adds on host memory over the
  // iteration's end, are not the planner's to place.
  std::uint64_t weights = 0;
  for (TensorId w : m.refreshed) weights += m.device.tensors[static_cast<std::size_t>(w)].bytes;
  const std::uint64_t taken = m.host_state_bytes + weights;
  planned.host_memory = hw.host_memory > taken ? hw.host_memory - taken : 0;
  Plan p = make_plan(m.device, planned, options);
  const auto la = trace::analyze_lifetimes(m.device);
  for (std::size_t i = 0; i < m.refreshed.size(); ++i) {
    const TensorId w = m.refreshed[i];
    const auto& life = la.tensors[static_cast<std::size_t>(w)];
    if (life.uses.empty()) continue;
    route_refresh_through_host(p, w, m.device.tensors[static_cast<std::size_t>(w)].bytes,
                               life.uses.back(), life.uses.front(),
                               m.tasks[m.refresh_task[i]].after);
  }
  for (std::size_t i = 0; i < m.drained.size(); ++i) {
    const TensorId g = m.drained[i];
    const OpIndex a = la.tensors[static_cast<std::size_t>(g)].uses.back();
    PlanAction off;
    detail::policy::set_action(off, g, m.device.tensors[static_cast<std::size_t>(g)].bytes,
                               ActionKind::kOffload, a, m.drain_deadline[i], Target::kHost);
    p.actions.push_back(off);
  }
  p.hardware = hw.name;
  p.summary.capacity_bytes = hw.device_memory;
  detail::policy::sort_actions(p);
  validate_plan(p, m.device);
  return p;
}

namespace {

// A refreshed parameter as the bound sees it: its first use u, the op g after which its last
// gradient is complete, its task's time, its gradient's way out and its copy's way back.
struct Refresh {
  OpIndex u = 0;
  OpIndex g = 0;
  double task = 0;
  double out = 0;
  double back = 0;
  std::string name;
};

std::vector<Refresh> refreshes(const HostStepModel& m, const trace::LifetimeAnalysis& la,
                               const ChannelRates& rates) {
  const trace::Trace& t = m.device;
  std::vector<Refresh> rs;
  for (std::size_t i = 0; i < m.refreshed.size(); ++i) {
    const auto w = static_cast<std::size_t>(m.refreshed[i]);
    const HostTask& task = m.tasks[m.refresh_task[i]];
    const auto& uses = la.tensors[w].uses;
    if (uses.empty()) continue;
    const auto g = static_cast<std::size_t>(task.inputs.front());
    rs.push_back({uses.front(), task.after, task.seconds,
                  static_cast<double>(t.tensors[g].bytes) / rates[Channel::kHostWrite],
                  static_cast<double>(t.tensors[w].bytes) / rates[Channel::kHostRead], task.name});
  }
  return rs;
}

// Terms 4 and 5 of host_step_bound (host_step.hpp): one parameter from its first use to its
// refresh; and for the set S of the parameters whose gradients complete last, the host runs all
// of S's tasks after the earliest of those gradients, and the one it runs last is needed by its
// first use in the next iteration: T >= compute(max u .. min g) + S's tasks + a refresh, where
// max u <= min g. Returns the largest, and in `of` what it is of.
double refresh_chain(std::vector<Refresh> rs, const std::vector<double>& before, std::string& of) {
  const auto compute = [&](OpIndex a, OpIndex b) {  // ops a..b, inclusive
    return before[static_cast<std::size_t>(b) + 1] - before[static_cast<std::size_t>(a)];
  };
  double chain = 0;
  for (const Refresh& r : rs) {
    if (r.u > r.g) continue;
    const double c = compute(r.u, r.g) + r.out + r.task + r.back;
    if (c > chain) {
      chain = c;
      of = r.name;
    }
  }
  std::sort(rs.begin(), rs.end(), [](const Refresh& a, const Refresh& b) { return a.g > b.g; });
  double tasks = 0;
  OpIndex u_max = 0;
  double back_min = 0;
  for (std::size_t k = 0; k < rs.size(); ++k) {
    tasks += rs[k].task;
    u_max = std::max(u_max, rs[k].u);
    back_min = k == 0 ? rs[k].back : std::min(back_min, rs[k].back);
    if (u_max > rs[k].g) continue;
    const double c = compute(u_max, rs[k].g) + tasks + back_min;
    if (c > chain) {
      chain = c;
      of = std::to_string(k + 1) + " parameters' tasks after " + rs[k].name + "'s gradient";
    }
  }
  return chain;
}

}  // namespace

StallBound host_step_bound(const HostStepModel& m, const Hardware& hw, double compute_seconds,
                           const std::function<void(double)>& progress) {
  StallBound device = stall_lower_bound(m.device, hw, progress);
  if (device.no_fit_op >= 0) return device;
  const ChannelRates rates = hw.channels();
  const trace::Trace& t = m.device;
  std::vector<double> before(t.ops.size() + 1, 0.0);  // compute of the ops before op k
  for (std::size_t k = 0; k < t.ops.size(); ++k) before[k + 1] = before[k] + t.op_seconds(k);
  const auto la = trace::analyze_lifetimes(t);
  double drained = 0;
  for (TensorId g : m.drained) {
    drained += static_cast<double>(t.tensors[static_cast<std::size_t>(g)].bytes);
  }
  double refreshed = 0;
  for (TensorId w : m.refreshed) {
    refreshed += static_cast<double>(t.tensors[static_cast<std::size_t>(w)].bytes);
  }
  std::string chain_of;
  const double chain = refresh_chain(refreshes(m, la, rates), before, chain_of);
  const std::vector<std::pair<double, std::string>> terms = {
      {device.iteration_seconds, "the device trace's transfers"},
      {m.host_seconds, "the host's Adam and accumulation"},
      {drained / rates[Channel::kHostWrite], "the gradients' way to host memory"},
      {refreshed / rates[Channel::kHostRead], "the 16-bit weights' way back"},
      {chain,
       "the host's tasks between a weight's last gradient and its next use (" + chain_of + ")"},
  };
  const auto top = std::max_element(terms.begin(), terms.end());
  // The windows are of the device trace's ops: a report of the given trace cannot name them.
  StallBound b;
  b.iteration_seconds = top->first;
  b.stall_seconds = std::max(0.0, b.iteration_seconds - compute_seconds);
  b.limit = top->second;
  return b;
}

}  // namespace tidal::plan

namespace tidal::plan::detail::policy {

namespace {

// The better of two simulated host-step plans: one that fits first, then the faster.
bool better(const SimResult& a, const SimResult& b) {
  if (a.fits != b.fits) return a.fits;
  return a.fits ? a.iteration_seconds < b.iteration_seconds : a.peak_bytes < b.peak_bytes;
}

}  // namespace

namespace {

// One host-step model planned (within up to four attempts: the planner does not see the
// gradients on their way out, so each attempt plans for less device memory by what they took
// over it in the one before) and simulated.
PolicyResult plan_host_step(const std::shared_ptr<const HostStepModel>& model,
                            const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt) {
  PolicyResult r;
  r.policy = Policy::kTidal;
  r.optimizer_step = OptimizerPlacement::kHost;
  SimOptions so = opt.sim;
  so.host_tasks = model->tasks;
  std::uint64_t reserve = 0;
  std::optional<Plan> best_plan;
  SimResult best;
  for (int attempt = 0; attempt < 4; ++attempt) {
    Plan p = host_step_plan(*model, hw, opt.planner, reserve);
    SimResult sim = simulate(model->device, &p, hw, so);
    r.planning_seconds += p.summary.planning_seconds;
    const bool fits = sim.fits;
    const std::uint64_t over = fits ? 0 : sim.peak_bytes - sim.capacity_bytes;
    if (!best_plan || better(sim, best)) {
      best = std::move(sim);
      best_plan = std::move(p);
    }
    if (fits || reserve + over >= hw.device_memory) break;
    reserve += over + over / 4;
  }
  r.sim = std::move(best);
  const std::uint64_t host_needed = r.sim.peak_host_bytes + model->host_state_bytes;
  r.fits = r.sim.fits && host_needed <= hw.host_memory;
  std::ostringstream note;
  note << "optimizer step on the host, gradients accumulated on the "
       << to_string(model->accumulation) << ": " << format_seconds(r.sim.host_task_seconds)
       << " of host CPU a step for " << std::fixed << std::setprecision(2)
       << static_cast<double>(model->parameters) / 1e9 << "B parameters; "
       << best_plan->summary.offloads_ssd << " offloads to SSD, "
       << best_plan->summary.offloads_host << " to host, " << model->drained.size()
       << " gradients sent to host";
  if (r.sim.refresh_waits > 0) note << "; " << r.sim.refresh_waits << " weight reads waited";
  if (host_needed > hw.host_memory) {
    note << "; out of host memory: needs " << format_bytes(static_cast<double>(host_needed))
         << ", has " << format_bytes(static_cast<double>(hw.host_memory));
  }
  r.note = note.str();
  r.plan = std::move(best_plan);
  r.bound = host_step_bound(*model, hw, tr.compute_seconds());
  r.plan_trace = std::shared_ptr<const trace::Trace>(model, &model->device);
  return r;
}

}  // namespace

namespace {

// The host step's variants planned so far: the fastest that fits, and the lowest bound.
class VariantSearch {
 public:
  VariantSearch(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt)
      : tr_(tr), hw_(hw), opt_(opt) {
    for (const auto& op : tr.ops) layers_ = std::max(layers_, op.layer + 1);
  }
  [[nodiscard]] int layers() const { return layers_; }

  // Plans the variant with checkpointing `c` and gradients accumulated as `a`; returns its
  // iteration (infinite where it does not fit).
  double run(Checkpointing c, GradientAccumulation a) {
    const bool any = c.whole_layers > 0 || c.selective_layers > 0;
    const trace::Trace t = any ? recompute_trace(tr_, c) : tr_;
    PolicyResult r =
        plan_host_step(std::make_shared<HostStepModel>(host_step_model(t, hw_, a)), tr_, hw_, opt_);
    if (any) r.note += "; with " + checkpointing_name(c, layers_);
    if (!bound_ ||
        (r.bound->no_fit_op < 0 &&
         (bound_->no_fit_op >= 0 || r.bound->iteration_seconds < bound_->iteration_seconds))) {
      bound_ = r.bound;
    }
    planning_ += r.planning_seconds;
    const double seconds = r.fits ? r.sim.iteration_seconds : INFINITY;
    if (!best_ || (r.fits != best_->fits ? r.fits : better(r.sim, best_->sim))) {
      best_ = std::move(r);
      best_accumulation_ = a;
    }
    return seconds;
  }
  [[nodiscard]] GradientAccumulation best_accumulation() const { return best_accumulation_; }

  PolicyResult take() {
    best_->bound = bound_;
    best_->planning_seconds = planning_;
    return std::move(*best_);
  }

 private:
  const trace::Trace& tr_;
  const Hardware& hw_;
  const PolicyOptions& opt_;
  int layers_ = 0;
  std::optional<PolicyResult> best_;
  GradientAccumulation best_accumulation_ = GradientAccumulation::kHost;
  std::optional<StallBound> bound_;
  double planning_ = 0;
};

}  // namespace

PolicyResult run_host_step(const trace::Trace& tr, const Hardware& hw, const PolicyOptions& opt) {
  // The variants: the gradients accumulated on the host or on the device, on the trace as it is
  // and with layer-wise activation checkpointing (ZeRO-Offload's companion: more compute, far
  // fewer activations to move); then, with the better accumulation, checkpointing of the first
  // half of the layers, and of a quarter or three quarters on the side where that helped; then
  // selective checkpointing behind whole blocks.
  VariantSearch search(tr, hw, opt);
  const int L = search.layers();
  double none = INFINITY;
  double all = INFINITY;
  for (GradientAccumulation a : {GradientAccumulation::kHost, GradientAccumulation::kDevice}) {
    none = std::min(none, search.run({0, 0}, a));
    if (L > 0) all = std::min(all, search.run({L, 0}, a));
  }
  // Nothing checkpoints more than every layer whole: where neither that nor no checkpointing
  // fits, no variant between them does.
  if (L < 2 || (all == INFINITY && none == INFINITY)) return search.take();
  const GradientAccumulation a = search.best_accumulation();
  const double half = search.run({L / 2, 0}, a);
  if (L >= 4) {
    if (half < all || all == INFINITY) {
      if (none == INFINITY || half < none) search.run({L / 4, 0}, a);
    } else {
      search.run({3 * L / 4, 0}, a);
    }
  }
  // Selective checkpointing of the layers whole-block checkpointing leaves, or of all of
  // them: less compute where the link can move what it keeps. The first layers' activations
  // live longest, so they are the ones checkpointed whole.
  for (int whole : {0, L / 4, L / 2, 3 * L / 4}) (void)search.run({whole, L - whole}, a);
  return search.take();
}

}  // namespace tidal::plan::detail::policy
