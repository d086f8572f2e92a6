"""A Hugging Face Accelerate loop with tidal: `accelerator.prepare`, then a Session around each
step. The model is a small Llama from a config (random weights: nothing is downloaded),
trained on a text file as bytes.

    PYTHONPATH=build/python python3 examples/python/accelerate_train.py --mode plan --dir D
    ... --mode none      # the same loop without tidal: the same losses

Prints each step's loss; --json writes them.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import tidal
from tidal.hf import unwrap_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["none", "activations", "plan"], default="plan")
    p.add_argument("--dir", action="append", help="store directory (one per SSD; repeatable)")
    p.add_argument("--budget", default="50%")
    p.add_argument("--text", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json")
    a = p.parse_args()

    with open(a.text, "rb") as f:
        ids = torch.tensor(list(f.read()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - a.seq - 1, (a.steps * a.batch,), generator=g)
    samples = torch.stack([ids[i:i + a.seq] for i in starts])
    loader = torch.utils.data.DataLoader(samples, batch_size=a.batch, shuffle=False)

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    # After prepare: the session hooks the torch optimizer inside Accelerate's wrapper.
    if a.mode == "none":
        session = tidal.Session(mode="none")
    else:
        extra = {"budget": a.budget} if a.mode == "plan" else {}
        session = tidal.Session(mode=a.mode, dirs=a.dir or ["/var/tmp/tidal"],
                                capacity="1GiB", min_bytes="16KiB", model=model,
                                optimizer=unwrap_optimizer(opt), **extra)
    losses = []
    with session:
        for x in loader:
            with session.step():
                loss = model(input_ids=x, labels=x).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            print(f"step {len(losses)} loss {loss.item():.4f}")
        print(session.stats())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": a.mode, "losses": losses}, f)


if __name__ == "__main__":
    main()
