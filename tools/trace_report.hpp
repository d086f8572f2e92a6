// What `tidal plan`, `tidal simulate` and `tidal estimate` say about the trace they planned: the
// optimizer schedule and micro-batch order its meta records, as text lines and as JSON fields;
// shares as percentages.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "tidal/trace/trace.hpp"

namespace tidal::cli {

/// A share as a percentage with one decimal: 0.8123 -> "81.2%".
inline std::string pct(double share) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * share);
  return buf;
}

/// Prints "optimizer step: <schedule>" when the trace records its optimizer schedule.
inline void print_optimizer_step(const trace::Trace& tr) {
  if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
    std::printf("optimizer step: %s\n", it->second.c_str());
}

/// Prints "micro-batch order: <order>" when the trace records its micro-batch order.
inline void print_micro_batch_order(const trace::Trace& tr) {
  if (const auto it = tr.meta.find("micro_batch_order"); it != tr.meta.end())
    std::printf("micro-batch order: %s\n", it->second.c_str());
}

/// Sets j's "model", and "optimizer_schedule" and "micro_batch_order" where the trace records
/// them.
inline void add_trace_meta(nlohmann::json& j, const trace::Trace& tr) {
  j["model"] = tr.model;
  if (const auto it = tr.meta.find("optimizer_schedule"); it != tr.meta.end())
    j["optimizer_schedule"] = it->second;
  if (const auto it = tr.meta.find("micro_batch_order"); it != tr.meta.end())
    j["micro_batch_order"] = it->second;
}

}  // namespace tidal::cli
