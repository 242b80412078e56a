"""Fleet scenarios on the in-process vLLM engine, in the vLLM engine venv.

Run by ``tests/fleet/test_fleet_vllm_inprocess.py`` (which writes every tenant version's adapter
and PEFT's tokens into ``LORASYNC_INPROC_DATA``), once with a ``vllm.LLM`` and once with an
``AsyncLLM`` (``LORASYNC_INPROC_MODE``), both with ``max_loras=3`` and a CPU LoRA cache of 3. One
engine per run; each scenario leaves nothing loaded. Rollouts are the trainer's own: one thread
generating batches through ``llm.generate`` (the AsyncLLM's ``generate`` on its loop), each
request on the version its tenant leases, while the fleet publishes from the main thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorasync import Adapter, Fleet
from lorasync.engines.vllm._protocol import WORKER_EXTENSION
from lorasync.engines.vllm.inprocess import VLLMInProcessEngine
from lorasync.errors import AdapterNotFoundError, BlockingCallError, CapacityError, PublisherClosedError
from tests.engines._inproc_host import connect_to, hosted
from tests.engines.peer_vllm_inprocess_trust import agenerate, params, wait_until

DATA: dict[str, Any] = json.loads(Path(os.environ["LORASYNC_INPROC_DATA"]).read_text()) if os.environ.get("LORASYNC_INPROC_DATA") else {}
MODE = os.environ.get("LORASYNC_INPROC_MODE", "llm")
ARGS = dict(
    enable_lora=True,
    max_lora_rank=16,
    max_loras=3,
    max_cpu_loras=3,
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=8,
    worker_extension_cls=WORKER_EXTENSION,
)


@pytest.fixture(scope="module")
def host() -> Iterator[Any]:
    yield from hosted(MODE, DATA["model_dir"], ARGS)


@pytest.fixture(scope="module")
def engine(host: Any) -> VLLMInProcessEngine:
    return connect_to(MODE, host)  # type: ignore[no-any-return]


def adapter(name: str, version: int) -> Adapter:
    return Adapter.load(DATA["adapters"][name][version - 1])


def want(served: str) -> list[int]:
    name, version = served.split("@v")
    return DATA["expected"][name][int(version) - 1]  # type: ignore[no-any-return]


def generate(host: Any, requests: list[tuple[Any, int]]) -> list[list[int]]:
    """One batch, as a rollout worker sends it: ``(LoRARequest, max_tokens)`` per request."""
    prompt = DATA["prompt"]
    if MODE == "async":
        import asyncio

        async def all_of() -> list[list[int]]:
            return list(await asyncio.gather(*(agenerate(host, r, prompt, t) for r, t in requests)))

        return host.run(all_of())  # type: ignore[no-any-return]
    outputs = host.generate([{"prompt_token_ids": prompt}] * len(requests), [params(t) for _, t in requests], lora_request=[r for r, _ in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def serves(host: Any, engine: VLLMInProcessEngine, names: list[str]) -> None:
    got = generate(host, [(engine.lora_request(n), DATA["new_tokens"]) for n in names])
    assert got == [want(n) for n in names], names


class Rollouts:
    """The trainer's rollout thread: batch after batch, one request per live tenant on the
    version it leases (a tenant retiring is skipped), the first batch with one long request on
    ``first`` besides. Records ``(served name, tokens)`` and every failed request (lost)."""

    def __init__(self, host: Any, engine: VLLMInProcessEngine, fleet: Fleet, *, first: str) -> None:
        self.host, self.engine, self.fleet = host, engine, fleet
        self.done: list[tuple[str, list[int]]] = []
        self.lost: list[tuple[list[str], str]] = []
        self.long: list[int] | None = None
        self.stop = threading.Event()
        self._long = engine.lora_request(first)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._batches()
        except BaseException as exc:  # noqa: BLE001 - the thread died: the test says so
            self.lost.append(([], f"the rollout thread died: {exc!r}"))

    def _batches(self) -> None:
        first = True
        while not self.stop.is_set():
            with contextlib.ExitStack() as leases:
                names, requests = [], []
                for tenant in list(self.fleet.tenants.values()):
                    if tenant.version is None:
                        continue  # registered, nothing published yet
                    try:
                        served = leases.enter_context(tenant.lease())
                        requests.append((self.engine.lora_request(served), DATA["new_tokens"]))
                    except (PublisherClosedError, AdapterNotFoundError):
                        continue  # retiring, or retired between reading its version and leasing it: nothing sent
                    names.append(served)
                if first:
                    requests.append((self._long, DATA["rollout_tokens"]))
                try:
                    got = generate(self.host, requests)
                except Exception as exc:  # noqa: BLE001 - a lost request, reported by the test
                    self.lost.append((names, repr(exc)))
                    continue
            if first:
                self.long, first = got.pop(), False
            self.done += list(zip(names, got))

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=600)
        assert not self.thread.is_alive(), "the rollout thread did not finish"


def test_three_tenants_step_while_rollouts_generate(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    steps = DATA["steps"]
    with Fleet([engine], root=tmp_path / "store") as fleet:
        for name in "abc":
            fleet.register(name, keep=1, grace=0.2)
        report = fleet.publish({n: adapter(n, 1) for n in "abc"}, versions=dict.fromkeys("abc", 1))
        assert report.ok, report
        assert {report[n].results[0].transport for n in "abc"} == {"ipc"}  # tensors through shared memory
        rollouts = Rollouts(host, engine, fleet, first="a@v1")
        try:
            wait_until(lambda: "a@v1" in (engine.adapters_in_use() or ()), "the rollouts did not start")
            for version in range(2, steps + 1):
                report = fleet.publish({n: adapter(n, version) for n in "abc"}, versions=dict.fromkeys("abc", version))
                assert report.ok, report
                assert all(report[n].status == "loaded" and report[n].served_name == f"{n}@v{version}" for n in "abc")
                if version == 2:
                    long_running = rollouts.long is None
                fresh = {f"{n}@v{version}" for n in "abc"}
                wait_until(lambda: rollouts.lost or fresh <= {x for x, _ in rollouts.done}, f"no rollout finished on {sorted(fresh)}")
            # Only what stepped is sent: b alone changed, one load; a and c keep their version.
            report = fleet.publish({n: adapter(n, steps + (n == "b")) for n in "abc"}, versions=dict.fromkeys("abc", steps + 1))
            assert [report[n].status for n in "abc"] == ["unchanged", "loaded", "unchanged"], report
            assert report["a"].results == [] and report["c"].results == [] and fleet.tenants["a"].version == steps
            with pytest.raises(CapacityError, match="3 adapter slots"):
                fleet.register("d")
            # Retiring c while rollouts run on it: its leases drain, then every version goes.
            gone = fleet.retire("c")
            assert f"c@v{steps}" in gone and not any(n.startswith("c@") for n in engine.list_adapters())
            fleet.register("d", keep=1, grace=0.2)
            fleet.publish({"d": adapter("d", 1)}, versions={"d": 1}).raise_for_errors()
            count = len(rollouts.done)
            wait_until(lambda: rollouts.lost or any(n == "d@v1" for n, _ in rollouts.done[count:]), "no rollout on d")
        finally:
            rollouts.join()
        assert rollouts.lost == [], rollouts.lost
        assert long_running, "the long rollout on a@v1 finished before v2 was published; the scenario proved nothing"
        assert rollouts.long == DATA["rollout_expected"]  # a@v1 kept serving its request through two rounds
        wrong = [(n, t, want(n)) for n, t in rollouts.done if t != want(n)]
        assert wrong == [], wrong
        assert {n.split("@")[0] for n, _ in rollouts.done} == set("abcd")
        assert {n for n, _ in rollouts.done if n.startswith("b@")} >= {f"b@v{v}" for v in range(1, steps + 2)}
        serves(host, engine, [f"a@v{steps}", f"b@v{steps + 1}", "d@v1"])
        for name in list(fleet.tenants):
            fleet.retire(name)
        assert engine.list_adapters() == []  # every slot free for the next scenario


def test_second_run_and_restore(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    with Fleet([engine], root=tmp_path / "store") as fleet:
        for name in "abc":
            fleet.register(name, keep=1)
        # The first run's v1 content again, in a new registration: loaded afresh, never "unchanged".
        report = fleet.publish({n: adapter(n, 1) for n in "abc"}, versions=dict.fromkeys("abc", 1))
        assert all(report[n].status == "loaded" and report[n].publish.bytes_moved > 0 for n in "abc"), report
        serves(host, engine, ["a@v1", "b@v1", "c@v1"])
        for name in engine.list_adapters():  # the engine lost them (as after a restart)
            engine.unload_adapter(name)
        restored = fleet.restore()
        assert {n: (t.status, t.version) for n, t in restored.tenants.items()} == dict.fromkeys("abc", ("restored", 1))
        serves(host, engine, ["a@v1", "b@v1", "c@v1"])
        for name in "abc":
            fleet.retire(name)
    assert engine.list_adapters() == []


def test_sync_fleet_calls_on_the_asyncllm_loop_are_refused(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    if MODE != "async":
        pytest.skip("async only")
    fleet = Fleet([engine], root=tmp_path / "store")
    fleet.register("z", keep=1)

    async def on_the_loop() -> None:
        with pytest.raises(BlockingCallError, match="apublish"):
            fleet.publish({"z": adapter("a", 1)}, versions={"z": 1})
        with pytest.raises(BlockingCallError, match="aadd_engine"):
            fleet.add_engine(engine)
        # The async API is what runs there.
        report = await fleet.apublish({"z": adapter("a", 2)}, versions={"z": 2})
        assert report["z"].status == "loaded", report
        assert await agenerate(host, engine.lora_request("z@v2"), DATA["prompt"], DATA["new_tokens"]) == want("a@v2")
        assert await fleet.aretire("z") == ["z@v2"]
        await fleet.aclose()

    host.run(on_the_loop(), timeout=300)
    assert engine.list_adapters() == []
