#include "tidal/models/trainer.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>

#include "tidal/common/error.hpp"
#include "tidal/torch/training_checkpoint.hpp"

namespace tidal::models {

AdamW::AdamW(std::vector<torch::Tensor> params, Options options)
    : params_(std::move(params)), options_(options) {
  torch::NoGradGuard no_grad;
  exp_avg_.reserve(params_.size());
  exp_avg_sq_.reserve(params_.size());
  for (const auto& p : params_) {
    exp_avg_.push_back(torch::zeros_like(p));
    exp_avg_sq_.push_back(torch::zeros_like(p));
  }
}

void AdamW::step() {
  begin_step();
  for (std::size_t i = 0; i < params_.size(); ++i) update(i);
}

void AdamW::begin_step() {
  ++step_;
  const double t = static_cast<double>(step_);
  const double bias_correction1 = 1.0 - std::pow(options_.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(options_.beta2, t);
  step_size_ = options_.lr / bias_correction1;
  sqrt_bc2_ = std::sqrt(bias_correction2);
}

void AdamW::update(std::size_t i) {
  torch::NoGradGuard no_grad;
  auto& p = params_.at(i);
  const auto& g = p.grad();
  if (!g.defined()) return;
  if (options_.weight_decay != 0 && p.dim() >= 2) p.mul_(1.0 - options_.lr * options_.weight_decay);
  exp_avg_[i].mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
  exp_avg_sq_[i].mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
  auto denom = (exp_avg_sq_[i].sqrt() / sqrt_bc2_).add_(options_.eps);
  p.addcdiv_(exp_avg_[i], denom, -step_size_);
}

void AdamW::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto g = p.grad();
    if (g.defined()) g.zero_();
  }
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::named_state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(2 * params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + std::to_string(i), exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + std::to_string(i), exp_avg_sq_[i]);
  }
  return out;
}

TokenSource::TokenSource(std::int64_t vocab, std::uint64_t seed) : vocab_(vocab), rng_(seed) {
  TIDAL_EXPECT_AS(InvalidArgument, vocab >= 2, "the vocabulary needs at least two tokens");
}

TokenSource::TokenSource(const std::string& path, std::int64_t vocab, std::uint64_t seed)
    : vocab_(vocab), rng_(seed) {
  TIDAL_EXPECT_AS(InvalidArgument, vocab >= 256,
                  "a data file trains on bytes: the model's vocabulary (", vocab,
                  ") must hold at least 256 tokens");
  std::ifstream in(path, std::ios::binary);
  TIDAL_EXPECT_AS(InvalidArgument, in.good(), "cannot open the data file '", path,
                  "'; check its path");
  text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  TIDAL_EXPECT_AS(InvalidArgument, text_.size() >= 2, "the data file '", path, "' is empty");
}

std::pair<torch::Tensor, torch::Tensor> TokenSource::next_batch(std::int64_t batch,
                                                                std::int64_t seq) {
  TIDAL_EXPECT_AS(InvalidArgument, batch >= 1 && seq >= 1, "batch and seq must be at least 1");
  std::vector<std::int64_t> rows(static_cast<std::size_t>(batch * (seq + 1)));
  if (!text_.empty()) {
    TIDAL_EXPECT_AS(InvalidArgument, static_cast<std::int64_t>(text_.size()) > seq,
                    "the data file holds ", text_.size(), " bytes, fewer than seq + 1 = ", seq + 1,
                    "; use a shorter sequence or a longer file");
    std::uniform_int_distribution<std::int64_t> offset(
        0, static_cast<std::int64_t>(text_.size()) - seq - 1);
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto start = offset(rng_);
      for (std::int64_t i = 0; i <= seq; ++i) {
        rows[static_cast<std::size_t>(b * (seq + 1) + i)] =
            text_[static_cast<std::size_t>(start + i)];
      }
    }
  } else {
    // t[i+1] = (5 t[i] + 3) mod vocab, replaced by a random token one time in eight.
    std::uniform_int_distribution<std::int64_t> token(0, vocab_ - 1);
    std::uniform_int_distribution<int> noise(0, 7);
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t i = 0; i <= seq; ++i) {
        state_ = noise(rng_) == 0 ? token(rng_) : (5 * state_ + 3) % vocab_;
        rows[static_cast<std::size_t>(b * (seq + 1) + i)] = state_;
      }
    }
  }
  auto all = torch::from_blob(rows.data(), {batch, seq + 1}, torch::kLong).clone();
  return {all.narrow(1, 0, seq).contiguous(), all.narrow(1, 1, seq).contiguous()};
}

