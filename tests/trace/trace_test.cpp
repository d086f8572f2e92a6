#include "tidal/trace/trace.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "tidal/common/error.hpp"
#include "trace/random_trace.hpp"

namespace tidal::trace {
namespace {

// Two ops, three tensors: w (persistent), x (input), y produced by op 0 and read by op 1.
Trace tiny() {
  Trace t;
  t.tensors.resize(3);
  for (int i = 0; i < 3; ++i) t.tensors[i].id = i;
  t.tensors[0].name = "w";
  t.tensors[0].persistent = true;
  t.tensors[0].cls = TensorClass::kParameter;
  t.tensors[1].name = "x";
  t.tensors[1].cls = TensorClass::kInput;
  t.tensors[2].name = "y";
  t.tensors[2].producer = 0;
  t.tensors[2].output_slot = 0;
  t.ops.resize(2);
  t.ops[0] = Op{0, "mm", Phase::kForward, 0.0, 1.0, {0, 1}, {2}, 0};
  t.ops[1] = Op{1, "sum", Phase::kForward, 1.0, 1.5, {2}, {}, 0};
  return t;
}

// Expects validate(t) to throw tidal::Error whose message contains every fragment.
void expect_invalid(const Trace& t, std::initializer_list<std::string> fragments) {
  try {
    validate(t);
    FAIL() << "validate accepted an invalid trace";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg;
  }
}

TEST(TraceNames, RoundTripEveryPhaseAndClass) {
  const char* phases[] = {"forward", "backward", "optimizer", "other"};
  for (int i = 0; i < 4; ++i) {
    const auto p = static_cast<Phase>(i);
    EXPECT_STREQ(to_string(p), phases[i]);
    EXPECT_EQ(phase_from_string(phases[i]), p);
  }
  const char* classes[] = {"parameter",  "gradient",  "optimizer_state",
                           "activation", "temporary", "input"};
  for (int i = 0; i < 6; ++i) {
    const auto c = static_cast<TensorClass>(i);
    EXPECT_STREQ(to_string(c), classes[i]);
    EXPECT_EQ(tensor_class_from_string(classes[i]), c);
  }
}

TEST(TraceNames, UnknownNameThrowsInvalidArgumentListingChoices) {
  try {
    phase_from_string("Forward");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'Forward'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("backward"), std::string::npos);
  }
  EXPECT_THROW(tensor_class_from_string("weight"), InvalidArgument);
  EXPECT_THROW(tensor_class_from_string(""), InvalidArgument);
}

TEST(Trace, OpSecondsCountTheHostTimeBeforeTheNextOp) {
  Trace t = tiny();
  EXPECT_DOUBLE_EQ(t.op_seconds(0), 1.0);  // back to back
  EXPECT_DOUBLE_EQ(t.compute_seconds(), 1.5);
  t.ops[1].start_s = 3.0;  // 2 s of host time between the ops: the framework's own work
  t.ops[1].end_s = 3.25;
  EXPECT_DOUBLE_EQ(t.op_seconds(0), 3.0);
  EXPECT_DOUBLE_EQ(t.op_seconds(1), 0.25);  // the last op: its duration
  EXPECT_DOUBLE_EQ(t.compute_seconds(), 3.25);
  t.ops[1].start_s = 0.5;  // out of order (overlapping ops): no negative host time
  t.ops[1].end_s = 0.75;
  EXPECT_DOUBLE_EQ(t.op_seconds(0), 1.0);
  EXPECT_DOUBLE_EQ(t.compute_seconds(), 1.25);
  EXPECT_DOUBLE_EQ(Trace{}.compute_seconds(), 0.0);
}

TEST(Validate, AcceptsWellFormedTraces) {
  EXPECT_NO_THROW(validate(tiny()));
  EXPECT_NO_THROW(validate(Trace{}));
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    EXPECT_NO_THROW(validate(testutil::random_trace(seed))) << "seed " << seed;
  }
}

