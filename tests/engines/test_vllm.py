"""VLLMEngine against the real vLLM 0.32 CPU server (one server for the whole run).

Adapters are exported by lorasync from PEFT models; the server's greedy tokens and logprobs are
compared with PEFT's own forward on the same base model.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from lorasync import RetryPolicy
from lorasync.engines import connect
from lorasync.engines.vllm import VLLMEngine
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    EngineError,
    IncompatibleAdapterError,
    RankTooLargeError,
)
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16], [400, 17])
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3  # fp32 on both sides; measured differences are ~1e-5


def unique(prefix: str) -> str:
    """A fresh versioned name: the server lives for the whole session."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}@v1"


def peft_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and their log-probabilities."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def peft_models() -> dict[str, Any]:
    return {
        "one": make_peft_model(make_tiny_model(), r=8, seed=1),
        "two": make_peft_model(make_tiny_model(), r=8, seed=7, std=0.08),
    }


@pytest.fixture(scope="module")
def adapter_dirs(peft_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT models exported by lorasync and saved in PEFT format (kept for the module's life)."""
    root = tmp_path_factory.mktemp("adapters")
    return {key: export(model).save(root / key) for key, model in peft_models.items()}


@pytest.fixture
def engine(vllm_server: Any) -> Iterator[VLLMEngine]:
    client = connect("vllm", vllm_server.url)
    assert isinstance(client, VLLMEngine)
    yield client
    client.close()


# -- capabilities and listing --------------------------------------------------------------------


def test_capabilities_read_from_the_dev_mode_server(engine: VLLMEngine) -> None:
    caps = engine.capabilities()
    assert (caps.engine, caps.url, caps.lora, caps.runtime_lora) == ("vllm", engine.url, True, True)
    # --max-lora-rank 16; capacity is the worker LRU (--max-cpu-loras 8), not the 4 GPU slots
    assert (caps.max_rank, caps.max_loras) == (16, 8)
    assert caps.target_modules is None
    # The session server loads lorasync's worker extension; vLLM 0.32 in-place reloads are unsafe.
    assert (caps.tensor_load, caps.weight_update, caps.load_inplace, caps.same_host) == (True, True, False, True)
    assert "vllm 0.32.0" in caps.notes


def test_worker_extension_hook(engine: VLLMEngine, vllm_server: Any) -> None:
    # The session server loads lorasync's extension: every worker answers the probe.
    assert engine._run(engine._has_worker_extension()) is True
    # A method the workers lack: the real server answers 500, the hook says False, the server lives on.
    engine.worker_extension_probe = "lorasync_no_such_method"  # type: ignore[misc]
    assert engine._run(engine._has_worker_extension()) is False
    assert httpx.get(f"{vllm_server.url}/health").status_code == 200


def test_list_excludes_the_base_model(engine: VLLMEngine) -> None:
    assert "tiny-base" not in engine.list_adapters()


# -- loading and serving ---------------------------------------------------------------------------


def test_load_serves_peft_greedy_tokens_and_logprobs(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], peft_models: dict[str, Any]
) -> None:
    name = unique("policy")
    engine.load_adapter(name, adapter_dirs["one"])
    assert name in engine.list_adapters()
    for prompt in PROMPTS:
        want_tokens, want_logprobs = peft_greedy(peft_models["one"], prompt, NEW_TOKENS)
        got = engine.generate(prompt, model=name, max_tokens=NEW_TOKENS)
        assert list(got.token_ids) == want_tokens, prompt
        assert got.logprobs is not None and got.top_logprobs is not None
        assert got.logprobs == pytest.approx(want_logprobs, abs=LOGPROB_ATOL)
        assert [max(step, key=step.get) for step in got.top_logprobs] == want_tokens
        assert engine.greedy(name, prompt, NEW_TOKENS)[0] == want_tokens
    engine.unload_adapter(name)


def test_second_adapter_changes_outputs_accordingly(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], peft_models: dict[str, Any]
) -> None:
    one, two = unique("one"), unique("two")
    engine.load_adapter(one, adapter_dirs["one"])
    engine.load_adapter(two, adapter_dirs["two"])
    outputs = {}
    for name, key in ((one, "one"), (two, "two")):
        outputs[key] = [list(engine.generate(p, model=name, max_tokens=NEW_TOKENS).token_ids) for p in PROMPTS]
        assert outputs[key] == [peft_greedy(peft_models[key], p, NEW_TOKENS)[0] for p in PROMPTS]
    assert outputs["one"] != outputs["two"]
    base = [list(engine.generate(p, model="tiny-base", max_tokens=NEW_TOKENS).token_ids) for p in PROMPTS]
    assert base not in (outputs["one"], outputs["two"])
    for name in (one, two):
        engine.unload_adapter(name)


