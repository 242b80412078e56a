"""The SGLang client against SGLang's own HTTP server (tests/peers/sglang_contract.py).

The peer runs in the SGLang venv (scripts/sglang-venv.sh): SGLang 0.5.23's FastAPI app, request
classes, LoRA manager checks and weight-update session, over an in-process CPU scheduler. Tests
skip when that venv is missing, and fail instead under LORASYNC_REQUIRE_SGLANG=1 (CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import lorasync
from lorasync import Adapter
from lorasync.runtime._retry import RetryPolicy
from lorasync.engines import connect
from lorasync.engines.sglang import SGLangEngine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    AdapterRejectedError,
    AuthenticationError,
    EngineError,
    EngineUnavailableError,
    IncompatibleAdapterError,
    RankTooLargeError,
)
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.testing._ports import group_listens
from support import free_port as _free_port

SERVER_FLAGS = [
    "--enable-lora",
    "--max-lora-rank", "16",
    "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
    "--max-loaded-loras", "4",
    "--tokenizer-worker-num", "1",
]  # fmt: skip
PROMPT = [5, 17, 42, 99]
PEER = Path(__file__).resolve().parents[1] / "peers" / "sglang_contract.py"  # SGLang's own app, tests/peers/


def _sglang_python() -> str | None:
    """The SGLang venv's python when it is ready (lorasync.testing.venvs: the ready marker)."""
    from lorasync.testing.venvs import engine_venv

    venv = engine_venv("sglang")
    return str(venv.python) if venv.ready else None


