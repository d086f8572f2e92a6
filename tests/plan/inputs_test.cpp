// Input checks of the plan layer: the SSD spec's messages, sizes that would overflow, and the
// size of an analytic trace known before it is built.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"

namespace tidal::plan {
namespace {

// The message of the InvalidArgument that f throws ("" when it throws none).
template <class F>
std::string invalid_argument_message(F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(SsdSpecMessages, SayWhichFigureIsWrongAndTheForm) {
  struct Case {
    const char* text;
    const char* figure;  // the figure the message must name
  };
  for (const Case c : {Case{"4x0/0GB/s", "write"}, Case{"4x6/0GB/s", "read"},
                       Case{"4x0/6GB/s", "write"}, Case{"4x0.0001/6GB/s", "write"},
                       Case{"4x6GB/0GB/s", "read"}, Case{"4x0GB/s", "bandwidth"}}) {
    const std::string msg = invalid_argument_message([&] { (void)parse_ssd_spec(c.text); });
    ASSERT_FALSE(msg.empty()) << c.text << " was accepted";
    EXPECT_NE(msg.find(c.figure), std::string::npos) << c.text << ": " << msg;
    EXPECT_NE(msg.find("<count>x<write>/<read>"), std::string::npos) << c.text << ": " << msg;
    EXPECT_EQ(msg.find("is not an SSD array"), std::string::npos) << c.text << ": " << msg;
  }
  // The good forms still parse, the unit of the second figure applying to the first.
  const SsdSpec s = parse_ssd_spec("2x3/1.5GB/s");
  EXPECT_EQ(s.count, 2);
  EXPECT_DOUBLE_EQ(s.write_bw, 3e9);
  EXPECT_DOUBLE_EQ(s.read_bw, 1.5e9);
}

// Sizes that would overflow 64 bits (or pass 1 PiB, trace::validate's limit for a tensor) are
// refused before the trace is built, naming the option that made them: once --batch
// 9223372036854775807 came back as a tensor of "18446744073709547520 bytes".
TEST(AnalyticTraceSizes, OverflowingDimensionsNameTheOption) {
  const Hardware hw = hardware_preset("h100-4ssd");
  const TransformerConfig llama = model_preset("llama3-8b");
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  struct Case {
    std::int64_t batch;
    std::int64_t seq;
    ModelOverrides shape;
    const char* option;  // the option the message must name
  };
  ModelOverrides wide;
  wide.hidden = std::int64_t{1} << 40;
  wide.heads = 1;
  wide.kv_heads = 1;
  ModelOverrides big_vocab;
  big_vocab.vocab = std::int64_t{1} << 50;
  for (const Case& c : {Case{max, 512, {}, "batch"}, Case{1, max, {}, "seq"},
                        Case{std::int64_t{1} << 40, 1 << 20, {}, "batch"},
                        Case{1, 512, wide, "hidden"}, Case{1, 512, big_vocab, "vocab"}}) {
    TransformerConfig cfg = llama;
    apply_overrides(cfg, c.shape);
    const std::string msg =
        invalid_argument_message([&] { (void)transformer_trace(cfg, c.batch, c.seq, hw); });
    ASSERT_FALSE(msg.empty()) << c.option << ": accepted";
    EXPECT_NE(msg.find(c.option), std::string::npos) << msg;
    EXPECT_EQ(msg.find("18446744073709"), std::string::npos) << "wrapped: " << msg;
  }
}

}  // namespace
}  // namespace tidal::plan
