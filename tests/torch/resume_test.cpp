// Checkpoint and resume from C++: a checkpoint written between steps while a plan keeps tensors
// offloaded restores a run that continues bit for bit, for tidal's trainer and for a user's own
// loop (torch::nn + torch::optim), and bad checkpoints give errors that say what is wrong.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "io/test_dir.hpp"
#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/torch/training_checkpoint.hpp"
#include "torch/test_models.hpp"

namespace tidal::torch_layer {
namespace {

SessionOptions plan_offloaded(const std::string& dir) {
  SessionOptions so;
  so.mode = OffloadMode::kPlan;
  so.store.dirs = {dir};
  so.store.capacity = 256 * kMiB;
  so.executor.min_bytes = 4 * 1024;
  so.budget_fraction = 0.5;
  so.warmup_steps = 0;
  so.profile_steps = 1;
  // Optimizer state may stay on the SSD across the step boundary: the checkpoint must bring it
  // back before torch's serializer reads raw bytes.
  so.between_steps = BetweenSteps::kOffloaded;
  return so;
}

models::TrainerOptions tiny(std::uint64_t seed) {
  return testing::tiny_options("gpt-tiny", 4, 32, seed);
}

TEST(Resume, TrainerCheckpointWrittenWhileOffloadedContinuesBitForBit) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/checkpoint.pt";
  std::vector<double> after;  // the losses of steps 6-8 of the uninterrupted run
  std::uint64_t offloaded_bytes = 0;
  {
    models::Trainer trainer(tiny(5));
    Session session(plan_offloaded(dir.sub("store")));
    trainer.add_observer(&session);
    for (int i = 0; i < 5; ++i) trainer.step();
    offloaded_bytes = session.stats().bytes_written;
    trainer.save_checkpoint(path, &session);
    for (int i = 0; i < 3; ++i) after.push_back(trainer.step().loss);
    trainer.remove_observer(&session);
  }
  EXPECT_GT(offloaded_bytes, 0u) << "the plan moved nothing: the test would prove nothing";
  models::Trainer resumed(tiny(5));
  resumed.load_checkpoint(path);
  EXPECT_EQ(resumed.steps_done(), 5);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.step().loss, after[i]) << "step " << 6 + i;
}

TEST(Resume, TrainerRefusesACheckpointOfAnotherRunNamingTheOption) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/checkpoint.pt";
  models::Trainer trainer(tiny(5));
  trainer.step();
  trainer.save_checkpoint(path);
  auto other = tiny(5);
  other.seq = 16;
  models::Trainer resumed(other);
  try {
    resumed.load_checkpoint(path);
    FAIL() << "a checkpoint of seq 32 loaded into seq 16";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("seq = 32, this run has seq = 16"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(resumed.load_checkpoint(dir.path() + "/missing.pt"), InvalidArgument);
  // Micro-batches change the arithmetic: a run in another number or order is refused too, and
  // the same options resume.
  auto micro = tiny(5);
  micro.micro_batches = 2;
  models::Trainer in_parts(micro);
  try {
    in_parts.load_checkpoint(path);
    FAIL() << "a checkpoint of whole batches loaded into micro-batches";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("micro_batches = 1, this run has micro_batches = 2"),
              std::string::npos)
        << e.what();
  }
  in_parts.step();
  in_parts.save_checkpoint(path);
  micro.micro_batch_order = plan::MicroBatchOrder::kLayerMajor;
  models::Trainer layer_major(micro);
  EXPECT_THROW(layer_major.load_checkpoint(path), InvalidArgument);
  micro.micro_batch_order = plan::MicroBatchOrder::kSequential;
  models::Trainer same(micro);
  EXPECT_NO_THROW(same.load_checkpoint(path));
}

// A user's loop: torch::nn and torch::optim::Adam, saved with write_checkpoint.
struct UserLoop {
  torch::nn::Sequential net{torch::nn::Linear(32, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 128), torch::nn::ReLU(),
                            torch::nn::Linear(128, 1)};
  torch::optim::Adam opt{net->parameters(), torch::optim::AdamOptions(1e-3)};
  double step(const torch::Tensor& x) {
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(x), x.sum(1, true).cos());
    loss.backward();
    opt.step();
    return loss.item<double>();
  }
  void save(const std::string& path, Session* session) {
    torch::serialize::OutputArchive out;
    net->save(out);
    torch::serialize::OutputArchive opt_out;
    opt.save(opt_out);
    out.write("optimizer", opt_out);
    write_checkpoint(out, path, session);
  }
  void load(const std::string& path) {
    torch::serialize::InputArchive in;
    read_checkpoint(in, path);
    net->load(in);
    torch::serialize::InputArchive opt_in;
    in.read("optimizer", opt_in);
    opt.load(opt_in);
  }
};

TEST(Resume, UserLoopCheckpointWrittenWhileOffloadedContinuesBitForBit) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/user.pt";
  torch::manual_seed(11);
  std::vector<torch::Tensor> data;
  for (int i = 0; i < 9; ++i) data.push_back(torch::randn({256, 32}));
  std::vector<double> after;
  std::uint64_t offloaded_bytes = 0;
  torch::manual_seed(12);
  {
    Session session(plan_offloaded(dir.sub("store")));
    UserLoop loop;
    for (int i = 0; i < 6; ++i) {
      session.begin_step();
      loop.step(data[i]);
      session.end_step();
      offloaded_bytes += session.stats().bytes_written;
    }
    loop.save(path, &session);
    for (int i = 6; i < 9; ++i) {
      session.begin_step();
      after.push_back(loop.step(data[i]));
      session.end_step();
    }
  }
  EXPECT_GT(offloaded_bytes, 0u) << "the plan moved nothing: the test would prove nothing";
  torch::manual_seed(99);  // other initial weights: the checkpoint must replace them all
  UserLoop resumed;
  resumed.load(path);
  for (int i = 6; i < 9; ++i) EXPECT_EQ(resumed.step(data[i]), after[i - 6]) << "step " << i;
}

