// tidal._C: the Python bindings of tidal's C++ core. Thin on purpose: every behaviour lives in
// the C++ library (Session, ActivationOffloader, TensorStore, the unit parser); the Python
// package (python/tidal) shapes the API to PyTorch's conventions on top of this.
//
// Threads and the GIL: calls that may wait for I/O (end_step, begin_step, make_resident, the
// store's destruction) release the GIL. Errors: tidal::Error and its subclasses become
// tidal.Error, tidal.InvalidArgument, tidal.IoError with the C++ message.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/store.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/torch/activations.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/trace/io.hpp"
#include "tidal/trace/trace.hpp"

namespace py = pybind11;
namespace tt = tidal::torch_layer;

namespace {

// The exception types, made once at import (module state lives as long as the interpreter).
PyObject* g_error = nullptr;
PyObject* g_invalid_argument = nullptr;
PyObject* g_io_error = nullptr;

PyObject* new_exception(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  const std::string qualified = std::string("tidal.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));
  return type;
}

void register_errors(py::module_& m) {
  g_error = new_exception(m, "Error", py::make_tuple(py::handle(PyExc_RuntimeError)),
                          "Base of every error tidal raises (tidal::Error in C++).");
  g_invalid_argument = new_exception(
      m, "InvalidArgument", py::make_tuple(py::handle(g_error), py::handle(PyExc_ValueError)),
      "An option given to tidal is wrong (tidal::InvalidArgument); the message says which.");
  g_io_error =
      new_exception(m, "IoError", py::make_tuple(py::handle(g_error), py::handle(PyExc_OSError)),
                    "A store directory or an I/O request failed (tidal::IoError); .errno is set.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tidal::InvalidArgument& e) {
      PyErr_SetString(g_invalid_argument, e.what());
    } catch (const tidal::IoError& e) {
      py::object err = py::reinterpret_borrow<py::object>(g_io_error)(e.what());
      err.attr("errno") = e.errnum();
      PyErr_SetObject(g_io_error, err.ptr());
    } catch (const tidal::Error& e) {
      PyErr_SetString(g_error, e.what());
    }
  });
}

py::dict store_stats_dict(const tidal::io::StoreStats& s) {
  py::dict d;
  d["capacity"] = s.capacity;
  d["used_bytes"] = s.used_bytes;
  d["file_used_bytes"] = s.file_used_bytes;
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["writes"] = s.writes;
  d["reads"] = s.reads;
  d["failed_requests"] = s.failed_requests;
  const auto degraded = [](const tidal::io::DegradedPath& p) {
    py::dict x;
    x["count"] = p.count;
    x["reason"] = p.reason;
    return x;
  };
  d["store_full"] = degraded(s.store_full);
  d["write_failed"] = degraded(s.write_failed);
  d["read_failed"] = degraded(s.read_failed);
  d["read_corrupt"] = degraded(s.read_corrupt);
  d["backend_fallback"] = degraded(s.backend_fallback);
  d["staged_ops"] = s.staged_ops;
  d["busy_seconds"] = s.busy_seconds;
  d["checksum_seconds"] = s.checksum_seconds;
  d["tickets"] = s.tickets;
  d["backend"] = s.backend;
  d["buffered"] = s.buffered;
  d["tmpfile"] = s.tmpfile;
  return d;
}

// The fields of a stats struct as a dict, in declaration order (the Python side makes a
// dataclass of it).
py::dict session_stats_dict(const tt::SessionStats& s) {
  py::dict d;
  d["mode"] = std::string(tt::to_string(s.mode));
  d["state"] = std::string(tt::to_string(s.state));
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["bytes_to_host"] = s.bytes_to_host;
  d["bytes_from_host"] = s.bytes_from_host;
  d["host_stall_seconds"] = s.host_stall_seconds;
  d["planned_bytes_to_ssd"] = s.planned_bytes_to_ssd;
  d["planned_bytes_to_host"] = s.planned_bytes_to_host;
  d["stall_seconds"] = s.stall_seconds;
  d["write_stall_seconds"] = s.write_stall_seconds;
  d["misses"] = s.misses;
  d["write_failures"] = s.write_failures;
  d["store_full_writes"] = s.store_full_writes;
  d["write_error"] = s.write_error;
  d["step_peak"] = s.step_peak;
  d["memory_budget"] = s.memory_budget;
  d["untouched_bytes"] = s.untouched_bytes;
  d["profiled_peak"] = s.profiled_peak;
  d["within_budget"] = s.within_budget;
  d["steps_measured"] = s.steps_measured;
  d["steps_over_budget"] = s.steps_over_budget;
  d["budget_reason"] = s.budget_reason;
  d["shapes"] = s.shapes;
  d["shape"] = s.shape;
  d["replans"] = s.replans;
  d["tightenings"] = s.tightenings;
  d["executed_peak"] = s.executed_peak;
  d["plan_summary"] = s.plan_summary;
  d["notice"] = s.notice;
  return d;
}

