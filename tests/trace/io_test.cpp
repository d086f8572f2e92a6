#include "tidal/trace/io.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "tidal/common/error.hpp"
#include "trace/random_trace.hpp"

namespace tidal::trace {
namespace {

using nlohmann::json;

// A file path in the test temp directory, removed when the object goes away.
class TempFile {
 public:
  explicit TempFile(const std::string& stem) {
    static int counter = 0;
    path_ = ::testing::TempDir() + "tidal_trace_" + stem + "_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++) + ".json";
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }
  void write(const std::string& text) const { std::ofstream(path_, std::ios::binary) << text; }
  [[nodiscard]] std::string read() const {
    std::ifstream in(path_, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::string path_;
};

// Every field a trace file carries, as a tuple gtest compares and prints; times bit-exact, not
// approximately equal.
auto fields(const Op& o) {
  return std::tie(o.index, o.name, o.phase, o.start_s, o.end_s, o.inputs, o.outputs, o.layer,
                  o.workspace_bytes);
}
auto fields(const Tensor& t) {
  return std::tie(t.id, t.name, t.bytes, t.device, t.cls, t.persistent, t.producer, t.output_slot,
                  t.freed_after);
}

void expect_same(const Trace& a, const Trace& b) {
  EXPECT_EQ(std::tie(a.version, a.model, a.device, a.batch, a.seq, a.meta),
            std::tie(b.version, b.model, b.device, b.batch, b.seq, b.meta));
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (std::size_t k = 0; k < a.ops.size(); ++k) {
    EXPECT_EQ(fields(a.ops[k]), fields(b.ops[k])) << "op " << k;
  }
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(fields(a.tensors[i]), fields(b.tensors[i])) << "tensor " << i;
  }
}

// Expects read_trace(file) to throw tidal::InvalidArgument naming the file and each fragment.
void expect_read_error(const TempFile& f, std::initializer_list<std::string> fragments) {
  try {
    read_trace(f.path());
    FAIL() << "read_trace accepted " << f.read();
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(f.path()), std::string::npos) << msg;
    for (const auto& s : fragments) EXPECT_NE(msg.find(s), std::string::npos) << msg;
  }
}

TEST(TraceJson, RoundTripIsLosslessOnRandomTraces) {
  for (std::uint64_t seed = 0; seed < 25; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    Trace t = testutil::random_trace(seed);
    // Awkward values: doubles with no short decimal form, huge sizes, odd strings.
    for (Op& op : t.ops) {
      op.start_s += 0.1 + 0.2;
      op.end_s += 1.0 / 3.0 + 0.1 + 0.2;  // keeps end >= start
    }
    t.ops.back().end_s = std::nextafter(t.ops.back().end_s, 1e9);
    for (std::size_t k = 0; k < t.ops.size(); k += 3) t.ops[k].workspace_bytes = 4096 * k + seed;
    t.tensors[0].bytes = (std::uint64_t{1} << 50) - 1;  // near the largest size allowed
    t.tensors[1].name = "quote\" backslash\\ tab\t newline\n unicode \xc3\xa9";
    t.meta["torch"] = "2.5.1+cu124";
    t.meta[""] = "";
    TempFile f("roundtrip");
    write_trace(t, f.path());
    const Trace back = read_trace(f.path());
    expect_same(t, back);
    // Writing what was read gives the same bytes.
    EXPECT_EQ(trace_to_json(back), f.read());
  }
  // A size the integer allows but no tensor has is refused on reading, with the reason.
  Trace t = testutil::random_trace(1);
  t.tensors[0].bytes = std::numeric_limits<std::uint64_t>::max();
  TempFile f("hugetensor");
  write_trace(t, f.path());
  try {
    (void)read_trace(f.path());
    ADD_FAILURE() << "a 2^64-1 byte tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1 PiB"), std::string::npos) << e.what();
  }
}

TEST(TraceJson, StringRoundTripAndEmptyTrace) {
  const Trace empty;
  expect_same(empty, trace_from_json(trace_to_json(empty)));
  const json j = json::parse(trace_to_json(testutil::random_trace(3)));
  EXPECT_EQ(j.at("format"), "tidal-trace");
  EXPECT_EQ(j.at("version"), kTraceVersion);
  EXPECT_TRUE(j.at("ops").is_array());
  EXPECT_TRUE(j.at("tensors").is_array());
}

TEST(TraceJson, OptionalFieldsTakeTheirDefaults) {
  json j = json::parse(trace_to_json(testutil::random_trace(1)));
  j.erase("meta");
  for (json& op : j["ops"]) op.erase("layer");
  for (json& t : j["tensors"]) {
    if (t["producer"] == -1) t.erase("producer");
    if (t["freed_after"] == -1) t.erase("freed_after");
    t.erase("output_slot");
  }
  const Trace t = trace_from_json(j.dump());
  EXPECT_TRUE(t.meta.empty());
  for (const Op& op : t.ops) EXPECT_EQ(op.layer, -1);
  for (const Tensor& x : t.tensors) EXPECT_EQ(x.output_slot, -1);
}

