"""Before a run: does a model train on a machine, and how fast.

`tidal.estimate(model, batch, seq, budget=...)` answers with the engine of `tidal estimate`:
tidal's plan of the model's analytic trace, simulated on the machine described (device memory,
host memory, SSDs), against the ideal step and the lower bound of plans of its kind. Nothing is
allocated: a model built on the meta device (`with torch.device("meta"): ...`) is enough, or
only its config.

What it reads: a Hugging Face decoder (a model with `.config`, a `PretrainedConfig`, the dict of
a `config.json` or its path: llama, mistral, qwen2, mixtral, qwen2_moe, gpt2), or the name of one
of tidal's built-in shapes (`"llama3-8b"`; `tidal estimate --help` lists them). Any other
module is refused with what to do instead: its trace comes from profiling a step (a Session
profiles its first steps), not from its code yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from . import _C
from .__main__ import cli_path

_OPTIMIZERS = ("AdamW", "Adam")


@dataclass
class Estimate:
    """What `tidal.estimate` found. Bytes are per device; seconds per optimizer step."""

    model: str
    parameters: int
    precision: str
    batch: int
    seq: int
    micro_batches: int
    micro_batch_order: str
    hardware: str
    device_memory: int
    fits: bool
    planned_peak_bytes: int
    step_seconds: float
    ideal_seconds: float
    fraction_of_ideal: float
    lower_bound_seconds: Optional[float]  # None: no plan of this kind fits at all
    optimizer_step: str
    host_bytes_written: int
    host_bytes_read: int
    ssd_bytes_written: int
    ssd_bytes_read: int
    host_memory_needed: int
    ssd_space_needed: int
    note: str
    estimate_seconds: float

    def session_options(self) -> dict:
        """Keyword arguments for `tidal.Session` that run this plan's setting."""
        return {"budget": self.device_memory, "host_memory": self.host_memory_needed,
                "optimizer_step": self.optimizer_step}

    def __str__(self) -> str:
        b = _C.format_bytes
        shape = f"batch {self.batch} x {self.seq}" if self.batch else "its traced step"
        head = (f"{self.model}: {self.parameters / 1e9:.2f}B parameters, {self.precision}, "
                f"{shape}")
        if not self.fits:
            return f"{head}: does not fit in {b(self.device_memory)} ({self.note})"
        return (f"{head}: fits, planned peak {b(self.planned_peak_bytes)} of "
                f"{b(self.device_memory)}, step {self.step_seconds:.3f} s "
                f"({self.fraction_of_ideal:.1%} of ideal), host memory "
                f"{b(self.host_memory_needed)}, SSD space {b(self.ssd_space_needed)}, "
                f"optimizer step on the {self.optimizer_step}")


