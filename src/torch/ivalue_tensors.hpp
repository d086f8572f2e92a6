// Internal: the tensors inside an op's argument or result (a tensor, a list, a tuple, nested).
#pragma once

#include <ATen/core/ivalue.h>

namespace tidal::torch_layer::detail {

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    const auto list = v.toTensorList();
    for (std::size_t i = 0; i < list.size(); ++i) f(list.get(i));
  } else if (v.isList()) {
    const auto list = v.toList();
    for (std::size_t i = 0; i < list.size(); ++i) for_each_tensor(list.get(i), f);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTuple()->elements()) for_each_tensor(e, f);
  }
}

}  // namespace tidal::torch_layer::detail
