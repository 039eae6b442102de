"""The error hierarchy (core/errors.py): every exception class of the package is one of the kinds a user is told
and acts on differently, or one of the few listed below that a caller must tell apart; their exit statuses are
those README's "Exit status" documents."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from aiflame.core import errors
from aiflame.core.errors import (
    AiflameError,
    BadInput,
    HostError,
    InternalError,
    NothingToShow,
    Refused,
    TargetGone,
    Unreadable,
    UsageError,
)

GROUPS: dict[type[AiflameError], int] = {
    AiflameError: 1, UsageError: 2, BadInput: 1, Unreadable: 1, Refused: 1, NothingToShow: 1, HostError: 3,
    TargetGone: 4, InternalError: 70,
}

# Classes besides the kinds, each with the caller that must tell it apart (a new one needs a line here).
APART: dict[str, str] = {
    # an interpreter read between its exec and the loader mapping libpython: agent/python/runtime.py asks again
    "aiflame.agent.python.detect.PythonNotLoaded": "HostError",
    # annotate_native lists the binaries it could not use with `why`, and annotate_any falls back to Python on it
    "aiflame.symbolize.annotate.result.BinaryNotFound": "Unreadable",
    # a capture cut inside a record: iter_records(partial=True) ends there (recover) instead of failing
    "aiflame.core.capture._Cut": "Unreadable",
    # the compiler refused these headers: build_injection tries the next set; any other failure is final
    "aiflame.agent.accel.cupti_build._CompileFailed": "Exception",
}

MOST = 25  # the bound on exception classes in the package


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for pkg in ("core", "symbolize", "exporters", "agent", "cli"):
        top = importlib.import_module(f"aiflame.{pkg}")
        for info in pkgutil.walk_packages(top.__path__, f"aiflame.{pkg}."):
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                    found[f"{mod.__name__}.{name}"] = obj
    return found


def test_every_exception_class_is_a_kind_or_listed() -> None:
    classes = _exception_classes()
    kinds = {f"aiflame.core.errors.{g.__name__}" for g in GROUPS}
    assert kinds <= classes.keys()
    others = {name: cls for name, cls in classes.items() if name not in kinds}
    assert sorted(others) == sorted(APART), "a new exception class: raise a kind of core/errors.py, or list it"
    for name, cls in others.items():
        assert [b.__name__ for b in cls.__bases__] == [APART[name]], name
    assert len(classes) <= MOST, sorted(classes)


@pytest.mark.parametrize(("kind", "status"), GROUPS.items(), ids=lambda k: getattr(k, "__name__", str(k)))
def test_exit_status_of_each_kind(kind: type[AiflameError], status: int) -> None:
    assert kind.exit_code == status


def test_the_kinds_nest_as_documented() -> None:
    assert issubclass(Refused, Unreadable) and issubclass(Unreadable, BadInput) and issubclass(NothingToShow, BadInput)
    for kind in (UsageError, BadInput, HostError, TargetGone, InternalError):
        assert kind.__bases__ == (AiflameError,)
    assert sorted(errors.__all__) == sorted(g.__name__ for g in GROUPS)