// A process whose file writes fail past `bytes` (RLIMIT_FSIZE: EFBIG, as a full disk gives
// ENOSPC), for the scope of the object.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);  // else the kernel ends the process
    rlimit lim = saved_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = SIG_DFL;
};

std::vector<std::string> temporary_files(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().string().find(".tmp.") != std::string::npos) found.push_back(e.path());
  }
  return found;
}

torch::Tensor read_x(const std::string& path) {
  torch::serialize::InputArchive in;
  read_checkpoint(in, path);
  torch::Tensor x;
  in.read("x", x);
  return x;
}

TEST(Resume, AFailedWriteLeavesThePreviousCheckpointIntact) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/checkpoint.pt";
  torch::serialize::OutputArchive first;
  first.write("x", torch::arange(10));
  write_checkpoint(first, path);
  const auto before = std::filesystem::file_size(path);
  torch::serialize::OutputArchive second;
  second.write("x", torch::arange(1 << 16));  // 512 KiB of int64
  {
    // The same path, failing half-way through the tensor's bytes (a disk that fills up): an
    // IoError, not the end of the process.
    FileSizeLimit limit(256 * 1024);
    try {
      write_checkpoint(second, path);
      ADD_FAILURE() << "a write past the file size limit succeeded";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("untouched"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(write_checkpoint(second, dir.path() + "/missing/checkpoint.pt"), IoError);
  // A directory in the way of the rename makes the write fail at its very end.
  std::filesystem::create_directory(dir.path() + "/blocked.pt");
  std::filesystem::create_directory(dir.path() + "/blocked.pt/inside");
  EXPECT_THROW(write_checkpoint(second, dir.path() + "/blocked.pt"), IoError);
  EXPECT_EQ(std::filesystem::file_size(path), before);
  EXPECT_TRUE(temporary_files(dir.path()).empty()) << temporary_files(dir.path()).front();
  EXPECT_TRUE(torch::equal(read_x(path), torch::arange(10)));
  // And the same archive, with room, is written whole.
  write_checkpoint(second, path);
  EXPECT_TRUE(torch::equal(read_x(path), torch::arange(1 << 16)));
}

TEST(Resume, ADamagedCheckpointIsAClearErrorNotWrongTraining) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/checkpoint.pt";
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({1 << 14});
  torch::serialize::OutputArchive out;
  out.write("x", x);
  write_checkpoint(out, path);
  EXPECT_TRUE(torch::equal(read_x(path), x));  // the control: undamaged, it reads back
  const auto size = std::filesystem::file_size(path);
  std::vector<char> bytes(size);
  {
    std::ifstream f(path, std::ios::binary);
    f.read(bytes.data(), static_cast<std::streamsize>(size));
  }
  // One bit of the tensor's data (the bulk of the file), then one of the archive's start.
  for (const std::size_t at : {size / 2, std::size_t{40}}) {
    auto damaged = bytes;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    {
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f.write(damaged.data(), static_cast<std::streamsize>(size));
    }
    try {
      (void)read_x(path);
      ADD_FAILURE() << "a checkpoint with byte " << at << " flipped was read";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("damaged"), std::string::npos) << e.what();
    }
  }
}

// A checkpoint whose trailer is cut (its last byte dropped) or no longer at the end (a byte
// added after it) is not taken for an old file without a checksum: with a bit of a tensor
// flipped too, it would be read unchecked and train on the damaged weight.
TEST(Resume, ACheckpointWithItsChecksumCutIsRefusedAsDamaged) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/checkpoint.pt";
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({1 << 14});
  torch::serialize::OutputArchive out;
  out.write("x", x);
  write_checkpoint(out, path);
  const auto size = std::filesystem::file_size(path);
  std::vector<char> bytes(size);
  {
    std::ifstream f(path, std::ios::binary);
    f.read(bytes.data(), static_cast<std::streamsize>(size));
  }
  auto flipped = bytes;
  flipped[size / 2] = static_cast<char>(flipped[size / 2] ^ 0x10);
  const auto cut = [](std::vector<char> b, std::size_t n) {
    b.resize(b.size() - n);
    return b;
  };
  auto grown = flipped;
  grown.push_back('\n');
  const std::vector<std::pair<std::string, std::vector<char>>> cases = {
      {"a bit flipped and the last byte dropped", cut(flipped, 1)},
      {"the last byte dropped", cut(bytes, 1)},
      {"the trailer's last 20 bytes dropped", cut(flipped, 20)},
      {"the whole trailer dropped", cut(flipped, 24)},
      {"a bit flipped and a byte added", grown}};
  for (const auto& [what, damaged] : cases) {
    {
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f.write(damaged.data(), static_cast<std::streamsize>(damaged.size()));
    }
    try {
      const torch::Tensor got = read_x(path);
      ADD_FAILURE() << "a checkpoint with " << what << " was read"
                    << (torch::equal(got, x) ? "" : ", and its tensor differs");
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("damaged"), std::string::npos)
          << what << ": " << e.what();
    }
  }
}

TEST(Resume, ACheckpointWithoutChecksumIsReadAsBefore) {
  testing::TestDir dir;
  const std::string path = dir.path() + "/plain.pt";
  torch::serialize::OutputArchive out;
  out.write("x", torch::arange(7));
  out.save_to(path);  // torch's own writer: no trailer
  EXPECT_TRUE(torch::equal(read_x(path), torch::arange(7)));
}

}  // namespace
}  // namespace tidal::torch_layer