def _bytes_flag(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _C.InvalidArgument(f"a size is bytes (an int >= 0) or text such as '80GiB', not "
                                 f"{value!r}")
    return f"{value}B"


def _config_dict(model: Any) -> Optional[dict]:
    """The config.json content of a Hugging Face model or config, a dict or a path; None for a
    built-in model's name."""
    if isinstance(model, dict):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not path.endswith(".json") and not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise _C.InvalidArgument(f"tidal.estimate: cannot read {path} as a config.json: "
                                     f"{e}") from e
    config = getattr(model, "config", model)
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return config.to_dict()
    raise _C.InvalidArgument(
        f"tidal.estimate reads a Hugging Face decoder (a model with .config, its config, or a "
        f"config.json) or a built-in model's name, not a {type(model).__name__}: for another "
        f"module, run its first steps under tidal.Session (it profiles them and plans), or "
        f"save a profiled trace (tidal profile) and plan it with tidal simulate --trace")


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is None:
        return
    name = optimizer if isinstance(optimizer, str) else (
        optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__)
    if name.lower() not in {o.lower() for o in _OPTIMIZERS}:
        raise _C.InvalidArgument(
            f"tidal.estimate models Adam's state (two moments per parameter: AdamW or Adam), "
            f"not {name}: another optimizer's state is not modelled yet")


def _run(args: list) -> Estimate:
    try:
        cli = cli_path()
    except SystemExit as e:  # not found: the same message, as this module's error
        raise _C.Error(str(e)) from None
    proc = subprocess.run([cli, "estimate", *args, "--json"], capture_output=True,
                          text=True, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        message = proc.stderr.strip().splitlines()
        raise _C.InvalidArgument(message[-1].removeprefix("tidal: error: ") if message else
                                 f"tidal estimate exited with status {proc.returncode}")
    j = json.loads(lines[-1])
    known = {f.name for f in fields(Estimate)}
    return Estimate(**{k: v for k, v in j.items() if k in known})


def _module_trace(model: Any, optimizer: Any, step: Callable, directory: str) -> dict:
    """The steady step's trace of `step(model, optimizer)` on fake tensors, with the meta
    `tidal estimate --trace` reads. `model`: a module (copied onto fake tensors) or a function
    that builds one (built under FakeTensorMode: nothing is allocated); `optimizer`: an
    optimizer of `model`, a class or a function of the parameters (default AdamW)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from . import fake_trace
    mode = None
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise _C.InvalidArgument(f"tidal.estimate(step=...) takes a module or a function "
                                     f"that builds one, not a {type(model).__name__}")
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = model()
    if optimizer is None or isinstance(optimizer, type) or (
            callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)):
        make = optimizer or torch.optim.AdamW
        with (mode if mode is not None else contextlib.nullcontext()):
            optimizer = make(model.parameters())
    elif mode is not None:
        raise _C.InvalidArgument("with a function that builds the model, give the optimizer "
                                 "as a class or a function of the parameters")
    # The step boundary offloaded: the plan may keep the state away between steps, as an
    # analytic trace's plan does (no step-end op holding every tensor in memory).
    kwargs = dict(mode="plan", dirs=[directory], budget=1 << 50, warmup_steps=0,
                  profile_steps=3, retime_steps=0, strict=False, host_memory=0,
                  timeline_steps=0, capacity="64MiB", checksum=False,
                  between_steps="offloaded")
    steady = fake_trace.trace_step(model, optimizer, step, kwargs, fake_mode=mode)[1]
    params = {id(p): p for p in model.parameters()}.values()
    dtypes = {p.dtype for p in params}
    steady["meta"]["parameters"] = str(sum(p.numel() for p in params))
    steady["meta"]["precision"] = "fp32" if dtypes <= {torch.float32} else "bf16"
    steady["model"] = type(model).__name__
    return steady


def estimate(model: Any, batch: Optional[int] = None, seq: Optional[int] = None, *,
             budget: Any, host_memory: Any = 0, ssd: Optional[str] = None,
             optimizer: Any = None, micro_batches: int = 1,
             micro_batch_order: str = "sequential", optimizer_step: str = "auto",
             precision: Optional[str] = None, hardware: str = "h100-4ssd",
             step: Optional[Callable] = None, **overrides: Any) -> Estimate:
    """Whether `model` trains at `batch` x `seq` tokens on a device with `budget` bytes of
    memory (an int, or text such as "80GiB"), `host_memory` of host RAM for offloaded tensors,
    and the SSDs `ssd` ("4x6.5/6.7GB/s": count x write/read), and how fast. The other figures of
    the machine come from `hardware` (a preset: h100-4ssd, a100-2ssd, cpu-here) and keyword
    overrides named as `tidal estimate`'s flags (host_link="55GB/s", gpu_flops_bf16="835T",
    cpu_adam="2G", ...). `optimizer`: None, or Adam/AdamW (a class, an instance or its name).

    Any other module: give `step`, a function `step(model, optimizer)` that runs one training
    step (forward, backward, optimizer step) with the batch it closes over; `model` is the
    module or a function that builds it (built on fake tensors: nothing is allocated, so a model
    larger than the machine is fine), `optimizer` an optimizer, a class or a function of the
    parameters (default AdamW). The step is traced on fake tensors (tidal.fake_trace), its op
    times come from the device's roofline, and the optimizer step is planned on the device.

    Returns an Estimate; one with `fits` False where no plan fits (a bad config or option raises
    tidal.InvalidArgument with the reason)."""
    common = ["--gpu-mem", _bytes_flag(budget), "--host-mem", _bytes_flag(host_memory),
              "--hardware", hardware]
    if ssd is not None:
        common += ["--ssd", ssd]
    for key, value in overrides.items():
        common += ["--" + key.replace("_", "-"), str(value)]
    if step is not None:
        with tempfile.TemporaryDirectory(prefix="tidal-estimate-") as d:
            trace = _module_trace(model, optimizer, step, d)
            path = os.path.join(d, "trace.json")
            with open(path, "x", encoding="utf-8") as f:
                json.dump(trace, f)
            return _run(["--trace", path, *common, "--optimizer-step", "device"])
    if batch is None or seq is None:
        raise _C.InvalidArgument("tidal.estimate needs batch and seq for a Hugging Face config "
                                 "or a built-in model (or step=... for any module)")
    _check_optimizer(optimizer)
    args = ["--batch", str(int(batch)), "--seq", str(int(seq)), *common,
            "--micro-batches", str(int(micro_batches)), "--optimizer-step", optimizer_step]
    if micro_batches > 1:
        args += ["--micro-batch-order", micro_batch_order]
    if precision is not None:
        args += ["--precision", precision]
    config = _config_dict(model)
    if config is None:
        return _run(["--model", os.fspath(model), *args])
    with tempfile.TemporaryDirectory(prefix="tidal-estimate-") as d:
        path = os.path.join(d, "config.json")
        with open(path, "x", encoding="utf-8") as f:
            json.dump(config, f)
        return _run(["--hf-config", path, *args])