std::string TokenSource::position() const {
  std::ostringstream out;
  out << rng_ << ' ' << state_;
  return out.str();
}

std::string TokenSource::content_id() const {
  if (text_.empty()) return "";
  std::ostringstream out;
  out << text_.size() << " bytes, XXH3 " << std::hex << XXH3_64bits(text_.data(), text_.size());
  return out.str();
}

void TokenSource::set_position(const std::string& text) {
  std::istringstream in(text);
  std::mt19937_64 rng;
  std::int64_t state = 0;
  in >> rng >> state;
  TIDAL_EXPECT_AS(InvalidArgument, !in.fail(), "not a data position: '", text.substr(0, 40),
                  "...'");
  rng_ = rng;
  state_ = state;
}

namespace {

Transformer seeded_model(const TrainerOptions& o) {
  TIDAL_EXPECT_AS(InvalidArgument, o.batch >= 1, "the batch must be at least 1");
  TIDAL_EXPECT_AS(InvalidArgument, o.seq >= 1 && o.seq <= o.config.max_seq, "the sequence length ",
                  o.seq, " is outside 1..", o.config.max_seq, " for model ", o.config.name);
  torch::manual_seed(o.seed);
  return make_model(o.config, o.device);
}

TokenSource make_source(const TrainerOptions& o) {
  if (o.data_path.empty()) return TokenSource(o.config.vocab, o.seed);
  return TokenSource(o.data_path, o.config.vocab, o.seed);
}

}  // namespace

Trainer::Trainer(TrainerOptions options)
    : options_(std::move(options)),
      model_(seeded_model(options_)),
      optimizer_(model_->parameters(), options_.adamw),
      data_(make_source(options_)),
      params_(model_->parameters()) {
  TIDAL_EXPECT_AS(InvalidArgument, options_.clip_grad_norm >= 0, "the clipping norm must be >= 0");
  TIDAL_EXPECT_AS(InvalidArgument, options_.clip_grad_norm == 0 || !in_backward(),
                  "clipping by the global norm needs every gradient before any update, which "
                  "the in-backward schedule does not wait for; use the deferred schedule");
  TIDAL_EXPECT(params_.size() == optimizer_.size(), "optimizer and model disagree on parameters");
  TIDAL_EXPECT_AS(InvalidArgument,
                  options_.micro_batches >= 1 && options_.batch % options_.micro_batches == 0,
                  "micro-batches must divide the batch: ", options_.micro_batches,
                  " micro-batches of a batch of ", options_.batch);
  TIDAL_EXPECT_AS(
      InvalidArgument,
      options_.micro_batches == 1 ||
          (options_.optimizer == OptimizerSchedule::kAfterBackward && options_.clip_grad_norm == 0),
      "micro-batches need the after-backward optimizer schedule without clipping "
      "(the other schedules update a parameter after one micro-batch's gradient)");
  const auto layers = static_cast<std::size_t>(options_.config.layers);
  model_->set_layer_listener([this, layers](std::int64_t layer) {
    for (auto* o : observers_) o->begin_layer(layer);
    if (deferred()) {
      apply_updates(layer >= 0 ? static_cast<std::size_t>(layer) + 1 : layers + 1);
    }
  });
  if (in_backward()) {
    on_gradient_ready([this](std::size_t i) {
      optimizer_.update(i);
      params_[i].mutable_grad() = torch::Tensor();  // set to none: a new one next backward
    });
  }
  if (deferred()) {
    update_groups_.resize(layers + 2);
    std::size_t i = 0;
    for (const auto& p : model_->named_parameters()) {
      const std::string& name = p.key();
      std::size_t group = layers + 1;
      if (name.rfind("blocks.", 0) == 0) {
        group = 1 + std::stoul(name.substr(7, name.find('.', 7) - 7));
      } else if (name.rfind("tok_embedding.", 0) == 0 || name.rfind("pos_embedding.", 0) == 0) {
        group = 0;
      }
      update_groups_.at(group).push_back(i++);
    }
    pending_.assign(params_.size(), 0);
  }
  if (options_.clip_grad_norm > 0) {
    // Each gradient's norm when backward completes it: the clipping coefficient is then known
    // when backward ends, without reading every gradient again.
    grad_norms_.resize(params_.size());
    on_gradient_ready([this](std::size_t i) {
      torch::NoGradGuard no_grad;
      grad_norms_[i] = params_[i].grad().norm();
    });
  }
}

