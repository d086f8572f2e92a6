"""The host CPU's Adam step, measured (issue 49): how many parameters per second (and per
thread) an AdamW step on fp32 parameters runs at on this machine, for torch's three AdamW
implementations and DeepSpeed's CPU Adam in the same run, plus the two element-wise passes a
host optimizer step also needs. Run by bench/host_adam.sh.

    python bench/host_adam.py [--params 64M] [--threads 1,2] [--steps 5] [--warmup 2]
                              [--check-params 1M] [--json FILE]

What is timed, on one set of fp32 parameters of a transformer-like mix of sizes (per layer of
width h: a 3h x h, an h x h, a 4h x h and an h x 4h matrix, and eight vectors of h to 4h
elements; then an embedding-like matrix and one vector of odd length that make the total
exactly --params), with fp32 gradients already in place:
  - adamw-forloop: torch.optim.AdamW(foreach=False), torch's default on CPU;
  - adamw-foreach: torch.optim.AdamW(foreach=True);
  - adamw-fused: torch.optim.AdamW(fused=True) (its CPU kernel exists since torch 2.4);
  - deepspeed: DeepSpeedCPUAdam(adamw_mode=True), DeepSpeed's AVX Adam of ZeRO-Offload (its op
    is JIT-built outside the timing; it runs on the OpenMP runtime torch loaded, so
    torch.set_num_threads sets its threads too);
  - accumulate: master_grad_fp32.add_(grad_bf16) per tensor (a bf16 gradient from the device
    added into the fp32 gradient buffer of the host step);
  - copy-to-bf16: w16.copy_(w32) per tensor (the updated fp32 master to its bf16 copy);
  - copy-fp32: dst.copy_(src) per tensor, fp32 to fp32: not part of a step, but the plainest
    memory-bound pass, the yardstick for the GB/s of the others.
Every optimizer is made and takes its first step (which allocates its state) before timing;
then, per thread count, --warmup untimed steps and --steps timed ones, the optimizers taking
turns step by step so that drift in the machine falls on all of them alike; the figure is the
median step (the fastest one is printed beside it: on a shared machine the spread is wide).
"GB/s" is the traffic an operation cannot avoid divided by the median time: 28 bytes per
parameter for Adam (read parameter, gradient and both moments; write parameter and both
moments), 10 per element for accumulate, 6 for the bf16 copy, 8 for the fp32 one; it says how
close an operation runs to the machine's memory bandwidth. (The copies write memory they did
not read, which the CPU reads first unless it streams the stores, so they move more bytes than
counted; the in-place Adam and accumulate do not.) Also printed: a whole host step per
parameter, accumulate + the fastest torch AdamW + copy-to-bf16, from their medians.

The arithmetic check: on a smaller set (--check-params, with awkward sizes such as 1, 7, 1025
and 4097 elements), every optimizer starts from the same parameters and takes three steps, all
given the same random gradients; each torch variant is compared with the for-loop AdamW by
torch.equal on parameters and every state tensor, DeepSpeed's result by its largest absolute
difference (its arithmetic differs from torch's: fused multiply-adds and a different order, so
not bit-equal by design).
"""

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

# One set of hyperparameters for every optimizer (AdamW's usual values, weight decay on, so that
# the decoupled decay is part of the step and of the arithmetic check).
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01

# Bytes an operation must move per element (see the module's docstring).
ADAM_BYTES = 28
ACCUMULATE_BYTES = 10
COPY_BYTES = 6
COPY_FP32_BYTES = 8

TORCH_VARIANTS = {
    "adamw-forloop": dict(foreach=False),
    "adamw-foreach": dict(foreach=True),
    "adamw-fused": dict(fused=True),
}
NOT_INSTALLED = "not installed: bench/vs_deepspeed.sh installs it"


