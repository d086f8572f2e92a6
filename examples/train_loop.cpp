// A plain libtorch training loop with tidal: the model is untouched; the Session wraps each step.
// Build: part of the tidal build (target tidal_example_train_loop). Run: ./tidal_example_train_loop
// DIR
#include <torch/torch.h>

#include <iostream>

#include "tidal/torch/session.hpp"

int main(int argc, char** argv) {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::GELU(),
                                     torch::nn::Linear(2048, 512));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));

  tidal::torch_layer::SessionOptions options;
  options.mode = tidal::torch_layer::OffloadMode::kActivations;  // or kPlan, kNone
  options.store.dirs = {argc > 1 ? argv[1] : "/var/tmp/tidal"};
  options.store.capacity = 1ull << 30;
  options.activations.min_bytes = 64 * 1024;
  tidal::torch_layer::Session session(options);
  session.register_persistent(model->parameters(), tidal::trace::TensorClass::kParameter);

  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({1024, 512});
    session.begin_step();
    optimizer.zero_grad();
    auto loss = (model->forward(x) - x).pow(2).mean();
    loss.backward();
    optimizer.step();
    session.end_step();
    const auto s = session.stats();
    std::cout << "step " << step << " loss " << loss.item<double>() << ", wrote " << s.bytes_written
              << " B, read " << s.bytes_read << " B\n";
  }
}
