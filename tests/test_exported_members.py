"""Lock the public surface: ``__all__`` lists exactly the public names, sorted."""

from __future__ import annotations

import __future__
from types import ModuleType

import pytest

import lorasync
import lorasync.errors
import lorasync.exporters


def _public(module: ModuleType) -> list[str]:
    # Submodules appear as attributes once imported anywhere; they, `from __future__` flags
    # and typing helpers used in annotations are not members.
    return sorted(
        name
        for name, value in vars(module).items()
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(value, (ModuleType, __future__._Feature))
        and getattr(value, "__module__", None) != "typing"
    )


@pytest.mark.parametrize("module", [lorasync, lorasync.errors, lorasync.exporters], ids=lambda m: m.__name__)
def test_all_lists_exactly_the_public_members_sorted(module: ModuleType) -> None:
    for name in dir(module):  # lorasync loads its names on first use (PEP 562)
        getattr(module, name)
    assert module.__all__ == _public(module)


def test_errors_all_is_every_exception_defined_there() -> None:
    defined = sorted(
        name
        for name, value in vars(lorasync.errors).items()
        if isinstance(value, type) and issubclass(value, (Exception, Warning)) and value.__module__ == "lorasync.errors"
    )
    assert lorasync.errors.__all__ == defined
