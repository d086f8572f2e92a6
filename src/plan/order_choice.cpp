#include "tidal/plan/order_choice.hpp"

#include <chrono>
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
  OrderChoice out;
  const auto n = static_cast<double>(traces.size());
  for (std::size_t i = 0; i < traces.size(); ++i) {
    TIDAL_EXPECT_AS(InvalidArgument, traces[i] != nullptr, "choose_fastest_order: trace ", i,
                    " is null");
    const trace::Trace& tr = *traces[i];
    OrderCandidate c;
    const auto it = tr.meta.find("micro_batch_order");
    c.order = it != tr.meta.end() ? it->second : "trace " + std::to_string(i);
    const double ideal = run_policy(Policy::kIdeal, tr, hw, options).sim.iteration_seconds;
    c.tidal = run_policy(Policy::kTidal, tr, hw, options, ideal);
    std::function<void(double)> progress;
    if (bound_progress) {
      progress = [&bound_progress, i, n](double f) {
        bound_progress((static_cast<double>(i) + f) / n);
      };
    }
    const auto t0 = std::chrono::steady_clock::now();
    c.bound = stall_lower_bound(tr, hw, progress);
    c.bound_wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.candidates.push_back(std::move(c));
  }
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
