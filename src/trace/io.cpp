#include "tidal/trace/io.hpp"

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "tidal/common/error.hpp"

namespace tidal::trace {

namespace {

using nlohmann::json;

constexpr const char* kFormat = "tidal-trace";

// ---- reading: every accessor names the field it failed on ---------------------------------

const json& field(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  TIDAL_EXPECT_AS(InvalidArgument, it != obj.end(), "missing field '", key, "' in ", where);
  return *it;
}

std::string where_of(const std::string& where, const char* key) {
  return where == "the trace" ? std::string(key) : where + "." + key;
}

std::string get_string(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_string(), "field '", where_of(where, key),
                  "' must be a string, not ", v.type_name());
  return v.get<std::string>();
}

std::int64_t get_int(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_number_integer(), "field '", where_of(where, key),
                  "' must be an integer, not ", v.type_name());
  return v.get<std::int64_t>();
}

std::int32_t get_int32(const json& obj, const char* key, const std::string& where) {
  const std::int64_t v = get_int(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument,
                  v >= std::numeric_limits<std::int32_t>::min() &&
                      v <= std::numeric_limits<std::int32_t>::max(),
                  "field '", where_of(where, key), "' = ", v, " is out of range");
  return static_cast<std::int32_t>(v);
}

std::int32_t get_int32_or(const json& obj, const char* key, const std::string& where,
                          std::int32_t fallback) {
  return obj.contains(key) ? get_int32(obj, key, where) : fallback;
}

std::uint64_t get_uint(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_number_unsigned(), "field '", where_of(where, key),
                  "' must be a non-negative integer, not ",
                  v.is_number() ? std::string("a negative or fractional number") : v.type_name());
  return v.get<std::uint64_t>();
}

double get_double(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_number(), "field '", where_of(where, key),
                  "' must be a number, not ", v.type_name());
  return v.get<double>();
}

bool get_bool(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_boolean(), "field '", where_of(where, key),
                  "' must be true or false, not ", v.type_name());
  return v.get<bool>();
}

const json& get_array(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  TIDAL_EXPECT_AS(InvalidArgument, v.is_array(), "field '", where_of(where, key),
                  "' must be an array, not ", v.type_name());
  return v;
}

std::vector<TensorId> get_ids(const json& obj, const char* key, const std::string& where) {
  const json& arr = get_array(obj, key, where);
  std::vector<TensorId> ids;
  ids.reserve(arr.size());
  for (const json& v : arr) {
    TIDAL_EXPECT_AS(InvalidArgument, v.is_number_integer(), "field '", where_of(where, key),
                    "' must hold integer tensor ids, not ", v.type_name());
    const auto id = v.get<std::int64_t>();
    TIDAL_EXPECT_AS(InvalidArgument, id >= 0 && id <= std::numeric_limits<TensorId>::max(),
                    "field '", where_of(where, key), "' holds tensor id ", id,
                    ", which is out of range");
    ids.push_back(static_cast<TensorId>(id));
  }
  return ids;
}

// Written in field order (format and version first), one op and one tensor per line: compact,
// yet a person can read and diff it.
using ordered_json = nlohmann::ordered_json;

ordered_json ids_to_json(const std::vector<TensorId>& ids) {
  ordered_json arr = ordered_json::array();
  for (TensorId id : ids) arr.push_back(id);
  return arr;
}

ordered_json op_to_json(const Op& op) {
  ordered_json j{{"index", op.index},
                 {"name", op.name},
                 {"phase", to_string(op.phase)},
                 {"start_s", op.start_s},
                 {"end_s", op.end_s},
                 {"inputs", ids_to_json(op.inputs)},
                 {"outputs", ids_to_json(op.outputs)},
                 {"layer", op.layer}};
  if (op.workspace_bytes != 0) j["workspace_bytes"] = op.workspace_bytes;
  return j;
}

ordered_json tensor_to_json(const Tensor& t) {
  return ordered_json{{"id", t.id},
                      {"name", t.name},
                      {"bytes", t.bytes},
                      {"device", t.device},
                      {"class", to_string(t.cls)},
                      {"persistent", t.persistent},
                      {"producer", t.producer},
                      {"output_slot", t.output_slot},
                      {"freed_after", t.freed_after}};
}

