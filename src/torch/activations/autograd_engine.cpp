// tidal's autograd engine: the saved-tensor hooks it installs on every graph, so that saved tensors
// reach the active offloader without the user's code changing.
#include "torch/activations/activations_impl.hpp"

namespace tidal::torch_layer {

ActivationEngineState g_engine;

namespace {

class OffloadHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit OffloadHooks(std::shared_ptr<ActivationOffloader::Impl> impl) : impl_(std::move(impl)) {}

  void call_pack_hook(const at::Tensor& t) override {
    version_ = t._version();
    version_counter_ = t.unsafeGetTensorImpl()->version_counter();
    record_ = impl_->pack(t, &kept_);
    if (record_) {
      offset_ = t.storage_offset();
      sizes_ = t.sizes().vec();
      strides_ = t.strides().vec();
      dtype_ = t.scalar_type();
      options_ = t.options();
    }
  }

  at::Tensor call_unpack_hook() override {
    // With hooks installed autograd no longer checks saved tensors for in-place changes.
    TIDAL_EXPECT(version_counter_.current_version() == version_,
                 "one of the variables needed for gradient computation has been modified by an "
                 "inplace operation (saved at version ",
                 version_, ", now ", version_counter_.current_version(),
                 "); tidal's activation offloading keeps autograd's rule");
    if (!record_) {
      impl_->note_backward();
      return kept_;
    }
    return impl_->unpack(*record_, options_, offset_, sizes_, strides_, dtype_);
  }

  // Autograd releases a saved variable when its node has run (or its graph is dropped): where
  // no offloading would free the tensor, the record gives up its memory and its write.
  ~OffloadHooks() override {
    if (record_) impl_->release(*record_);
  }

 private:
  std::shared_ptr<ActivationOffloader::Impl> impl_;
  std::shared_ptr<Record> record_;
  at::Tensor kept_;
  c10::TensorOptions options_;  // the original device and dtype
  std::uint32_t version_ = 0;
  c10::VariableVersion version_counter_{c10::VariableVersion::DISABLED};
  std::int64_t offset_ = 0;
  std::vector<std::int64_t> sizes_;
  std::vector<std::int64_t> strides_;
  at::ScalarType dtype_ = at::kFloat;
};

// The default engine before tidal's was installed (PyTorch's own, or its Python engine).

class TidalEngine final : public torch::autograd::Engine {
 public:
  TidalEngine() = default;
  ~TidalEngine() override {
    device_ready_queues_.clear();  // the replaced engine's: its threads are not ours to stop
    stop();
  }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    // Hooks of the engine tidal's replaced come first: in a Python process that is PyTorch's
    // Python engine, whose hooks are torch.autograd.graph.saved_tensors_hooks (save_on_cpu,
    // non-reentrant checkpointing), which the user set around this very code.
    if (g_engine.previous_engine != nullptr) {
      if (auto hooks = g_engine.previous_engine->get_default_saved_variable_hooks()) return hooks;
    }
    if (g_engine.active.load(std::memory_order_acquire) == nullptr) return nullptr;
    if (!at::SavedTensorDefaultHooks::is_enabled()) return nullptr;
    std::shared_ptr<ActivationOffloader::Impl> impl;
    {
      std::lock_guard<std::mutex> lock(g_engine.active_mu);
      impl = g_engine.active_owner;
    }
    if (!impl || g_engine.backward_running.load() > 0)
      return nullptr;  // saved inside backward: keep
    return std::make_unique<OffloadHooks>(std::move(impl));
  }

  // Python's anomaly mode (torch.autograd.detect_anomaly) records Python stacks through it.
  std::unique_ptr<torch::autograd::AnomalyMetadata> make_anomaly_metadata() override {
    return g_engine.previous_engine != nullptr ? g_engine.previous_engine->make_anomaly_metadata()
                                               : Engine::make_anomaly_metadata();
  }

  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs,
                                         bool keep_graph, bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    struct Running {
      Running() { ++g_engine.backward_running; }
      ~Running() { --g_engine.backward_running; }
    } running;
    share_device_threads();
    return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }

 private:
  // PyTorch 2.x starts the autograd engine's device threads (one per GPU) once per process,
  // for whichever engine runs a backward first: an engine installed after a backward has none,
  // and its first CUDA backward fails an internal assert in Engine::ready_queue. So tidal's
  // engine works through the threads of the engine it replaced (started here if no backward
  // has run yet): their ready queues and the pool for reentrant backwards. Those threads run
  // the same Engine code; tidal's overrides act on the calling thread. (Where a torch keeps the
  // flag per engine, Engine::execute then starts this engine's own threads over these.)
  void share_device_threads() {
    std::call_once(shared_, [this] {
      if (g_engine.previous_engine == nullptr) return;
      g_engine.previous_engine->initialize_device_threads_pool();
      // Members of the replaced engine, reached through pointers to members formed here.
      constexpr auto queues = &TidalEngine::device_ready_queues_;
      constexpr auto pool = &TidalEngine::thread_pool_shared_;
      if (device_ready_queues_.empty()) device_ready_queues_ = g_engine.previous_engine->*queues;
      if (!thread_pool_shared_) thread_pool_shared_ = g_engine.previous_engine->*pool;
    });
  }

  std::once_flag shared_;
};

torch::autograd::Engine& tidal_engine() {
  static TidalEngine engine;
  return engine;
}

}  // namespace

void install_autograd_engine() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_engine.previous_engine = &torch::autograd::Engine::get_default_engine();
    torch::autograd::set_default_engine_stub(&tidal_engine);
  });
}

}  // namespace tidal::torch_layer
