#include "tidal/torch/activations.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"

namespace tidal::torch_layer {
namespace {

// Linear, GELU, Linear, with a residual and a reused hidden tensor: enough for saved
// activations of several shapes, views, and a storage saved twice.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 64));
    fc3 = register_module("fc3", torch::nn::Linear(256, 64));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::gelu(fc1->forward(x));
    auto y = fc2->forward(h) + fc3->forward(h);  // h saved by two ops: deduplicated
    return (y * torch::sigmoid(y)).sum();
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

struct RunResult {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

// `before_backward`, when set, runs between each step's forward and backward; `after_step` after
// each step's end.
RunResult train(ActivationOffloader* off, int steps,
                const std::function<void()>& before_backward = {},
                const std::function<void()>& after_step = {}) {
  torch::manual_seed(123);
  Net net;
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  if (off != nullptr) off->keep_storages_of(net->parameters());
  RunResult r;
  for (int s = 0; s < steps; ++s) {
    auto x = torch::randn({512, 64});
    if (off != nullptr) off->begin_step();
    opt.zero_grad();
    auto loss = net->forward(x);
    if (before_backward) before_backward();
    loss.backward();
    opt.step();
    if (off != nullptr) off->end_step();
    r.losses.push_back(loss.item<double>());
    if (after_step) after_step();
  }
  for (auto& p : net->parameters()) r.params.push_back(p.detach().clone());
  return r;
}

std::shared_ptr<io::TensorStore> make_store(const testing::TestDir& dir, io::FaultPlan faults = {},
                                            int queue_depth = 0) {
  io::StoreOptions o;
  o.dirs = {dir.path()};
  o.capacity = 256 * kMiB;
  o.faults = faults;
  o.queue_depth = queue_depth;
  o.threads = queue_depth;
  return std::make_shared<io::TensorStore>(o);
}

// Polls `done` every millisecond until it holds or `seconds` have passed; returns whether it
// held. Tests wait on what they need (a write finished) instead of sleeping a fixed time.
template <typename Pred>
bool wait_until(Pred done, double seconds = 5) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A before_backward that waits (up to 5 s) until the store has finished one more request, done
// or failed, than when the previous call returned: on a loaded machine the store's thread may
// otherwise not start a single write before backward drops every queued one, and a test of what
// the disk does would then see no disk at all.
std::function<void()> wait_for_one_request(std::shared_ptr<io::TensorStore> store) {
  auto seen = std::make_shared<std::uint64_t>(0);
  return [store = std::move(store), seen] {
    const auto finished = [&] {
      const io::StoreStats st = store->stats();
      return st.writes + st.reads + st.failed_requests;
    };
    wait_until([&] { return finished() > *seen; });
    *seen = finished();
  };
}

// True when every write the store was given has finished (done or failed) and nothing else is
// alive in it: in a store that served only the running step's forward pass, each ticket alive
// is one write, so the step's writes are all on the disk.
bool all_writes_finished(const io::TensorStore& store) {
  const io::StoreStats st = store.stats();
  return st.tickets > 0 && st.writes + st.failed_requests >= st.tickets;
}

// Runs `f`, which must throw an E; returns its what(). A different exception, or none, fails the
// test (a bug's exception must not pass for the one expected).
template <typename E, typename F>
std::string what_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected another exception type, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "nothing was thrown";
  return {};
}

void expect_identical(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << i;
  ASSERT_EQ(a.params.size(), b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << "parameter " << i;
  }
}

// Options that offload every saved tensor of 4 KiB or more, with the adaptive rule off.
ActivationOptions fixed_options() {
  ActivationOptions opt;
  opt.min_bytes = 4096;
  opt.adaptive = false;
  return opt;
}

TEST(Activations, BitIdenticalTrainingWithEveryActivationThroughTheStore) {
  testing::TestDir dir;
  const RunResult plain = train(nullptr, 5);
  ActivationOptions opt = fixed_options();
  auto store = make_store(dir);
  ActivationOffloader off(store, opt);
  const RunResult offloaded = train(&off, 5, wait_for_one_request(store));
  expect_identical(plain, offloaded);
  const ActivationStats s = off.last_step();
  EXPECT_GT(s.offloaded, 0u);
  EXPECT_GT(s.kept_parameter, 0u) << "weights reach the pack hook and must be skipped";
  EXPECT_GT(s.deduplicated, 0u) << "h is saved by fc2 and fc3";
  // Each step let one write finish before its backward (wait_for_one_request says why).
  EXPECT_GT(store->stats().bytes_written, 0u);
  EXPECT_GT(s.bytes_read + s.forwarded, 0u);
  EXPECT_EQ(s.write_failures, 0u);
}

// The class of race torchtune's activation offloading hit (NaN gradients): a saved tensor's
// memory freed and reused while its copy to host memory was still in flight. Here every copy
// is slowed: the host pool's copy thread has 256 MiB of urgent copies ahead of each step's
// saved tensors, so they are copied only after forward has gone on allocating and freeing.
// Backward waits for them and reads them back from the pool. The record owns a tensor's
// storage until its copy is complete, so the bytes copied are the tensor's: the same losses.
TEST(Activations, AHostCopyInFlightNeverSeesItsMemoryReused) {
  testing::TestDir dir;
  const RunResult plain = train(nullptr, 4);
  ActivationOptions opt = fixed_options();
  opt.host = std::make_shared<io::HostPool>(512 * kMiB);
  io::HostPool& pool = *opt.host;
  std::vector<unsigned char> ballast(64 * kMiB, 7);
  std::vector<io::Ticket> ahead;
  const auto slow_down = [&] {
    for (auto& t : ahead) pool.free(t);
    ahead.clear();
    for (int i = 0; i < 4; ++i) {
      ahead.push_back(pool.write(ballast.data(), ballast.size(), io::Priority::kUrgent));
    }
  };
  slow_down();
  ActivationOffloader off(make_store(dir), opt);
  std::uint64_t read_back = 0;
  const RunResult offloaded = train(
      &off, 4,
      [&] {  // before backward: the copies done (the copy thread quiet), so backward reads
        for (auto& t : ahead) pool.wait(t);
        std::uint64_t last = pool.stats().writes;
        int quiet = 0;
        wait_until([&] {
          const std::uint64_t now = pool.stats().writes;
          quiet = now == last ? quiet + 1 : 0;
          last = now;
          return quiet >= 20;
        });
      },
      [&] {
        read_back += off.last_step().bytes_read;
        slow_down();
      });
  for (auto& t : ahead) pool.free(t);
  expect_identical(plain, offloaded);
  EXPECT_GT(off.last_step().bytes_to_host, 0u);
  EXPECT_EQ(off.last_step().bytes_to_host, off.last_step().bytes_written);
  EXPECT_GT(read_back, 0u) << "backward read nothing back from the pool: the test proves nothing";
}

TEST(Activations, AFailingStoreNeverChangesALoss) {
  testing::TestDir dir;
  const RunResult plain = train(nullptr, 4);
  io::FaultPlan faults;
  faults.fail_op = 3;
  faults.fail_every_after = true;  // the disk stops taking writes after two ops
  faults.only_writes = true;       // (a read failure would fail the step, by design)
  ActivationOptions opt;
  opt.min_bytes = 4096;
  // Not the adaptive rule: on a loaded machine it may judge the failing disk too slow and keep
  // every tensor of the last step, which writes nothing and so cannot fail.
  opt.adaptive = false;
  auto store = make_store(dir, faults);
  ActivationOffloader off(store, opt);
  const RunResult offloaded = train(&off, 4, wait_for_one_request(store));
  expect_identical(plain, offloaded);
  EXPECT_GT(off.last_step().write_failures, 0u);
  EXPECT_GT(store->stats().write_failed.count, 0u);
}

TEST(Activations, AFullStoreKeepsTensorsInMemory) {
  testing::TestDir dir;
  const RunResult plain = train(nullptr, 3);
  io::StoreOptions o;
  o.dirs = {dir.path()};
  o.capacity = 600 * kKiB;  // room for one or two activations only
  ActivationOptions opt = fixed_options();
  ActivationOffloader off(std::make_shared<io::TensorStore>(o), opt);
  const RunResult offloaded = train(&off, 3);
  expect_identical(plain, offloaded);
  const ActivationStats s = off.last_step();
  EXPECT_GT(s.write_failures, 0u);
  EXPECT_EQ(s.store_full, s.write_failures) << "every failure is for want of space";
}

TEST(Activations, CorruptReadFailsBackwardInsteadOfAWrongGradient) {
  testing::TestDir dir;
  io::FaultPlan faults;
  faults.corrupt_read = 1;
  ActivationOptions opt = fixed_options();
  opt.lookahead_bytes = 0;  // reads happen at unpack time
  opt.min_lookahead_bytes = 0;
  auto store = make_store(dir, faults);
  ActivationOffloader off(store, opt);
  torch::manual_seed(1);
  Net net;
  auto x = torch::randn({512, 64});
  off.begin_step();
  auto loss = net->forward(x);
  // Every write must land so that backward has to read (a tensor still being written is
  // forwarded from memory, and nothing would be read to be corrupt).
  ASSERT_TRUE(wait_until([&] { return all_writes_finished(*store); }))
      << store->stats().writes << " of " << store->stats().tickets << " writes finished in 5 s";
  const std::string what = what_of<IoError>([&] { loss.backward(); });
  EXPECT_NE(what.find("checksum mismatch"), std::string::npos) << what;
  off.end_step();
  EXPECT_EQ(store->stats().read_corrupt.count, 1u);
  EXPECT_GT(off.last_step().misses, 0u) << "backward read nothing back";
}

TEST(Activations, InPlaceChangeOfASavedTensorIsStillAnError) {
  testing::TestDir dir;
  ActivationOptions opt;
  opt.min_bytes = 0;
  ActivationOffloader off(make_store(dir), opt);
  const std::string rule = "modified by an inplace operation";
  for (bool with_tidal : {false, true}) {
    auto w = torch::randn({256, 256}, torch::requires_grad());
    auto a = torch::mm(w, w);
    if (with_tidal) off.begin_step();
    auto b = torch::sigmoid(a);  // saves its result
    b.add_(1);                   // ... which is then changed in place
    // Stock autograd's check (c10::Error), or tidal's, which replaces it for hooked tensors.
    const std::string what = with_tidal ? what_of<tidal::Error>([&] { b.sum().backward(); })
                                        : what_of<c10::Error>([&] { b.sum().backward(); });
    EXPECT_NE(what.find(rule), std::string::npos) << (with_tidal ? "tidal: " : "stock: ") << what;
    if (with_tidal) {
      off.end_step();
      EXPECT_EQ(off.last_step().offloaded, 1u) << "sigmoid's result went through the offloader";
    }
  }
}

// A tensor saved in one pass whose write was cancelled (backward began while it was queued) and
// whose saved variables autograd then released, saved again by a later pass of the same step:
// it gets a record of its own. (It used to share the released one, which had given up its
// storage: the unpack built a tensor on an empty storage and PyTorch asserted.)
TEST(Activations, ATensorSavedAgainAfterAutogradReleasedItIsSavedAnew) {
  testing::TestDir dir;
  io::FaultPlan slow;
  // One op at a time, 200 ms each: the first write (x, saved by the first mm) holds the store
  // for far longer than this forward pass takes, so the writes of f and h wait in the queue
  // until backward drops them.
  slow.delay_us = 200000;
  ActivationOptions opt = fixed_options();
  ActivationOffloader off(make_store(dir, slow, 1), opt);
  std::vector<torch::Tensor> grads;
  for (bool with_tidal : {false, true}) {
    torch::manual_seed(5);
    auto w = torch::randn({128, 128}, torch::requires_grad());
    auto v = torch::randn({128, 128}, torch::requires_grad());
    auto x = torch::randn({128, 128});
    if (with_tidal) off.begin_step();
    auto f = torch::exp(torch::mm(x, w) / 64);  // mm saves x first: its write holds the store
    auto h = torch::relu(torch::mm(x, w));      // saved by relu and by the mul below
    ((h * v).sum() + f.sum()).backward();       // releases every saved variable of pass 1
    (h.detach() * v).sum().backward();          // pass 2 saves h's storage again
    if (with_tidal) {
      off.end_step();
      const ActivationStats s = off.last_step();
      EXPECT_EQ(s.passes, 2);
      // The case under test ran: h's write was dropped unstarted. Only x's write can be running
      // when backward begins and the queue is first in, first out, so two cancelled writes mean
      // h's was one of them (pass 2 adds at most one, h's second write).
      EXPECT_GE(s.cancelled_writes, 2u);
      // Pass 2's h is a record of its own, not the released one of pass 1: x, f, h and h again.
      EXPECT_EQ(s.offloaded, 4u);
    }
    grads.push_back(v.grad().clone());
    grads.push_back(w.grad().clone());
  }
  EXPECT_TRUE(torch::equal(grads[0], grads[2]));
  EXPECT_TRUE(torch::equal(grads[1], grads[3]));
}

// The adaptive rules at step scale, on both sides. A disk that cannot write a step's tensors
// before its backward needs them: the writes still queued then are dropped, and from the next
// step on the tensors from there stay in memory (kept_adaptive). A disk that can: a forward pass
// that lasts ten times what the disk took for its writes keeps nothing back, step after step.
// Either way no loss changes.
TEST(Activations, AdaptiveKeepHoldsWhatTheDiskCannotWriteInTimeAndOffloadsWhatItCan) {
  const int steps = 4;
  const RunResult plain = train(nullptr, steps);
  ActivationOptions opt;
  opt.min_bytes = 4096;
  opt.adaptive = true;
  {
    testing::TestDir dir;
    io::FaultPlan slow;
    slow.delay_us = 200000;  // one op at a time, 200 ms each: far longer than this forward pass
    auto store = make_store(dir, slow, 1);
    ActivationOffloader off(store, opt);
    std::vector<ActivationStats> per_step;
    const RunResult r = train(&off, steps, {}, [&] { per_step.push_back(off.last_step()); });
    expect_identical(plain, r);
    ASSERT_EQ(per_step.size(), static_cast<std::size_t>(steps));
    EXPECT_EQ(per_step[0].keep_from, -1) << "the first step has nothing to go on";
    EXPECT_GT(per_step[0].cancelled_writes, 0u) << "backward began with no write waiting";
    for (std::size_t i = 1; i < per_step.size(); ++i) {
      EXPECT_GE(per_step[i].keep_from, 0) << "step " << i;
      EXPECT_GT(per_step[i].kept_adaptive, 0u) << "step " << i;
    }
  }
  {
    testing::TestDir dir;
    auto store = make_store(dir);
    ActivationOffloader off(store, opt);
    const auto finished = [&] {
      const io::StoreStats st = store->stats();
      return st.writes + st.failed_requests;
    };
    // The step starts right after the previous one ended (train() does nothing in between).
    auto step_start = std::chrono::steady_clock::now();
    std::uint64_t finished_before = finished();
    std::vector<ActivationStats> per_step;
    const auto long_forward = [&] {
      // Every write of this step done (each ticket alive is one of them), then as long again
      // nine times over: the disk kept up with this forward pass by a wide margin.
      ASSERT_TRUE(wait_until([&] {
        const std::uint64_t tickets = store->stats().tickets;
        return tickets > 0 && finished() - finished_before >= tickets;
      }));
      const auto written = std::chrono::steady_clock::now() - step_start;
      ASSERT_TRUE(wait_until(
          [&] { return std::chrono::steady_clock::now() - step_start >= 10 * written; }));
    };
    const RunResult r = train(&off, steps, long_forward, [&] {
      per_step.push_back(off.last_step());
      step_start = std::chrono::steady_clock::now();
      finished_before = finished();
    });
    expect_identical(plain, r);
    ASSERT_EQ(per_step.size(), static_cast<std::size_t>(steps));
    for (std::size_t i = 0; i < per_step.size(); ++i) {
      const ActivationStats& s = per_step[i];
      EXPECT_EQ(s.keep_from, -1) << "step " << i;
      EXPECT_EQ(s.kept_adaptive, 0u) << "step " << i;
      EXPECT_EQ(s.cancelled_writes, 0u) << "step " << i;
      EXPECT_GT(s.offloaded, 0u) << "step " << i;
      EXPECT_GT(s.bytes_written, 0u) << "step " << i;
    }
    EXPECT_EQ(off.notice(), "");
  }
}

}  // namespace
}  // namespace tidal::torch_layer
