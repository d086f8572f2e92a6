// Trainer::save_checkpoint and load_checkpoint: what a resumed run needs to continue bit for bit.
#include <optional>
#include <sstream>

#include "tidal/common/error.hpp"
#include "tidal/models/trainer.hpp"
#include "tidal/torch/training_checkpoint.hpp"

namespace tidal::models {

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
          {"micro_batch_order", plan::to_string(o.micro_batch_order)},
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
  optimizer_.refresh_copies();  // a step on the host updates copies of the parameters
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

}  // namespace tidal::models