py::dict activation_stats_dict(const tt::ActivationStats& s) {
  py::dict d;
  d["packed"] = s.packed;
  d["offloaded"] = s.offloaded;
  d["kept_small"] = s.kept_small;
  d["kept_parameter"] = s.kept_parameter;
  d["kept_adaptive"] = s.kept_adaptive;
  d["deduplicated"] = s.deduplicated;
  d["forwarded"] = s.forwarded;
  d["prefetched"] = s.prefetched;
  d["misses"] = s.misses;
  d["write_failures"] = s.write_failures;
  d["store_full"] = s.store_full;
  d["write_error"] = s.write_error;
  d["cancelled_writes"] = s.cancelled_writes;
  d["bytes_written"] = s.bytes_written;
  d["bytes_read"] = s.bytes_read;
  d["stall_seconds"] = s.stall_seconds;
  d["forward_seconds"] = s.forward_seconds;
  d["passes"] = s.passes;
  d["keep_from"] = s.keep_from;
  d["lookahead_bytes"] = s.lookahead_bytes;
  return d;
}

// An ActivationOffloader with the store it writes to (the offloader holds it too; kept here for
// the statistics).
struct Offloader {
  std::shared_ptr<tidal::io::TensorStore> store;
  std::unique_ptr<tt::ActivationOffloader> offloader;
};

