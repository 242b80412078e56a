"""The PEFT engine's adapters: one ``PeftModel`` wrapping the base model while at least one is
loaded, and which internal PEFT adapter name (slot) serves each served name.

Served names map to slots (``slot0``, ``slot1`` ...), so any name (``"policy@v3"``,
``"qwen-1.5"``) works even though PEFT forbids dots in its own. When the last adapter is
unloaded, PEFT's ``unload()`` puts the original modules back (same parameters, so in-place
weight updates survive). Every change is rolled back on failure. The caller holds the lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from lorasync.adapter._adapter import Adapter
from lorasync.engines.peft._errors import check_load_result, translated
from lorasync.engines.peft._inject import plan
from lorasync.engines.peft._model import KIND, quiet_foreign_warnings
from lorasync.errors import AdapterNotFoundError

logger = logging.getLogger("lorasync")


class AdapterSlots:
    """The base model, the ``PeftModel`` around it (None while no adapter is loaded) and
    ``names``: served name -> slot, in load order."""

    def __init__(self, base: Any, *, kind: str = KIND) -> None:
        self.base = base
        self.peft: Any = None
        self.names: dict[str, str] = {}
        self._kind = kind
        self._ids = itertools.count()

    @property
    def serving(self) -> Any:
        """The module that serves now: the ``PeftModel`` while adapters are loaded, else the base."""
        return self.peft if self.peft is not None else self.base

    def slot(self, name: str) -> str:
        """The slot ``name`` is served from.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        slot = self.names.get(name)
        if slot is None:
            raise AdapterNotFoundError(
                f"adapter {name!r} is not loaded in the peft engine; loaded: {sorted(self.names)}",
                engine=self._kind,
                adapter=name,
            )
        return slot

    def add(self, name: str, adapter: Adapter) -> None:
        """Inject ``adapter``'s LoRA layers into a fresh slot, copy its tensors in, and serve it as
        ``name``; on any failure everything is as before."""
        from peft import get_peft_model, set_peft_model_state_dict

        slot = f"slot{next(self._ids)}"
        created = self.peft is None
        with translated("load", name, kind=self._kind):
            injection = plan(adapter, self.base, kind=self._kind, name=name)
            try:
                with quiet_foreign_warnings():
                    if created:
                        self.peft = get_peft_model(self.base, injection.config, adapter_name=slot)
                    else:
                        self.peft.add_adapter(slot, injection.config)
                    state = injection.state_dict(adapter, self.peft, slot)
                    result = set_peft_model_state_dict(self.peft, state, adapter_name=slot)
                check_load_result(result, slot, name)
                self.peft.eval()
            except BaseException:
                try:
                    self._rollback(slot, created)
                except Exception:  # keep the load's own error; the rollback's goes to the log
                    logger.exception("peft engine: rolling back adapter %r failed", name)
                raise
        self.names[name] = slot

    def swap(self, name: str, adapter: Adapter) -> None:
        """Make the loaded ``name`` serve ``adapter``: loaded into a fresh slot first, then the
        name switches to it and the old slot is freed."""
        old = self.slot(name)
        staging = f"{name}\0next"  # NUL: never a user's name
        self.add(staging, adapter)
        new = self.names.pop(staging)
        self.names[name] = new
        with translated("replace", name, kind=self._kind):
            self.peft.set_adapter(new, inference_mode=True)
            self.peft.delete_adapter(old)

    def remove(self, name: str) -> None:
        """Stop serving ``name`` and free its slot.

        Raises:
            AdapterNotFoundError: ``name`` is not loaded.
        """
        slot = self.slot(name)
        with translated("unload", name, kind=self._kind):
            if len(self.names) == 1:
                self.base = self.peft.unload()  # the last one: the original modules come back
                self.peft = None
            else:
                remaining = next(s for n, s in self.names.items() if n != name)
                self.peft.set_adapter(remaining, inference_mode=True)  # never delete the active one
                self.peft.delete_adapter(slot)
        del self.names[name]

    @contextlib.contextmanager
    def active(self, adapter: str | None) -> Iterator[Any]:
        """The model to run with only ``adapter`` applied (None: no adapter at all)."""
        if adapter is None:
            if self.peft is None:
                yield self.base
            else:
                with self.peft.disable_adapter():
                    yield self.peft
            return
        self.peft.set_adapter(self.slot(adapter), inference_mode=True)
        yield self.peft

    def _rollback(self, slot: str, created: bool) -> None:
        if self.peft is None:
            return
        if created:
            self.base = self.peft.unload()
            self.peft = None
        elif slot in self.peft.peft_config:
            if self.peft.active_adapter == slot:
                self.peft.set_adapter(next(iter(self.names.values())), inference_mode=True)
            self.peft.delete_adapter(slot)
