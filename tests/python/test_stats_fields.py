"""The stats classes of the Python front-end against what the C++ binding returns from a real
run: the same field names both ways, each value of the type the class declares. A field added to
or dropped from a C++ stats struct (and so from the binding's dict) fails here by name."""

import dataclasses
import typing

import tidal
from tidal.activations import ActivationStats
from conftest import batches, train_mlp


def assert_same_fields(cls, returned: dict) -> None:
    declared = {f.name for f in dataclasses.fields(cls)}
    only_cpp = sorted(set(returned) - declared)
    only_python = sorted(declared - set(returned))
    assert not only_cpp, f"the binding returns fields that {cls.__name__} lacks: {only_cpp}"
    assert not only_python, f"{cls.__name__} declares fields the binding lacks: {only_python}"
    hints = typing.get_type_hints(cls)
    for name, value in returned.items():
        assert isinstance(value, hints[name]), (name, value, hints[name])


def test_session_stats_declares_the_fields_of_the_binding(store_dir):
    holder = {}

    def session(model, opt):
        holder["s"] = tidal.Session(mode="plan", dirs=[store_dir], budget="70%",
                                    capacity="512MiB", min_bytes="64KiB", model=model,
                                    optimizer=opt)
        return holder["s"]

    # A warm-up step, two profiled ones and one that runs the plan.
    _, _, stats = train_mlp(batches(seed=21, steps=4), session)
    assert len(stats) == 4
    with holder["s"] as s:
        returned = s._session.stats()
    assert_same_fields(tidal.SessionStats, returned)


def test_activation_stats_declares_the_fields_of_the_binding(store_dir):
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes="64KiB", capacity="256MiB",
                                        adaptive=False)
    train_mlp(batches(seed=22, steps=2), seed=1, offload=offload)
    offload.end_step()
    returned = offload._offloader.last_step()
    offload.close()
    assert returned["offloaded"] > 0  # a step that offloaded: every counter had its chance
    assert_same_fields(ActivationStats, returned)