namespace {

// Runs after a gradient accumulator has added the last contribution of this backward pass to
// its parameter's .grad.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

void Trainer::on_gradient_ready(std::function<void(std::size_t)> fn) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    TIDAL_EXPECT(p.is_leaf() && p.requires_grad(), "parameter ", i,
                 " is not a leaf that requires grad; gradient hooks need one");
    auto acc = torch::autograd::impl::grad_accumulator(p);
    TIDAL_EXPECT(acc != nullptr, "no gradient accumulator for parameter ", i);
    acc->add_post_hook(std::make_unique<GradientReadyHook>([fn, i] { fn(i); }));
    accumulators_.push_back(std::move(acc));
  }
}

torch::Tensor Trainer::clip_coefficient() const {
  if (options_.clip_grad_norm <= 0) return {};
  std::vector<torch::Tensor> norms;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad().defined() && grad_norms_[i].defined()) norms.push_back(grad_norms_[i]);
  }
  if (norms.empty()) return {};
  torch::NoGradGuard no_grad;
  const torch::Tensor total = torch::stack(norms).norm();
  return (options_.clip_grad_norm / (total + 1e-6)).clamp_max(1.0);
}

void Trainer::apply_updates(std::size_t group) {
  if (group >= update_groups_.size()) return;
  torch::NoGradGuard no_grad;
  for (const std::size_t i : update_groups_[group]) {
    if (pending_[i] == 0) continue;
    pending_[i] = 0;
    auto& p = params_[i];
    if (!p.grad().defined()) continue;
    if (clip_coef_.defined()) p.mutable_grad().mul_(clip_coef_);
    optimizer_.update(i);
    p.mutable_grad() = torch::Tensor();
  }
}

void Trainer::flush_optimizer() {
  for (std::size_t g = 0; g < update_groups_.size(); ++g) apply_updates(g);
}

void Trainer::add_observer(torch_layer::StepObserver* observer) {
  TIDAL_EXPECT(observer != nullptr, "add_observer: null observer");
  if (std::find(observers_.begin(), observers_.end(), observer) == observers_.end()) {
    observers_.push_back(observer);
  }
}

void Trainer::remove_observer(torch_layer::StepObserver* observer) {
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
}

void Trainer::notify_phase(trace::Phase phase) {
  for (auto* o : observers_) o->begin_phase(phase);
}

