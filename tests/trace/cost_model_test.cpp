#include "tidal/trace/cost_model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tidal/common/error.hpp"

namespace tidal::trace {
namespace {

// One matrix product a[m,k] @ b[k,n] -> c[m,n] of random sizes, then an elementwise op on c.
struct Product {
  Trace t;
  double flops = 0;
  double bytes = 0;  // the elementwise op's: c read, d written
};

Product random_product(std::mt19937& rng) {
  std::uniform_int_distribution<int> size(16, 4096);
  const double m = size(rng), k = size(rng), n = size(rng);
  Product p;
  p.flops = 2 * m * k * n;
  auto tensor = [&](int id, double elements, OpIndex producer) {
    Tensor x;
    x.id = id;
    x.name = "t" + std::to_string(id);
    x.bytes = static_cast<std::uint64_t>(elements * 4);
    x.producer = producer;
    x.output_slot = producer >= 0 ? 0 : -1;
    x.cls = producer >= 0 ? TensorClass::kTemporary : TensorClass::kInput;
    return x;
  };
  p.t.tensors = {tensor(0, m * k, kNoOp), tensor(1, k * n, kNoOp), tensor(2, m * n, 0),
                 tensor(3, m * n, 1)};
  p.t.ops = {Op{0, "aten::mm", Phase::kForward, 0, 0, {0, 1}, {2}, 0},
             Op{1, "aten::relu", Phase::kForward, 0, 0, {2}, {3}, 0}};
  p.bytes = 2 * m * n * 4;
  return p;
}

TEST(CostModel, AMatrixProductTakesItsFlopsAndAnElementwiseOpItsBytes) {
  std::mt19937 rng(7);
  for (int i = 0; i < 20; ++i) {
    Product p = random_product(rng);
    Roofline r;
    r.flops = 1e12;
    r.bytes_per_s = 1e15;  // a product is bound by its FLOPs here
    r.op_overhead = 1e-6;
    model_op_times(p.t, r);
    validate(p.t);
    EXPECT_NEAR(p.t.ops[0].end_s - p.t.ops[0].start_s, p.flops / r.flops, 1e-9 * p.flops / r.flops);
    EXPECT_NEAR(p.t.ops[1].end_s - p.t.ops[1].start_s, p.bytes / r.bytes_per_s, 1e-15);
    EXPECT_DOUBLE_EQ(p.t.ops[1].start_s, p.t.ops[0].end_s + r.op_overhead);
    // A slower memory makes the product bound by its bytes instead.
    r.bytes_per_s = 1;
    model_op_times(p.t, r);
    const double moved =
        static_cast<double>(p.t.tensors[0].bytes + p.t.tensors[1].bytes + p.t.tensors[2].bytes);
    EXPECT_DOUBLE_EQ(p.t.ops[0].end_s - p.t.ops[0].start_s, moved);
  }
}

TEST(CostModel, RatesThatAreNotPositiveAreRefused) {
  std::mt19937 rng(1);
  Product p = random_product(rng);
  Roofline r;
  r.flops = 0;
  r.bytes_per_s = 1e9;
  EXPECT_THROW(model_op_times(p.t, r), InvalidArgument);
}

}  // namespace
}  // namespace tidal::trace
