"""The lorasync error tree: one root, builtin bases, pickling with context, documented."""

from __future__ import annotations

import pickle

import pytest

import lorasync.errors as errors
from lorasync.errors import LoraSyncError, LoraSyncWarning

CLASSES = [getattr(errors, name) for name in errors.__all__]
WARNINGS = [cls for cls in CLASSES if issubclass(cls, LoraSyncWarning)]
ERRORS = [cls for cls in CLASSES if cls not in WARNINGS]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_pickle_round_trip_keeps_type_message_and_context(cls: type) -> None:
    if cls is LoraSyncWarning:
        err = cls("adapter 'x' published without verification")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.args == err.args
        return
    if issubclass(cls, LoraSyncWarning):
        err = cls("engine 'vllm' still holds 'p@v1' after its unload", engine="vllm", url="http://127.0.0.1:1", adapters=("p@v1",))
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.args == err.args
        assert (back.engine, back.url, back.adapters) == ("vllm", "http://127.0.0.1:1", ("p@v1",))
        return
    err = cls(
        "engine 'vllm' at http://127.0.0.1:1 refused adapter 'policy@v3'; retry later",
        engine="vllm",
        url="http://127.0.0.1:1",
        adapter="policy@v3",
        status=503,
        attempts=4,
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) == err.message
    assert back.context == err.context
    assert (back.engine, back.url, back.adapter, back.status, back.attempts) == (
        "vllm",
        "http://127.0.0.1:1",
        "policy@v3",
        503,
        4,
    )


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_is_a_lorasync_error(cls: type) -> None:
    assert issubclass(cls, LoraSyncError)
    with pytest.raises(LoraSyncError):
        raise cls("boom")


@pytest.mark.parametrize("cls", WARNINGS, ids=lambda c: c.__name__)
def test_warnings_have_their_own_root(cls: type) -> None:
    assert issubclass(cls, LoraSyncWarning) and issubclass(cls, UserWarning)
    assert not issubclass(cls, LoraSyncError)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_docstring_tree_mentions_every_class(cls: type) -> None:
    assert errors.__doc__ is not None
    assert cls.__name__ in errors.__doc__
    assert cls.__doc__, f"{cls.__name__} needs a docstring"


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("AdapterError", ValueError),
        ("ExportError", ValueError),
        ("ConfigError", ValueError),
        ("InvalidNameError", ValueError),
        ("UnknownEngineError", KeyError),
        ("EngineUnavailableError", ConnectionError),
        ("EngineTimeoutError", TimeoutError),
        ("StorageError", OSError),
    ],
)
def test_leaves_inherit_the_builtin_callers_already_catch(name: str, builtin: type) -> None:
    assert issubclass(getattr(errors, name), builtin)


def test_key_error_leaf_prints_its_message_not_a_repr() -> None:
    err = errors.UnknownEngineError("no engine named 'x'; install its plugin", name="x")
    assert str(err) == "no engine named 'x'; install its plugin"