StepResult Trainer::step() {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto [inputs, targets] = data_.next_batch(options_.batch, options_.seq);
  if (options_.device != torch::Device(torch::kCPU)) {
    inputs = inputs.to(options_.device);
    targets = targets.to(options_.device);
  }
  for (auto* o : observers_) o->begin_step(step_, {inputs, targets});

  torch::Tensor loss;
  if (options_.micro_batches > 1) {
    loss = options_.micro_batch_order == MicroBatchOrder::kLayerMajor
               ? layer_major_micro_batches(inputs, targets)
               : sequential_micro_batches(inputs, targets);
  } else {
    notify_phase(trace::Phase::kForward);
    // Deferred: the last step's updates run as forward reaches each parameter (layer listener).
    apply_updates(0);
    loss = model_->loss(inputs, targets);
    flush_optimizer();  // deferred: any parameter forward did not reach

    notify_phase(trace::Phase::kBackward);
    // Optimizer-in-backward: the hooks update each parameter during backward, with this step's
    // bias corrections.
    if (in_backward()) optimizer_.begin_step();
    for (auto& n : grad_norms_) n = torch::Tensor();  // the hooks take this backward's norms
    // torch::autograd::backward rather than Tensor::backward: the latter is itself a dispatched
    // op (aten::_backward) and would hide the backward ops from a tracer as nested calls.
    torch::autograd::backward({loss});
  }

  notify_phase(trace::Phase::kOptimizer);
  clip_coef_ = clip_coefficient();
  if (deferred()) {
    // This step's bias corrections and clipping coefficient serve the updates in the next
    // forward pass.
    optimizer_.begin_step();
    std::fill(pending_.begin(), pending_.end(), 1);
  } else if (!in_backward()) {
    if (clip_coef_.defined()) {
      torch::NoGradGuard no_grad;
      for (auto& p : params_) {
        if (p.grad().defined()) p.mutable_grad().mul_(clip_coef_);
      }
    }
    optimizer_.step();
    optimizer_.zero_grad();
  }

  for (auto* o : observers_) o->end_step(step_);

  StepResult r;
  r.step = step_++;
  r.loss = loss.item<double>();  // also waits for the device
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

// Gradient accumulation: each micro-batch's forward and backward in turn, its loss divided by
// the number of micro-batches.
torch::Tensor Trainer::sequential_micro_batches(const torch::Tensor& inputs,
                                                const torch::Tensor& targets) {
  const auto n = options_.micro_batches;
  const auto in = inputs.chunk(n, 0);
  const auto tg = targets.chunk(n, 0);
  torch::Tensor total;
  for (std::int64_t m = 0; m < n; ++m) {
    notify_phase(trace::Phase::kForward);
    torch::Tensor loss = model_->loss(in[m], tg[m]) / static_cast<double>(n);
    notify_phase(trace::Phase::kBackward);
    torch::autograd::backward({loss});
    total = m == 0 ? loss.detach() : total + loss.detach();
  }
  return total;
}

// Layer-major (GreedySnake's order): every micro-batch through a layer before the next, in
// forward, and in backward from the last layer down. Each block's input is a detached leaf
// that requires a gradient, so each (layer, micro-batch) is its own graph: backward runs one at
// a time, handing the gradient of a block's input to the block below.
torch::Tensor Trainer::layer_major_micro_batches(const torch::Tensor& inputs,
                                                 const torch::Tensor& targets) {
  const auto n = static_cast<std::size_t>(options_.micro_batches);
  const auto layers = static_cast<std::size_t>(options_.config.layers);
  const auto in = inputs.chunk(static_cast<std::int64_t>(n), 0);
  const auto tg = targets.chunk(static_cast<std::int64_t>(n), 0);
  const auto leaf = [](const torch::Tensor& x) { return x.detach().requires_grad_(true); };

  notify_phase(trace::Phase::kForward);
  std::vector<torch::Tensor> embedded(n);
  for (std::size_t m = 0; m < n; ++m) embedded[m] = model_->embed(in[m]);
  // inputs_of[l][m] / outputs_of[l][m]: block l's detached input and its output, micro-batch m.
  std::vector<std::vector<torch::Tensor>> inputs_of(layers, std::vector<torch::Tensor>(n));
  std::vector<std::vector<torch::Tensor>> outputs_of(layers, std::vector<torch::Tensor>(n));
  std::vector<torch::Tensor> x = embedded;
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t m = 0; m < n; ++m) {
      inputs_of[l][m] = leaf(x[m]);
      outputs_of[l][m] = model_->block(static_cast<std::int64_t>(l), inputs_of[l][m]);
      x[m] = outputs_of[l][m];
    }
  }
  std::vector<torch::Tensor> head_in(n);
  std::vector<torch::Tensor> losses(n);
  torch::Tensor total;
  for (std::size_t m = 0; m < n; ++m) {
    head_in[m] = leaf(x[m]);
    losses[m] = model_->head_loss(head_in[m], tg[m]) / static_cast<double>(n);
    total = m == 0 ? losses[m].detach() : total + losses[m].detach();
  }
  x.clear();

  notify_phase(trace::Phase::kBackward);
  std::vector<torch::Tensor> grad(n);
  for (std::size_t m = 0; m < n; ++m) {
    torch::autograd::backward({losses[m]});
    losses[m] = torch::Tensor();
    grad[m] = head_in[m].grad();
    head_in[m] = torch::Tensor();
  }
  for (std::size_t l = layers; l-- > 0;) {
    for (std::size_t m = 0; m < n; ++m) {
      torch::autograd::backward({outputs_of[l][m]}, {grad[m]});
      outputs_of[l][m] = torch::Tensor();
      grad[m] = inputs_of[l][m].grad();
      inputs_of[l][m] = torch::Tensor();
    }
  }
  for (std::size_t m = 0; m < n; ++m) {
    torch::autograd::backward({embedded[m]}, {grad[m]});
    embedded[m] = torch::Tensor();
  }
  return total;
}