// Invalid UTF-8 in a name becomes U+FFFD rather than failing the whole file.
std::string dump_line(const ordered_json& j) {
  return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

template <typename T, typename F>
void write_array(std::string& out, const char* key, const std::vector<T>& items, F to_line) {
  out += detail::concat(" \"", key, "\": [");
  for (std::size_t i = 0; i < items.size(); ++i) {
    out += i == 0 ? "\n  " : ",\n  ";
    out += dump_line(to_line(items[i]));
  }
  out += items.empty() ? "]" : "\n ]";
}

std::string to_json_text(const Trace& trace) {
  ordered_json meta = ordered_json::object();
  for (const auto& [k, v] : trace.meta) meta[k] = v;
  std::string out = "{\n";
  out += detail::concat(" \"format\": ", dump_line(ordered_json(kFormat)), ",\n");
  out += detail::concat(" \"version\": ", kTraceVersion, ",\n");
  out += detail::concat(" \"model\": ", dump_line(ordered_json(trace.model)), ",\n");
  out += detail::concat(" \"device\": ", dump_line(ordered_json(trace.device)), ",\n");
  out += detail::concat(" \"batch\": ", trace.batch, ",\n");
  out += detail::concat(" \"seq\": ", trace.seq, ",\n");
  out += detail::concat(" \"meta\": ", dump_line(meta), ",\n");
  write_array(out, "ops", trace.ops, op_to_json);
  out += ",\n";
  write_array(out, "tensors", trace.tensors, tensor_to_json);
  out += "\n}\n";
  return out;
}

// Format and version come first: a file that is not a tidal trace, or one of another version,
// gets that sentence rather than a complaint about some later field.
int check_format_and_version(const json& j, const std::string& top) {
  TIDAL_EXPECT_AS(InvalidArgument, j.is_object(), "the trace must be a JSON object, not ",
                  j.type_name());
  const std::string format = get_string(j, "format", top);
  TIDAL_EXPECT_AS(InvalidArgument, format == kFormat, "field 'format' is '", format,
                  "', expected '", kFormat, "'; this is not a tidal trace");
  const std::int64_t version = get_int(j, "version", top);
  TIDAL_EXPECT_AS(InvalidArgument, version == kTraceVersion, "trace format version ", version,
                  " is not supported: this build of tidal reads version ", kTraceVersion,
                  "; re-profile with this build or use the matching tidal version");
  return static_cast<int>(version);
}

void read_meta(const json& j, Trace& t) {
  if (!j.contains("meta")) return;
  const json& meta = j.at("meta");
  TIDAL_EXPECT_AS(InvalidArgument, meta.is_object(), "field 'meta' must be an object, not ",
                  meta.type_name());
  for (const auto& [k, v] : meta.items()) {
    TIDAL_EXPECT_AS(InvalidArgument, v.is_string(), "field 'meta.", k, "' must be a string, not ",
                    v.type_name());
    t.meta[k] = v.get<std::string>();
  }
}

// Reads an enum's name through parse (phase_from_string, ...), naming the element on failure.
template <typename Parse>
auto get_enum(const json& o, const char* key, const std::string& where, Parse parse) {
  try {
    return parse(get_string(o, key, where));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::concat("in ", where, ": ", e.what()));
  }
}

// Element k of the file's array `kind` ("ops", "tensors"), which must be an object, read by
// read(object, where) with where = "<kind>[k]" for the messages.
template <class Read>
auto element_from_json(const json& arr, std::size_t k, const char* kind, Read read) {
  const std::string where = detail::concat(kind, "[", k, "]");
  const json& o = arr[k];
  TIDAL_EXPECT_AS(InvalidArgument, o.is_object(), where, " must be an object, not ", o.type_name());
  return read(o, where);
}

Op op_from_json(const json& ops, std::size_t k) {
  return element_from_json(ops, k, "ops", [](const json& o, const std::string& where) {
    Op op;
    op.index = get_int32(o, "index", where);
    op.name = get_string(o, "name", where);
    op.phase = get_enum(o, "phase", where, phase_from_string);
    op.start_s = get_double(o, "start_s", where);
    op.end_s = get_double(o, "end_s", where);
    op.inputs = get_ids(o, "inputs", where);
    op.outputs = get_ids(o, "outputs", where);
    op.layer = get_int32_or(o, "layer", where, -1);
    op.workspace_bytes = o.contains("workspace_bytes") ? get_uint(o, "workspace_bytes", where) : 0;
    return op;
  });
}

Tensor tensor_from_json(const json& tensors, std::size_t i) {
  return element_from_json(tensors, i, "tensors", [](const json& o, const std::string& where) {
    Tensor ten;
    ten.id = get_int32(o, "id", where);
    ten.name = get_string(o, "name", where);
    ten.bytes = get_uint(o, "bytes", where);
    ten.device = get_string(o, "device", where);
    ten.cls = get_enum(o, "class", where, tensor_class_from_string);
    ten.persistent = get_bool(o, "persistent", where);
    ten.producer = get_int32_or(o, "producer", where, kNoOp);
    ten.output_slot = get_int32_or(o, "output_slot", where, -1);
    ten.freed_after = get_int32_or(o, "freed_after", where, kNoOp);
    return ten;
  });
}

// A trace read from a file that breaks an invariant is the user's input being wrong.
void validate_as_input(const Trace& t) {
  try {
    validate(t);
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw InvalidArgument(e.what());
  }
}

