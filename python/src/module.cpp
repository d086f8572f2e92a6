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

#include <cctype>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tidal/common/error.hpp"
#include "tidal/common/units.hpp"
#include "tidal/io/store.hpp"
#include "tidal/plan/plan.hpp"
#include "tidal/torch/activations.hpp"
#include "tidal/torch/memory.hpp"
#include "tidal/torch/session.hpp"
#include "tidal/trace/cost_model.hpp"
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

// A field of a stats struct as Python sees it: numbers, strings and lists as they are, enums by
// name, a degraded path as a dict.
template <typename T>
py::object field_to_py(const T& value) {
  return py::cast(value);
}
py::object field_to_py(tt::OffloadMode mode) { return py::str(std::string(tt::to_string(mode))); }
py::object field_to_py(tt::SessionState state) {
  return py::str(std::string(tt::to_string(state)));
}
py::object field_to_py(const tidal::io::DegradedPath& p) {
  py::dict x;
  x["count"] = p.count;
  x["reason"] = p.reason;
  return x;
}

// names: the fields' names as written in the source, separated by commas ("a, b, c").
template <typename... Values>
py::dict fields_dict(const std::string& names, const Values&... values) {
  std::vector<std::string> keys;
  std::string key;
  for (const char c : names + ",") {
    if (c == ',') {
      keys.push_back(key);
      key.clear();
    } else if (std::isspace(static_cast<unsigned char>(c)) == 0) {
      key += c;
    }
  }
  py::dict d;
  std::size_t i = 0;
  ((d[py::str(keys.at(i++))] = field_to_py(values)), ...);
  return d;
}

