"""Errors that name the fix (issue 37): every CapabilityError and StaleVersionError a user can meet
says what to change: the engine's flag or environment variable, ``base=``, ``transport=``,
``name=``, the version numbering, ``run=``. The refusals come from the code that raises them
(transport selection with a real vLLM client's remedies, the ledger's monotonic check, the
engine base class); tests/cli/test_cli_vllm_first_day.py and tests/engines/test_vllm_flags.py
meet the same ones through a real vLLM server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorasync.publisher._retention import Ledger
from lorasync.publisher._select import choose_transport
from lorasync.engines._engine import Capabilities, Engine
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import CapabilityError, ConfigError, RuntimeLoraDisabledError, StaleVersionError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.transports._store import DiskStore
from lorasync.transports.disk import DiskTransport
from lorasync.transports.ipc import IPCTransport

DEV = "VLLM_SERVER_DEV_MODE=1"
EXT = "--worker-extension-cls lorasync.engines.vllm_worker.LoraSyncWorkerExtension"
RUNTIME = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"


@pytest.fixture(scope="module")
def adapter():
    return export(make_peft_model(make_tiny_model(), r=8, seed=2))


class _NoMerge:
    """A merged transport the engine cannot take (what selection asks of it: ``unsupported``)."""

    name, versioned = "merged", False

    def unsupported(self, caps: Capabilities) -> str | None:
        return None if caps.weight_update else "engine has no weight-update route"


def _candidates(tmp_path: Path, *, merged: bool) -> dict:
    return {"disk": DiskTransport(DiskStore(tmp_path / "store")), "ipc": IPCTransport(), "merged": _NoMerge() if merged else None}


def _caps(**kw) -> Capabilities:
    return Capabilities(engine="vllm", url="http://127.0.0.1:8000", **kw)


def test_runtime_lora_off_is_runtime_lora_disabled_naming_the_variable(adapter, tmp_path: Path) -> None:
    engine = VLLMEngine("http://127.0.0.1:8000")
    with pytest.raises(RuntimeLoraDisabledError) as caught:
        choose_transport("auto", engine, _caps(runtime_lora=False), adapter, _candidates(tmp_path, merged=False))
    message = str(caught.value)
    assert isinstance(caught.value, CapabilityError)  # still what callers caught before
    assert RUNTIME in message and "--api-server-count 1" in message
    assert "base=" in message and DEV in message and EXT in message  # the merged way, in full


def test_merged_requested_names_dev_mode_and_the_worker_extension(adapter, tmp_path: Path) -> None:
    # The recipes' merged block against the server getting-started starts (issue 37, item 2).
    engine = VLLMEngine("http://127.0.0.1:8000")
    with pytest.raises(CapabilityError) as caught:
        choose_transport("merged", engine, _caps(), adapter, _candidates(tmp_path, merged=True))
    assert DEV in str(caught.value) and EXT in str(caught.value)
    with pytest.raises(ConfigError, match="base=.*--base DIR"):
        choose_transport("merged", engine, _caps(), adapter, _candidates(tmp_path, merged=False))


def test_ipc_requested_names_the_flags_or_disk(adapter, tmp_path: Path) -> None:
    engine = VLLMEngine("http://127.0.0.1:8000")
    with pytest.raises(CapabilityError) as caught:
        choose_transport("ipc", engine, _caps(), adapter, _candidates(tmp_path, merged=False))
    assert DEV in str(caught.value) and EXT in str(caught.value) and "transport='disk'" in str(caught.value)


def test_in_process_vllm_names_its_constructor_argument(adapter, tmp_path: Path) -> None:
    from lorasync.engines.vllm.inprocess import VLLMInProcessEngine

    engine = VLLMInProcessEngine.__new__(VLLMInProcessEngine)  # remedies are the class's: no vllm.LLM needed
    with pytest.raises(CapabilityError, match="worker_extension_cls="):
        choose_transport("merged", engine, _caps(in_process=True), adapter, _candidates(tmp_path, merged=True))


def test_stale_version_names_every_way_out() -> None:
    ledger = Ledger()
    ledger.versions = {3: "h3"}
    with pytest.raises(StaleVersionError) as caught:
        ledger.check_monotonic("policy", versioned=True, version=1, digest="h1")
    message = str(caught.value)
    assert "would replace v3" in message
    assert "name='policy-2'" in message  # a new name=
    assert "version=3 + step" in message  # a version offset
    assert "run=" in message  # and what run= does and does not do


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (lambda e: e.load_adapter_tensors("x", None), "transport='disk'"),
        (lambda e: e.replace_adapter("x", "/p"), "in_place=False"),
        (lambda e: e.replace_adapter_tensors("x", None), "in_place=False"),
        (lambda e: e.update_weights({}), "transport='disk'"),
        (lambda e: e.greedy(None, [1], 1), "without verify="),
    ],
)
def test_an_engine_without_an_operation_says_what_to_use_instead(call, fix: str) -> None:
    class Bare(Engine):
        kind = "bare"

    with pytest.raises(CapabilityError, match=fix.replace("(", r"\(")):
        call(Bare())
