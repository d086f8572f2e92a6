"""One run of the Python API fuzz test (test_fuzz.py runs it in a subprocess, so that a crash or a
hang is seen as one): random calls of tidal's Python API, in random orders and with random
arguments, good and bad, around an ordinary training loop.

    python fuzz_worker.py SEED OPS STORE_DIR

What must hold, checked here: every call returns or raises a clear error (tidal.Error, a
ValueError/TypeError of a bad argument, torch.OutOfMemoryError from the strict meter, or a
RuntimeError carrying tidal's message through autograd); and every training step that ran whole
gives the loss of the same step of a shadow model trained without tidal, bit for bit. Prints one
line per call (the seed and the line reproduce it) and "fuzz ok" at the end.
"""

import io
import random
import sys
import threading
import traceback

import torch

import tidal

CLEAR_ERRORS = (tidal.Error, ValueError, TypeError, torch.OutOfMemoryError)


class SkipBatch(Exception):
    """A user's own exception inside a step (a bad batch skipped)."""


class CountingSGD(torch.optim.SGD):
    """SGD whose learning rate decays with a step counter kept in its param group, as some
    third-party optimizers keep state there."""

    def step(self, closure=None):
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
            g["lr"] = g["base_lr"] * 0.97 ** g["step"]
        return super().step(closure)


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    opt = CountingSGD(model.parameters(), lr=0.05, foreach=kind == "counting-foreach")
    for g in opt.param_groups:
        g["base_lr"] = 0.05
    return opt


class OtherThread:
    """A metrics or logging thread doing small torch ops while the loop trains."""

    def __init__(self):
        self.stop = threading.Event()
        self.ops = 0
        self.refused = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            try:
                torch.ones(1024).mul_(2).sum().item()
                self.ops += 1
            except torch.OutOfMemoryError:
                self.refused += 1  # the strict wall refused it, as a full GPU would
            self.stop.wait(0.0005)

    def join(self):
        self.stop.set()
        self.thread.join()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