// The fields of a stats struct as a dict keyed by their names (the Python side makes a
// dataclass of it). The structured binding takes the fields by position: list every field under
// its own name, in declaration order. A field missing or extra does not compile; the order is not
// checked, so keep the list in the struct's order.
#define TIDAL_FIELDS_DICT(stats, ...)              \
  [&] {                                            \
    const auto& [__VA_ARGS__] = (stats);           \
    return fields_dict(#__VA_ARGS__, __VA_ARGS__); \
  }()

py::dict store_stats_dict(const tidal::io::StoreStats& s) {
  return TIDAL_FIELDS_DICT(s, capacity, used_bytes, file_used_bytes, bytes_written, bytes_read,
                           writes, reads, failed_requests, store_full, write_failed, read_failed,
                           read_corrupt, backend_fallback, staged_ops, busy_seconds,
                           checksum_seconds, checksum_threads, tickets, backend, buffered, tmpfile);
}

py::dict session_stats_dict(const tt::SessionStats& s) {
  return TIDAL_FIELDS_DICT(
      s, mode, state, bytes_written, bytes_read, bytes_to_host, bytes_from_host, bytes_staged,
      host_stall_seconds, planned_bytes_to_ssd, planned_bytes_to_host, planned_step_seconds,
      between_steps, stall_seconds, write_stall_seconds, misses, write_failures, store_full_writes,
      write_error, step_peak, memory_budget, untouched_bytes, profiled_peak, within_budget,
      steps_measured, steps_over_budget, steps_aborted, out_of_memory_retries, budget_reason,
      shapes, shape, replans, tightenings, retimings, planned_ahead, executed_peak, plan_summary,
      defaults, notice);
}

py::dict activation_stats_dict(const tt::ActivationStats& s) {
  return TIDAL_FIELDS_DICT(s, packed, offloaded, kept_small, kept_parameter, kept_adaptive,
                           deduplicated, forwarded, prefetched, misses, write_failures, store_full,
                           write_error, cancelled_writes, bytes_written, bytes_to_host, bytes_read,
                           stall_seconds, forward_seconds, passes, keep_from, lookahead_bytes);
}

// Binds fields of an options struct read-write under their C++ names. fields: a name and its
// member pointer, again and again, as TIDAL_FIELD writes them.
template <typename Class>
Class& def_fields(Class& cls) {
  return cls;
}
template <typename Class, typename Member, typename... Fields>
Class& def_fields(Class& cls, const char* name, Member member, Fields... fields) {
  cls.def_readwrite(name, member);
  return def_fields(cls, fields...);
}
#define TIDAL_FIELD(Struct, field) #field, &Struct::field

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

namespace {

// Where the time went (plan::TimeReport) as a dict (plan::time_report_json's fields), with
// "text": the report as the CLI prints it.
py::dict time_report_dict(const tidal::plan::TimeReport& r) {
  py::dict d = py::module_::import("json").attr("loads")(tidal::plan::time_report_json(r));
  d["text"] = tidal::plan::format_report(r);
  return d;
}

// A Python context manager around tt::HostMemoryScope (entered and left on one thread).
struct HostMemory {
  std::optional<tt::HostMemoryScope> scope;
};

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
        return TIDAL_FIELDS_DICT(meter.stats(), current_bytes, peak_bytes, allocations, frees,
                                 refusals, reclaimed_bytes, host_bytes, host_peak_bytes);
      },
      "CPU tensor memory counted by tidal's tracking allocator (installed at import of tidal).");
  m.def(
      "reset_peak_memory",
      [] {
        static tt::MemoryMeter meter(c10::Device(c10::kCPU));
        meter.reset_peak();
      },
      "Restarts the CPU peak from the bytes held now.");
  m.def("set_memory_cap", &tt::set_cpu_memory_cap, py::arg("bytes"),
        "The strict meter: CPU allocations past `bytes` raise torch.OutOfMemoryError (0: none).");
  m.def("memory_cap", &tt::cpu_memory_cap, "The strict meter's cap in bytes, or 0 for none.");
  // `with _C.host_memory():` (the thread's CPU allocations are host memory: tt::HostMemoryScope).
  py::class_<HostMemory>(m, "host_memory")
      .def(py::init<>())
      .def("__enter__", [](HostMemory& h) { h.scope.emplace(true); })
      .def("__exit__", [](HostMemory& h, const py::args&) { h.scope.reset(); });
  m.def(
      "is_host_memory",
      [](const at::Tensor& t) {
        return t.defined() && t.has_storage() &&
               tt::host_tier_storage(*t.storage().unsafeGetStorageImpl());
      },
      "True for a CPU tensor allocated inside `with host_memory():`.");

  using tidal::io::FaultPlan;
  using tidal::io::StoreOptions;
  using tt::ActivationOptions;
  using tt::SessionOptions;
  // Test hook: deterministic faults between the store and its backend (io/backend.hpp).
  def_fields(py::class_<FaultPlan>(m, "FaultPlan").def(py::init<>()),
             TIDAL_FIELD(FaultPlan, fail_op), TIDAL_FIELD(FaultPlan, fail_errno),
             TIDAL_FIELD(FaultPlan, fail_every_after), TIDAL_FIELD(FaultPlan, only_writes),
             TIDAL_FIELD(FaultPlan, only_reads), TIDAL_FIELD(FaultPlan, corrupt_read),
             TIDAL_FIELD(FaultPlan, delay_us));

  def_fields(py::class_<StoreOptions>(m, "StoreOptions").def(py::init<>()),
             TIDAL_FIELD(StoreOptions, dirs), TIDAL_FIELD(StoreOptions, capacity),
             TIDAL_FIELD(StoreOptions, stripe_unit), TIDAL_FIELD(StoreOptions, queue_depth),
             TIDAL_FIELD(StoreOptions, threads), TIDAL_FIELD(StoreOptions, checksum),
             TIDAL_FIELD(StoreOptions, buffered), TIDAL_FIELD(StoreOptions, allow_memory_fs),
             TIDAL_FIELD(StoreOptions, faults));

  def_fields(py::class_<ActivationOptions>(m, "ActivationOptions").def(py::init<>()),
             TIDAL_FIELD(ActivationOptions, min_bytes),
             TIDAL_FIELD(ActivationOptions, lookahead_bytes),
             TIDAL_FIELD(ActivationOptions, min_lookahead_bytes),
             TIDAL_FIELD(ActivationOptions, max_lookahead_bytes),
             TIDAL_FIELD(ActivationOptions, adaptive));

  py::class_<SessionOptions> session_options(m, "SessionOptions");
  session_options.def(py::init<>())
      .def_property(
          "mode", [](const SessionOptions& o) { return std::string(tt::to_string(o.mode)); },
          [](SessionOptions& o, const std::string& s) { o.mode = tt::offload_mode_from_string(s); })
      .def_property(
          "device", [](const SessionOptions& o) { return o.device.str(); },
          [](SessionOptions& o, const std::string& s) { o.device = c10::Device(s); })
      .def_property(
          "executor_min_bytes", [](const SessionOptions& o) { return o.executor.min_bytes; },
          [](SessionOptions& o, std::uint64_t b) { o.executor.min_bytes = b; })
      .def_property(
          "between_steps",
          [](const SessionOptions& o) {
            return std::string(o.between_steps == tt::BetweenSteps::kResident    ? "resident"
                               : o.between_steps == tt::BetweenSteps::kOffloaded ? "offloaded"
                                                                                 : "auto");
          },
          [](SessionOptions& o, const std::string& s) {
            TIDAL_EXPECT_AS(tidal::InvalidArgument,
                            s == "resident" || s == "offloaded" || s == "auto",
                            "between_steps is 'auto', 'resident' or 'offloaded', not '", s, "'");
            o.between_steps = s == "resident"    ? tt::BetweenSteps::kResident
                              : s == "offloaded" ? tt::BetweenSteps::kOffloaded
                                                 : tt::BetweenSteps::kAuto;
          });
  def_fields(
      session_options, TIDAL_FIELD(SessionOptions, store), TIDAL_FIELD(SessionOptions, activations),
      TIDAL_FIELD(SessionOptions, warmup_steps), TIDAL_FIELD(SessionOptions, profile_steps),
      TIDAL_FIELD(SessionOptions, retime_steps), TIDAL_FIELD(SessionOptions, memory_budget),
      TIDAL_FIELD(SessionOptions, budget_fraction), TIDAL_FIELD(SessionOptions, strict_budget),
      TIDAL_FIELD(SessionOptions, strict_meter), TIDAL_FIELD(SessionOptions, wall_by_retry),
      TIDAL_FIELD(SessionOptions, budget_option), TIDAL_FIELD(SessionOptions, between_steps_option),
      TIDAL_FIELD(SessionOptions, host_memory), TIDAL_FIELD(SessionOptions, hardware),
      TIDAL_FIELD(SessionOptions, model_name), TIDAL_FIELD(SessionOptions, batch),
      TIDAL_FIELD(SessionOptions, seq), TIDAL_FIELD(SessionOptions, timeline_steps),
      TIDAL_FIELD(SessionOptions, timeline_chosen_steps),
      TIDAL_FIELD(SessionOptions, timeline_path));

  m.def(
      "model_op_times",
      [](const std::string& trace_json, double flops, double bytes_per_s, int element_bytes) {
        tidal::trace::Trace t = tidal::trace::trace_from_json(trace_json);
        tidal::trace::Roofline r;
        r.flops = flops;
        r.bytes_per_s = bytes_per_s;
        r.element_bytes = element_bytes;
        tidal::trace::model_op_times(t, r);
        return tidal::trace::trace_to_json(t);
      },
      py::arg("trace_json"), py::arg("flops"), py::arg("bytes_per_s"), py::arg("element_bytes"),
      "The trace (JSON) with each op's time from a roofline (tidal/trace/cost_model.hpp)");

  py::class_<tt::Session, Holder<tt::Session>>(m, "Session")
      .def(py::init<tt::SessionOptions>(), py::call_guard<py::gil_scoped_release>())
      .def("begin_step", py::overload_cast<>(&tt::Session::begin_step),
           py::call_guard<py::gil_scoped_release>())
      .def("end_step", py::overload_cast<>(&tt::Session::end_step),
           py::call_guard<py::gil_scoped_release>())
      .def("abort_step", &tt::Session::abort_step, py::call_guard<py::gil_scoped_release>())
      .def(
          "preflight",
          [](tt::Session& s, std::uint64_t state_bytes) {
            const tidal::plan::Preflight p = s.preflight(state_bytes);
            return TIDAL_FIELDS_DICT(p, fits, state_bytes, device_bytes, outside_bytes, to_host,
                                     to_ssd, transfer_seconds, line);
          },
          py::arg("state_bytes"))
      .def("options", &tt::Session::options)
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
      .def("close", &tt::Session::close, py::call_guard<py::gil_scoped_release>())
      .def("hold", &tt::Session::hold, py::arg("tensor"), py::call_guard<py::gil_scoped_release>())
      .def("release", &tt::Session::release, py::arg("tensor"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const tt::Session& s) { return session_stats_dict(s.stats()); })
      .def("trace_json",
           [](const tt::Session& s) -> py::object {
             if (!s.trace()) return py::none();
             return py::str(tidal::trace::trace_to_json(*s.trace()));
           })
      .def("recorded_iterations_json",
           [](const tt::Session& s) {
             py::list out;
             for (const auto& t : s.recorded_iterations()) {
               out.append(py::str(tidal::trace::trace_to_json(t)));
             }
             return out;
           })
      .def(
          "plan_ahead",
          [](tt::Session& s, const std::string& first, const std::string& steady) {
            s.plan_ahead(tidal::trace::trace_from_json(first),
                         tidal::trace::trace_from_json(steady));
          },
          py::arg("first"), py::arg("steady"), py::call_guard<py::gil_scoped_release>())
      .def("plan_json",
           [](const tt::Session& s) -> py::object {
             if (!s.plan()) return py::none();
             return py::str(tidal::plan::plan_to_json(*s.plan()));
           })
      .def("store_stats",
           [](const tt::Session& s) -> py::object {
             if (!s.store()) return py::none();
             return store_stats_dict(s.store()->stats());
           })
      .def("write_timeline", &tt::Session::write_timeline, py::arg("path"),
           py::call_guard<py::gil_scoped_release>())
      .def("time_report", [](const tt::Session& s) { return time_report_dict(s.time_report()); });

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
