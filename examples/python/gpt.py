"""A small character-level GPT (nanoGPT's shape) for the Python examples: model and corpus."""

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, layers: int, d: int, heads: int, block: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class CharCorpus:
    """A text file as characters; batches of `block` characters and the next ones."""

    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        chars = sorted(set(text))
        self.vocab = len(chars)
        index = {c: i for i, c in enumerate(chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)

    def batch(self, g: torch.Generator, batch: int, block: int):
        starts = torch.randint(0, len(self.data) - block - 1, (batch,), generator=g)
        x = torch.stack([self.data[s:s + block] for s in starts])
        y = torch.stack([self.data[s + 1:s + 1 + block] for s in starts])
        return x, y


def add_model_args(p) -> None:
    p.add_argument("--text", default="README.md", help="the corpus (a text file)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=256, help="embedding width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=256, help="context length")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)


def train_step(model, opt, x, y, session=None, offload=None):
    """One ordinary training step: inside tidal's step markers when there is a `tidal.Session`,
    with the forward pass under `tidal.offload_activations` when there is one. Returns the loss,
    the step's seconds and its peak bytes (tidal's memory meter, and the session's step peak)."""
    import tidal

    tidal.reset_peak_memory()
    t0 = time.perf_counter()
    if session:
        session.begin_step()
    opt.zero_grad(set_to_none=False)
    if offload:
        with offload:
            loss = model(x, y)
    else:
        loss = model(x, y)
    loss.backward()
    opt.step()
    if session:
        session.end_step()
    seconds = time.perf_counter() - t0
    peak = tidal.memory_stats()["peak_bytes"]
    if session:
        peak = max(peak, session.stats().step_peak)
    return loss, seconds, peak
