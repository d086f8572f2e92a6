#include "tidal/plan/plan.hpp"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tidal/common/enum_names.hpp"
#include "tidal/common/error.hpp"

namespace tidal::plan {

using nlohmann::json;

TIDAL_ENUM_NAMES(ActionKind, action_kind_from_string, "plan action",
                 {ActionKind::kOffload, "offload"}, {ActionKind::kPrefetch, "prefetch"},
                 {ActionKind::kStage, "stage"})
TIDAL_ENUM_TO_STRING(Tier, {Tier::kSsd, "ssd"}, {Tier::kHost, "host"}, {Tier::kDevice, "device"})
TIDAL_ENUM_TO_STRING(Channel, {Channel::kSsdWrite, "ssd-write"}, {Channel::kSsdRead, "ssd-read"},
                     {Channel::kHostWrite, "host-write"}, {Channel::kHostRead, "host-read"})

namespace {
constexpr EnumName<Target> kTargetNames[] = {{Target::kSsd, "ssd"}, {Target::kHost, "host"}};
}  // namespace

Target target_from_string(const std::string& s) {
  return enum_value(kTargetNames, s, "plan target");
}

// The summary's fields, both ways (a missing or mistyped one fails the read with its name).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PlanSummary, capacity_bytes, target_bytes, peak_before_bytes,
                                   peak_after_bytes, peak_after_op, candidates, offloads_ssd,
                                   offloads_host, bytes_to_ssd, bytes_to_host, peak_host_bytes,
                                   planned_stall_seconds, compute_seconds, planning_seconds, fits)

std::string summary_to_json(const PlanSummary& summary) { return json(summary).dump(); }

// Written as text, one action per line, in the order of docs/plan-format.md: a plan of
// Llama3-70B has thousands of actions, and building them as a JSON document first took about a
// tenth of `tidal plan`'s time.
std::string plan_to_json(const Plan& plan) {
  std::string out;
  out.reserve(256 + plan.actions.size() * 112 + plan.stalls.size() * 40);
  char buf[32];
  const auto num = [&](auto v) {
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    out.append(buf, r.ptr);
  };
  out += "{\n \"format\": \"tidal-plan\",\n \"version\": ";
  num(plan.version);
  out += ",\n \"model\": " + json(plan.model).dump();
  out += ",\n \"hardware\": " + json(plan.hardware).dump();
  out += ",\n \"num_ops\": ";
  num(plan.num_ops);
  out += ",\n \"num_tensors\": ";
  num(plan.num_tensors);
  out += ",\n \"summary\": " + summary_to_json(plan.summary);
  out += ",\n \"actions\": [";
  for (std::size_t i = 0; i < plan.actions.size(); ++i) {
    const PlanAction& a = plan.actions[i];
    out += i == 0 ? "\n  {\"tensor\": " : ",\n  {\"tensor\": ";
    num(a.tensor);
    out += R"(, "action": ")";
    out += to_string(a.kind);
    out += R"(", "trigger": )";
    num(a.trigger);
    out += ", \"deadline\": ";
    num(a.deadline);
    out += R"(, "target": ")";
    out += to_string(a.target);
    out += R"(", "bytes": )";
    num(a.bytes);
    out += a.wraps ? ", \"wraps\": true}" : ", \"wraps\": false}";
  }
  out += plan.actions.empty() ? "],\n \"stalls\": [" : "\n ],\n \"stalls\": [";
  for (std::size_t i = 0; i < plan.stalls.size(); ++i) {
    out += i == 0 ? "\n  {\"op\": " : ",\n  {\"op\": ";
    num(plan.stalls[i].first);
    out += ", \"seconds\": " + json(plan.stalls[i].second).dump() + "}";
  }
  out += plan.stalls.empty() ? "]\n}" : "\n ]\n}";
  return out;
}

namespace {

template <typename T>
T field(const json& j, const char* name, const char* where) {
  TIDAL_EXPECT_AS(InvalidArgument, j.is_object() && j.contains(name), "the plan's ", where,
                  " lacks the field '", name, "'");
  try {
    return j.at(name).get<T>();
  } catch (const json::exception& e) {
    TIDAL_EXPECT_AS(InvalidArgument, false, "the plan's ", where, " field '", name,
                    "' has the wrong type: ", e.what());
  }
  return T{};
}

}  // namespace

