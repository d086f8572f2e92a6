#include "tidal/torch/training_checkpoint.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

#include "tidal/common/atomic_file.hpp"
#include "tidal/common/error.hpp"
#include "tidal/torch/session.hpp"

namespace tidal::torch_layer {
namespace {

// After the archive's bytes: a magic word, the archive's length and the XXH3-64 of its bytes.
// torch reads the archive through a reader that stops before the trailer; a file without one
// (written before the trailer existed, or by torch::save) is read as it is, unless it shows it
// had one: the magic in it anywhere, or the archive's record kChecksummedKey (which covers a
// trailer cut whole, or down to less than its magic). Then it is refused as damaged.
constexpr std::array<char, 8> kMagic = {'T', 'I', 'D', 'A', 'L', 'C', 'K', '1'};
struct Trailer {
  std::array<char, 8> magic;
  std::uint64_t length;
  std::uint64_t hash;
};
static_assert(sizeof(Trailer) == 24);
// In every archive write_checkpoint writes: its file ends with a trailer.
constexpr const char* kChecksummedKey = "tidal.checksummed";

struct HashState {
  HashState() : state(XXH3_createState()) {
    TIDAL_EXPECT(state != nullptr, "out of memory for a checksum state");
    XXH3_64bits_reset(state);
  }
  ~HashState() { XXH3_freeState(state); }
  HashState(const HashState&) = delete;
  HashState& operator=(const HashState&) = delete;
  XXH3_state_t* state;
};

struct Fd {
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) {
      const int e = errno;
      TIDAL_FAIL_IO(e, "cannot open checkpoint '", path, "': ", std::strerror(e));
    }
  }
  ~Fd() { ::close(fd); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int fd;
};

std::size_t pread_some(const Fd& f, const std::string& path, void* buf, std::size_t n,
                       std::uint64_t pos) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r =
        ::pread(f.fd, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(pos + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      TIDAL_FAIL_IO(e, "reading checkpoint '", path, "' failed: ", std::strerror(e));
    }
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

// Whether tidal's trailer magic is anywhere in the file's first `size` bytes.
bool carries_magic(const Fd& f, const std::string& path, std::uint64_t size) {
  std::vector<char> buf(std::size_t{4} << 20);
  const std::size_t keep = kMagic.size() - 1;  // a magic split between two reads
  std::size_t have = 0;
  for (std::uint64_t pos = 0; pos < size;) {
    const auto want =
        static_cast<std::size_t>(std::min<std::uint64_t>(buf.size() - have, size - pos));
    const std::size_t got = pread_some(f, path, buf.data() + have, want, pos);
    if (got == 0) break;
    have += got;
    pos += got;
    if (std::search(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(have), kMagic.begin(),
                    kMagic.end()) != buf.begin() + static_cast<std::ptrdiff_t>(have)) {
      return true;
    }
    const std::size_t tail = std::min(keep, have);
    std::memmove(buf.data(), buf.data() + have - tail, tail);
    have = tail;
  }
  return false;
}

// The archive's length when the file ends with a trailer whose checksum matches its bytes;
// 0 when it has no trailer (torch::save's files, or tidal's from before the trailer). Throws
// InvalidArgument when the bytes do not match, and when the file carries the trailer's magic
// but does not end with a whole trailer: cut short or grown at its end, it is damaged, not old.
std::uint64_t verified_length(const Fd& f, const std::string& path, std::uint64_t size) {
  Trailer t{};
  const bool ends_with_trailer = size >= sizeof t &&
                                 pread_some(f, path, &t, sizeof t, size - sizeof t) == sizeof t &&
                                 t.magic == kMagic && t.length == size - sizeof t;
  if (!ends_with_trailer) {
    TIDAL_EXPECT_AS(InvalidArgument, !carries_magic(f, path, size), "checkpoint '", path,
                    "' is damaged: it was written with a checksum, but does not end with it (",
                    size,
                    " bytes: cut short, or bytes added after it), so its bytes cannot be "
                    "checked; resume from an earlier checkpoint, or start again without --resume");
    return 0;
  }
  HashState h;
  std::vector<char> buf(std::size_t{4} << 20);
  for (std::uint64_t pos = 0; pos < t.length;) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), t.length - pos));
    const std::size_t got = pread_some(f, path, buf.data(), want, pos);
    TIDAL_EXPECT_AS(InvalidArgument, got == want, "checkpoint '", path, "' ends early");
    XXH3_64bits_update(h.state, buf.data(), got);
    pos += got;
  }
  const std::uint64_t hash = XXH3_64bits_digest(h.state);
  TIDAL_EXPECT_AS(InvalidArgument, hash == t.hash, "checkpoint '", path,
                  "' is damaged: its bytes do not match the checksum written with it (", t.length,
                  " bytes, XXH3 ", std::hex, hash, " against ", t.hash, std::dec,
                  "); resume from an earlier checkpoint, or start again without --resume");
  return t.length;
}

}  // namespace

void write_checkpoint(torch::serialize::OutputArchive& archive, const std::string& path,
                      Session* session) {
  if (session != nullptr) session->make_resident();
  archive.write(kChecksummedKey, c10::IValue(true));
  AtomicFile file(path);
  HashState h;
  Trailer t{kMagic, 0, 0};
  // A failed write (disk full) is kept and thrown once torch's writer has finished: thrown
  // through it, torch's archive writer raised again from its destructor during the unwinding,
  // which ended the process (std::terminate) and left the temporary file behind.
  std::exception_ptr failure;
  archive.save_to([&](const void* data, std::size_t n) {
    if (failure) return n;
    try {
      file.write(data, n);
      XXH3_64bits_update(h.state, data, n);
      t.length += n;
    } catch (...) {
      failure = std::current_exception();
    }
    return n;
  });
  if (failure) std::rethrow_exception(failure);
  t.hash = XXH3_64bits_digest(h.state);
  file.write(&t, sizeof t);
  file.commit();
}

void read_checkpoint(torch::serialize::InputArchive& archive, const std::string& path) {
  TIDAL_EXPECT_AS(InvalidArgument, std::filesystem::is_regular_file(path), "checkpoint '", path,
                  "' does not exist (resume from a directory a run wrote checkpoints to)");
  const std::uint64_t size = std::filesystem::file_size(path);
  const auto f = std::make_shared<Fd>(path);
  const std::uint64_t length = verified_length(*f, path, size);
  try {
    if (length == 0) {
      archive.load_from(path);
    } else {
      archive.load_from([f, path](std::uint64_t pos, void* buf,
                                  std::size_t n) { return pread_some(*f, path, buf, n, pos); },
                        [length] { return static_cast<std::size_t>(length); });
    }
    c10::IValue checksummed;
    TIDAL_EXPECT_AS(InvalidArgument, length != 0 || !archive.try_read(kChecksummedKey, checksummed),
                    "checkpoint '", path,
                    "' is damaged: it was written with a checksum, but its end, where the "
                    "checksum was, is missing (",
                    size,
                    " bytes: cut short), so its bytes cannot be checked; resume from an earlier "
                    "checkpoint, or start again without --resume");
  } catch (const c10::Error& e) {
    TIDAL_FAIL_AS(
        InvalidArgument, "checkpoint '", path,
        "' cannot be read (truncated, or not a checkpoint): ", e.what_without_backtrace());
  }
}

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace tidal::torch_layer
