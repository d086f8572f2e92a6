"""Profile-first start against plan_ahead, side by side in one run: time from Session() to the
end of the first step that runs a plan, and the total for N steps, on an HF Llama in the
ordinary PyTorch style, at a budget of half the model's state (weights + AdamW's two states),
under the strict meter. Losses must be bit-identical between the two and to no offloading.

Usage: PYTHONPATH=build/python .venv/bin/python bench/plan_ahead.py DIR [--steps 10]
"""

import argparse
import time

import torch
import transformers as T

import tidal


def make():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4))


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(kind, steps, batches, dirs):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    extra = {"plan_ahead": lambda m, o: step(m, o, batches[0])} if kind == "ahead" else {}
    start = time.perf_counter()
    first_planned = None
    losses = []
    s = None
    if kind != "none":
        s = tidal.Session(mode="plan", dirs=[dirs], budget=state // 2, strict=True,
                          model=model, optimizer=opt, **extra)
    made = time.perf_counter() - start
    times = []
    for k in range(steps):
        ids = batches[k]
        t_step = time.perf_counter()
        if s is None:
            losses.append(step(model, opt, ids).item())
            times.append(time.perf_counter() - t_step)
            continue
        with s.step():
            loss = step(model, opt, ids)
        losses.append(loss.item())
        times.append(time.perf_counter() - t_step)
        if first_planned is None and s.stats().shape >= 0:
            first_planned = (k, time.perf_counter() - start)
    total = time.perf_counter() - start
    st = s.stats() if s else None
    if s:
        s.close()
    return dict(kind=kind, made=made, first=first_planned, total=total, losses=losses,
                last=sum(times[steps // 2:]),
                state=state, peak=st.executed_peak if st else None,
                budget=st.memory_budget if st else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8000, (4, 128), generator=g) for _ in range(a.steps)]
    rows = [run(k, a.steps, batches, a.dir) for k in ("none", "profile", "ahead")]
    ref = rows[0]["losses"]
    print(f"HF Llama, {rows[0]['state'] / 2**20:.0f} MiB of state, budget half of it, strict "
          f"meter, {a.steps} steps, batch 4x128, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| start | Session() s | first planned step (index, s from Session()) | "
          f"{a.steps} steps s | last {a.steps - a.steps // 2} steps s | losses bit-identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        first = f"{r['first'][0]}, {r['first'][1]:.2f}" if r["first"] else "-"
        print(f"| {r['kind']} | {r['made']:.2f} | {first} | {r['total']:.2f} | "
              f"{r['last']:.2f} | {r['losses'] == ref} |")
    p, q = rows[1], rows[2]
    if p["first"] and q["first"]:
        print(f"ratio profile-first / plan_ahead: first planned step "
              f"{p['first'][1] / q['first'][1]:.2f}x, {a.steps} steps "
              f"{p['total'] / q['total']:.2f}x, last steps {p['last'] / q['last']:.2f}x")


if __name__ == "__main__":
    main()
