"""Every hook the Lightning and Hugging Face callbacks implement is marked ``@override`` and really
overrides a hook of the framework's base class (a misspelt hook would never be called)."""

from __future__ import annotations

import inspect

import pytest


def _hooks(cls):
    """The framework hooks ``cls`` defines itself: ``on_*`` methods, ``teardown``, the state methods."""
    names = [n for n in vars(cls) if n.startswith("on_") or n in ("teardown", "state_dict", "load_state_dict",
                                                                   "state_key", "setup")]
    return [n for n in names if not isinstance(vars(cls)[n], property) or n == "state_key"]


@pytest.mark.parametrize("where", ["fp8track.lightning:FP8Monitor", "fp8track.hf:FP8TrainerCallback"])
def test_hooks_are_marked_and_exist_on_the_base(where):
    module, name = where.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    base = cls.__mro__[1]  # Callback / TrainerCallback
    hooks = _hooks(cls)
    assert len(hooks) >= 7
    for hook in hooks:
        member = vars(cls)[hook]
        func = member.fget if isinstance(member, property) else member
        assert getattr(func, "__override__", False), f"{name}.{hook} lacks @override"
        assert hasattr(base, hook), f"{name}.{hook} overrides nothing on {base.__name__}"
        if inspect.isfunction(func) and not isinstance(member, property):
            assert inspect.isfunction(getattr(base, hook))
