#include "tidal/torch/checkpoint.hpp"

#include <torch/csrc/autograd/custom_function.h>

namespace tidal::torch_layer {
namespace {

struct BlockHolder : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
};

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               c10::intrusive_ptr<BlockHolder> holder) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    torch::NoGradGuard no_grad;  // nothing inside the block is saved
    return holder->fn(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    auto holder =
        c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["fn"].toCapsule());
    torch::Tensor input = x.detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = holder->fn(input);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& x) {
  auto holder = c10::make_intrusive<BlockHolder>();
  holder->fn = fn;
  return Checkpoint::apply(x, holder);
}

}  // namespace tidal::torch_layer