def parse_count(text: str) -> int:
    """'64M' -> 64 * 2**20, '1000000' -> 1000000 (K, M, G are powers of 1024 here)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count such as 64M or 1000000")
    n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if n <= 0:
        raise argparse.ArgumentTypeError("the count must be positive")
    return n


def parse_threads(text: str) -> list:
    try:
        ts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of thread counts such as 1,2")
    if not ts or min(ts) < 1:
        raise argparse.ArgumentTypeError("thread counts must be positive integers")
    return sorted(set(ts))


def layer_shapes(total: int) -> list:
    """Shapes of a transformer-like set of exactly `total` parameters (see the docstring)."""
    h = 768
    while h > 64 and 12 * h * h > total:
        h //= 2
    per_layer = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h),
                 (3 * h,), (h,), (4 * h,), (h,), (h,), (h,), (h,), (h,)]
    layer_numel = sum(math.prod(s) for s in per_layer)
    shapes = per_layer * (total // layer_numel)
    rest = total - layer_numel * (total // layer_numel)
    if rest >= h:
        shapes.append((rest // h, h))
    if rest % h:
        shapes.append((rest % h,))
    return shapes


def check_shapes(total: int) -> list:
    """A smaller mix for the arithmetic check, with sizes that leave vector tails."""
    odd = [(1,), (7,), (17,), (1025,), (4097,), (513, 3), (33, 31)]
    return odd + layer_shapes(max(total - sum(math.prod(s) for s in odd), 1))


def make_params(shapes, gen):
    """fp32 parameters with fp32 gradients, drawn from `gen`."""
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
        p.grad = torch.randn(s, generator=gen) * 1e-3
        params.append(p)
    return params


def clone_params(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def unavailable(e: Exception) -> str:
    """The reason an optimizer cannot run, in one line."""
    lines = str(e).strip().splitlines()
    return f"not available: {type(e).__name__}{': ' + lines[0] if lines else ''}"


def load_deepspeed():
    """(DeepSpeedCPUAdam class, None) or (None, why not). Builds (or loads the cached build of)
    its CPU Adam op, so that no timing includes the JIT build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return None, NOT_INSTALLED
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        print("loading DeepSpeed's CPU Adam op (JIT-built the first time, about a minute)",
              file=sys.stderr, flush=True)
        CPUAdamBuilder().load()
    except Exception as e:  # the build's failure comes as many exception types
        return None, unavailable(e)
    return DeepSpeedCPUAdam, None


def make_optimizer(name, params, ds_class):
    if name == "deepspeed":
        return ds_class(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                        bias_correction=True, adamw_mode=True)
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                             **TORCH_VARIANTS[name])


def first_step(name, params, ds_class):
    """The optimizer after its first step (state allocated), or the reason it cannot run."""
    try:
        opt = make_optimizer(name, params, ds_class)
        opt.step()
    except Exception as e:
        return None, unavailable(e)
    return opt, None


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_rounds(ops: dict, warmup: int, steps: int) -> dict:
    """Each op in turn, warmup untimed rounds then `steps` timed ones: op name -> seconds list."""
    for _ in range(warmup):
        for fn in ops.values():
            fn()
    times = {name: [] for name in ops}
    for _ in range(steps):
        for name, fn in ops.items():
            times[name].append(timed(fn))
    return times


def accumulate_op(master, grads16):
    def fn():
        for m, g in zip(master, grads16):
            m.add_(g)
    return fn


def copy_op(w16, w32):
    def fn():
        for d, s in zip(w16, w32):
            d.copy_(s)
    return fn


def measure(a, ds_class, ds_reason):
    """The timed rows, one per (operation, thread count)."""
    gen = torch.Generator().manual_seed(a.seed)
    shapes = layer_shapes(a.params)
    base = make_params(shapes, gen)
    n = sum(p.numel() for p in base)
    assert n == a.params, (n, a.params)
    sizes = [math.prod(s) for s in shapes]
    print(f"{n:,} parameters in {len(shapes)} tensors (largest {max(sizes):,}, smallest "
          f"{min(sizes):,})", file=sys.stderr, flush=True)

    unavailable = {}
    optimizers = {}
    names = list(TORCH_VARIANTS) + ["deepspeed"]
    for name in names:
        if name == "deepspeed" and ds_class is None:
            unavailable[name] = ds_reason
            continue
        # The for-loop variant steps `base` itself; the others a copy each.
        params = base if name == "adamw-forloop" else clone_params(base)
        opt, why = first_step(name, params, ds_class)
        if opt is None:
            unavailable[name] = why
        else:
            optimizers[name] = opt

    master = [torch.zeros_like(p) for p in base]
    grads16 = [p.grad.to(torch.bfloat16) for p in base]
    w16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in base]
    ops = {name: opt.step for name, opt in optimizers.items()}
    ops["accumulate"] = accumulate_op(master, grads16)
    ops["copy-to-bf16"] = copy_op(w16, [p.detach() for p in base])
    ops["copy-fp32"] = copy_op(master, [p.detach() for p in base])
    bytes_per = {name: ADAM_BYTES for name in names}
    bytes_per.update({"accumulate": ACCUMULATE_BYTES, "copy-to-bf16": COPY_BYTES,
                      "copy-fp32": COPY_FP32_BYTES})

    rows = []
    for t in a.threads:
        torch.set_num_threads(t)
        print(f"{t} thread(s): {a.warmup} warm-up and {a.steps} timed rounds", file=sys.stderr,
              flush=True)
        times = run_rounds(ops, a.warmup, a.steps)
        for name in names + ["accumulate", "copy-to-bf16", "copy-fp32"]:
            row = {"operation": name, "threads": t}
            if name in unavailable:
                row["unavailable"] = unavailable[name]
            else:
                med = statistics.median(times[name])
                row.update(seconds=times[name], median_seconds=med,
                           min_seconds=min(times[name]), elements_per_s=n / med,
                           elements_per_s_per_thread=n / med / t,
                           gb_per_s=n * bytes_per[name] / med / 1e9)
            rows.append(row)
        ds = next((r for r in rows if r["operation"] == "deepspeed" and r["threads"] == t
                   and "elements_per_s" in r), None)
        for r in rows:
            if r["threads"] == t and ds and "elements_per_s" in r and r["operation"] in names:
                r["vs_deepspeed"] = r["elements_per_s"] / ds["elements_per_s"]
    return n, len(shapes), rows