@contextlib.contextmanager
def _contract_server(model_dir: Path, log: Path, *extra: str) -> Iterator[str]:
    """Run the contract server (SGLang's app) on a free port; yield its URL; stop it."""
    python = _sglang_python()
    if python is None:
        from lorasync.testing.venvs import engine_venv

        message = engine_venv("sglang").problem or "SGLang venv missing: run scripts/sglang-venv.sh (or set LORASYNC_SGLANG_PYTHON)"
        if os.environ.get("LORASYNC_REQUIRE_SGLANG") == "1":
            pytest.fail(message)
        pytest.skip(message)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(lorasync.__file__).resolve().parents[1])}
    cmd = [python, str(PEER), "--host", "127.0.0.1", "--port", str(port),
           "--model-path", str(model_dir), *SERVER_FLAGS, *extra]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # the other pytest worker may be starting a vLLM meanwhile
        while True:
            if proc.poll() is not None:
                pytest.fail(f"SGLang contract server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                # only an answer from this peer's own socket counts (not another process's on the port)
                if httpx.get(f"{url}/_contract/requests", timeout=2).status_code == 200 and group_listens(proc.pid, port) is not False:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang contract server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def sglang_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a running contract server (SGLang's app), stopped after the module."""
    with _contract_server(tiny_model_dir, tmp_path_factory.mktemp("sglang") / "server.log") as url:
        yield url


class Peer:
    """The contract server's test routes: request log and fault injection."""

    def __init__(self, url: str) -> None:
        self.url = url

    def requests(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/_contract/requests").json())

    def calls(self) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests()]

    def reset(self) -> None:
        httpx.post(f"{self.url}/_contract/reset")

    def fail(self, path: str, status: int, times: int = 1) -> None:
        httpx.post(f"{self.url}/_contract/fail", json={"path": path, "status": status, "times": times})

    def lose(self, path: str, times: int = 1, status: int = 502) -> None:
        """The next ``times`` requests to ``path`` reach SGLang, which handles them; their answers
        are replaced by ``status`` (an answer lost after the request landed)."""
        httpx.post(f"{self.url}/_contract/fail", json={"path": path, "status": status, "times": times, "lose": True}).raise_for_status()

    def hold(self, lora_name: str) -> None:
        """Later /generate requests on ``lora_name`` stay in flight (adapter acquired) until released."""
        httpx.post(f"{self.url}/_contract/hold", json={"lora_name": lora_name}).raise_for_status()

    def release(self, lora_name: str) -> None:
        httpx.post(f"{self.url}/_contract/release", json={"lora_name": lora_name}).raise_for_status()

    def inflight(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/_contract/inflight").json())

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.inflight()
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"the peer never reached the expected state: {state}")
            time.sleep(0.05)


def clean_peer(url: str) -> Iterator[Peer]:
    """The server at ``url`` cleaned for a test: no adapters, no open session, empty log;
    afterwards every body the client sent must have decoded into SGLang's request class with
    no ignored key."""
    client = SGLangEngine(url)
    for name in client.list_adapters():
        client.unload_adapter(name)
    httpx.post(f"{url}/end_weight_update", json={})
    client.close()
    p = Peer(url)
    p.reset()
    yield p
    ignored = [(r["path"], r["unknown"]) for r in p.requests() if r.get("unknown")]
    assert not ignored, f"SGLang would silently ignore these request fields: {ignored}"


@pytest.fixture
def peer(sglang_server: str) -> Iterator[Peer]:
    yield from clean_peer(sglang_server)


@pytest.fixture
def engine(peer: Peer) -> Any:
    with SGLangEngine(peer.url, retries=RetryPolicy(attempts=3, backoff=0.01, jitter=0.0)) as client:
        yield client


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapter directories saved by PEFT itself."""
    root = tmp_path_factory.mktemp("adapters")
    specs: dict[str, dict[str, Any]] = {
        "qkvo": dict(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
        "qv": dict(r=4, alpha=8, targets=("q_proj", "v_proj"), seed=2),
        "rank32": dict(r=32, alpha=32, targets=("q_proj", "v_proj"), seed=3),
        "mlp": dict(r=8, alpha=16, targets=("q_proj", "v_proj", "down_proj"), seed=4),
        "q_only": dict(r=8, alpha=16, targets=("q_proj",), seed=5),
        "rslora": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=6, use_rslora=True),
        # per-module ranks with one global scale (2): SGLang-safe once padded
        "mixed": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=7, rank_pattern={"q_proj": 4}, alpha_pattern={"q_proj": 8}),
    }
    out = {}
    for name, spec in specs.items():
        model = make_peft_model(make_tiny_model(), **spec)
        model.save_pretrained(str(root / name))
        out[name] = root / name
    return out


def _reference(model_dir: Path, adapter_dir: Path | None, steps: int = 4) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs from PEFT on the same base model (the trainer's view)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    ids, out, logprobs = list(PROMPT), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out.append(token)
            ids.append(token)
    return out, logprobs


# -- capabilities -------------------------------------------------------------------------


def test_capabilities_come_from_server_info(engine: SGLangEngine, peer: Peer) -> None:
    caps = engine.capabilities()
    assert (caps.engine, caps.lora, caps.runtime_lora, caps.max_rank, caps.max_loras) == ("sglang", True, True, 16, 4)
    # SGLang compares packed modules: q_proj..v_proj are one qkv_proj, gate/up are not served.
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= caps.target_modules
    assert not {"gate_proj", "up_proj", "down_proj"} & caps.target_modules
    assert caps.tensor_load and caps.weight_update and not caps.load_inplace
    # 0.5.23 and later: the tensor protocol is read from the routes the server offers.
    assert peer.calls() == [("GET", "/server_info"), ("GET", "/openapi.json")]
    assert any("/load_lora_adapter_from_tensors" in note for note in caps.notes)


def test_connect_builds_the_sglang_client(peer: Peer) -> None:
    with connect("sglang", peer.url) as client:
        assert isinstance(client, SGLangEngine)
        assert client.list_adapters() == []


# -- load / list / unload ---------------------------------------------------------------------


def test_disk_load_serves_the_adapter_like_peft(
    engine: SGLangEngine, adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    engine.load_adapter("qkvo@v1", adapters["qkvo"])
    assert engine.list_adapters() == ["qkvo@v1"]
    tokens, logprobs = _reference(tiny_model_dir, adapters["qkvo"])
    served = engine.generate(PROMPT, lora_name="qkvo@v1", max_new_tokens=4, return_logprob=True)
    assert list(served.output_ids) == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-4)
    base = engine.generate(PROMPT, max_new_tokens=4)
    assert list(base.output_ids) == _reference(tiny_model_dir, None)[0] != tokens
    engine.unload_adapter("qkvo@v1")
    assert engine.list_adapters() == []


def test_tensor_load_reaches_sglang_exactly(
    engine: SGLangEngine, peer: Peer, adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    adapter = Adapter.load(adapters["qv"])
    engine.load_adapter_tensors("qv@v1", adapter)
    assert engine.list_adapters() == ["qv@v1"]
    tokens, logprobs = _reference(tiny_model_dir, adapters["qv"])
    served = engine.generate(PROMPT, lora_name="qv@v1", max_new_tokens=4, return_logprob=True)
    assert list(served.output_ids) == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-4)
    (load,) = [r for r in peer.requests() if r["path"] == "/load_lora_adapter_from_tensors"]
    assert load["keys"] == ["config_dict", "expected_checksums", "lora_name", "serialized_named_tensors"]
    assert len(load["body"]["serialized_named_tensors"]) == 1  # one payload per TP rank (tp_size 1)
    assert set(load["body"]["expected_checksums"]) == set(adapter.tensors)
    assert load["body"]["config_dict"]["peft_type"] == "LORA"


def test_mixed_ranks_are_padded_exactly(
    engine: SGLangEngine, adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    adapter = Adapter.load(adapters["mixed"])
    with pytest.raises(IncompatibleAdapterError, match="pad_ranks"):
        engine.preflight(adapter)  # from disk SGLang would fail at the first batch
    engine.load_adapter_tensors("mixed@v1", adapter)
    tokens, logprobs = _reference(tiny_model_dir, adapters["mixed"])
    served = engine.generate(PROMPT, lora_name="mixed@v1", max_new_tokens=4, return_logprob=True)
    assert list(served.output_ids) == tokens
    assert served.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_bf16_tensor_load(engine: SGLangEngine, adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    engine.load_adapter_tensors("bf16@v1", Adapter.load(adapters["qkvo"]).to(dtype=torch.bfloat16))
    served = engine.generate(PROMPT, lora_name="bf16@v1", max_new_tokens=4)
    assert list(served.output_ids) == _reference(tiny_model_dir, adapters["qkvo"])[0]


def test_async_twins(engine: SGLangEngine, adapters: dict[str, Path], tiny_model_dir: Path) -> None:
    async def scenario() -> tuple[Any, ...]:
        caps = await engine.acapabilities()
        await engine.apreflight(Adapter.load(adapters["qv"]))
        await engine.aload_adapter("a@v1", adapters["qkvo"])
        await engine.aload_adapter_tensors("b@v1", Adapter.load(adapters["qv"]))
        names = await engine.alist_adapters()
        out = await engine.agenerate(PROMPT, lora_name="b@v1", max_new_tokens=4)
        with pytest.raises(AdapterAlreadyLoadedError):
            await engine.aload_adapter("a@v1", adapters["qkvo"])
        await engine.aunload_adapter("a@v1")
        await engine.aunload_adapter("b@v1")
        with pytest.raises(AdapterNotFoundError):
            await engine.aunload_adapter("b@v1")
        return caps, names, out, await engine.alist_adapters()

    caps, names, out, after = asyncio.run(scenario())
    assert caps.max_rank == 16
    assert names == ["a@v1", "b@v1"]
    assert list(out.output_ids) == _reference(tiny_model_dir, adapters["qv"])[0]
    assert after == []


# -- errors the server raises, mapped ---------------------------------------------------------


def test_duplicate_name_is_already_loaded_and_keeps_serving(engine: SGLangEngine, adapters: dict[str, Path]) -> None:
    engine.load_adapter("pol", adapters["qkvo"])
    with pytest.raises(AdapterAlreadyLoadedError, match="unload it first") as info:
        engine.load_adapter("pol", adapters["qv"])
    assert (info.value.status, info.value.adapter, info.value.engine) == (400, "pol", "sglang")
    assert engine.list_adapters() == ["pol"]


def test_unload_unknown_name(engine: SGLangEngine) -> None:
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        engine.unload_adapter("never-loaded")


def test_rank_above_server_max_is_rank_too_large(engine: SGLangEngine, adapters: dict[str, Path]) -> None:
    with pytest.raises(RankTooLargeError) as info:
        engine.load_adapter("big", adapters["rank32"])
    assert (info.value.rank, info.value.max_rank) == (32, 16)


def test_modules_outside_server_targets_are_incompatible(engine: SGLangEngine, adapters: dict[str, Path]) -> None:
    with pytest.raises(IncompatibleAdapterError, match="lora-target-modules"):
        engine.load_adapter("mlp", adapters["mlp"])


def test_missing_directory_is_not_found(engine: SGLangEngine, tmp_path: Path) -> None:
    with pytest.raises(AdapterNotFoundError, match="server's host"):
        engine.load_adapter("ghost", tmp_path / "no-such-adapter")


def test_sglang_rejects_q_without_v(engine: SGLangEngine, adapters: dict[str, Path]) -> None:
    # SGLang's own q/k/v packing needs v_proj; its error is a bare KeyError text.
    with pytest.raises(AdapterRejectedError, match="v_proj"):
        engine.load_adapter("q", adapters["q_only"])
    assert engine.list_adapters() == []


def test_generate_with_unknown_adapter(engine: SGLangEngine) -> None:
    with pytest.raises(AdapterNotFoundError, match="never been loaded"):
        engine.generate(PROMPT, lora_name="nobody", max_new_tokens=2)


# -- pre-flight: refused before any bytes move ----------------------------------------------


@pytest.mark.parametrize(
    ("which", "error", "match"),
    [
        ("rank32", RankTooLargeError, "max LoRA rank 16"),
        ("mlp", IncompatibleAdapterError, "down_proj"),
        ("rslora", IncompatibleAdapterError, "normalize_scaling"),
        ("q_only", IncompatibleAdapterError, "v_proj"),
    ],
)
def test_preflight_refuses_before_any_load_request(
    engine: SGLangEngine, peer: Peer, adapters: dict[str, Path], which: str, error: type, match: str
) -> None:
    adapter = Adapter.load(adapters[which])
    with pytest.raises(error, match=match):
        engine.load_adapter_tensors(which, adapter)
    with pytest.raises(error, match=match):
        engine.preflight(adapter)
    # The refusals come first: not even the routes are read, and no load reached the server.
    assert peer.calls() == [("GET", "/server_info")] * 2


@pytest.mark.parametrize(("which", "match"), [("rslora", "normalize_scaling"), ("q_only", "v_proj")])
def test_disk_publish_is_prechecked_by_sglangs_rules(
    engine: SGLangEngine, peer: Peer, adapters: dict[str, Path], tmp_path: Path, which: str, match: str
) -> None:
    """The publisher runs SGLang's rules for the disk route too: nothing is written or loaded."""
    from lorasync import Publisher

    pub = Publisher([engine], name=which, transport="disk", root=tmp_path, keep=1)
    report = pub.publish(Adapter.load(adapters[which]), version=1)
    (result,) = report.results
    assert not report.ok and isinstance(result.error, IncompatibleAdapterError), report
    assert match in str(result.error)
    assert not any(path.startswith("/load_lora_adapter") for _, path in peer.calls())
    assert not (tmp_path / which / "v1").exists()
    assert engine.list_adapters() == []


# -- retries ----------------------------------------------------------------------------------


def test_5xx_is_retried_then_succeeds(engine: SGLangEngine, peer: Peer, adapters: dict[str, Path]) -> None:
    peer.fail("/load_lora_adapter", 503, times=2)
    engine.load_adapter("flaky", adapters["qkvo"])
    assert engine.list_adapters() == ["flaky"]
    assert peer.calls().count(("POST", "/load_lora_adapter")) == 3


def test_5xx_past_the_budget_is_unavailable(engine: SGLangEngine, peer: Peer, adapters: dict[str, Path]) -> None:
    peer.fail("/load_lora_adapter", 502, times=5)
    with pytest.raises(EngineUnavailableError) as info:
        engine.load_adapter("down", adapters["qkvo"])
    assert (info.value.status, info.value.attempts) == (502, 3)


def test_4xx_is_not_retried(engine: SGLangEngine, peer: Peer, adapters: dict[str, Path]) -> None:
    engine.load_adapter("once", adapters["qkvo"])
    peer.reset()
    with pytest.raises(AdapterAlreadyLoadedError):
        engine.load_adapter("once", adapters["qkvo"])
    assert peer.calls() == [("POST", "/load_lora_adapter")]


# -- merged fallback: weight updates ---------------------------------------------------------


def _lm_head(model_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))["lm_head.weight"]


def test_update_weights_runs_in_one_session(engine: SGLangEngine, peer: Peer, tiny_model_dir: Path) -> None:
    before = engine.generate(PROMPT, max_new_tokens=4).output_ids
    head = _lm_head(tiny_model_dir)
    engine.weight_bucket_bytes = head.numel() * head.element_size()  # one tensor per request
    engine.update_weights({"lm_head.weight": head.flip(0), "model.norm.weight": torch.full((256,), 2.0)})
    changed = engine.generate(PROMPT, max_new_tokens=4).output_ids
    assert changed != before
    posts = [r for r in peer.requests() if r["method"] == "POST" and r["path"] != "/generate"]
    assert [r["path"] for r in posts] == [
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",
        "/end_weight_update",
    ]
    assert [r["body"]["flush_cache"] for r in posts[1:3]] == [False, True]  # flush once, at the end
    engine.update_weights_from_disk(tiny_model_dir)
    assert engine.generate(PROMPT, max_new_tokens=4).output_ids == before


def test_failed_update_still_closes_the_session(engine: SGLangEngine, peer: Peer, tiny_model_dir: Path) -> None:
    head = _lm_head(tiny_model_dir)
    peer.fail("/update_weights_from_tensor", 503, times=3)
    with pytest.raises(EngineUnavailableError):
        engine.update_weights({"lm_head.weight": head})
    assert peer.calls()[-1] == ("POST", "/end_weight_update")
    engine.update_weights({"lm_head.weight": head})  # no session left open


def test_pre_0_5_23_protocol_is_refused_by_a_0_5_23_server(peer: Peer, tiny_model_dir: Path) -> None:
    with SGLangEngine(peer.url, version="0.5.17") as old:
        with pytest.raises(EngineError, match="begin_weight_update.*version='0.5.23'"):
            old.update_weights({"lm_head.weight": _lm_head(tiny_model_dir)})
    assert ("POST", "/begin_weight_update") not in peer.calls()


def test_version_auto_reads_server_info(peer: Peer, adapters: dict[str, Path]) -> None:
    with SGLangEngine(peer.url, version="auto") as client:
        client.load_adapter_tensors("auto@v1", Adapter.load(adapters["qv"]))
        assert client.list_adapters() == ["auto@v1"]
    assert peer.calls()[0] == ("GET", "/server_info")


# -- auth (SGLang's own API-key middleware) ----------------------------------------------------


def test_api_key(tiny_model_dir: Path, tmp_path: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with _contract_server(tiny_model_dir, tmp_path / "server.log", "--api-key", "s3cret") as url:
        with SGLangEngine(url) as anonymous, pytest.raises(AuthenticationError, match="api_key") as info:
            anonymous.load_adapter("a", adapters["qkvo"])
        assert info.value.status == 401
        monkeypatch.setenv("SGLANG_API_KEY", "s3cret")
        with SGLangEngine(url) as client:
            client.load_adapter("a", adapters["qkvo"])
            assert client.list_adapters() == ["a"]
            assert "s3cret" not in repr(client)


@pytest.mark.parametrize("transport", ["disk", "ipc"])
def test_publisher_serves_trained_weights_on_sglang(transport: str, engine: SGLangEngine, tiny_model_dir: Path, tmp_path: Path) -> None:
    """publish_adapter end to end on SGLang's own HTTP layer: versions switch, probes verify."""
    from transformers import AutoModelForCausalLM

    from lorasync import Probe, Publisher
    from lorasync.exporters.fsdp import export

    pub = Publisher([engine], name="pol", transport=transport, root=tmp_path, keep=1)
    outputs = []
    for version, seed in ((1, 61), (2, 62)):
        model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=seed, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
        probe = Probe.from_model(model, [5, 17, 99, 230], max_tokens=4, atol=1e-3)
        report = pub.publish(export(model), version=version, verify=probe).settled()
        assert report.ok, report
        assert report.results[0].transport == transport
        outputs.append(engine.greedy(report.served_name, [5, 17, 99, 230], 4)[0])
        assert outputs[-1] == list(probe.expected_ids)
    assert outputs[0] != outputs[1]
    assert engine.list_adapters() == ["pol@v2"]


def test_merged_publish_on_sglang_is_one_session(engine: SGLangEngine, peer: Peer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The merged fallback folds from the pristine base and brackets every bucket in ONE
    weight-update session, so no request sees half an update."""
    from transformers import AutoModelForCausalLM

    from lorasync import Probe, Publisher
    from lorasync.exporters.fsdp import export

    model = make_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), seed=71, targets=("q_proj", "k_proj", "v_proj", "down_proj"))
    pub = Publisher([engine], name="m", transport="merged", root=tmp_path, base=tiny_model_dir, bucket_bytes=1 << 18)
    try:
        report = pub.publish(export(model), version=1)
        assert report.ok, report
        calls = [path for _, path in peer.calls() if "weight" in path]
        assert calls[0] == "/begin_weight_update" and calls[-1] == "/end_weight_update"
        assert calls.count("/begin_weight_update") == 1 and calls.count("/update_weights_from_tensor") > 1
        expected = Probe.from_model(model, [5, 17, 99, 230], max_tokens=4).expected_ids
        assert engine.greedy(None, [5, 17, 99, 230], 4)[0] == list(expected)
    finally:
        pub.restore_base()


# -- requests in flight: what SGLang 0.5.23's own unload does with them -----------------------


def test_unload_waits_for_requests_in_flight_and_blocks_loads_meanwhile(
    engine: SGLangEngine, peer: Peer, adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    """A request holding v1 keeps it through v2's load and v1's unload: SGLang unregisters v1 at
    once (no longer listed) but answers the unload only after the request released it, and holds
    its LoRA update lock meanwhile, so v3's load waits too. The held request then decodes exactly
    the tokens of an undisturbed v1 run. After the unload a request naming v1 makes SGLang
    reload it from its path (the files must still be there)."""
    engine.load_adapter("pol@v1", adapters["qkvo"])
    expected = _reference(tiny_model_dir, adapters["qkvo"], steps=6)[0]
    peer.hold("pol@v1")
    clients = [SGLangEngine(peer.url, timeout=120) for _ in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:
            long = pool.submit(clients[0].generate, PROMPT, lora_name="pol@v1", max_new_tokens=6)
            state = peer.wait_for(lambda s: any(r["held"] for r in s["requests"]))
            assert state["in_use"] == {"pol@v1": 1}
            assert engine.adapters_in_use() is None  # no SGLang route reports it: see the docs
            engine.load_adapter("pol@v2", adapters["qv"])  # loads while v1 is in use
            unload = pool.submit(clients[1].unload_adapter, "pol@v1")
            peer.wait_for(lambda s: s["unloading"] == ["pol@v1"] and "pol@v1" not in s["registered"])
            assert engine.list_adapters() == ["pol@v2"]
            load3 = pool.submit(clients[2].load_adapter, "pol@v3", adapters["qv"])
            time.sleep(1.0)
            assert not unload.done() and not load3.done() and not long.done()
            assert peer.inflight()["in_use"] == {"pol@v1": 1}
            peer.release("pol@v1")
            assert list(long.result(timeout=120).output_ids) == expected
            unload.result(timeout=120)
            load3.result(timeout=120)
        assert engine.list_adapters() == ["pol@v2", "pol@v3"]
        assert peer.inflight() == {"requests": [], "in_use": {}, "registered": ["pol@v2", "pol@v3"], "unloading": []}
        # SGLang's implicit reload: a request on the unloaded name loads it again from its path.
        again = engine.generate(PROMPT, lora_name="pol@v1", max_new_tokens=6)
        assert list(again.output_ids) == expected
        assert "pol@v1" in engine.list_adapters()
    finally:
        peer.release("pol@v1")
        for client in clients:
            client.close()


def test_publisher_keeps_a_held_version_serving_until_its_request_finished(
    peer: Peer, adapters: dict[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through the publisher, keep=1: a request held on v1 keeps decoding while v2 and v3 are
    published. SGLang cannot report it, but its unload waits for it: v2 serves at once and the
    publish of v2 returns then (the retirement of v1 runs after it), the report settles once v1's
    request finished (with exactly the undisturbed tokens), v1's files are still there for
    SGLang's implicit reload, and v3 then publishes normally."""
    from lorasync import Publisher

    expected = _reference(tiny_model_dir, adapters["qkvo"], steps=6)[0]
    engine = SGLangEngine(peer.url, timeout=120)
    pub = Publisher([engine], name="pol", keep=1, transport="disk", root=tmp_path)
    requester = SGLangEngine(peer.url, timeout=120)
    try:
        assert pub.publish(Adapter.load(adapters["qkvo"]), version=1).ok
        v1_dir = pub.store.path_for("pol", 1)
        peer.hold("pol@v1")
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(requester.generate, PROMPT, lora_name="pol@v1", max_new_tokens=6)
            peer.wait_for(lambda s: any(r["held"] for r in s["requests"]))
            publish2 = pool.submit(pub.publish, Adapter.load(adapters["qv"]), version=2)
            peer.wait_for(lambda s: s["unloading"] == ["pol@v1"] and "pol@v2" in s["registered"])
            report2 = publish2.result(timeout=60)  # v2 serves: the publish does not wait for v1's drain
            assert report2.ok and report2.served_name == "pol@v2", report2
            settling = pool.submit(report2.settled)
            time.sleep(0.5)
            assert not long.done() and not settling.done()  # v1's request still decodes; its unload waits
            assert (v1_dir / "adapter_model.safetensors").is_file()
            peer.release("pol@v1")
            assert list(long.result(timeout=120).output_ids) == expected
            settling.result(timeout=120)
        assert report2.ok and report2.results[0].retired == ["pol@v1"], report2
        assert (v1_dir / "adapter_model.safetensors").is_file()  # outlives the unload by the grace
        report3 = pub.publish(Adapter.load(adapters["qkvo"]), version=3).settled()  # other content than v2 (qv)
        assert report3.ok and engine.list_adapters() == ["pol@v3"], report3
        assert list(engine.generate(PROMPT, lora_name="pol@v3", max_new_tokens=6).output_ids) == expected
    finally:
        peer.release("pol@v1")
        pub.close()
        requester.close()
