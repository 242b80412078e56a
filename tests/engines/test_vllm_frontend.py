"""The in-process vLLM Frontend's own rules, on frontends vLLM 0.32 does not have (no vLLM needed).

The real LLM and AsyncLLM are covered by ``test_vllm_inprocess_trust.py``; here are the paths
that vLLM 0.32 never takes: an engine core client lorasync cannot serialise (another vLLM), where
a call that would overlap the caller's generate must be refused with a typed error instead.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from lorasync.engines.vllm._frontend import Frontend
from lorasync.errors import AdapterNotFoundError, ConfigError


class _Processor:
    def __init__(self) -> None:
        self.request_states: dict[str, Any] = {}

    def add_request(self, request: Any, *args: Any) -> None:
        self.request_states[request.request_id] = SimpleNamespace(lora_request=request.lora_request)


class _UnknownClient:
    def add_lora(self, request: Any) -> bool:
        return True


def _core(client: Any) -> Any:
    return SimpleNamespace(engine_core=client, output_processor=_Processor())


def _request(request_id: str, lora_id: int | None) -> Any:
    lora = SimpleNamespace(lora_int_id=lora_id, lora_name=f"n{lora_id}") if lora_id is not None else None
    return SimpleNamespace(request_id=request_id, lora_request=lora)


def test_an_unserialisable_client_refuses_calls_while_requests_run() -> None:
    core = _core(_UnknownClient())
    frontend = Frontend.of(core, is_async=False)
    assert not frontend.serialised and Frontend.of(core, is_async=False) is frontend
    frontend.check_idle("vllm-inprocess")  # idle: fine
    core.output_processor.add_request(_request("r1", None))
    with pytest.raises(ConfigError, match="between llm.generate calls"):
        frontend.check_idle("vllm-inprocess")


def test_sends_of_two_threads_never_overlap() -> None:
    inside, overlaps = [0], []

    class Client:
        def _send_input(self, kind: str, payload: Any) -> None:
            inside[0] += 1
            if inside[0] > 1:
                overlaps.append(payload)
            time.sleep(0.001)
            inside[0] -= 1

    client = Client()
    frontend = Frontend.of(_core(client), is_async=False)
    assert frontend.serialised
    threads = [threading.Thread(target=lambda: [client._send_input("ADD", i) for i in range(50)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == []


def test_retired_ids_are_refused_at_admission_and_their_source_waits_for_running_requests() -> None:
    core = _core(_UnknownClient())
    frontend = Frontend.of(core, is_async=False)
    core.output_processor.add_request(_request("running", 7))  # admitted before the retirement
    frontend.retire(7, "p@v1")
    with pytest.raises(AdapterNotFoundError, match="retired"):
        core.output_processor.add_request(_request("late", 7))
    core.output_processor.add_request(_request("other", 8))  # other versions are admitted
    assert frontend.keep_or_release(7, "token-7") is None  # a request still names it
    assert frontend.releasable() == []
    del core.output_processor.request_states["running"]
    assert frontend.releasable() == ["token-7"] and not frontend.pending
    assert frontend.keep_or_release(9, "token-9") == "token-9"  # nothing uses it: release now
