"""``lorasync.engines.vllm.guard.AdminRouteGuard`` on a real vLLM server: the dev-mode admin
routes (``/collective_rpc`` above all) need the API key, which vLLM's own ``--api-key`` does
not ask for there, and lorasync's client with the key still reaches everything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lorasync.engines import connect
from lorasync.errors import AuthenticationError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.testing.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm

API_KEY = "guard-test-key"  # a test value, not a secret
SMALL = ("--max-num-seqs", "4", "--max-model-len", "256")


@pytest.fixture(scope="module")
def guarded(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        served_model_name="tiny-base",
        env={"VLLM_API_KEY": API_KEY},  # vLLM's --api-key and the guard both read it
        extra_args=(
            *SMALL,
            "--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension",
            "--middleware", "lorasync.engines.vllm.guard.AdminRouteGuard",
        ),  # fmt: skip
        log_path=tmp_path_factory.mktemp("vllm-logs") / "vllm-guarded.log",
    )
    with server:
        yield server


def test_admin_routes_need_the_key(guarded: VLLMServer) -> None:
    rpc = {"method": "lorasync_ping"}
    assert httpx.post(f"{guarded.url}/collective_rpc", json=rpc).status_code == 401
    assert httpx.get(f"{guarded.url}/server_info").status_code == 401
    assert httpx.post(f"{guarded.url}/pause").status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.post(f"{guarded.url}/collective_rpc", json=rpc, headers=wrong).status_code == 401
    ok = httpx.post(f"{guarded.url}/collective_rpc", json=rpc, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["results"] == ["lorasync:cuda_updates"]  # the worker answered
    # Health and metrics stay open for load balancers and scrapers.
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_the_client_with_the_key_loads_tensors(guarded: VLLMServer) -> None:
    with connect("vllm", guarded.url, api_key=API_KEY) as engine:
        caps = engine.capabilities()
        assert (caps.tensor_load, caps.max_rank) == (True, 16)
        adapter = export(make_peft_model(make_tiny_model(), r=8, seed=5))
        engine.load_adapter_tensors("guarded@v1", adapter)
        assert engine.list_adapters() == ["guarded@v1"]
        engine.unload_adapter("guarded@v1")
    with connect("vllm", guarded.url, api_key="not-the-key") as stranger, pytest.raises(AuthenticationError):
        stranger.capabilities()
