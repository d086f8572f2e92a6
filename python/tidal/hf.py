"""tidal in a Hugging Face `transformers.Trainer`: one callback, the Session's options.

    from tidal.hf import TidalCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TidalCallback(mode="plan", dirs=["/mnt/nvme0/tidal"])])
    trainer.train()

The callback opens a `tidal.Session` when training begins (with the Trainer's model and
optimizer), runs each optimizer step (all its gradient-accumulation micro-batches) as one
session step, and closes the session when training ends. Evaluation, logging and
`save_pretrained` between steps keep working: plan mode brings tensors back for them (the
model's `state_dict()` does so first).
"""

from typing import Any, Optional

import torch

from .session import Session

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the callback needs transformers
    raise ImportError("tidal.hf needs transformers (pip install transformers)") from e


def unwrap_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside Accelerate's wrapper (or the optimizer itself)."""
    # The Trainer hands out Accelerate's wrapper (AcceleratedOptimizer, itself an Optimizer
    # subclass without the hooks' state); the session hooks the torch optimizer inside it.
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class TidalCallback(TrainerCallback):
    """Runs a tidal Session around a Trainer's optimizer steps. Takes the Session's keyword
    options (mode, dirs, budget, host_memory, capacity, min_bytes, ...); model and optimizer
    come from the Trainer. `session` is the open Session during training (None before and
    after); `last_stats` the session's stats when training ended."""

    def __init__(self, **session_options: Any):
        for key in ("model", "optimizer"):
            if key in session_options:
                raise TypeError(f"TidalCallback takes the Trainer's {key}: do not pass {key}=")
        self.options = session_options
        self.session: Optional[Session] = None
        self.last_stats = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.session is not None:
            self.session.close()
        self.session = Session(model=model, optimizer=unwrap_optimizer(optimizer),
                               **self.options)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            session, self.session = self.session, None
            if session._in_step:  # a run stopped inside a step (max_steps, an error)
                session.end_step()
            self.last_stats = session.stats()
            session.close()