def check(a, ds_class, ds_reason):
    """Three steps of every optimizer from the same start with the same gradients; compared
    with the for-loop AdamW (see the docstring)."""
    gen = torch.Generator().manual_seed(a.seed + 1)
    shapes = check_shapes(a.check_params)
    start = make_params(shapes, gen)
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(3)]

    results = {}
    reasons = {}
    for name in list(TORCH_VARIANTS) + ["deepspeed"]:
        if name == "deepspeed" and ds_class is None:
            reasons[name] = ds_reason
            continue
        params = clone_params(start)
        try:
            opt = make_optimizer(name, params, ds_class)
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
                opt.step()
        except Exception as e:
            reasons[name] = unavailable(e)
            continue
        results[name] = (params, [opt.state[p] for p in params])

    out = {"elements": sum(math.prod(s) for s in shapes), "tensors": len(shapes), "steps": 3,
           "threads": torch.get_num_threads(), "variants": {}}
    ref = results.get("adamw-forloop")
    for name in list(TORCH_VARIANTS) + ["deepspeed"]:
        if name in reasons:
            out["variants"][name] = {"unavailable": reasons[name]}
            continue
        params, states = results[name]
        entry = {}
        if ref is None:
            entry["unavailable"] = "no reference: the for-loop AdamW did not run"
        else:
            rparams, rstates = ref
            keys = ("exp_avg", "exp_avg_sq")
            if name != "deepspeed":
                same = all(torch.equal(p, q) for p, q in zip(params, rparams))
                for s, rs in zip(states, rstates):
                    for k, v in rs.items():
                        same = same and torch.equal(torch.as_tensor(s[k], dtype=v.dtype), v)
                entry["bit_identical"] = same

            def maxdiff(xs, ys):
                return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(xs, ys))

            entry["max_abs_diff_params"] = maxdiff(params, rparams)
            for k in keys:
                entry[f"max_abs_diff_{k}"] = maxdiff([s[k] for s in states],
                                                     [s[k] for s in rstates])
            # The size of what is compared, so a difference can be read relative to it.
            entry["max_abs_update"] = maxdiff(rparams, start)
        out["variants"][name] = entry
    return out


def machine_info():
    model = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    config = torch.__config__.show()
    parallel = torch.__config__.parallel_info()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", config)
    backend = re.search(r"ATen parallel backend: (.+)", parallel)
    omp = re.search(r"OpenMP (\d+)", parallel)
    one_line = (f"CPU capability {torch.backends.cpu.get_cpu_capability()}; "
                f"BLAS {blas.group(1) if blas else 'unknown'}; "
                f"parallel backend {backend.group(1).strip() if backend else 'unknown'}"
                f"{f' (OpenMP {omp.group(1)})' if omp else ''}")
    info = {"cpu_model": model, "cores_online": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "torch_config": one_line, "python": platform.python_version(),
            "kernel": platform.release()}
    try:
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        info["deepspeed"] = None
    try:
        info["date"] = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    except OSError:
        info["date"] = time.strftime("%c")
    return info


