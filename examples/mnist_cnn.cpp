// The classic libtorch MNIST CNN (pytorch/examples cpp/mnist), with a tidal Session around each
// step. The data comes through libtorch's own MNIST dataset and a DataLoader with two worker
// threads, so tensor ops run on other threads while a step computes.
//
//   ./tidal_example_mnist_cnn --make-data /tmp/mnist 10000      # random images, idx format
//   ./tidal_example_mnist_cnn --data /tmp/mnist --mode activations --steps 30
//
// Flags: --mode none|activations|plan, --dir DIR (store), --steps N, --mem-budget FRACTION
// (plan mode), --width K (channel multiplier, default 4), --data DIR, --make-data DIR N.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "example_report.hpp"
#include "tidal/torch/session.hpp"

namespace {

struct Net : torch::nn::Module {
  explicit Net(int64_t k)
      : conv1(torch::nn::Conv2dOptions(1, 10 * k, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10 * k, 20 * k, /*kernel_size=*/5)),
        fc1(320 * k, 50 * k),
        fc2(50 * k, 10),
        flat(320 * k) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, flat});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
  int64_t flat;
};

void write_be32(std::ofstream& out, uint32_t v) {
  const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
  out.write(b, 4);
}

// libtorch's MNIST reader insists on the real sizes: 60000 images for the train files, 10000 for
// the t10k (test) files. Pixels are noise plus a bright band whose row depends on the label, so
// the loss has something to learn.
void make_data(const std::string& dir, int n) {
  std::string prefix;
  if (n == 60000) {
    prefix = "train";
  } else if (n == 10000) {
    prefix = "t10k";
  } else {
    throw std::invalid_argument(
        "--make-data: libtorch's MNIST reader accepts exactly 60000 (train) or 10000 (test) "
        "images, not " +
        std::to_string(n));
  }
  std::filesystem::create_directories(dir);
  std::ofstream images(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary);
  std::ofstream labels(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary);
  write_be32(images, 2051);
  write_be32(images, n);
  write_be32(images, 28);
  write_be32(images, 28);
  write_be32(labels, 2049);
  write_be32(labels, n);
  std::mt19937 rng(1234);
  std::vector<char> pixels(28 * 28);
  for (int i = 0; i < n; ++i) {
    const int label = static_cast<int>(rng() % 10);
    for (auto& p : pixels) p = static_cast<char>(rng() % 128);
    for (int c = 0; c < 28; ++c) {
      pixels[(2 * label + 4) * 28 + c] = static_cast<char>(255);
      pixels[(2 * label + 5) * 28 + c] = static_cast<char>(255);
    }
    images.write(pixels.data(), static_cast<std::streamsize>(pixels.size()));
    labels.put(static_cast<char>(label));
  }
  if (!images || !labels) throw std::runtime_error("--make-data: could not write to " + dir);
  std::printf("wrote %d images to %s (%s-*)\n", n, dir.c_str(), prefix.c_str());
}

int run(int argc, char** argv) {
  tidal_example::Args args;
  args.steps = 30;
  std::string data_dir;
  int64_t width = 4;
  bool made_data = false;
  tidal_example::parse_args(argc, argv, args, [&](const std::string& flag, const auto& value) {
    if (flag == "--width") {
      width = std::stoll(value());
    } else if (flag == "--data") {
      data_dir = value();
    } else if (flag == "--make-data") {
      const std::string out = value();
      make_data(out, std::stoi(value()));
      made_data = true;
    } else {
      return false;
    }
    return true;
  });
  if (made_data) return 0;
  if (data_dir.empty()) throw std::invalid_argument("--data DIR is required (see --make-data)");

  torch::manual_seed(1);
  // Before the model, so that every tensor of the run is allocated while tidal is watching.
  tidal::torch_layer::Session session(tidal_example::session_options(args));

  auto model = std::make_shared<Net>(width);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));

  const bool have_train = std::filesystem::exists(data_dir + "/train-images-idx3-ubyte");
  auto dataset =
      torch::data::datasets::MNIST(data_dir, have_train ? torch::data::datasets::MNIST::Mode::kTrain
                                                        : torch::data::datasets::MNIST::Mode::kTest)
          .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
          .map(torch::data::transforms::Stack<>());
  // Sequential, so that every mode sees the same batches in the same order.
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(dataset), torch::data::DataLoaderOptions().batch_size(64).workers(2));

  model->train();
  tidal_example::Report report;
  int step = 0;
  while (step < args.steps) {
    for (auto& batch : *loader) {
      if (step == args.steps) break;
      report.start_step();
      session.begin_step();
      optimizer.zero_grad();
      auto output = model->forward(batch.data);
      auto loss = torch::nll_loss(output, batch.target);
      loss.backward();
      optimizer.step();
      session.end_step();
      report.end_step(step, session, {{"loss", loss.item<double>()}});
      ++step;
    }
  }

  report.print_summary(args, session);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return tidal_example::main_with_errors(argc, argv, run); }