def test_success_is_plain_text_without_content_type(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], vllm_server: Any
) -> None:
    # The premise of body_text/body_json: vLLM's 200 is not JSON. The client then parses it.
    name = unique("raw")
    response = httpx.post(
        f"{vllm_server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs["one"])}
    )
    assert response.status_code == 200
    assert "content-type" not in response.headers
    assert response.text == f"Success: LoRA adapter '{name}' added successfully."
    engine.unload_adapter(name)  # plain-text 200 parsed as success
    assert name not in engine.list_adapters()


def test_unload_stops_serving(engine: VLLMEngine, adapter_dirs: dict[str, Path]) -> None:
    name = unique("gone")
    engine.load_adapter(name, adapter_dirs["one"])
    engine.unload_adapter(name)
    assert name not in engine.list_adapters()
    with pytest.raises(AdapterNotFoundError) as info:
        engine.generate([5, 6], model=name, max_tokens=2)
    assert info.value.adapter == name and info.value.status == 404


def test_relative_path_is_sent_absolute(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM would take a relative path it cannot resolve for a Hugging Face repo id.
    monkeypatch.chdir(adapter_dirs["one"].parent)
    name = unique("rel")
    engine.load_adapter(name, "one")
    models = httpx.get(f"{engine.url}/v1/models").json()["data"]
    assert {m["id"]: m["root"] for m in models}[name] == str(adapter_dirs["one"])
    engine.unload_adapter(name)


# -- every refusal of the real server, mapped -------------------------------------------------------


def _variant(
    src: Path, dst: Path, *, config: dict[str, Any] | None = None, rename: Callable[[str], str] | None = None
) -> Path:
    """A copy of the adapter at ``src`` with config fields replaced or tensor keys renamed."""
    shutil.copytree(src, dst)
    if config:
        cfg_path = dst / "adapter_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config}))
    if rename:
        tensors = load_file(dst / "adapter_model.safetensors")
        save_file({rename(k): v for k, v in tensors.items()}, dst / "adapter_model.safetensors")
    return dst


@pytest.fixture(scope="module")
def rank32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(make_peft_model(make_tiny_model(), r=32, seed=3)).save(tmp_path_factory.mktemp("r32") / "a")


REFUSALS = {
    "dora": (IncompatibleAdapterError, {"config": {"use_dora": True}}, "DoRA"),
    "bias": (IncompatibleAdapterError, {"config": {"bias": "all"}}, "bias"),
    "lora_bias": (IncompatibleAdapterError, {"config": {"lora_bias": True}}, "lora_bias"),
    "peft_default_suffix": (
        IncompatibleAdapterError,
        {"rename": lambda k: k.replace(".weight", ".default.weight")},
        "unsupported LoRA weight",
    ),
    "unknown_module": (
        IncompatibleAdapterError,
        {"rename": lambda k: k.replace("mlp.down_proj", "mlp.foo_proj")},
        "expected target modules",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_rejected_content_maps_to_incompatible(
    case: str, engine: VLLMEngine, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    cls, edit, needle = REFUSALS[case]
    path = _variant(adapter_dirs["one"], tmp_path / case, **edit)
    name = unique(case)
    with pytest.raises(cls) as info:
        engine.load_adapter(name, path)
    err = info.value
    assert (err.engine, err.adapter, err.status, err.attempts) == ("vllm", name, 500, 1)
    assert needle in str(err) and str(path) in str(err) and engine.url in str(err)
    assert name not in engine.list_adapters()


def test_rank_above_max_maps_to_rank_too_large(engine: VLLMEngine, rank32_dir: Path) -> None:
    with pytest.raises(RankTooLargeError) as info:
        engine.load_adapter(unique("r32"), rank32_dir)
    assert (info.value.rank, info.value.max_rank, info.value.status) == (32, 16, 500)
    assert "--max-lora-rank" in str(info.value)


def test_bad_path_maps_to_not_found(engine: VLLMEngine, tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(AdapterNotFoundError) as info:
        engine.load_adapter(unique("missing"), missing)
    assert info.value.status == 404 and info.value.path == str(missing)
    assert str(missing) in str(info.value)  # vLLM hides the path as <path>; lorasync names it


def test_already_loaded_maps_and_keeps_the_first(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], peft_models: dict[str, Any]
) -> None:
    name = unique("dup")
    engine.load_adapter(name, adapter_dirs["one"])
    with pytest.raises(AdapterAlreadyLoadedError) as info:
        engine.load_adapter(name, adapter_dirs["two"])
    assert info.value.status == 400 and "versioned name" in str(info.value)
    # The refused load changed nothing: the first adapter still serves.
    got = engine.generate(PROMPTS[0], model=name, max_tokens=NEW_TOKENS, logprobs=None)
    assert list(got.token_ids) == peft_greedy(peft_models["one"], PROMPTS[0], NEW_TOKENS)[0]
    engine.unload_adapter(name)


def test_base_model_name_conflict(engine: VLLMEngine, adapter_dirs: dict[str, Path]) -> None:
    with pytest.raises(IncompatibleAdapterError, match="another adapter name") as info:
        engine.load_adapter("tiny-base", adapter_dirs["one"])
    assert info.value.status == 400


def test_unknown_unload_maps_to_not_found(engine: VLLMEngine) -> None:
    name = unique("never")
    with pytest.raises(AdapterNotFoundError) as info:
        engine.unload_adapter(name)
    assert (info.value.status, info.value.adapter) == (404, name)


def test_failed_loads_leave_served_adapters_alone(
    engine: VLLMEngine, adapter_dirs: dict[str, Path], rank32_dir: Path, tmp_path: Path
) -> None:
    name = unique("keep")
    engine.load_adapter(name, adapter_dirs["one"])
    before = [engine.generate(p, model=name, max_tokens=NEW_TOKENS).token_ids for p in PROMPTS]
    dora = _variant(adapter_dirs["two"], tmp_path / "dora", config={"use_dora": True})
    for bad in (rank32_dir, tmp_path / "missing", dora):
        with pytest.raises(EngineError):
            engine.load_adapter(unique("bad"), bad)
    assert [engine.generate(p, model=name, max_tokens=NEW_TOKENS).token_ids for p in PROMPTS] == before
    engine.unload_adapter(name)


# -- retries against the real server ------------------------------------------------------------------


class FlakyTransport(httpx.BaseTransport):
    """The real server behind a connection that fails once on the load route.

    ``landed=True``: the request reaches vLLM, then the answer is lost (a dropped connection).
    ``landed=False``: the connection fails before the request is sent.
    """

    def __init__(self, *, landed: bool) -> None:
        self.inner = httpx.HTTPTransport()
        self.landed = landed
        self.load_calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            self.load_calls += 1
            if self.load_calls == 1:
                if self.landed:
                    self.inner.handle_request(request).close()
                    raise httpx.ReadError("connection reset after the server answered", request=request)
                raise httpx.ConnectError("connection refused", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


FAST = RetryPolicy(attempts=3, backoff=0.0, jitter=0.0)


def test_retried_load_that_had_landed_is_success(vllm_server: Any, adapter_dirs: dict[str, Path]) -> None:
    transport = FlakyTransport(landed=True)
    with VLLMEngine(vllm_server.url, retries=FAST, transport=transport) as engine:
        name = unique("landed")
        engine.load_adapter(name, adapter_dirs["one"])  # second attempt: "already been loaded"
        assert transport.load_calls == 2
        assert name in engine.list_adapters()
        engine.unload_adapter(name)


def test_retried_load_hitting_another_adapter_is_refused(vllm_server: Any, adapter_dirs: dict[str, Path]) -> None:
    name = unique("taken")
    with VLLMEngine(vllm_server.url) as plain:
        plain.load_adapter(name, adapter_dirs["two"])
    transport = FlakyTransport(landed=False)
    with VLLMEngine(vllm_server.url, retries=FAST, transport=transport) as engine:
        with pytest.raises(AdapterAlreadyLoadedError) as info:
            engine.load_adapter(name, adapter_dirs["one"])  # the name serves someone else's path
        assert (transport.load_calls, info.value.attempts) == (2, 2)
        engine.unload_adapter(name)


# -- which adapters requests use (drain-aware retirement) -------------------------------------------


def _poll(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``check`` until it holds: vLLM refreshes its LoRA gauge only with engine steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_adapters_in_use_sees_a_decoding_request(
    engine: VLLMEngine, vllm_server: Any, adapter_dirs: dict[str, Path]
) -> None:
    busy, idle = unique("busy"), unique("idle")
    engine.load_adapter(busy, adapter_dirs["one"])
    engine.load_adapter(idle, adapter_dirs["two"])
    body = {"model": busy, "prompt": [5, 6, 7], "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}
    answers: list[httpx.Response] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def feed() -> None:
        # Long requests back to back keep the adapter busy until the gauge has been seen naming it,
        # however fast (idle box) or slow (a busy one, where a /metrics poll may wait seconds) the
        # engine decodes them.
        try:
            while not done.is_set():
                answers.append(httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=300))
        except BaseException as exc:  # a failed request fails the test, not only its thread
            errors.append(exc)

    threads = [threading.Thread(target=feed) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        seen: list[tuple[float, int, frozenset[str] | None]] = []
        start = time.monotonic()

        def busy_seen() -> bool:
            seen.append((round(time.monotonic() - start, 2), len(answers), engine.adapters_in_use()))
            return busy in (seen[-1][2] or ())

        # 120 s, not 30: on a loaded 2-core CI box a /metrics answer can take seconds and the first
        # request's prefill waits behind the other worker's engines. Should it still fail, the
        # message tells a slow engine (no request answered yet) from a gauge that misses a
        # decoding adapter (requests answered, the newest sample empty): the raw gauge lines too.
        if not _poll(busy_seen, timeout=120.0):
            gauge = [line for line in httpx.get(f"{vllm_server.url}/metrics", timeout=60).text.splitlines() if "lora_requests_info" in line]
            pytest.fail(f"the gauge never named {busy!r}: (seconds, answers so far, names) {seen[:3]} ... {seen[-5:]}; errors {errors}; gauge now {gauge}")
        seen_names = seen[-1][2]
        assert seen_names is not None and idle not in seen_names
        during = asyncio.run(engine.aadapters_in_use())
        assert during is not None and idle not in during
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=300)
    assert not errors, errors
    assert answers and {a.status_code for a in answers} == {200}
    # Every request finished: the newest gauge sample names no adapter any more.
    after: list[frozenset[str] | None] = []
    assert _poll(lambda: (after.append(engine.adapters_in_use()) or after[-1]) is not None and busy not in after[-1]), after[-5:]
    engine.unload_adapter(busy)
    engine.unload_adapter(idle)


# -- async twins --------------------------------------------------------------------------------------


def test_async_twins(vllm_server: Any, adapter_dirs: dict[str, Path], peft_models: dict[str, Any]) -> None:
    async def scenario() -> None:
        async with VLLMEngine(vllm_server.url) as engine:
            caps = await engine.acapabilities()
            assert (caps.runtime_lora, caps.max_rank) == (True, 16)
            name = unique("async")
            await engine.aload_adapter(name, adapter_dirs["two"])
            assert name in await engine.alist_adapters()
            results = await asyncio.gather(
                *(engine.agenerate(p, model=name, max_tokens=NEW_TOKENS) for p in PROMPTS)
            )
            assert [list(r.token_ids) for r in results] == [
                peft_greedy(peft_models["two"], p, NEW_TOKENS)[0] for p in PROMPTS
            ]
            tokens, logprobs = await engine.agreedy(name, PROMPTS[0], NEW_TOKENS)
            assert (tokens, logprobs) == (list(results[0].token_ids), list(results[0].logprobs or ()))
            with pytest.raises(AdapterAlreadyLoadedError):
                await engine.aload_adapter(name, adapter_dirs["one"])
            await engine.aunload_adapter(name)
            with pytest.raises(AdapterNotFoundError):
                await engine.aunload_adapter(name)
            assert name not in await engine.alist_adapters()

    asyncio.run(scenario())


# -- the engine venv can import lorasync (for the worker extension) -------------------------------------


def test_engine_venv_imports_lorasync(vllm_python: Path) -> None:
    from lorasync.testing import vllm_server as launcher

    env = launcher.VLLMServer("unused", python=vllm_python).environment()
    code = "import lorasync, lorasync.engines._http, lorasync.errors; print(lorasync.__file__)"
    out = subprocess.run([str(vllm_python), "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(Path(launcher.__file__).resolve().parent.parent / "__init__.py")
