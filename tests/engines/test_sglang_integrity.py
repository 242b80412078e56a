"""What SGLang serves is exactly what the trainer trained, against SGLang's own app
(tests/peers/sglang_contract.py, SGLang 0.5.23):

* **checksums.** A tensor load carries ``expected_checksums`` (sha256 of each tensor's bytes,
  hex, keyed by PEFT name; SGLang 0.5.16+). SGLang's own ``TpModelWorker.
  load_lora_adapter_from_tensors`` (run by the peer) compares them before the load: a normal
  publish passes, and bytes that differ from their checksums are refused. 0.5.23 refuses by its
  scheduler raising, which takes the whole server down (``run_scheduler_process``): the peer dies
  the same way, and the torn adapter is never served.
* **rsLoRA.** SGLang scales every module by ``lora_alpha / r`` (sgl-project/sglang#40835), PEFT's
  rsLoRA by ``lora_alpha / sqrt(r)``: such an adapter is refused with a typed error that names
  the conversion, and the conversion is served with PEFT's exact scale and factors, without
  touching the trainer's tensors (a no-copy export holds them).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lorasync import Publisher
from lorasync.runtime._retry import RetryPolicy
from lorasync.engines.sglang import SGLangEngine
from lorasync.engines.sglang import tensors as tensor_loads
from lorasync.engines.sglang.protocol import sha256
from lorasync.errors import EngineUnavailableError, IncompatibleAdapterError
from lorasync.exporters.fsdp import export
from lorasync.testing import make_peft_model, make_tiny_model
from lorasync.transforms import normalize_scaling
from tests.engines.test_sglang import PROMPT, Peer, _contract_server, clean_peer

QV = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def sglang_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _contract_server(tiny_model_dir, tmp_path_factory.mktemp("sglang-integrity") / "server.log") as url:
        yield url


@pytest.fixture
def peer(sglang_server: str) -> Iterator[Peer]:
    yield from clean_peer(sglang_server)


@pytest.fixture
def engine(peer: Peer) -> Iterator[SGLangEngine]:
    with SGLangEngine(peer.url, retries=RetryPolicy(attempts=2, backoff=0.01, jitter=0.0)) as client:
        yield client


def _greedy(model: Any, steps: int = 4) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and log-probabilities after PROMPT (the trainer's view)."""
    ids, out, logprobs = list(PROMPT), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out.append(token)
            ids.append(token)
    return out, logprobs


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


# -- checksums ----------------------------------------------------------------------------------


def test_a_publish_sends_the_checksums_sglang_verifies(engine: SGLangEngine, peer: Peer, tmp_path: Path) -> None:
    model = make_peft_model(make_tiny_model(), r=8, alpha=16, targets=QV, seed=11)
    adapter = export(model, copy=True)
    report = Publisher([engine], name="sum", transport="ipc", root=tmp_path, keep=1).publish(adapter, version=1)
    assert report.ok, report
    tokens, logprobs = _greedy(model)
    served = engine.generate(PROMPT, lora_name=report.served_name, max_new_tokens=4, return_logprob=True)
    assert list(served.output_ids) == tokens and served.logprobs == pytest.approx(logprobs, abs=1e-4)
    (load,) = [r for r in peer.requests() if r["path"] == "/load_lora_adapter_from_tensors"]
    # SGLang's format: hex sha256 of each tensor's contiguous bytes, keyed by the PEFT name it
    # deserializes, every tensor and no other (its check refuses missing and extra names too).
    assert load["body"]["expected_checksums"] == {k: sha256(t) for k, t in adapter.tensors.items()}


def test_bytes_that_differ_from_their_checksums_are_refused(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One element of one tensor changes between the checksums and the bytes sent (what a
    corrupting hop does): SGLang's check refuses the load, the server dies of it, and the torn
    adapter never serves. Its own peer: this one does not survive."""
    adapter = export(make_peft_model(make_tiny_model(), r=8, alpha=16, targets=QV, seed=12), copy=True)
    torn_key = sorted(adapter.tensors)[0]
    real = tensor_loads.serialize

    def tear(obj: Any) -> str:
        if isinstance(obj, dict) and torn_key in obj:  # the tensor route's payload, checksummed already
            obj = dict(obj)
            obj[torn_key] = obj[torn_key].clone()
            obj[torn_key].view(-1)[0] += 1.0
        return real(obj)

    monkeypatch.setattr(tensor_loads, "serialize", tear)
    log = tmp_path / "server.log"
    with _contract_server(tiny_model_dir, log) as url:
        with SGLangEngine(url, retries=RetryPolicy(attempts=2, backoff=0.01, jitter=0.0)) as engine:
            with pytest.raises(EngineUnavailableError):
                engine.load_adapter_tensors("torn@v1", adapter)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=5)
    text = log.read_text()
    assert "Scheduler hit an exception" in text
    assert f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(adapter.tensors)} expected: 1 value-diff ['{torn_key}']" in text


# -- rsLoRA -------------------------------------------------------------------------------------


def test_rslora_is_refused_then_served_exactly_once_converted(engine: SGLangEngine, peer: Peer) -> None:
    """r = 8: PEFT scales by 16 / sqrt(8), SGLang by lora_alpha / r. The adapter as trained is
    refused before any load; normalize_scaling's conversion is served with PEFT's scale and
    factors bit for bit; the trainer's tensors, held by a no-copy export, are never changed."""
    model = make_peft_model(make_tiny_model(), r=8, alpha=16, targets=QV, seed=13, use_rslora=True)
    params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    before = {n: p.detach().clone() for n, p in params.items()}
    adapter = export(model)  # no copy: the Adapter holds the trainer's own parameters
    assert {t.data_ptr() for t in adapter.tensors.values()} <= {p.data_ptr() for p in params.values()}

    with pytest.raises(IncompatibleAdapterError, match=r"lora_alpha / r.*normalize_scaling"):
        engine.load_adapter_tensors("rs@v1", adapter)
    assert not any(path.startswith("/load_lora_adapter") for _, path in peer.calls())

    converted = normalize_scaling(adapter)
    engine.load_adapter_tensors("rs@v1", converted)
    factors = httpx.post(f"{peer.url}/_contract/factors", json={"lora_name": "rs@v1"}).json()
    peft_scale = model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]
    assert peft_scale == 16 / math.sqrt(8) != 16 / 8
    assert factors["scaling"] == peft_scale  # SGLang's alpha' / r is PEFT's alpha / sqrt(r), exactly
    want = {}
    for name, p in params.items():  # base_model.model.<path>.lora_A.default.weight
        path, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
        want.setdefault(path, {})[rest[0]] = _digest(p)
    held = factors["modules"]
    assert {k: v for k, v in held.items() if k in want} == want  # every trained factor is the trainer's, bit for bit
    # SGLang packs q/k/v into qkv_proj: the k_proj this adapter lacks is all zeros there, exactly.
    k_proj = model.base_model.model.model.layers[0].self_attn.k_proj
    zeros = {"A": _digest(torch.zeros(8, k_proj.in_features)), "B": _digest(torch.zeros(k_proj.out_features, 8))}
    assert {k: v for k, v in held.items() if k not in want} == {path.replace("q_proj", "k_proj"): zeros for path in want if "q_proj" in path}
    tokens, logprobs = _greedy(model)
    served = engine.generate(PROMPT, lora_name="rs@v1", max_new_tokens=4, return_logprob=True)
    assert list(served.output_ids) == tokens and served.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert all(torch.equal(p, before[n]) for n, p in params.items())  # nothing wrote into the trainer's tensors
    engine.unload_adapter("rs@v1")
