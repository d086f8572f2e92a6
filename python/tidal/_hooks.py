"""The hooks a session puts on a user's model, optimizer and torch.save: they hold the session
weakly, and do nothing once the session is gone or they are pickled."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from . import _C

if TYPE_CHECKING:
    from .session import Session


def _inert_hook():
    return _inert


def _inert(*_args, **_kwargs) -> None:
    """A session's hook on a model or optimizer, once they are pickled (torch.save(model),
    copy.deepcopy): the session does not travel with them."""
    return None


class _Hook:
    """A hook the session puts on the user's model or optimizer: `fn(session, *args)` while the
    session lives. It holds the session weakly (a hook must not keep it alive), and pickles as
    `_inert`, so that torch.save(model) and deepcopy work while a session is open."""

    __slots__ = ("_ref", "_fn")

    def __init__(self, session: "Session", fn) -> None:
        self._ref = weakref.ref(session)
        self._fn = fn

    def __call__(self, *args, **kwargs):
        session = self._ref()
        return None if session is None else self._fn(session, *args, **kwargs)

    def __reduce__(self):
        return (_inert_hook, ())


# torch.save(model) or torch.save(optimizer) reads raw storages, which no hook brings back from
# the SSD: while a plan session is open, torch.save brings its tensors back first (between
# steps), and an invalid storage (inside a step) is an error that says what to do.
_sessions_watching_save: "weakref.WeakSet[Session]" = weakref.WeakSet()
_torch_save = None


def _save(*args, **kwargs):
    for session in list(_sessions_watching_save):
        session._resident_between_steps()
    try:
        return _torch_save(*args, **kwargs)
    except RuntimeError as e:
        if "invalid python storage" not in str(e):
            raise
        raise _C.Error(
            "torch.save read a tensor whose bytes tidal has moved out of memory (plan mode "
            "with the step boundary offloaded, or inside a step): save between steps, or call "
            "session.make_resident() first") from e


def _watch_torch_save(session: "Session") -> None:
    global _torch_save
    _sessions_watching_save.add(session)
    if _torch_save is None:
        _torch_save = torch.save
        torch.save = _save


def _unwatch_torch_save(session: "Session") -> None:
    global _torch_save
    _sessions_watching_save.discard(session)
    if not _sessions_watching_save and _torch_save is not None and torch.save is _save:
        torch.save = _torch_save
        _torch_save = None
