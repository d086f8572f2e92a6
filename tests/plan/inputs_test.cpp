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

}  // namespace
}  // namespace tidal::plan
