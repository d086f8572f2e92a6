"""Training against DeepSpeed's ZeRO-Infinity, measured: the Python example's GPT
(examples/python/gpt.py) with AdamW, trained by DeepSpeed ZeRO-3 with its parameters and its
optimizer state offloaded to NVMe (CPU accelerator, gloo, world size 1) and by tidal's plan mode
under the strict meter, with the same model, batches, seed and memory budget, in alternating
rounds, each side in its own process. Run by bench/vs_deepspeed_train.sh.

    python bench/vs_deepspeed_train.py --dir /var/tmp/x [--rounds 3] [--steps 20] [--budget B]
    python bench/vs_deepspeed_train.py --side deepspeed|tidal|none --dir D --json OUT ...

What each figure is, per side (every one measured in the run that prints it):
  - peak: tidal's memory meter (importing tidal installs a tracking CPU allocator: the bytes of
    live CPU tensors allocated through PyTorch), the highest step peak over the timed steps, and
    the highest over the whole run (model construction and DeepSpeed's set-up included). The
    same meter on both sides: DeepSpeed's swap buffers are ordinary tensors here (pin_memory
    false); memory DeepSpeed's C++ ops allocate outside PyTorch is not in it, so the process's
    peak resident set (VmHWM) is printed beside it for both.
  - s/step: the median over the timed steps (after --skip steps: tidal's warm-up, two profiled
    steps and its first planned step; DeepSpeed's first step records its trace).
  - SSD bytes/step: /proc/self/io read_bytes and write_bytes deltas over each step (bytes this
    process made the block layer read or write: O_DIRECT I/O of libaio and io_uring included,
    page-cache hits not), the median over the timed steps; for tidal also its store's own
    counters (session stats).
  - losses of every step, side by side (DeepSpeed's CPU Adam and torch's AdamW differ in
    arithmetic, so not bit-equal).
The budget: --budget bytes (default: the DeepSpeed side's timed peak of round 1, so that tidal
runs in no more memory than DeepSpeed used). tidal runs Session(strict=True) at that budget:
an allocation past it is refused as on a GPU. DeepSpeed has no such knob: its peak is what its
configuration gives; --ds-cap runs it under the same wall (tidal.memory_cap) to show whether it
fits. --ds-pipeline also runs DeepSpeed with pipeline_write on (its optimizer swapper then
overlaps a sub-group's swap-out with the next one's swap-in and Adam) each round. --also-budget B runs tidal a second time each round at B (bytes, or N% of the plain run's
peak), lower than DeepSpeed's configuration reaches ("tidal-low" in the table).
Also printed: each side's forward / backward / optimizer-step seconds (DeepSpeed's step includes
its NVMe swaps of the optimizer state; tidal's includes end_step), used to calibrate the
simulator's ZeRO-Infinity model (docs/simulator.md); --save-trace FILE writes the first tidal
run's profiled trace for `tidal simulate --trace FILE`.
--ds-offload cpu runs DeepSpeed's ZeRO-Offload instead (ZeRO-3 with parameters and optimizer
state in CPU memory, offload_param and offload_optimizer device cpu: the configuration the
simulator's zero-offload policy models), to calibrate that model the same way. On the CPU
accelerator "device" and host memory are one memory, so its SSD bytes are 0 and its optimizer
step is CPU Adam plus DeepSpeed's gradient and parameter copies within that memory.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def proc_io():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines() if line)
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def ds_config(a, nvme):
    """ZeRO-3 with parameters and optimizer state on NVMe (ZeRO-Infinity), fp32 as tidal's side;
    with --ds-offload cpu, both in CPU memory instead (ZeRO-Offload as the simulator's
    zero-offload policy models it). Each setting here is one the run needs on this machine;
    docs/results.md says why."""
    config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            # Every parameter of at least min_aio_bytes (max(1 MiB, aio block_size)) goes to the
            # NVMe files; smaller ones (biases, norms, the embeddings here) stay in CPU memory.
            # max_in_cpu 0: none is kept in CPU memory by choice. buffer_size: elements of the
            # largest parameter (4d x d); buffer_count: swap-in buffers.
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                              "buffer_count": a.ds_buffers, "buffer_size": 4 * a.d * a.d,
                              "max_in_cpu": 0},
            # pipeline_read/pipeline_write off (DeepSpeed's default): each sub-group's swap-in,
            # CPU Adam and swap-out run one after the other. --ds-pipeline: pipeline_write on
            # (a sub-group's swap-out overlaps the next one's swap-in and Adam), which needs 8
            # buffers here ("ran out of swap buffers" with 4). pipeline_read fails with 0.19.8
            # here: AssertionError at pipelined_optimizer_swapper.py:138 (assert
            # self.swap_ops[SYNC_SWAP_IN] is not None) with 4 buffers, "ran out of swap
            # buffers" with 8 and pipeline_write on too.
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                  "buffer_count": 8 if a.ds_pipeline else 4,
                                  "pipeline_read": False, "pipeline_write": a.ds_pipeline},
            "sub_group_size": a.ds_sub_group,
            "stage3_param_persistence_threshold": 0,
            # With the default reuse distance (1e9) parameters fetched in forward stay in their
            # swap buffers for backward, and the second step fails with "Not enough buffers 0
            # for swapping 1" (ZeRO-3 keeps what it will reuse; NVMe has only buffer_count).
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 4 * 4 * a.d * a.d,
            "stage3_prefetch_bucket_size": 2 * 4 * a.d * a.d,
            # Gradients are reduced through a flat buffer of this many elements, allocated once
            # (default 5e8: 2 GB of fp32 counted by the meter, though mostly never touched).
            "reduce_bucket_size": 4 * a.d * a.d,
        },
        "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 1 << 30,
    }
    return as_zero_offload(config) if a.ds_offload == "cpu" else config


def as_zero_offload(config):
    """ZeRO-Offload as the simulator's zero-offload policy models it (src/plan/policies/zero.cpp,
    docs/simulator.md): ZeRO-3 with offload_param and offload_optimizer both device cpu, so the
    fp32 master parameters, Adam moments and gradients live in CPU memory and DeepSpeed's CPU
    Adam steps them after backward. The ZeRO-3 knobs are the NVMe run's, so the two runs differ
    only in where the offloaded tensors go: parameters released after each use (reuse distance
    0) and fetched again, gradients reduced through one matrix-sized bucket. pin_memory false:
    pinned buffers would be allocated outside the meter."""
    zero = config["zero_optimization"]
    zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    del config["aio"]
    return config


def time_inner_optimizer(engine):
    """Times the optimizer ZeRO-3 wraps (DeepSpeed's CPU Adam): its step is replaced on the
    instance by one that calls it and adds up the seconds it took. Returns a function that gives
    the seconds since its last call (None when the engine wraps no optimizer)."""
    inner = getattr(engine.optimizer, "optimizer", None)
    if inner is None:
        return None
    total = [0.0]
    step = inner.step

    def timed_step(*args, **kwargs):
        t = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t

    def take():
        seconds, total[0] = total[0], 0.0
        return seconds

    inner.step = timed_step
    return take


def run_side(a):
    """One side in this process; writes its figures to a.json."""
    import torch

    import tidal  # before the model: the meter counts every tensor from here

    sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
    from gpt import GPT, CharCorpus

    torch.manual_seed(a.seed)
    corpus = CharCorpus(a.text)
    g = torch.Generator().manual_seed(a.seed + 1)
    out = {"side": a.side, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "steps": []}
    rss0 = vm_hwm()
    store = tempfile.mkdtemp(prefix=f"vsds-{a.side}-", dir=a.dir)
    session = engine = None
    adam_seconds = None
    try:
        if a.side == "deepspeed":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0",
                             WORLD_SIZE="1", LOCAL_RANK="0").items():
                os.environ.setdefault(k, v)
            import deepspeed

            out["deepspeed"] = deepspeed.__version__
            deepspeed.init_distributed(dist_backend="gloo")
            cfg = ds_config(a, store)
            out["ds_config"] = cfg
            # Built under zero.Init with the config: its parameter swapper then takes the
            # config's dtype (fp32). Built outside, deepspeed.initialize converts the model with
            # Init(dtype=fp32), and Init._set_dtype's `dtype or torch.float16 if
            # is_fp16_supported() else torch.bfloat16 ...` gives bfloat16 on the CPU accelerator:
            # the swapper then sizes fp32 partitions as 2-byte elements (and with 1 MiB blocks
            # no parameter of this model reaches min_aio_bytes: nothing went to NVMe).
            # Seeded again here: DeepSpeed's set-up above can draw from torch's generator (it
            # did with offload to cpu: step 0's loss differed from the plain run's), and each
            # side must start from the same weights.
            torch.manual_seed(a.seed)
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = GPT(corpus.vocab, a.layers, a.d, a.heads, a.block)
            engine, _, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=cfg)
            out["parameters"] = sum(p.ds_numel for p in engine.module.parameters())
            swapped = [p for p in engine.module.parameters()
                       if getattr(p.ds_tensor, "final_location", None) == "nvme"]
            out["parameters_on_nvme"] = sum(p.ds_numel for p in swapped)
            out["ds_offload"] = a.ds_offload
            adam_seconds = time_inner_optimizer(engine)
        else:
            model = GPT(corpus.vocab, a.layers, a.d, a.heads, a.block)
            opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
            out["parameters"] = sum(p.numel() for p in model.parameters())
            if a.side == "tidal":
                session = tidal.Session(mode="plan", dirs=[store], budget=a.budget, strict=True,
                                        capacity=a.capacity, model=model, optimizer=opt,
                                        name="gpt")
        cap = tidal.memory_cap(a.budget) if a.side == "deepspeed" and a.ds_cap else None
        if cap:
            cap.__enter__()
        refused = ""
        for step in range(a.steps):
            x, y = corpus.batch(g, a.batch, a.block)
            tidal.reset_peak_memory()
            io0 = proc_io()
            t0 = time.perf_counter()
            marks = []
            try:
                if engine is not None:
                    loss = engine(x, y)
                    marks.append(time.perf_counter())
                    engine.backward(loss)
                    marks.append(time.perf_counter())
                    engine.step()
                else:
                    if session:
                        session.begin_step()
                    opt.zero_grad(set_to_none=False)
                    loss = model(x, y)
                    marks.append(time.perf_counter())
                    loss.backward()
                    marks.append(time.perf_counter())
                    opt.step()
                    if session:
                        session.end_step()
            except torch.OutOfMemoryError as e:
                refused = str(e).split("\n")[0]
                break
            seconds = time.perf_counter() - t0
            io1 = proc_io()
            row = {"loss": loss.item(), "seconds": seconds,
                   "peak": tidal.memory_stats()["peak_bytes"],
                   "read_bytes": io1[0] - io0[0], "write_bytes": io1[1] - io0[1],
                   # forward (with tidal's begin_step), backward, optimizer step (with
                   # DeepSpeed's swaps of the step, or tidal's end_step)
                   "phases": [marks[0] - t0, marks[1] - marks[0], t0 + seconds - marks[1]]}
            if adam_seconds:
                # the optimizer step's own Adam (DeepSpeed's CPU Adam over every sub-group)
                row["adam"] = adam_seconds()
            if session:
                s = session.stats()
                row.update(step_peak=s.step_peak, store_read=s.bytes_read,
                           store_written=s.bytes_written, stall=s.stall_seconds,
                           write_stall=s.write_stall_seconds, state=s.state,
                           planned_seconds=s.planned_step_seconds)
                row["peak"] = max(row["peak"], s.step_peak)
            out["steps"].append(row)
            print(f"{a.side} step {step:2d} loss {row['loss']:.4f} {seconds:6.2f} s peak "
                  f"{row['peak'] / 2**20:7.1f} MiB read {row['read_bytes'] / 2**20:7.1f} MiB "
                  f"write {row['write_bytes'] / 2**20:7.1f} MiB", file=sys.stderr, flush=True)
        if cap:
            cap.__exit__(None, None, None)
        out["refused"] = refused
        out["refusals"] = tidal.memory_stats()["refusals"]
        if session:
            s = session.stats()
            out.update(budget=s.memory_budget, within_budget=s.within_budget,
                       steps_over_budget=s.steps_over_budget,
                       between_steps=s.between_steps, plan_summary=s.plan_summary,
                       notice=s.notice or s.budget_reason)
        if session and a.save_trace and session.trace_json():
            with open(a.save_trace, "w") as f:
                f.write(session.trace_json())
        out["vm_hwm"] = vm_hwm()
        out["vm_hwm_at_start"] = rss0
        out["store_files_bytes"] = sum(os.path.getsize(os.path.join(d, f))
                                       for d, _, fs in os.walk(store) for f in fs)
    finally:
        if session:
            session.close()
        shutil.rmtree(store, ignore_errors=True)
    with open(a.json, "w") as f:
        json.dump(out, f)


def side_cmd(a, side, json_out, budget):
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--dir", a.dir,
           "--json", json_out, "--budget", str(budget)]
    for k in ("steps", "layers", "d", "heads", "block", "batch", "lr", "seed", "text",
              "capacity", "ds_buffers", "ds_sub_group", "port", "ds_offload"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.ds_cap:
        cmd.append("--ds-cap")
    if side == "deepspeed-pipelined":
        cmd[cmd.index("--side") + 1] = "deepspeed"
        cmd.append("--ds-pipeline")
    return cmd


def run_one(a, side, budget, tag):
    path = os.path.join(a.work, f"{tag}.json")
    t0 = time.time()
    cmd = side_cmd(a, side, path, budget)
    if a.save_trace and tag == "tidal.1":
        cmd += ["--save-trace", a.save_trace]
    r = subprocess.run(cmd, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0 or not os.path.exists(path):
        sys.stderr.write(r.stderr[-6000:])
        return {"side": side, "error": (r.stderr.strip().splitlines() or ["?"])[-1],
                "steps": []}
    out = json.load(open(path))
    out["wall"] = time.time() - t0
    print(f"  {tag}: {len(out['steps'])} steps in {out['wall']:.0f} s", file=sys.stderr,
          flush=True)
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summary(r, skip):
    timed = r["steps"][skip:]
    s = {"steps": len(r["steps"]), "timed": len(timed)}
    if not timed:
        return s
    s["seconds"] = med([x["seconds"] for x in timed])
    s["peak"] = max(x["peak"] for x in timed)
    s["run_peak"] = max(x["peak"] for x in r["steps"])
    s["read"] = med([x["read_bytes"] for x in timed])
    s["write"] = med([x["write_bytes"] for x in timed])
    if "store_read" in timed[0]:
        s["store_read"] = med([x["store_read"] for x in timed])
        s["store_written"] = med([x["store_written"] for x in timed])
    s["vm_hwm"] = r.get("vm_hwm", 0)
    return s


def phases_of(r, skip):
    rows = [x["phases"] for x in r["steps"][skip:]]
    return "/".join(f"{med([p[i] for p in rows]):.2f}" for i in range(3)) if rows else "-"


def mib(b):
    return f"{b / 2**20:.1f}"


def driver(a):
    a.work = tempfile.mkdtemp(prefix="vsds-work-")
    print(f"GPT (examples/python/gpt.py): {a.layers} layers, d {a.d}, {a.heads} heads, context "
          f"{a.block}, batch {a.batch}, AdamW lr {a.lr}, fp32, {a.steps} steps, the first "
          f"{a.skip} not timed; store/swap directory {a.dir} (O_DIRECT both sides); DeepSpeed "
          f"offloads to {a.ds_offload}", flush=True)
    ref = run_one(a, "none", 0, "none")
    if ref.get("error"):
        sys.exit(f"the reference run failed: {ref['error']}")
    budget = a.budget_bytes
    runs = {"deepspeed": [], "tidal": []}
    low = a.also_budget
    if low and low.endswith("%"):
        low = int(float(low[:-1]) / 100 * summary(ref, a.skip)["peak"])
    elif low:
        low = int(low)
    if low:
        runs["tidal-low"] = []
    if a.ds_pipeline:
        runs["deepspeed-pipelined"] = []
    for rnd in range(1, a.rounds + 1):
        order = ["deepspeed", "tidal"] if rnd % 2 == 1 else ["tidal", "deepspeed"]
        if low:
            order.append("tidal-low")
        if a.ds_pipeline:
            order.append("deepspeed-pipelined")
        for side in order:
            if side == "tidal-low":
                runs[side].append(run_one(a, "tidal", low, f"tidal-low.{rnd}"))
                continue
            if side == "deepspeed-pipelined":
                runs[side].append(run_one(a, side, budget, f"{side}.{rnd}"))
                continue
            if side == "tidal" and not budget:
                ds = runs["deepspeed"][0] if runs["deepspeed"] else {}
                sm = summary(ds, a.skip) if ds.get("steps") else {}
                if "peak" not in sm:
                    sys.exit("no budget: give --budget, the DeepSpeed side did not run")
                budget = sm["peak"]
                print(f"budget: {mib(budget)} MiB, the DeepSpeed side's timed peak in round 1",
                      flush=True)
            runs[side].append(run_one(a, side, budget, f"{side}.{rnd}"))
    rsum = summary(ref, a.skip)
    print()
    print(f"reference (plain PyTorch, no offload, same process kind): peak "
          f"{mib(rsum['peak'])} MiB, {rsum['seconds']:.2f} s/step, {ref['parameters']} "
          f"parameters (state with AdamW: {mib(16 * ref['parameters'])} MiB)")
    for r in [r for v in runs.values() for r in v]:
        if r.get("error") or r.get("refused"):
            print(f"{r['side']}: {r.get('error') or 'refused: ' + r['refused']}")
    head = (f"{'side':10} {'round':>5} {'peak MiB':>9} {'run peak':>9} {'VmHWM MiB':>9} "
            f"{'s/step':>7} {'SSD read/step':>14} {'SSD write/step':>14} {'store r/w MiB':>15}")
    print(head)
    per = {k: [] for k in runs}
    for rnd in range(a.rounds):
        for side in runs:
            r = runs[side][rnd]
            s = summary(r, a.skip)
            per[side].append(s)
            if "seconds" not in s:
                print(f"{side:10} {rnd + 1:>5} not measured ({r.get('error') or r.get('refused')})")
                continue
            store = (f"{mib(s['store_read'])}/{mib(s['store_written'])}"
                     if "store_read" in s else "-")
            print(f"{side:10} {rnd + 1:>5} {mib(s['peak']):>9} {mib(s['run_peak']):>9} "
                  f"{mib(s['vm_hwm']):>9} {s['seconds']:7.2f} {mib(s['read']):>10} MiB "
                  f"{mib(s['write']):>10} MiB {store:>15}")
    print("# peak: tidal's meter (live CPU tensor bytes), highest timed step; run peak: whole "
          "run incl. set-up; VmHWM: peak resident set of the process; SSD: /proc/self/io "
          "deltas, median per timed step; store r/w: tidal's store counters")
    ok = {k: [s for s in v if "seconds" in s] for k, v in per.items()}
    if ok["deepspeed"] and ok["tidal"]:
        def ratio(key):
            # "-" where DeepSpeed's figure is 0 (no SSD bytes when it offloads to cpu)
            d = med([s[key] for s in ok["deepspeed"]])
            return f"{med([s[key] for s in ok['tidal']]) / d:.2f}x" if d else "-"
        print(f"ratios tidal/DeepSpeed (medians over rounds): step time {ratio('seconds')}, "
              f"peak {ratio('peak')}, SSD read {ratio('read')}, SSD write {ratio('write')}")
        ds_first = [t["seconds"] / d["seconds"] for i, (t, d) in
                    enumerate(zip(per["tidal"], per["deepspeed"]))
                    if "seconds" in t and "seconds" in d]
        print("step-time ratio per round: " + ", ".join(f"{x:.2f}x" for x in ds_first) +
              " (DeepSpeed first in odd rounds)")
    def phases(side):
        rows = [x["phases"] for r in runs[side] for x in r["steps"][a.skip:]]
        return "/".join(f"{med([p[i] for p in rows]):.2f}" for i in range(3)) if rows else "-"
    print("forward/backward/optimizer-step seconds (medians of the timed steps, all rounds): "
          f"plain {phases_of(ref, a.skip)}, " +
          ", ".join(f"{side} {phases(side)}" for side in runs))
    for side in [k for k in runs if k.startswith("deepspeed")]:
        adam = [x["adam"] for r in runs[side] for x in r["steps"][a.skip:] if "adam" in x]
        if adam:
            n = runs[side][0]["parameters"]
            print(f"{side}: CPU Adam inside its optimizer step {med(adam):.3f} s (median), "
                  f"{n / med(adam) / 1e9:.2f}e9 parameters/s over its {n} parameters")
    for side in [k for k in runs if k.startswith("tidal")]:
        t = runs[side][0]
        if not t.get("budget"):
            continue
        print(f"{side}: budget {mib(t['budget'])} MiB, within budget: {t.get('within_budget')}, "
              f"steps over it {t.get('steps_over_budget')}, refusals {t.get('refusals')}, step boundary {t.get('between_steps')}; "
              f"{t.get('plan_summary', '')}")
    d = runs["deepspeed"][0]
    if d.get("ds_offload") == "cpu":
        print(f"DeepSpeed: ZeRO-Offload, parameters and optimizer state in CPU memory "
              f"(offload_param and offload_optimizer device cpu), {d['parameters']} parameter "
              f"elements")
    elif d.get("parameters_on_nvme") is not None:
        print(f"DeepSpeed: {d['parameters_on_nvme']} of {d['parameters']} parameter elements on "
              f"NVMe (the rest below min_aio_bytes, in CPU memory); swap files "
              f"{mib(d.get('store_files_bytes', 0))} MiB at the end")
    print("losses, round 1:")
    print(f"{'step':>4} {'plain':>9} {'DeepSpeed':>10} {'tidal':>9}" +
          (f" {'tidal-low':>10}" if low else ""))
    for i in range(a.steps):
        def at(r):
            return f"{r['steps'][i]['loss']:.4f}" if i < len(r["steps"]) else "not run"
        print(f"{i:4d} {at(ref):>9} {at(runs['deepspeed'][0]):>10} {at(runs['tidal'][0]):>9}" +
              (f" {at(runs['tidal-low'][0]):>10}" if low else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"reference": ref, "runs": runs, "budget": budget,
                       "summaries": per}, f, indent=1)
    shutil.rmtree(a.work, ignore_errors=True)
    fine = all("seconds" in s for v in per.values() for s in v)
    sys.exit(0 if fine else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=["none", "tidal", "deepspeed"])
    p.add_argument("--dir", default=os.environ.get("TIDAL_BENCH_DIR", "/var/tmp"))
    p.add_argument("--json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--budget", default="0", help="bytes or a size; 0: DeepSpeed's peak")
    p.add_argument("--also-budget", default="",
                   help="also run tidal at this budget each round (bytes, or N%% of the plain "
                        "run's peak), below what DeepSpeed can reach")
    p.add_argument("--save-trace", help="tidal side: write the profiled trace here")
    p.add_argument("--ds-pipeline", action="store_true",
                   help="side: DeepSpeed with pipeline_write; driver: also run that "
                        "variant each round (deepspeed-pipelined)")
    p.add_argument("--ds-cap", action="store_true",
                   help="run DeepSpeed's steps under the same wall (tidal.memory_cap)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--capacity", default="4GiB")
    p.add_argument("--ds-offload", choices=["nvme", "cpu"], default="nvme",
                   help="where DeepSpeed's ZeRO-3 offloads parameters and optimizer state: nvme "
                        "(ZeRO-Infinity, the default) or cpu (ZeRO-Offload: CPU memory)")
    p.add_argument("--ds-buffers", type=int, default=8)
    p.add_argument("--ds-sub-group", type=int, default=1 << 20)
    p.add_argument("--port", type=int, default=29517)
    a = p.parse_args()
    # The swap and store files go under --dir: made here, as the other benches make theirs.
    os.makedirs(a.dir, exist_ok=True)
    if a.side:
        import tidal
        a.budget = tidal.parse_bytes(a.budget) if not a.budget.isdigit() else int(a.budget)
        run_side(a)
        return
    if not a.budget.isdigit():
        sys.path.insert(0, os.path.join(ROOT, "build", "python"))
    a.budget_bytes = int(a.budget) if a.budget.isdigit() else None
    if a.budget_bytes is None:
        import tidal
        a.budget_bytes = tidal.parse_bytes(a.budget)
    driver(a)


if __name__ == "__main__":
    main()