TEST(Validate, NamesTheViolation) {
  {
    Trace t = tiny();
    t.tensors[1].id = 5;
    expect_invalid(t, {"tensor at position 1", "has id 5"});
  }
  {
    // A size the format's integer allows but no tensor has: sums of it would overflow (the
    // planner used to say "fits").
    Trace t = tiny();
    t.tensors[2].bytes = ~std::uint64_t{0};
    expect_invalid(t, {"tensor 2", "more than 1 PiB"});
    t.tensors[2].bytes = std::uint64_t{1} << 50;  // the largest allowed
    EXPECT_NO_THROW(validate(t));
    t.ops[0].workspace_bytes = ~std::uint64_t{0};
    expect_invalid(t, {"op 0", "workspace", "more than 1 PiB"});
  }
  {
    Trace t = tiny();
    t.ops[1].index = 0;
    expect_invalid(t, {"op at position 1", "has index 0"});
  }
  {
    Trace t = tiny();
    t.ops[1].inputs.push_back(7);
    expect_invalid(t, {"op 1", "input tensor 7", "does not exist"});
  }
  {
    Trace t = tiny();
    t.ops[0].outputs.push_back(-1);
    expect_invalid(t, {"op 0", "output tensor -1", "does not exist"});
  }
  {
    Trace t = tiny();
    t.ops[1].start_s = -0.5;  // before op 0 starts
    expect_invalid(t, {"op 1", "non-decreasing"});
  }
  {
    Trace t = tiny();
    t.ops[0].end_s = -1;
    expect_invalid(t, {"op 0", "ends at"});
  }
  {
    Trace t = tiny();
    t.ops[1].end_s = std::numeric_limits<double>::quiet_NaN();
    expect_invalid(t, {"op 1", "non-finite"});
  }
  {
    Trace t = tiny();
    t.tensors[2].producer = 1;  // op 1 does not output y
    expect_invalid(t, {"tensor 2", "'y'", "does not list it"});
  }
  {
    Trace t = tiny();
    t.tensors[2].producer = 9;
    expect_invalid(t, {"tensor 2", "producer 9", "not an op"});
  }
  {
    Trace t = tiny();
    t.ops[1].outputs.push_back(2);  // y written again by op 1, but named as produced by op 1 ...
    t.tensors[2].producer = 1;      // ... while op 0 already used it
    expect_invalid(t, {"tensor 2", "used by op 0 before its producer op 1"});
  }
  {
    Trace t = tiny();
    t.tensors[2].freed_after = 0;  // op 1 still reads it
    expect_invalid(t, {"tensor 2", "used by op 1 after it is freed after op 0"});
  }
  {
    Trace t = tiny();
    t.tensors[0].freed_after = 1;
    expect_invalid(t, {"tensor 0", "persistent", "freed_after"});
  }
  {
    Trace t = tiny();
    t.tensors[1].freed_after = 2;
    expect_invalid(t, {"tensor 1", "freed_after 2", "not an op"});
  }
}

TEST(Validate, PersistentTensorsWithAGap) {
  // y made by op 1, read by op 0 of the next iteration: persistent, freed after op 0.
  Trace t = tiny();
  t.ops[0].outputs.clear();
  t.ops[1].inputs.clear();
  t.ops[1].outputs = {2};
  t.ops[0].inputs = {0, 1, 2};
  t.tensors[2].persistent = true;
  t.tensors[2].producer = 1;
  t.tensors[2].freed_after = 0;
  ASSERT_NO_THROW(validate(t));
  EXPECT_TRUE(t.tensors[2].has_gap());
  {
    Trace u = t;
    u.tensors[2].freed_after = 1;  // not before its producer
    expect_invalid(u, {"tensor 2", "freed_after 1", "producer 1"});
  }
  {
    Trace u = t;
    u.tensors[2].producer = kNoOp;  // nothing makes it anew
    expect_invalid(u, {"tensor 2", "persistent", "freed_after 0"});
  }
  {
    Trace u = t;  // three ops: a use in the gap
    u.ops.push_back(Op{2, "late", Phase::kForward, 1.5, 2.0, {}, {2}, 0});
    u.tensors[2].producer = 2;
    u.ops[1].outputs.clear();
    u.ops[1].inputs = {2};
    expect_invalid(u, {"tensor 2", "used by op 1 while it is dead"});
  }
}

TEST(Validate, RandomCorruptionOfARandomTraceIsCaught) {
  // Every one of these corruptions breaks an invariant whatever the trace looks like.
  const std::function<void(Trace&)> corruptions[] = {
      [](Trace& t) { t.tensors.back().id += 1; },
      [](Trace& t) { t.ops.back().index += 1; },
      [](Trace& t) { t.ops.front().inputs.push_back(static_cast<TensorId>(t.tensors.size())); },
      [](Trace& t) { t.ops.back().start_s = t.ops.front().start_s - 1; },
      [](Trace& t) { t.ops.front().end_s = t.ops.front().start_s - 1e-9; },
      [](Trace& t) { t.tensors.front().freed_after = 0; },  // tensor 0 is a persistent parameter
  };
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    for (const auto& corrupt : corruptions) {
      Trace t = testutil::random_trace(seed);
      corrupt(t);
      EXPECT_THROW(validate(t), Error) << "seed " << seed;
    }
  }
}

}  // namespace
}  // namespace tidal::trace
