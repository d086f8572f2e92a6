"""Train a small character-level GPT on a text file with tidal from Python.

    PYTHONPATH=build/python python3 examples/python/gpt_activations.py --dir /var/tmp/tidal
    ... --mode plan --budget 50%     # every tensor class, within a memory budget
    ... --mode none                  # the reference: same losses, bit for bit
    ... --mode plan --optimizer-step host   # AdamW on host copies, its state in host memory

--mode activations wraps forward in tidal.offload_activations(); --mode plan runs each step
in a tidal.Session(mode="plan"). Prints the loss, step time and memory peak of every step, and
a summary (median step time and peak over the steps after the warm-up/profiling ones).
"""

import argparse
import json
import statistics

import torch

import tidal  # before the model: tidal's memory meter counts from here
from gpt import GPT, CharCorpus, add_model_args, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--mode", choices=["none", "activations", "plan"], default="activations")
    p.add_argument("--dir", action="append", help="store directory (one per SSD; repeatable)")
    p.add_argument("--budget", default="50%", help="plan mode: '50%%' of the peak, or bytes")
    p.add_argument("--host-memory", default="0", help="plan mode: host tier size, e.g. 2GiB")
    p.add_argument("--min-bytes", default="1MiB", help="smallest tensor to offload")
    p.add_argument("--capacity", default="4GiB", help="store size")
    p.add_argument("--json", help="write the per-step figures here")
    p.add_argument("--optimizer-step", choices=["device", "host"], default="device",
                   help="plan mode: where AdamW steps (host: its state outside the budget)")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    corpus = CharCorpus(a.text)
    model = GPT(corpus.vocab, a.layers, a.d, a.heads, a.block)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(a.seed)

    offload = session = None
    if a.mode == "activations":
        offload = tidal.offload_activations(dirs=a.dir, min_bytes=a.min_bytes,
                                            capacity=a.capacity, model=model)
    elif a.mode == "plan":
        session = tidal.Session(mode="plan", dirs=a.dir, budget=a.budget,
                                host_memory=a.host_memory, capacity=a.capacity,
                                min_bytes=a.min_bytes, model=model, optimizer=opt, name="gpt",
                                optimizer_step=a.optimizer_step)
    # Steps before the mode runs as it will: plan mode warms up, profiles two steps, and its
    # first executed step still brings memory down from the profiled peak.
    skip = 4 if a.mode == "plan" else 1

    rows = []
    for step in range(a.steps):
        x, y = corpus.batch(g, a.batch, a.block)
        loss, seconds, peak = train_step(model, opt, x, y, session=session, offload=offload)
        row = {"step": step, "loss": loss.item(), "seconds": seconds, "peak": peak}
        note = str(session.stats()) if session else ""
        rows.append(row)
        print(f"step {step:3d}  loss {row['loss']:.6f}  {1e3 * seconds:8.1f} ms  "
              f"peak {tidal.format_bytes(peak)}  {note}", flush=True)
    if offload:
        offload.end_step()
        print(offload.stats())
        store = offload.store_stats()
        offload.close()
    elif session:
        store = session.store_stats()
        s = session.stats()
        print(s.plan_summary)
        if s.notice or s.budget_reason:
            print("note:", s.notice or s.budget_reason)
    else:
        store = None
    timed = rows[skip:] or rows
    summary = {
        "mode": a.mode,
        "median_step_seconds": statistics.median(r["seconds"] for r in timed),
        "peak": max(r["peak"] for r in timed),
        "final_loss": rows[-1]["loss"],
        "store_bytes_written": store["bytes_written"] if store else 0,
        "store_bytes_read": store["bytes_read"] if store else 0,
    }
    print(f"summary: mode {a.mode}, median step {1e3 * summary['median_step_seconds']:.1f} ms, "
          f"peak {tidal.format_bytes(summary['peak'])} (steps {skip}..{a.steps - 1}), "
          f"store wrote {tidal.format_bytes(summary['store_bytes_written'])}, "
          f"read {tidal.format_bytes(summary['store_bytes_read'])}, "
          f"final loss {summary['final_loss']:.6f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
