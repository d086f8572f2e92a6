#include "tidal/plan/order_choice.hpp"

#include <chrono>
#include <future>
#include <mutex>
#include <numeric>
#include <utility>

#include "tidal/common/error.hpp"

namespace tidal::plan {
namespace {
constexpr double kOrderTie = 1e-6;
}  // namespace

OrderChoice choose_fastest_order(const std::vector<const trace::Trace*>& traces, const Hardware& hw,
                                 const PolicyOptions& options,
                                 const std::function<void(double)>& bound_progress) {
  TIDAL_EXPECT_AS(InvalidArgument, !traces.empty(), "choose_fastest_order needs a trace");
  for (std::size_t i = 0; i < traces.size(); ++i) {
    TIDAL_EXPECT_AS(InvalidArgument, traces[i] != nullptr, "choose_fastest_order: trace ", i,
                    " is null");
  }
  // Each order is planned, simulated and bounded on its own thread (the planner and the bound
  // only read the trace): auto takes the time of the slower order, not of both. The progress of
  // the bounds is their mean, reported under a lock.
  std::mutex progress_mu;
  std::vector<double> fraction(traces.size(), 0.0);
  const auto n = static_cast<double>(traces.size());
  const auto plan_order = [&](std::size_t i) {
    const trace::Trace& tr = *traces[i];
    OrderCandidate c;
    const auto it = tr.meta.find("micro_batch_order");
    c.order = it != tr.meta.end() ? it->second : "trace " + std::to_string(i);
    const double ideal = run_policy(Policy::kIdeal, tr, hw, options).sim.iteration_seconds;
    c.tidal = run_policy(Policy::kTidal, tr, hw, options, ideal);
    std::function<void(double)> progress;
    if (bound_progress) {
      progress = [&, i](double f) {
        std::lock_guard<std::mutex> lock(progress_mu);
        fraction[i] = f;
        bound_progress(std::accumulate(fraction.begin(), fraction.end(), 0.0) / n);
      };
    }
    // The bound tidal's planner computed, where it did (the same trace and machine).
    const auto t0 = std::chrono::steady_clock::now();
    if (c.tidal.bound) {
      c.bound = *c.tidal.bound;
      if (progress) progress(1.0);
    } else {
      c.bound = stall_lower_bound(tr, hw, progress);
    }
    c.bound_wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return c;
  };
  std::vector<std::future<OrderCandidate>> others;
  for (std::size_t i = 1; i < traces.size(); ++i) {
    others.push_back(std::async(std::launch::async, plan_order, i));
  }
  OrderChoice out;
  out.candidates.push_back(plan_order(0));
  for (auto& f : others) out.candidates.push_back(f.get());  // rethrows a thread's error
  // A plan that fits beats one that does not; then the shorter iteration; the first on a tie.
  // Iterations within a millionth are a tie: the orders sum the same op times in another order,
  // so two plans that both run at ideal differ in the last digits, and the first order (the
  // sequential one, which training loops run) should then be kept.
  const auto better = [](const PolicyResult& a, const PolicyResult& b) {
    if (a.fits != b.fits) return a.fits;
    return a.sim.iteration_seconds < b.sim.iteration_seconds * (1 - kOrderTie);
  };
  for (std::size_t i = 1; i < out.candidates.size(); ++i) {
    if (better(out.candidates[i].tidal, out.candidates[out.chosen].tidal)) out.chosen = i;
    if (out.candidates[i].bound.iteration_seconds <
        out.candidates[out.bound_from].bound.iteration_seconds) {
      out.bound_from = i;
    }
  }
  return out;
}

}  // namespace tidal::plan