class Fuzz:
    def __init__(self, seed: int, store_dir: str):
        self.rng = random.Random(seed)
        self.store_dir = store_dir
        self.model = make_model(seed)
        self.shadow = make_model(seed)
        # SGD without momentum: a step that broke off leaves no optimizer state to mend but the
        # group's step counter (CountingSGD), which resync() mends.
        kind = self.rng.choice(["sgd", "counting", "counting-foreach"])
        self.opt = make_optimizer(kind, self.model)
        self.shadow_opt = make_optimizer(kind, self.shadow)
        self.other_thread = OtherThread() if self.rng.random() < 0.5 else None
        self.session = None
        self.offload = None
        self.kept_loss = None  # a graph kept past its step, for a late backward
        self.data_seed = seed * 1000
        self.steps_compared = 0

    # -- arguments, good and bad ------------------------------------------------------------

    def pick(self, good: list, bad: list):
        # Mostly good arguments (a session must live to be fuzzed), sometimes a bad one.
        return self.rng.choice(bad if bad and self.rng.random() < 0.12 else good)

    def session_kwargs(self) -> dict:
        p = self.pick
        kw = {"mode": p(["none", "activations", "plan", "plan", "plan"], ["bogus"]),
              "dirs": p([[self.store_dir], self.store_dir],
                        ["", [self.store_dir + "/missing"], [self.store_dir, self.store_dir]]),
              "capacity": p(["256MiB", "64MiB", "8MiB"], ["1MiB", 0, "lots", -1]),
              "min_bytes": p([0, "4KiB", "64KiB"], [-3, "x"]),
              "model": p([self.model], [None]),
              "optimizer": p([self.opt], [None])}
        if kw["mode"] == "plan":
            kw["budget"] = p(["50%", "70%", 0.6, "2MiB", self.rng.randint(1 << 20, 4 << 20)],
                             ["1B", 0, "200%", "nope"])
            kw["between_steps"] = p(["auto", "resident", "offloaded"], ["sometimes"])
            kw["strict"] = p([True, False], [])
        if kw["mode"] == "activations":
            kw["adaptive"] = p([True, False], [])
        return kw

    # -- the calls ----------------------------------------------------------------------------

    def new_session(self):
        self.close_session()
        kw = self.session_kwargs()
        self.session = tidal.Session(**kw)
        return kw["mode"]

    def close_session(self):
        if self.session is not None:
            s, self.session = self.session, None
            s.close()

    def train_step(self, use_context: bool):
        x, y = self.batch()
        if self.session is not None and use_context:
            with self.session.step():
                loss = self.forward_backward(x, y)
        else:
            if self.session is not None:
                self.session.begin_step()
            loss = self.forward_backward(x, y)
            if self.session is not None:
                self.session.end_step()
        self.compare(loss, x, y)

    def skipped_step(self, caught_inside: bool):
        # The user's own exception part-way through a step: the batch is skipped, and the next
        # whole step must give the shadow's loss.
        x, y = self.batch()
        stage = self.rng.choice(["forward", "backward"])

        def body():
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            if stage == "backward":
                loss.backward()
            raise SkipBatch(stage)

        if self.session is None:
            return
        try:
            with self.session.step():
                if caught_inside:
                    try:
                        body()
                    except SkipBatch:
                        pass
                else:
                    body()
        except SkipBatch:
            pass
        self.opt.zero_grad()

    def save_mid_run(self):
        # torch.save of the whole model and optimizer between steps, as a user checkpoints.
        saved_model, saved_opt = io.BytesIO(), io.BytesIO()
        torch.save(self.model, saved_model)
        torch.save(self.opt, saved_opt)
        saved_model.seek(0)
        copy = torch.load(saved_model, weights_only=False)
        for p, q in zip(copy.parameters(), self.model.parameters()):
            if not torch.equal(p, q):
                raise AssertionError("WRONG SAVE: torch.save(model) wrote other weights")

    def forward_backward(self, x, y):
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach().clone()

    def compare(self, loss, x, y):
        self.shadow_opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(self.shadow(x), y)
        ref.backward()
        self.shadow_opt.step()
        if not torch.equal(loss, ref.detach()):
            raise AssertionError(f"WRONG LOSS: {loss.item()!r} with tidal, {ref.item()!r} "
                                 "without")
        self.steps_compared += 1

    def batch(self):
        g = torch.Generator().manual_seed(self.data_seed)
        self.data_seed += 1
        return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def resync(self):
        # After a call that broke off inside a step, the model may have half a step in it: it
        # takes the shadow's parameters (no step open) and training goes on from there.
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.shadow.parameters()):
                p.copy_(q)
        for g, h in zip(self.opt.param_groups, self.shadow_opt.param_groups):
            for key in ("step", "lr"):
                if key in h:
                    g[key] = h[key]
        self.opt.zero_grad()

    def random_call(self) -> str:
        r = self.rng
        s = self.session
        choice = r.choice(["new_session"] * 2 + ["train"] * 5 + ["train_ctx"] * 5 +
                          ["begin", "end", "forward_only", "late_backward", "close", "stats",
                           "make_resident", "offload_ctx", "phase", "state_dict", "repr",
                           "skip_outside", "skip_inside", "save"])
        if choice == "new_session":
            return f"new_session -> {self.new_session()}"
        if choice == "train":
            self.train_step(use_context=False)
        elif choice == "train_ctx":
            self.train_step(use_context=True)
        elif choice == "begin" and s is not None:
            s.begin_step()
        elif choice == "end" and s is not None:
            s.end_step()
        elif choice == "forward_only":
            x, y = self.batch()
            self.kept_loss = torch.nn.functional.cross_entropy(self.model(x), y)
        elif choice == "late_backward" and self.kept_loss is not None:
            loss, self.kept_loss = self.kept_loss, None
            loss.backward()
            self.opt.zero_grad()
        elif choice == "close":
            self.close_session()
        elif choice == "stats" and s is not None:
            str(s.stats())
            s.store_stats()
        elif choice == "make_resident" and s is not None:
            s.make_resident()
        elif choice == "offload_ctx":
            self.offload = tidal.offload_activations(
                dirs=[self.store_dir], capacity=self.pick(["64MiB", "8MiB"], ["1MiB", "zero"]),
                min_bytes=r.choice([0, "4KiB"]), adaptive=r.choice([True, False]))
            with self.offload:
                x, y = self.batch()
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
                if r.random() < 0.7:
                    loss.backward()
            self.offload.close()
            self.opt.zero_grad()
        elif choice == "phase" and s is not None:
            s.phase(r.choice(["forward", "backward", "optimizer", "lunch"]))
        elif choice == "state_dict":
            self.model.state_dict()
            self.opt.state_dict()
        elif choice == "repr" and s is not None:
            repr(s)
        elif choice in ("skip_outside", "skip_inside"):
            self.skipped_step(caught_inside=choice == "skip_inside")
        elif choice == "save":
            self.save_mid_run()
        return choice

    def run(self, ops: int):
        for i in range(ops):
            try:
                what = self.random_call()
                print(f"{i:3d} {what}", flush=True)
            except AssertionError:
                raise
            except CLEAR_ERRORS as e:
                print(f"{i:3d} raised {type(e).__name__}: {str(e)[:160]}", flush=True)
                self.after_error()
            except RuntimeError as e:  # through autograd or torch: must carry a clear message
                text = str(e)
                if not text.strip():
                    raise AssertionError(f"a RuntimeError without a message: {e!r}") from e
                print(f"{i:3d} raised RuntimeError: {text[:160]}", flush=True)
                self.after_error()
        if self.session is not None:
            try:
                self.session.end_step()  # a step the calls left open
            except (tidal.Error, RuntimeError):
                pass
        self.close_session()
        self.stop_other_thread()
        print(f"fuzz ok: {self.steps_compared} steps compared bit for bit", flush=True)

    def stop_other_thread(self):
        # Also when the run failed: a thread still in torch at the interpreter's exit aborts the
        # process, and the failure would read as a crash.
        if self.other_thread is not None:
            self.other_thread.join()
            print(f"other thread: {self.other_thread.ops} ops, {self.other_thread.refused} "
                  "refused by the wall", flush=True)
            self.other_thread = None

    def after_error(self):
        # A step left open by the error is ended (its own error, if any, is not the point).
        if self.session is not None:
            try:
                self.session.end_step()
            except (tidal.Error, RuntimeError):
                pass
        self.kept_loss = None
        try:
            self.resync()
        except CLEAR_ERRORS as e:
            # A wall the model cannot live under (budget="2MiB" under the strict meter): the
            # session goes, and with it the wall.
            print(f"    resync raised {type(e).__name__}: closing the session", flush=True)
            try:
                self.close_session()
            except (tidal.Error, RuntimeError):
                self.session = None
            self.resync()


def main():
    seed, ops, store_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fuzz = Fuzz(seed, store_dir)
    try:
        fuzz.run(ops)
    except AssertionError:
        traceback.print_exc()
        sys.exit(3)
    finally:
        fuzz.stop_other_thread()


if __name__ == "__main__":
    main()