// Destroys with the GIL released: the session's and the offloader's destructors wait for I/O
// threads, which may need the GIL to drop a tensor that a Python object shares.
struct DeleteWithoutGil {
  template <typename T>
  void operator()(T* p) const {
    if (PyGILState_Check() == 0) {  // e.g. a constructor that threw, under its call guard
      std::default_delete<T>()(p);
      return;
    }
    py::gil_scoped_release release;
    std::default_delete<T>()(p);
  }
};
template <typename T>
using Holder = std::unique_ptr<T, DeleteWithoutGil>;

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tidal's C++ core (see the tidal package for the Python API)";
  register_errors(m);

  m.def(
      "parse_bytes", [](const std::string& s) { return tidal::parse_bytes(s); },
      "Bytes in a size written with units ('64MiB', '2GB', '1.5GiB'); raises InvalidArgument.");
  m.def("format_bytes", [](double b) { return tidal::format_bytes(b); });
  m.def(
      "memory_stats",
      [] {
        static tt::MemoryMeter meter(c10::Device(c10::kCPU));
        const tt::MemoryStats s = meter.stats();
        py::dict d;
        d["current_bytes"] = s.current_bytes;
        d["peak_bytes"] = s.peak_bytes;
        d["allocations"] = s.allocations;
        d["frees"] = s.frees;
        return d;
      },
      "CPU tensor memory counted by tidal's tracking allocator (installed at import of tidal).");
  m.def(
      "reset_peak_memory",
      [] {
        static tt::MemoryMeter meter(c10::Device(c10::kCPU));
        meter.reset_peak();
      },
      "Restarts the CPU peak from the bytes held now.");

  // Test hook: deterministic faults between the store and its backend (io/backend.hpp).
  py::class_<tidal::io::FaultPlan>(m, "FaultPlan")
      .def(py::init<>())
      .def_readwrite("fail_op", &tidal::io::FaultPlan::fail_op)
      .def_readwrite("fail_errno", &tidal::io::FaultPlan::fail_errno)
      .def_readwrite("fail_every_after", &tidal::io::FaultPlan::fail_every_after)
      .def_readwrite("only_writes", &tidal::io::FaultPlan::only_writes)
      .def_readwrite("only_reads", &tidal::io::FaultPlan::only_reads)
      .def_readwrite("corrupt_read", &tidal::io::FaultPlan::corrupt_read)
      .def_readwrite("delay_us", &tidal::io::FaultPlan::delay_us);

  py::class_<tidal::io::StoreOptions>(m, "StoreOptions")
      .def(py::init<>())
      .def_readwrite("dirs", &tidal::io::StoreOptions::dirs)
      .def_readwrite("capacity", &tidal::io::StoreOptions::capacity)
      .def_readwrite("stripe_unit", &tidal::io::StoreOptions::stripe_unit)
      .def_readwrite("queue_depth", &tidal::io::StoreOptions::queue_depth)
      .def_readwrite("threads", &tidal::io::StoreOptions::threads)
      .def_readwrite("checksum", &tidal::io::StoreOptions::checksum)
      .def_readwrite("buffered", &tidal::io::StoreOptions::buffered)
      .def_readwrite("allow_memory_fs", &tidal::io::StoreOptions::allow_memory_fs)
      .def_readwrite("faults", &tidal::io::StoreOptions::faults);

  py::class_<tt::ActivationOptions>(m, "ActivationOptions")
      .def(py::init<>())
      .def_readwrite("min_bytes", &tt::ActivationOptions::min_bytes)
      .def_readwrite("lookahead_bytes", &tt::ActivationOptions::lookahead_bytes)
      .def_readwrite("min_lookahead_bytes", &tt::ActivationOptions::min_lookahead_bytes)
      .def_readwrite("max_lookahead_bytes", &tt::ActivationOptions::max_lookahead_bytes)
      .def_readwrite("adaptive", &tt::ActivationOptions::adaptive);

  py::class_<tt::SessionOptions>(m, "SessionOptions")
      .def(py::init<>())
      .def_property(
          "mode", [](const tt::SessionOptions& o) { return std::string(tt::to_string(o.mode)); },
          [](tt::SessionOptions& o, const std::string& s) {
            o.mode = tt::offload_mode_from_string(s);
          })
      .def_readwrite("store", &tt::SessionOptions::store)
      .def_readwrite("activations", &tt::SessionOptions::activations)
      .def_property(
          "executor_min_bytes", [](const tt::SessionOptions& o) { return o.executor.min_bytes; },
          [](tt::SessionOptions& o, std::uint64_t b) { o.executor.min_bytes = b; })
      .def_readwrite("warmup_steps", &tt::SessionOptions::warmup_steps)
      .def_readwrite("profile_steps", &tt::SessionOptions::profile_steps)
      .def_readwrite("memory_budget", &tt::SessionOptions::memory_budget)
      .def_readwrite("budget_fraction", &tt::SessionOptions::budget_fraction)
      .def_readwrite("strict_budget", &tt::SessionOptions::strict_budget)
      .def_readwrite("budget_option", &tt::SessionOptions::budget_option)
      .def_readwrite("between_steps_option", &tt::SessionOptions::between_steps_option)
      .def_property(
          "between_steps",
          [](const tt::SessionOptions& o) {
            return std::string(o.between_steps == tt::BetweenSteps::kResident ? "resident"
                                                                              : "offloaded");
          },
          [](tt::SessionOptions& o, const std::string& s) {
            TIDAL_EXPECT_AS(tidal::InvalidArgument, s == "resident" || s == "offloaded",
                            "between_steps is 'resident' or 'offloaded', not '", s, "'");
            o.between_steps =
                s == "resident" ? tt::BetweenSteps::kResident : tt::BetweenSteps::kOffloaded;
          })
      .def_readwrite("host_memory", &tt::SessionOptions::host_memory)
      .def_readwrite("hardware", &tt::SessionOptions::hardware)
      .def_readwrite("model_name", &tt::SessionOptions::model_name)
      .def_readwrite("batch", &tt::SessionOptions::batch)
      .def_readwrite("seq", &tt::SessionOptions::seq);

  py::class_<tt::Session, Holder<tt::Session>>(m, "Session")
      .def(py::init<tt::SessionOptions>(), py::call_guard<py::gil_scoped_release>())
      .def("begin_step", py::overload_cast<>(&tt::Session::begin_step),
           py::call_guard<py::gil_scoped_release>())
      .def("end_step", py::overload_cast<>(&tt::Session::end_step),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "begin_phase",
          [](tt::Session& s, const std::string& phase) {
            s.begin_phase(tidal::trace::phase_from_string(phase));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "register_persistent",
          [](tt::Session& s, const torch::Tensor& t, const std::string& name,
             const std::string& cls) {
            s.register_persistent(t, name, tidal::trace::tensor_class_from_string(cls));
          },
          py::arg("tensor"), py::arg("name"), py::arg("cls"))
      .def("make_resident", &tt::Session::make_resident, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const tt::Session& s) { return session_stats_dict(s.stats()); })
      .def("trace_json",
           [](const tt::Session& s) -> py::object {
             if (!s.trace()) return py::none();
             return py::str(tidal::trace::trace_to_json(*s.trace()));
           })
      .def("plan_json",
           [](const tt::Session& s) -> py::object {
             if (!s.plan()) return py::none();
             return py::str(tidal::plan::plan_to_json(*s.plan()));
           })
      .def("store_stats", [](const tt::Session& s) -> py::object {
        if (!s.store()) return py::none();
        return store_stats_dict(s.store()->stats());
      });

  py::class_<Offloader, Holder<Offloader>>(m, "ActivationOffloader")
      .def(py::init([](const tidal::io::StoreOptions& so, const tt::ActivationOptions& ao) {
             Holder<Offloader> o(std::make_unique<Offloader>().release());
             o->store = std::make_shared<tidal::io::TensorStore>(so);
             o->offloader = std::make_unique<tt::ActivationOffloader>(o->store, ao);
             return o;
           }),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "begin_step", [](Offloader& o) { o.offloader->begin_step(); },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "end_step", [](Offloader& o) { o.offloader->end_step(); },
          py::call_guard<py::gil_scoped_release>())
      .def("keep_storages_of",
           [](Offloader& o, const std::vector<torch::Tensor>& tensors) {
             o.offloader->keep_storages_of(tensors);
           })
      .def("last_step",
           [](const Offloader& o) { return activation_stats_dict(o.offloader->last_step()); })
      .def("notice", [](const Offloader& o) { return o.offloader->notice(); })
      .def("store_stats", [](const Offloader& o) { return store_stats_dict(o.store->stats()); });
}
