"""The optimizer step on the host, executed (issue 49): an ordinary PyTorch training loop (a
Hugging Face GPT-2 of a small configuration, AdamW) on the CPU under the strict meter, side by
side in one run:

  reference     the plain loop, no tidal (its optimizer runs on the CPU: the host);
  host step     tidal.Session(mode="plan", budget=B, strict=True, optimizer_step="host");
  device step   the same session with optimizer_step="device" (the state goes where the plan
                puts it: the SSD store, as the machine has no host tier by default).

B is the reference's peak (what its step held at most beyond what the process held before it)
less --budget-less copies of the parameters (default 2.5: the two moments and most of the
gradients, which the host step keeps in host memory), on top of what the process holds when the
run starts. The device step must then move state to the store to stay within B; the host step's
state lives in host memory, outside B. --fused makes both loops' AdamW fused=True (torch's
vectorized CPU kernel), the fast host Adam; without it they use torch's default (for-loop).

Printed per configuration: the median step time and its ratio to the reference, the largest
step peak against B, whether every loss and every final parameter equals the reference's
(torch.equal), the host memory the host step held, and the host Adam's throughput: parameters
per second of the optimizer's own step inside the session, per thread, beside torch's for-loop
AdamW and DeepSpeed's CPU Adam (DeepSpeedCPUAdam, adamw_mode) on the same parameter shapes in
the same run (bench/host_adam.py's loader; "not installed" when DeepSpeed is absent).

    python bench/host_step.py [--layers 4] [--width 512] [--seq 128] [--batch 4]
                              [--micro-batches 2] [--steps 8] [--precision fp32,bf16]
                              [--budget-less 2.5] [--fused] [--dir /var/tmp/tidal]
                              [--json FILE]
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_adam  # noqa: E402  (bench/host_adam.py: DeepSpeed's loader, the Adam settings)

import tidal  # noqa: E402  (before the model: the meter counts from here)


def make_model(a):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 64),
                        n_positions=a.seq, vocab_size=a.vocab, attn_pdrop=0.0,
                        embd_pdrop=0.0, resid_pdrop=0.0)
    return GPT2LMHeadModel(config)


def make_data(a):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
             for _ in range(a.micro_batches)] for _ in range(a.steps)]


def run(a, data, precision, session_options=None):
    """One training run: (losses, final parameters, step seconds, session stats, host report)."""
    model = make_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=host_adam.LR, betas=host_adam.BETAS,
                            eps=host_adam.EPS, weight_decay=host_adam.WEIGHT_DECAY,
                            **({"fused": True} if a.fused else {}))
    session = None
    if session_options is not None:
        session = tidal.Session(model=model, optimizer=opt, **session_options)
    losses, seconds, peaks = [], [], []
    held = tidal.memory_stats()["current_bytes"]
    tidal.reset_peak_memory()
    for micro_batches in data:
        t0 = time.perf_counter()
        if session is not None:
            session.begin_step()
        for ids in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach().float())
        opt.step()
        opt.zero_grad()
        if session is not None:
            session.end_step()
            peaks.append(session.stats().step_peak)
        seconds.append(time.perf_counter() - t0)
    if session is None:
        peaks.append(tidal.memory_stats()["peak_bytes"] - held)
    stats = session.stats() if session is not None else None
    host = session.host_step if session is not None else None
    report = None
    if host is not None:
        report = {"host_bytes": host.host_bytes(), "params_per_s": host.parameters_per_second()}
    params = [p.detach().clone() for p in model.parameters()]
    if session is not None:
        session.close()
    del model, opt, session
    gc.collect()
    return torch.stack(losses), params, seconds, stats, peaks, report


def adam_rates(shapes, threads: int) -> dict:
    """Parameters per second of torch's for-loop AdamW and DeepSpeed's CPU Adam on parameters
    of `shapes` (fp32, random gradients): the median of 5 steps after 2 untimed ones."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    ds_class, ds_reason = host_adam.load_deepspeed()
    n = sum(torch.Size(s).numel() for s in shapes)
    for name in ("adamw-forloop", "adamw-fused", "deepspeed"):
        if name == "deepspeed" and ds_class is None:
            out[name] = ds_reason
            continue
        params = host_adam.make_params(shapes, gen)
        opt, why = host_adam.first_step(name, params, ds_class)
        if opt is None:
            out[name] = why
            continue
        for _ in range(2):
            opt.step()
        times = [host_adam.timed(opt.step) for _ in range(5)]
        out[name] = n / statistics.median(times) / threads
        del opt, params
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--budget-less", type=float, default=2.5)
    p.add_argument("--fused", action="store_true")
    p.add_argument("--dir", default=os.environ.get("TIDAL_TEST_DIR", "/var/tmp/tidal"))
    p.add_argument("--json", default="")
    a = p.parse_args()
    threads = torch.get_num_threads()
    data = make_data(a)
    probe = make_model(a)
    shapes = [tuple(q.shape) for q in probe.parameters()]
    param_bytes = sum(q.nbytes for q in probe.parameters())
    del probe
    gc.collect()
    print(f"model: GPT-2 (transformers), {a.layers} layers x {a.width}, AdamW "
          f"{'fused' if a.fused else 'for-loop'}, "
          f"{sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters "
          f"({tidal.format_bytes(param_bytes)} fp32); {a.steps} steps of {a.micro_batches} "
          f"micro-batches of {a.batch}x{a.seq}; torch {torch.__version__}, {threads} threads")
    os.makedirs(a.dir, exist_ok=True)
    results = {"threads": threads, "param_bytes": param_bytes, "cases": []}
    for precision in a.precision.split(","):
        ref = run(a, data, precision)
        held = tidal.memory_stats()["current_bytes"]
        ref_peak = ref[4][0]
        budget = held + ref_peak - int(a.budget_less * param_bytes)
        ref_median = statistics.median(ref[2][2:])
        print(f"\n{precision}: reference step {ref_median:.3f} s, peak "
              f"{tidal.format_bytes(ref_peak)}; budget {tidal.format_bytes(budget)} (its peak "
              f"less {a.budget_less} copies of the parameters, on top of the "
              f"{tidal.format_bytes(held)} the process holds)")
        for where in ("host", "device"):
            with tempfile.TemporaryDirectory(prefix="host-step-", dir=a.dir) as d:
                try:
                    got = run(a, data, precision, dict(
                        mode="plan", dirs=[d], capacity="4GiB", budget=budget, strict=True,
                        min_bytes="64KiB", optimizer_step=where))
                except Exception as e:  # noqa: BLE001: a configuration that fails says why
                    print(f"  {where} step: failed: {type(e).__name__}: {e}")
                    results["cases"].append({"precision": precision, "step": where,
                                             "error": str(e)})
                    continue
            losses, params, seconds, stats, peaks, report = got
            same = torch.equal(losses, ref[0]) and all(
                torch.equal(x, y) for x, y in zip(params, ref[1]))
            median = statistics.median(seconds[2:])
            case = {"precision": precision, "step": where, "median_step_s": median,
                    "vs_reference": ref_median / median, "bit_identical": same,
                    "max_peak": max(peaks), "budget": budget,
                    "steps_over_budget": stats.steps_over_budget,
                    "bytes_written": stats.bytes_written}
            line = (f"  {where} step: {median:.3f} s/step ({ref_median / median:.2f}x the "
                    f"reference), peak {tidal.format_bytes(max(peaks))} of "
                    f"{tidal.format_bytes(budget)}, steps over budget "
                    f"{stats.steps_over_budget}, written to the store "
                    f"{tidal.format_bytes(stats.bytes_written)} in the last step, "
                    f"bit-identical: {'yes' if same else 'NO'}")
            if report is not None:
                case.update(report)
                line += (f", host memory {tidal.format_bytes(report['host_bytes'])}, host Adam "
                         f"{report['params_per_s'] / threads / 1e9:.2f}e9 params/s per thread")
            print(line)
            results["cases"].append(case)
            del got, losses, params
        del ref
        gc.collect()
    rates = adam_rates(shapes, threads)
    results["adam_per_thread"] = rates
    print("\nAdam on these parameter shapes, outside any session (params/s per thread):")
    for name, value in rates.items():
        print(f"  {name}: " + (f"{value / 1e9:.2f}e9" if isinstance(value, float) else value))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
