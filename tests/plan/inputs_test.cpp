// Input checks of the plan layer: the SSD spec's messages, sizes that would overflow, and the
// size of an analytic trace known before it is built.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "tidal/common/error.hpp"
#include "tidal/plan/hardware.hpp"
#include "tidal/plan/model_trace.hpp"
#include "tidal/trace/trace.hpp"

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

// The size known before building is the size built, for both architectures and the options
// that add ops (micro-batches, parallelism, schedules); and a size past what a trace can index
// is refused without allocating it (a million layers once ended in std::bad_alloc).
TEST(AnalyticTraceSizes, KnownBeforeBuildingAndBoundedByTheIndex) {
  Hardware hw = hardware_preset("h100-4ssd");
  hw.gpu_link_bw = 300e9;
  int checked = 0;
  for (const char* model : {"gpt2-small", "llama3-8b"}) {
    for (int layers : {1, 2, 3, 7}) {
      for (int micro : {1, 2}) {
        for (int tp : {1, 2}) {
          for (OptimizerSchedule sched :
               {OptimizerSchedule::kAfterBackward, OptimizerSchedule::kInBackward}) {
            TransformerConfig cfg = model_preset(model);
            ModelOverrides o;
            o.layers = layers;
            o.vocab = 32000;  // divisible by the tensor-parallel group (GPT-2's 50257 is not)
            apply_overrides(cfg, o);
            AnalyticTraceOptions opt;
            opt.micro_batches = micro;
            opt.tensor_parallel = tp;
            opt.data_parallel = 2;
            opt.optimizer = sched;
            const AnalyticTraceSize size = analytic_trace_size(cfg, 4, 64, hw, opt);
            const trace::Trace t = transformer_trace(cfg, 4, 64, hw, opt);
            EXPECT_EQ(size.ops, static_cast<std::int64_t>(t.ops.size())) << model << layers;
            EXPECT_EQ(size.tensors, static_cast<std::int64_t>(t.tensors.size())) << model;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 64);
  TransformerConfig huge = model_preset("llama3-8b");
  ModelOverrides o;
  o.layers = 100000000;
  apply_overrides(huge, o);
  const std::string msg =
      invalid_argument_message([&] { (void)transformer_trace(huge, 1, 64, hw); });
  EXPECT_NE(msg.find("100000000 layers"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fewer layers"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tidal::plan