namespace {

// What must match between the run that wrote a checkpoint and the run that resumes it: the
// options that change the math (the optimizer schedule does not).
std::vector<std::pair<std::string, std::string>> fingerprint(const TrainerOptions& o) {
  const auto& c = o.config;
  auto num = [](double v) {
    std::ostringstream out;
    out.precision(17);
    out << v;
    return out.str();
  };
  // The model's name last: a changed --layers or --hidden also changes the name (to
  // "<model>-custom"), and the message names the first difference, the more telling one.
  return {{"layers", std::to_string(c.layers)},
          {"hidden", std::to_string(c.hidden)},
          {"heads", std::to_string(c.heads)},
          {"kv_heads", std::to_string(c.kv_heads)},
          {"ffn_hidden", std::to_string(c.ffn_hidden)},
          {"vocab", std::to_string(c.vocab)},
          {"max_seq", std::to_string(c.max_seq)},
          {"batch", std::to_string(o.batch)},
          {"seq", std::to_string(o.seq)},
          {"seed", std::to_string(o.seed)},
          {"data_path", o.data_path},
          {"lr", num(o.adamw.lr)},
          {"beta1", num(o.adamw.beta1)},
          {"beta2", num(o.adamw.beta2)},
          {"eps", num(o.adamw.eps)},
          {"weight_decay", num(o.adamw.weight_decay)},
          {"clip_grad_norm", num(o.clip_grad_norm)},
          {"micro_batches", std::to_string(o.micro_batches)},
          {"micro_batch_order",
           o.micro_batch_order == MicroBatchOrder::kLayerMajor ? "layer-major" : "sequential"},
          {"model", c.name}};
}

// Options added after checkpoints were first written: a checkpoint without one was written
// with its default.
std::optional<std::string> default_of_later_option(const std::string& key) {
  if (key == "micro_batches") return "1";
  if (key == "micro_batch_order") return "sequential";
  return std::nullopt;
}

constexpr std::int64_t kCheckpointFormat = 1;

}  // namespace

void Trainer::save_checkpoint(const std::string& path, torch_layer::Session* session) {
  flush_optimizer();
  torch::serialize::OutputArchive out;
  out.write("tidal.format", c10::IValue(kCheckpointFormat));
  for (const auto& [key, value] : fingerprint(options_)) {
    out.write("options." + key, c10::IValue(value));
  }
  out.write("step", c10::IValue(step_));
  out.write("adamw.steps", c10::IValue(optimizer_.steps_taken()));
  out.write("data.position", c10::IValue(data_.position()));
  out.write("data.content", c10::IValue(data_.content_id()));
  out.write("rng.cpu", torch_layer::cpu_rng_state());
  for (const auto& p : persistent_tensors(false)) out.write(p.name, p.tensor);
  torch_layer::write_checkpoint(out, path, session);
}