Trace from_json(const json& j) {
  const std::string top = "the trace";
  Trace t;
  t.version = check_format_and_version(j, top);
  t.model = get_string(j, "model", top);
  t.device = get_string(j, "device", top);
  t.batch = get_int(j, "batch", top);
  t.seq = get_int(j, "seq", top);
  read_meta(j, t);

  const json& ops = get_array(j, "ops", top);
  t.ops.reserve(ops.size());
  for (std::size_t k = 0; k < ops.size(); ++k) t.ops.push_back(op_from_json(ops, k));

  const json& tensors = get_array(j, "tensors", top);
  t.tensors.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    t.tensors.push_back(tensor_from_json(tensors, i));
  }

  validate_as_input(t);
  return t;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TIDAL_EXPECT_AS(InvalidArgument, in.good(), "cannot open trace file '", path,
                  "'; check that it exists and is readable");
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TIDAL_EXPECT(out.good(), "cannot create '", path,
               "'; check that its directory exists and is writable");
  out << text;
  out.close();
  TIDAL_EXPECT(!out.fail(), "writing '", path, "' failed (disk full?)");
}

}  // namespace

std::string trace_to_json(const Trace& trace) { return to_json_text(trace); }

Trace trace_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    TIDAL_EXPECT_AS(InvalidArgument, false, "not valid JSON (", e.what(), ")");
  }
  return from_json(j);
}

void write_trace(const Trace& trace, const std::string& path) {
  write_file(path, trace_to_json(trace));
}

Trace read_trace(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return trace_from_json(text);
  } catch (const Error& e) {
    throw InvalidArgument(detail::concat("trace file '", path, "' is invalid: ", e.what()));
  }
}

void write_chrome_trace(const Trace& trace, const LifetimeAnalysis& lifetimes,
                        const std::string& path) {
  TIDAL_EXPECT(lifetimes.live_bytes.size() == trace.ops.size() &&
                   lifetimes.active_bytes.size() == trace.ops.size(),
               "the lifetime analysis has ", lifetimes.live_bytes.size(), " ops but the trace has ",
               trace.ops.size(), "; analyze this trace before writing its Chrome trace");
  constexpr int kPid = 1;
  constexpr double kUs = 1e6;
  json events = json::array();
  events.push_back(json{{"name", "process_name"},
                        {"ph", "M"},
                        {"pid", kPid},
                        {"args", {{"name", trace.model.empty() ? "tidal" : trace.model}}}});
  for (Phase p : {Phase::kForward, Phase::kBackward, Phase::kOptimizer, Phase::kOther}) {
    const int tid = static_cast<int>(p) + 1;
    events.push_back(json{{"name", "thread_name"},
                          {"ph", "M"},
                          {"pid", kPid},
                          {"tid", tid},
                          {"args", {{"name", to_string(p)}}}});
    events.push_back(json{{"name", "thread_sort_index"},
                          {"ph", "M"},
                          {"pid", kPid},
                          {"tid", tid},
                          {"args", {{"sort_index", tid}}}});
  }
  auto names = [&](const std::vector<TensorId>& ids) {
    json arr = json::array();
    for (TensorId id : ids) {
      const bool ok = id >= 0 && static_cast<std::size_t>(id) < trace.tensors.size();
      arr.push_back(ok ? trace.tensors[id].name : detail::concat("#", id));
    }
    return arr;
  };
  for (std::size_t k = 0; k < trace.ops.size(); ++k) {
    const Op& op = trace.ops[k];
    const double ts = op.start_s * kUs;
    events.push_back(json{{"name", op.name},
                          {"cat", to_string(op.phase)},
                          {"ph", "X"},
                          {"ts", ts},
                          {"dur", op.duration() * kUs},
                          {"pid", kPid},
                          {"tid", static_cast<int>(op.phase) + 1},
                          {"args",
                           {{"index", op.index},
                            {"layer", op.layer},
                            {"inputs", names(op.inputs)},
                            {"outputs", names(op.outputs)}}}});
    events.push_back(json{{"name", "live bytes"},
                          {"ph", "C"},
                          {"ts", ts},
                          {"pid", kPid},
                          {"args", {{"bytes", lifetimes.live_bytes[k]}}}});
    events.push_back(json{{"name", "active bytes"},
                          {"ph", "C"},
                          {"ts", ts},
                          {"pid", kPid},
                          {"args", {{"bytes", lifetimes.active_bytes[k]}}}});
  }
  json doc{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  doc["otherData"] = json{{"format", "tidal chrome trace"},
                          {"model", trace.model},
                          {"device", trace.device},
                          {"batch", trace.batch},
                          {"seq", trace.seq}};
  write_file(path, doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
}

}  // namespace tidal::trace
