// Checkpoint files for resuming training: a torch::serialize archive written atomically (a
// crash while writing leaves the previous checkpoint intact), with the offloaded tensors brought
// back first, and clear errors when a file is missing, truncated or written for another run.
//
// What a user's loop calls (models::Trainer::save_checkpoint uses the same functions):
//
//   torch::serialize::OutputArchive out;
//   model->save(out); optimizer.save(out);                 // whatever the loop needs
//   out.write("step", torch::tensor(step));
//   tidal::torch_layer::write_checkpoint(out, dir + "/checkpoint.pt", &session);
//
// (Not to be confused with tidal/torch/checkpoint.hpp: activation checkpointing.)
#pragma once

#include <torch/torch.h>

#include <string>

namespace tidal::torch_layer {

class Session;

/// Writes `archive` to `path` atomically: a temporary file in the same directory, fsync, rename,
/// fsync of the directory. The file ends with a checksum trailer, and the archive gets a record
/// "tidal.checksummed" that says so (read_checkpoint refuses the file without its trailer). When
/// `session` is given, its offloaded tensors are made resident
/// first (Session::make_resident): torch's serializer reads raw bytes, which an offloaded
/// tensor does not hold. Call it between steps. Throws tidal::IoError (directory missing, disk
/// full) with the previous file, if any, untouched.
void write_checkpoint(torch::serialize::OutputArchive& archive, const std::string& path,
                      Session* session = nullptr);

/// Reads a checkpoint written by write_checkpoint (or torch::save, which writes no checksum).
/// Throws tidal::InvalidArgument naming the path when it does not exist, cannot be read as an
/// archive (truncated, not a checkpoint), or is damaged: its bytes do not match its checksum,
/// or it shows it was written by write_checkpoint (the trailer's magic anywhere, or the
/// archive's record "tidal.checksummed") but does not end with a whole trailer (cut short, or
/// bytes added after it).
void read_checkpoint(torch::serialize::InputArchive& archive, const std::string& path);

/// The state of torch's default CPU random generator (a byte tensor), and restoring it: part
/// of what a resumed run needs to draw the same random numbers (dropout, sampling).
torch::Tensor cpu_rng_state();
void set_cpu_rng_state(const torch::Tensor& state);

}  // namespace tidal::torch_layer
