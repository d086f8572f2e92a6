"""Fine-tune a small causal language model with the Hugging Face Trainer and tidal's callback.

    PYTHONPATH=build/python python3 examples/python/hf_finetune.py --dir /var/tmp/tidal
    ... --mode plan --budget 50%    # every tensor class, within a memory budget
    ... --mode none                 # the same run without tidal: the same losses

A Llama-family model built from a config (random weights: nothing is downloaded), trained on a
text file as bytes (a vocabulary of 256; default: this repository's README). The one line that
brings tidal in is the callback: `callbacks=[TidalCallback(mode=..., dirs=[...])]`. Runs on a
CPU in well under a minute; prints the Trainer's losses and, with --json, writes them.
"""

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tidal  # noqa: F401  (before the model: tidal's memory meter counts from here)
from tidal.hf import TidalCallback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["none", "activations", "plan"], default="activations")
    p.add_argument("--dir", action="append", help="store directory (one per SSD; repeatable)")
    p.add_argument("--budget", default="50%", help="plan mode: '50%%' of the peak, or bytes")
    p.add_argument("--text", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--output", default="/tmp/tidal-hf-finetune")
    p.add_argument("--json", help="write the logged losses here")
    a = p.parse_args()

    with open(a.text, "rb") as f:
        ids = torch.tensor(list(f.read()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - a.seq - 1, (a.steps * a.batch,), generator=g)
    dataset = [{"input_ids": ids[i:i + a.seq], "labels": ids[i:i + a.seq]} for i in starts]

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=a.seq))

    callbacks = []
    if a.mode != "none":
        options = {"mode": a.mode, "dirs": a.dir or ["/var/tmp/tidal"], "capacity": "1GiB",
                   "min_bytes": "64KiB"}
        if a.mode == "plan":
            options["budget"] = a.budget
        callbacks.append(TidalCallback(**options))
    args = TrainingArguments(output_dir=a.output, max_steps=a.steps,
                             per_device_train_batch_size=a.batch, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, data_seed=0,
                             save_strategy="no", learning_rate=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print("losses:", " ".join(f"{x:.4f}" for x in losses))
    if callbacks:
        print("tidal:", callbacks[0].last_stats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": a.mode, "losses": losses}, f)


if __name__ == "__main__":
    main()
