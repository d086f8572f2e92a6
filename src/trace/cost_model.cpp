#include "tidal/trace/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <string_view>

#include "tidal/common/error.hpp"

namespace tidal::trace {
namespace {

constexpr std::string_view kMatmuls[] = {"aten::mm",      "aten::addmm",      "aten::bmm",
                                         "aten::baddbmm", "aten::matmul",     "aten::linear",
                                         "aten::addbmm",  "aten::_grouped_mm"};

bool is_matmul(const std::string& name) {
  return std::find(std::begin(kMatmuls), std::end(kMatmuls), name) != std::end(kMatmuls);
}

double op_seconds(const Trace& t, const Op& op, const Roofline& r) {
  std::set<TensorId> touched(op.inputs.begin(), op.inputs.end());
  touched.insert(op.outputs.begin(), op.outputs.end());
  double bytes = 0;
  for (const TensorId id : touched)
    bytes += static_cast<double>(t.tensors[static_cast<std::size_t>(id)].bytes);
  double seconds = bytes / r.bytes_per_s;
  if (is_matmul(op.name) && op.inputs.size() >= 2 && !op.outputs.empty()) {
    std::vector<double> in;
    for (const TensorId id : op.inputs)
      in.push_back(static_cast<double>(t.tensors[static_cast<std::size_t>(id)].bytes));
    std::sort(in.rbegin(), in.rend());
    const double e = r.element_bytes;
    const auto out =
        static_cast<double>(t.tensors[static_cast<std::size_t>(op.outputs.front())].bytes);
    const double elements = (in[0] / e) * (in[1] / e) * (out / e);
    seconds = std::max(seconds, 2.0 * std::sqrt(elements) / r.flops);
  }
  return seconds;
}

}  // namespace

void model_op_times(Trace& trace, const Roofline& r) {
  TIDAL_EXPECT_AS(InvalidArgument, r.flops > 0 && r.bytes_per_s > 0 && r.element_bytes > 0,
                  "the roofline's rates must be positive (FLOP/s ", r.flops, ", bytes/s ",
                  r.bytes_per_s, ", element bytes ", r.element_bytes, ")");
  double now = 0;
  for (auto& op : trace.ops) {
    const double seconds = op.name == "tidal::step_end" ? 0.0 : op_seconds(trace, op, r);
    op.start_s = now;
    op.end_s = now + seconds;
    now = op.end_s + (seconds > 0 ? r.op_overhead : 0.0);
  }
}

}  // namespace tidal::trace