Plan plan_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TIDAL_EXPECT_AS(InvalidArgument, false, "the plan is not valid JSON: ", e.what());
  }
  Plan p;
  p.version = field<int>(j, "version", "top level");
  TIDAL_EXPECT_AS(InvalidArgument, p.version == kPlanVersion, "plan version ", p.version,
                  " is not supported (this tidal reads version ", kPlanVersion,
                  "); make the plan again with this tidal");
  p.model = field<std::string>(j, "model", "top level");
  p.hardware = field<std::string>(j, "hardware", "top level");
  p.num_ops = field<std::int32_t>(j, "num_ops", "top level");
  p.num_tensors = field<std::int32_t>(j, "num_tensors", "top level");
  if (j.contains("summary")) p.summary = field<PlanSummary>(j, "summary", "top level");
  for (const json& a : field<json>(j, "actions", "top level")) {
    PlanAction x;
    x.tensor = field<trace::TensorId>(a, "tensor", "action");
    x.kind = action_kind_from_string(field<std::string>(a, "action", "action"));
    x.trigger = field<trace::OpIndex>(a, "trigger", "action");
    x.deadline = field<trace::OpIndex>(a, "deadline", "action");
    x.target = target_from_string(field<std::string>(a, "target", "action"));
    x.bytes = field<std::uint64_t>(a, "bytes", "action");
    x.wraps = a.contains("wraps") ? a["wraps"].get<bool>() : x.deadline <= x.trigger;
    p.actions.push_back(x);
  }
  if (j.contains("stalls")) {
    for (const json& s : j["stalls"]) {
      p.stalls.emplace_back(field<trace::OpIndex>(s, "op", "stall"),
                            field<double>(s, "seconds", "stall"));
    }
  }
  return p;
}

void write_plan(const Plan& plan, const std::string& path) {
  std::ofstream out(path);
  TIDAL_EXPECT(out.good(), "cannot open '", path, "' for writing the plan");
  out << plan_to_json(plan) << "\n";
  out.close();
  TIDAL_EXPECT(!out.fail(), "writing the plan to '", path, "' failed (disk full?)");
}

Plan read_plan(const std::string& path) {
  std::ifstream in(path);
  TIDAL_EXPECT_AS(InvalidArgument, in.good(), "cannot open the plan file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return plan_from_json(ss.str());
  } catch (const InvalidArgument& e) {
    TIDAL_EXPECT_AS(InvalidArgument, false, path, ": ", e.what());
  }
  return {};
}

void validate_plan(const Plan& plan, const trace::Trace& trace) {
  const auto n_ops = static_cast<trace::OpIndex>(trace.ops.size());
  const auto n_tensors = static_cast<trace::TensorId>(trace.tensors.size());
  TIDAL_EXPECT_AS(InvalidArgument, plan.num_ops == n_ops && plan.num_tensors == n_tensors,
                  "the plan was made for a trace of ", plan.num_ops, " ops and ", plan.num_tensors,
                  " tensors, this trace has ", n_ops, " and ", n_tensors);
  std::vector<char> offloaded(static_cast<std::size_t>(n_tensors), 0);
  for (const PlanAction& a : plan.actions) {
    if (a.kind == ActionKind::kOffload && a.tensor >= 0 && a.tensor < n_tensors) {
      offloaded[static_cast<std::size_t>(a.tensor)] = 1;
    }
  }
  for (std::size_t i = 0; i < plan.actions.size(); ++i) {
    const PlanAction& a = plan.actions[i];
    TIDAL_EXPECT_AS(InvalidArgument, a.tensor >= 0 && a.tensor < n_tensors, "plan action ", i,
                    ": tensor ", a.tensor, " is out of range");
    TIDAL_EXPECT_AS(InvalidArgument,
                    a.trigger >= 0 && a.trigger < n_ops && a.deadline >= 0 && a.deadline < n_ops,
                    "plan action ", i, ": trigger ", a.trigger, " or deadline ", a.deadline,
                    " is out of range");
    TIDAL_EXPECT_AS(InvalidArgument, a.bytes == trace.tensors[a.tensor].bytes, "plan action ", i,
                    ": ", a.bytes, " bytes, but tensor ", a.tensor, " has ",
                    trace.tensors[a.tensor].bytes);
    TIDAL_EXPECT_AS(InvalidArgument, a.target == Target::kSsd || a.target == Target::kHost,
                    "plan action ", i, ": its target must be ssd or host");
    TIDAL_EXPECT_AS(InvalidArgument, a.wraps == (a.deadline <= a.trigger), "plan action ", i,
                    ": wraps must be true exactly when deadline <= trigger");
    TIDAL_EXPECT_AS(InvalidArgument,
                    a.kind == ActionKind::kOffload || offloaded[static_cast<std::size_t>(a.tensor)],
                    "plan action ", i, ": ", to_string(a.kind), " of tensor ", a.tensor,
                    " which the plan never offloads");
    TIDAL_EXPECT_AS(InvalidArgument, a.kind != ActionKind::kStage || a.target == Target::kHost,
                    "plan action ", i,
                    ": a stage copies from the SSDs to host memory, so its "
                    "target must be host");
    // A per-iteration tensor's offload may complete in the next iteration (a gradient on its
    // way to the host step); nothing of it waits across the iteration's end to come back.
    TIDAL_EXPECT_AS(
        InvalidArgument,
        !a.wraps || trace.tensors[a.tensor].persistent || a.kind == ActionKind::kOffload,
        "plan action ", i, ": only a persistent tensor can wait across iterations");
  }
}

}  // namespace tidal::plan