void Trainer::load_checkpoint(const std::string& path) {
  torch::serialize::InputArchive in;
  torch_layer::read_checkpoint(in, path);
  c10::IValue v;
  TIDAL_EXPECT_AS(InvalidArgument, in.try_read("tidal.format", v) && v.isInt(), "'", path,
                  "' is not a checkpoint written by tidal (Trainer::save_checkpoint)");
  TIDAL_EXPECT_AS(InvalidArgument, v.toInt() == kCheckpointFormat, "checkpoint '", path,
                  "' has format ", v.toInt(), "; this build reads format ", kCheckpointFormat);
  for (const auto& [key, value] : fingerprint(options_)) {
    c10::IValue saved;
    std::optional<std::string> written = default_of_later_option(key);
    if (in.try_read("options." + key, saved) && saved.isString()) written = saved.toStringRef();
    TIDAL_EXPECT_AS(InvalidArgument, written.has_value(), "checkpoint '", path, "' lacks option '",
                    key, "'");
    TIDAL_EXPECT_AS(InvalidArgument, *written == value, "checkpoint '", path, "' was written with ",
                    key, " = ", *written, ", this run has ", key, " = ", value,
                    ": resume with the options the run was started with");
  }
  // The data file's contents, not only its name: the same path with other text would resume
  // on batches the run never saw. A checkpoint from before this check has no record of them.
  c10::IValue content;
  if (in.try_read("data.content", content) && content.isString()) {
    TIDAL_EXPECT_AS(InvalidArgument, content.toStringRef() == data_.content_id(), "checkpoint '",
                    path, "' was written with data file '", options_.data_path, "' of ",
                    content.toStringRef(), "; that file now holds ", data_.content_id(),
                    ": its contents changed since; resume with the data the run was started with");
  }
  auto read_int = [&](const char* key) {
    c10::IValue x;
    in.read(key, x);
    return x.toInt();
  };
  auto read_string = [&](const char* key) {
    c10::IValue x;
    in.read(key, x);
    return x.toStringRef();
  };
  torch::NoGradGuard no_grad;
  for (auto& p : persistent_tensors(false)) {
    torch::Tensor saved;
    TIDAL_EXPECT_AS(InvalidArgument, in.try_read(p.name, saved), "checkpoint '", path,
                    "' has no tensor '", p.name, "'");
    TIDAL_EXPECT_AS(InvalidArgument, saved.sizes() == p.tensor.sizes(), "checkpoint '", path,
                    "': tensor '", p.name, "' has shape ", saved.sizes(), ", the model's is ",
                    p.tensor.sizes());
    p.tensor.copy_(saved);
  }
  const auto step = read_int("step");
  optimizer_.set_steps_taken(read_int("adamw.steps"));
  data_.set_position(read_string("data.position"));
  torch::Tensor rng;
  in.read("rng.cpu", rng);
  torch_layer::set_cpu_rng_state(rng);
  // Nothing pending: save_checkpoint applied the deferred updates; gradients start afresh.
  std::fill(pending_.begin(), pending_.end(), 0);
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  step_ = step;
}

std::vector<Trainer::PersistentTensor> Trainer::persistent_tensors(bool gradients) {
  std::vector<PersistentTensor> out;
  for (const auto& p : model_->named_parameters()) {
    out.push_back({"param:" + p.key(), p.value(), trace::TensorClass::kParameter});
  }
  for (const auto& b : model_->named_buffers()) {
    out.push_back({"buffer:" + b.key(), b.value(), trace::TensorClass::kParameter});
  }
  if (gradients) {
    for (const auto& p : model_->named_parameters()) {
      if (p.value().grad().defined()) {
        out.push_back({"grad:" + p.key(), p.value().grad(), trace::TensorClass::kGradient});
      }
    }
  }
  for (auto& s : optimizer_.named_state()) {
    out.push_back({"adamw:" + s.first, s.second, trace::TensorClass::kOptimizerState});
  }
  return out;
}

}  // namespace tidal::models
