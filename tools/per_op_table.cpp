#include "per_op_table.hpp"

#include <algorithm>
#include <fstream>

#include "tidal/common/error.hpp"
#include "tidal/plan/simulator.hpp"

namespace tidal::cli {

// --per-op: tidal's plan op by op, replayed once more with the residency recorded: each op's
// compute, stall and device bytes, and the device-side bytes of each tensor class as the op
// comes up (resident, leaving or arriving), to see where a plan stalls and what it holds there.
void write_per_op(const std::string& path, const trace::Trace& tr, const plan::Plan& p,
                  const plan::Hardware& hw) {
  plan::SimOptions so;
  so.record_residency = true;
  const plan::SimResult r = plan::simulate(tr, &p, hw, so);
  std::ofstream out(path);
  TIDAL_EXPECT(out.good(), "cannot write the per-op table to '", path, "'");
  constexpr int kClasses = static_cast<int>(trace::TensorClass::kInput) + 1;  // the last class
  out << "op,phase,name,compute_s,stall_s,memory_bytes";
  for (int c = 0; c < kClasses; ++c)
    out << "," << trace::to_string(static_cast<trace::TensorClass>(c)) << "_bytes";
  for (plan::Channel c : plan::kChannels) {
    std::string name = plan::to_string(c);  // ssd_write_busy_s: seconds the channel was busy
    std::replace(name.begin(), name.end(), '-', '_');
    out << "," << name << "_busy_s";
  }
  out << "\n";
  for (std::size_t k = 0; k < tr.ops.size() && k < r.residency.size(); ++k) {
    std::uint64_t by_class[kClasses] = {};
    const auto& res = r.residency[k];
    for (std::size_t t = 0; t < res.size() && t < tr.tensors.size(); ++t) {
      if (res[t] == plan::Residency::kResident || res[t] == plan::Residency::kLeaving ||
          res[t] == plan::Residency::kArriving)
        by_class[static_cast<int>(tr.tensors[t].cls)] += tr.tensors[t].bytes;
    }
    const auto& op = tr.ops[k];
    out << k << "," << trace::to_string(op.phase) << "," << op.name << ","
        << tr.op_seconds(static_cast<trace::OpIndex>(k)) << "," << r.stall_per_op[k] << ","
        << r.memory_per_op[k];
    for (const std::uint64_t b : by_class) out << "," << b;
    for (plan::Channel c : plan::kChannels) out << "," << r.busy_per_op[k][plan::index_of(c)];
    out << "\n";
  }
  TIDAL_EXPECT(out.good(), "writing the per-op table to '", path, "' failed");
}

}  // namespace tidal::cli