TEST(TraceJson, ReadErrorsNameTheFileAndTheProblem) {
  const std::string good = trace_to_json(testutil::random_trace(2));
  {
    TempFile f("garbage");
    f.write("this is not { json");
    expect_read_error(f, {"not valid JSON"});
  }
  {
    TempFile f("empty");
    f.write("");
    expect_read_error(f, {"not valid JSON"});
  }
  {
    TempFile f("version");
    json j = json::parse(good);
    j["version"] = 2;
    f.write(j.dump());
    expect_read_error(f, {"version 2", "reads version 1"});
  }
  {
    TempFile f("format");
    json j = json::parse(good);
    j["format"] = "chrome";
    f.write(j.dump());
    expect_read_error(f, {"'format'", "not a tidal trace"});
  }
  {
    TempFile f("dangling");
    json j = json::parse(good);
    j["ops"][3]["inputs"].push_back(j["tensors"].size() + 5);
    f.write(j.dump());
    expect_read_error(
        f, {"op 3", "tensor " + std::to_string(j["tensors"].size() + 5), "does not exist"});
  }
  {
    TempFile f("missing");
    json j = json::parse(good);
    j["tensors"][4].erase("bytes");
    f.write(j.dump());
    expect_read_error(f, {"missing field 'bytes'", "tensors[4]"});
  }
  {
    TempFile f("missing_top");
    json j = json::parse(good);
    j.erase("ops");
    f.write(j.dump());
    expect_read_error(f, {"missing field 'ops'"});
  }
  {
    TempFile f("type");
    json j = json::parse(good);
    j["ops"][0]["start_s"] = "soon";
    f.write(j.dump());
    expect_read_error(f, {"ops[0].start_s", "must be a number"});
  }
  {
    TempFile f("phase");
    json j = json::parse(good);
    j["ops"][1]["phase"] = "sideways";
    f.write(j.dump());
    expect_read_error(f, {"ops[1]", "unknown op phase 'sideways'"});
  }
  {
    TempFile f("negative");
    json j = json::parse(good);
    j["tensors"][0]["bytes"] = -4;
    f.write(j.dump());
    expect_read_error(f, {"tensors[0].bytes", "non-negative"});
  }
  {
    TempFile f("nofile");
    expect_read_error(f, {"cannot open"});
  }
}

TEST(TraceJson, InvalidUtf8InANameIsReplacedNotFatal) {
  Trace t = testutil::random_trace(4);
  t.tensors[2].name = "bad\xff";
  TempFile f("utf8");
  write_trace(t, f.path());
  EXPECT_EQ(read_trace(f.path()).tensors[2].name, "bad\xef\xbf\xbd");  // U+FFFD
}

TEST(TraceJson, WriteToUnwritablePathThrows) {
  EXPECT_THROW(write_trace(Trace{}, "/nonexistent-dir-for-tidal/x.json"), Error);
}

TEST(ChromeTrace, OneSlicePerOpAndCountersForLiveAndActiveBytes) {
  for (std::uint64_t seed = 0; seed < 5; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    const Trace t = testutil::random_trace(seed);
    const LifetimeAnalysis a = analyze_lifetimes(t);
    TempFile f("chrome");
    write_chrome_trace(t, a, f.path());
    const json doc = json::parse(f.read());  // throws, failing the test, if not JSON
    ASSERT_TRUE(doc.at("traceEvents").is_array());

    std::vector<json> slices;
    std::map<std::string, std::vector<json>> counters;
    for (const json& e : doc["traceEvents"]) {
      ASSERT_TRUE(e.contains("ph"));
      if (e["ph"] == "X") slices.push_back(e);
      if (e["ph"] == "C") counters[e["name"].get<std::string>()].push_back(e);
    }
    ASSERT_EQ(slices.size(), t.ops.size());
    std::map<int, std::string> phase_of_tid;
    for (std::size_t k = 0; k < t.ops.size(); ++k) {
      const Op& op = t.ops[k];
      const json& e = slices[k];
      EXPECT_EQ(e["name"], op.name);
      EXPECT_NEAR(e["ts"].get<double>(), op.start_s * 1e6, 1e-6);
      EXPECT_NEAR(e["dur"].get<double>(), op.duration() * 1e6, 1e-6);
      // One track per phase: a tid never carries two phases.
      const int tid = e["tid"].get<int>();
      auto [it, inserted] = phase_of_tid.emplace(tid, to_string(op.phase));
      EXPECT_EQ(it->second, to_string(op.phase));
      ASSERT_EQ(e["args"]["inputs"].size(), op.inputs.size());
      for (std::size_t i = 0; i < op.inputs.size(); ++i) {
        EXPECT_EQ(e["args"]["inputs"][i], t.tensors[op.inputs[i]].name);
      }
      ASSERT_EQ(e["args"]["outputs"].size(), op.outputs.size());
      for (std::size_t i = 0; i < op.outputs.size(); ++i) {
        EXPECT_EQ(e["args"]["outputs"][i], t.tensors[op.outputs[i]].name);
      }
    }
    std::set<std::string> phases;
    for (const auto& [tid, p] : phase_of_tid) phases.insert(p);
    EXPECT_EQ(phases.size(), phase_of_tid.size());

    ASSERT_EQ(counters.size(), 2u);
    const auto& live = counters["live bytes"];
    const auto& active = counters["active bytes"];
    ASSERT_EQ(live.size(), t.ops.size());
    ASSERT_EQ(active.size(), t.ops.size());
    for (std::size_t k = 0; k < t.ops.size(); ++k) {
      EXPECT_EQ(live[k]["args"]["bytes"].get<std::uint64_t>(), a.live_bytes[k]);
      EXPECT_EQ(active[k]["args"]["bytes"].get<std::uint64_t>(), a.active_bytes[k]);
      EXPECT_NEAR(live[k]["ts"].get<double>(), t.ops[k].start_s * 1e6, 1e-6);
    }
  }
}

TEST(ChromeTrace, RejectsAnalysisOfAnotherTrace) {
  const Trace t = testutil::random_trace(0);
  const LifetimeAnalysis other = analyze_lifetimes(testutil::random_trace(0, {1, 1, 1, 1, 0}));
  TempFile f("mismatch");
  EXPECT_THROW(write_chrome_trace(t, other, f.path()), Error);
}

}  // namespace
}  // namespace tidal::trace
