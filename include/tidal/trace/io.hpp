// Trace files: versioned JSON (docs/trace-format.md) and Chrome trace for Perfetto.
#pragma once

#include <string>

#include "tidal/trace/lifetime.hpp"
#include "tidal/trace/trace.hpp"

namespace tidal::trace {

/// Writes the trace as JSON. Throws tidal::Error when the file cannot be written.
void write_trace(const Trace& trace, const std::string& path);

/// Reads and validates a trace. Throws tidal::InvalidArgument naming the file and the problem
/// (not JSON, wrong version, missing field, dangling reference).
Trace read_trace(const std::string& path);

/// JSON text of the trace (the same as the file) and its inverse. trace_from_json validates like
/// read_trace and throws tidal::InvalidArgument naming the problem (without a file name).
std::string trace_to_json(const Trace& trace);
Trace trace_from_json(const std::string& text);

/// Writes a Chrome trace (JSON array format): one slice per op on a track per phase, and counter
/// tracks for live and active bytes. Perfetto (ui.perfetto.dev) and chrome://tracing open it.
void write_chrome_trace(const Trace& trace, const LifetimeAnalysis& lifetimes,
                        const std::string& path);

}  // namespace tidal::trace