def print_report(a, n, ntensors, rows, chk, info, host_step):
    print(f"host Adam: {n:,} fp32 parameters in {ntensors} tensors, median of {a.steps} steps "
          f"after {a.warmup} warm-up; {info['cpu_model']}, {info['cores_usable']} usable cores; "
          f"torch {info['torch']} ({info['torch_config']}); "
          f"DeepSpeed {info['deepspeed'] or 'not installed'}")
    print()
    print("| operation | threads | median ms | best ms | 1e6 elem/s | 1e6 elem/s per thread "
          "| GB/s | vs DeepSpeed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "unavailable" in r:
            print(f"| {r['operation']} | {r['threads']} | {r['unavailable']} | | | | | |")
            continue
        vs = f"{r['vs_deepspeed']:.2f}x" if "vs_deepspeed" in r else "-"
        print(f"| {r['operation']} | {r['threads']} | {r['median_seconds'] * 1e3:.1f} "
              f"| {r['min_seconds'] * 1e3:.1f} | {r['elements_per_s'] / 1e6:.0f} "
              f"| {r['elements_per_s_per_thread'] / 1e6:.0f} | {r['gb_per_s']:.1f} | {vs} |")
    print()
    print("elements = parameters for the optimizers; elem/s, GB/s and ratios from the median; "
          "GB/s = unavoidable traffic (28 B/parameter "
          "for Adam, 10 B for accumulate, 6 B for copy-to-bf16, 8 B for copy-fp32) / median "
          "time; vs DeepSpeed = elements/s over DeepSpeedCPUAdam's at the same thread count, "
          "same run")
    if host_step:
        print()
        print("a whole host step (accumulate + the fastest torch AdamW + copy-to-bf16):")
        for h in host_step:
            print(f"  {h['threads']} thread(s): {h['adam']}: {h['elements_per_s'] / 1e6:.0f}e6 "
                  f"parameters/s ({h['elements_per_s_per_thread'] / 1e6:.0f}e6 per thread)")
    print()
    print(f"arithmetic: {chk['elements']:,} parameters in {chk['tensors']} tensors, "
          f"{chk['steps']} steps from the same start with the same gradients, "
          f"{chk['threads']} thread(s), against adamw-forloop")
    print()
    print("| variant | bit-identical | max abs diff params | exp_avg | exp_avg_sq |")
    print("|---|---|---:|---:|---:|")
    for name, e in chk["variants"].items():
        if "unavailable" in e:
            print(f"| {name} | {e['unavailable']} | | | |")
            continue
        same = {True: "yes", False: "NO"}.get(e.get("bit_identical"), "not expected")
        print(f"| {name} | {same} | {e['max_abs_diff_params']:.3g} "
              f"| {e['max_abs_diff_exp_avg']:.3g} | {e['max_abs_diff_exp_avg_sq']:.3g} |")
    upd = next((e["max_abs_update"] for e in chk["variants"].values() if "max_abs_update" in e),
               None)
    if upd is not None:
        print(f"(the largest change of a parameter over the {chk['steps']} steps: {upd:.3g})")


def host_steps(rows, threads):
    """accumulate + the fastest torch AdamW + copy-to-bf16, as one rate per thread count."""
    out = []
    for t in threads:
        at = {r["operation"]: r for r in rows if r["threads"] == t and "median_seconds" in r}
        adams = [r for name, r in at.items() if name in TORCH_VARIANTS]
        if not adams or "accumulate" not in at or "copy-to-bf16" not in at:
            continue
        best = min(adams, key=lambda r: r["median_seconds"])
        seconds = (best["median_seconds"] + at["accumulate"]["median_seconds"]
                   + at["copy-to-bf16"]["median_seconds"])
        n = best["elements_per_s"] * best["median_seconds"]
        out.append({"threads": t, "adam": best["operation"], "seconds": seconds,
                    "elements_per_s": n / seconds, "elements_per_s_per_thread": n / seconds / t})
    return out


def main():
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_count, default=64 << 20,
                   help="parameters stepped (default 64M = 64 * 2**20)")
    p.add_argument("--threads", type=parse_threads, default=parse_threads(f"1,{cores}"),
                   help=f"comma-separated thread counts (default 1,{cores}: one and all cores)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per thread count")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per thread count")
    p.add_argument("--check-params", type=parse_count, default=1 << 20,
                   help="parameters of the arithmetic check (default 1M)")
    p.add_argument("--seed", type=int, default=49)
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")

    info = machine_info()
    ds_class, ds_reason = load_deepspeed()
    n, ntensors, rows = measure(a, ds_class, ds_reason)
    torch.set_num_threads(max(a.threads))
    chk = check(a, ds_class, ds_reason)
    host_step = host_steps(rows, a.threads)
    print_report(a, n, ntensors, rows, chk, info, host_step)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"machine": info,
                       "config": {"params": n, "tensors": ntensors, "threads": a.threads,
                                  "steps": a.steps, "warmup": a.warmup,
                                  "check_params": a.check_params, "seed": a.seed,
                                  "lr": LR, "betas": BETAS, "eps": EPS,
                                  "weight_decay": WEIGHT_DECAY},
                       "rows": rows, "host_step": host_step, "check": chk}, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
