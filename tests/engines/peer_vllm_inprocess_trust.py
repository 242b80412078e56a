"""Trust scenarios of the in-process vLLM engine (issue 28, items 30-37), in the vLLM engine venv.

Run by ``tests/engines/test_vllm_inprocess_trust.py`` (which writes the adapters and PEFT's
tokens into ``LORASYNC_INPROC_DATA``), once with a ``vllm.LLM`` and once with an ``AsyncLLM``
(``LORASYNC_INPROC_MODE``), both ``max_loras=2`` with vLLM's default CPU LoRA cache of the same
size: three versions in use mean evictions and rebuilds. One engine per run; each scenario
cleans up what it loaded. The AsyncLLM's last scenario may wedge its loop (item 36 without the
Publisher's guard), so it runs last.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorasync import Adapter, Probe, Publisher, RetentionWarning
from lorasync.engines.vllm._protocol import IPC_PREFIX, WORKER_EXTENSION
from lorasync.engines.vllm.inprocess import VLLMInProcessEngine
from lorasync.errors import VerificationError, AdapterNotFoundError, AdapterRejectedError, ConfigError
from tests.engines._inproc_host import connect_to, hosted

DATA: dict[str, Any] = json.loads(Path(os.environ["LORASYNC_INPROC_DATA"]).read_text()) if os.environ.get("LORASYNC_INPROC_DATA") else {}
MODE = os.environ.get("LORASYNC_INPROC_MODE", "llm")
ARGS = dict(
    enable_lora=True,
    max_lora_rank=16,
    max_loras=2,  # and vLLM's default max_cpu_loras (= max_loras): a 2-entry LRU
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=4,
    worker_extension_cls=WORKER_EXTENSION,
)


def only(mode: str) -> None:
    if MODE != mode:
        pytest.skip(f"{mode} only")


@pytest.fixture(scope="module")
def host() -> Iterator[Any]:
    yield from hosted(MODE, DATA["model_dir"], ARGS)


@pytest.fixture(scope="module")
def engine(host: Any) -> VLLMInProcessEngine:
    return connect_to(MODE, host)  # type: ignore[no-any-return]


def params(tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def generate_with(host: Any, request: Any, prompt: list[int], tokens: int | None = None) -> list[int]:
    """Greedy tokens the way a rollout asks for them: llm.generate with a LoRARequest."""
    tokens = tokens or DATA["new_tokens"]
    if MODE == "async":
        return host.run(agenerate(host, request, prompt, tokens))
    outputs = host.generate([{"prompt_token_ids": prompt}], params(tokens), lora_request=request, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


async def agenerate(host: Any, request: Any, prompt: list[int], tokens: int) -> list[int]:
    final = None
    async for out in host.llm.generate({"prompt_token_ids": prompt}, params(tokens), request_id=f"r-{time.monotonic_ns()}", lora_request=request):
        final = out
    return list(final.outputs[0].token_ids)


def generate(host: Any, engine: VLLMInProcessEngine, served: str, prompt: list[int]) -> list[int]:
    return generate_with(host, engine.lora_request(served), prompt)


def vllm_ids(host: Any) -> set[int]:
    """The LoRA ids vLLM's worker cache holds (its own view, not lorasync's)."""
    if MODE == "async":
        return set(host.run(host.llm.list_loras()))
    return set(host.llm_engine.list_loras())


def staged(host: Any) -> set[str]:
    """Tokens of the tensors lorasync's worker extension holds."""
    if MODE == "async":
        answers = host.run(host.llm.collective_rpc("lorasync_staged"))
    else:
        answers = host.collective_rpc("lorasync_staged")
    return set(answers[0])


def wait_until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def unload_all(engine: VLLMInProcessEngine) -> Iterator[None]:
    """Every scenario starts with nothing loaded through the engine, whatever the last one left."""
    yield
    for name in engine.list_adapters():
        engine.unload_adapter(name)


def assert_serves(host: Any, engine: VLLMInProcessEngine, served: str, version: int) -> None:
    for prompt, want in zip(DATA["prompts"], DATA["expected"][version - 1]):
        assert generate(host, engine, served, prompt) == want, (served, prompt)


# -- vllm.LLM ------------------------------------------------------------------------------------


def test_evicted_ipc_versions_rebuild_with_peft_tokens(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("llm")
    with Publisher(engine, name="evict", keep=3, root=tmp_path / "store") as publisher:
        names = []
        for version in (1, 2, 3):
            report = publisher.publish(Adapter.load(DATA["adapters"][version - 1]), version=version).raise_for_errors()
            assert report.results[0].transport == "ipc"
            names.append(report.served_name)
        # Three versions, two cache entries: each generate below rebuilds the version it asks for.
        for _ in range(2):
            for version, name in enumerate(names, start=1):
                assert_serves(host, engine, name, version)
        assert len(vllm_ids(host) & {engine.lora_request(n).lora_int_id for n in names}) <= 2


def test_missing_staged_tensors_is_vllms_not_found(host: Any, engine: VLLMInProcessEngine) -> None:
    only("llm")
    with pytest.raises(AdapterNotFoundError) as info:
        engine.load_adapter("ghost@v1", IPC_PREFIX + "0" * 32)
    assert "No adapter found" in str(info.value) and "ImportError" not in str(info.value), info.value
    assert "ghost@v1" not in engine.list_adapters()
    assert generate_with(host, None, DATA["prompts"][0]) == DATA["base_expected"][0]  # still serving


def test_refused_activation_leaves_no_zombie(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("llm")
    before = vllm_ids(host)
    with Publisher(engine, name="alien", root=tmp_path / "store") as publisher:
        report = publisher.publish(Adapter.load(DATA["alien"]), version=1)
    error = report.results[0].error
    assert isinstance(error, AdapterRejectedError), error
    assert vllm_ids(host) == before  # nothing of it stays in vLLM's cache
    assert engine.list_adapters() == []
    with Publisher(engine, name="after-alien", root=tmp_path / "store2") as publisher:
        served = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors().served_name
    assert_serves(host, engine, served, 1)


@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_retired_lora_request_fails_per_request(host: Any, engine: VLLMInProcessEngine, tmp_path: Path, transport: str) -> None:
    with Publisher(engine, name=f"gone-{transport}", keep=1, transport=transport, root=tmp_path / "store") as publisher:
        first = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors().served_name
        old = engine.lora_request(first)  # a rollout worker keeps it
        second = publisher.publish(Adapter.load(DATA["adapters"][1]), version=2).raise_for_errors().settled().served_name
        assert engine.list_adapters() == [second]
        assert old.lora_int_id not in vllm_ids(host)  # vLLM would have to rebuild it
        with pytest.raises(AdapterNotFoundError, match="retired"):
            generate_with(host, old, DATA["prompts"][0])
        assert_serves(host, engine, second, 2)  # the engine keeps serving
        third = publisher.publish(Adapter.load(DATA["adapters"][2]), version=3).raise_for_errors().served_name
        assert_serves(host, engine, third, 3)


def test_publish_while_another_thread_generates(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("llm")
    stop, seen, errors = threading.Event(), [], []

    def rollouts() -> None:  # the caller's own generate loop (base model: no version it uses retires)
        # Many short requests: every generate call sends one add_request per prompt, so its sends
        # and the publisher's (add_lora, collective_rpc, remove_lora) keep meeting.
        prompts = [{"prompt_token_ids": p} for p in DATA["prompts"]] * 16
        try:
            while not stop.is_set():
                outputs = host.generate(prompts, params(2), use_tqdm=False)
                seen.append([list(o.outputs[0].token_ids) for o in outputs])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=rollouts)
    thread.start()
    try:
        wait_until(lambda: seen or host.llm_engine.has_unfinished_requests(), "no rollout started")
        with Publisher(engine, name="busy", keep=2, root=tmp_path / "store") as publisher:
            names = []
            for step in range(12):
                version = step + 1
                report = publisher.publish(Adapter.load(DATA["adapters"][step % 4]), version=version).raise_for_errors()
                names.append(report.served_name)
    finally:
        stop.set()
        thread.join(timeout=300)
    assert not errors, errors
    assert seen and all(batch == [e[:2] for e in DATA["base_expected"]] * 16 for batch in seen)
    assert engine.list_adapters() == names[-2:]
    assert_serves(host, engine, names[-1], 4)


def test_verify_while_another_thread_generates_is_refused(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("llm")
    probe = Probe(prompt_ids=tuple(DATA["prompts"][0]), expected_ids=tuple(DATA["expected"][0][0]))
    done = threading.Event()

    def rollout() -> None:
        host.generate([{"prompt_token_ids": DATA["rollout_prompt"]}], params(len(DATA["rollout_expected"])), use_tqdm=False)
        done.set()

    thread = threading.Thread(target=rollout)
    thread.start()
    wait_until(lambda: host.llm_engine.has_unfinished_requests() or done.is_set(), "no rollout started")
    with Publisher(engine, name="verified", root=tmp_path / "store") as publisher:
        report = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1, verify=probe)
        assert not done.is_set(), "the rollout finished before the verification; the scenario proved nothing"
        # The rollout was still decoding: lorasync must not step the LLM under it. The probe could
        # not run, so the version failed verification (issue 33: only a pass counts) and was taken
        # out; why, and the fix, travel as the typed cause and in the message.
        error = report.results[0].error
        assert isinstance(error, VerificationError) and isinstance(error.__cause__, ConfigError), repr(error)
        assert "engine.lock" in str(error) and "verified@v1" not in engine.list_adapters()
        thread.join(timeout=300)
        # Holding engine.lock around the caller's generate serialises verification with it.
        with engine.lock:
            host.generate([{"prompt_token_ids": DATA["prompts"][0]}], params(4), use_tqdm=False)
        probe = Probe(prompt_ids=tuple(DATA["prompts"][0]), expected_ids=tuple(DATA["expected"][1][0]))
        report = publisher.publish(Adapter.load(DATA["adapters"][1]), version=2, verify=probe).raise_for_errors()
        assert "verified" in report.results[0].reason


# -- AsyncLLM --------------------------------------------------------------------------------------


def start_rollout(host: Any, engine: VLLMInProcessEngine, served: str) -> Any:
    request = engine.lora_request(served)
    future = host.submit(agenerate(host, request, DATA["rollout_prompt"], len(DATA["rollout_expected"])))
    wait_until(lambda: served in (engine.adapters_in_use() or ()), f"the rollout on {served} did not start")
    return future


def test_rollout_on_v1_while_v2_v3_publish_keeps_peft_tokens(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("async")
    with Publisher(engine, name="roll", root=tmp_path / "store") as publisher:  # every default: keep=2, IPC
        v1 = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors().served_name
        rollout = start_rollout(host, engine, v1)
        v2 = publisher.publish(Adapter.load(DATA["adapters"][1]), version=2).raise_for_errors().served_name
        report = publisher.publish(Adapter.load(DATA["adapters"][2]), version=3).raise_for_errors().settled()
        v3 = report.served_name
        assert report.results[0].transport == "ipc"
        assert v1 in report.results[0].deferred, "the rollout finished before v3; the scenario proved nothing"
        assert rollout.result(timeout=600) == DATA["rollout_expected"]
        for _ in range(2):  # v1, v2 and v3 took turns in a 2-entry cache: v2 was evicted and rebuilt
            assert_serves(host, engine, v2, 2)
            assert_serves(host, engine, v3, 3)
        publisher.collect()
        assert engine.list_adapters() == [v2, v3]


def test_forced_retirement_keeps_the_running_requests_weights(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    only("async")
    with Publisher(engine, name="forced", keep=1, drain_timeout=0, root=tmp_path / "store") as publisher:
        v1 = publisher.publish(Adapter.load(DATA["adapters"][0]), version=1).raise_for_errors().served_name
        token = engine._tokens[v1]
        rollout = start_rollout(host, engine, v1)
        with pytest.warns(RetentionWarning):
            report = publisher.publish(Adapter.load(DATA["adapters"][1]), version=2).raise_for_errors().settled()
        v2 = report.served_name
        running = not rollout.done()
        kept = token in staged(host)
        assert v1 in report.results[0].retired and engine.list_adapters() == [v2]
        # Unloaded under its request: vLLM rebuilds v1 for it (at once: remove_lora took it out
        # of its cache), from what lorasync kept.
        assert rollout.result(timeout=600) == DATA["rollout_expected"]
        assert_serves(host, engine, v2, 2)
        assert running, "the rollout finished before v2 was published; the scenario proved nothing"
        assert kept
        engine.list_adapters()  # any engine call after the request finished releases the snapshot
        assert token not in staged(host)


def test_worker_keeps_released_tensors_for_its_running_request(host: Any, engine: VLLMInProcessEngine) -> None:
    # What the HTTP client does after unloading a version (vLLM's server frontend has no requests
    # lorasync can see): release the staged tensors right away. A request the worker runs on them
    # must still get them when vLLM rebuilds the adapter.
    only("async")
    engine.load_adapter_tensors("keep@v1", Adapter.load(DATA["adapters"][0]))
    token, lora_id = engine._tokens["keep@v1"], engine.lora_request("keep@v1").lora_int_id
    rollout = start_rollout(host, engine, "keep@v1")
    time.sleep(0.5)  # admitted already; let the scheduler hand it to the worker (its first steps)
    host.run(host.llm.collective_rpc("lorasync_release_adapter", args=(token,)))
    host.run(host.llm.remove_lora(lora_id))  # out of vLLM's cache: the next step rebuilds it
    running = not rollout.done()
    assert rollout.result(timeout=600) == DATA["rollout_expected"]
    assert running, "the rollout finished before the release; the scenario proved nothing"
    generate_with(host, None, DATA["prompts"][0])  # a step after it finished: the worker forgets it
    assert token not in staged(host)


# -- both: a random walk (issue 28's state machine, the smaller version) ----------------------------

WALK_STEPS = 24
WALK_DEADLINE_S = 300.0  # one call on a loaded 2-core box; a hang shows as this deadline passing


class Walk:
    """One seeded walk over a publisher of ``walk`` on the engine (see the test's docstring)."""

    def __init__(self, host: Any, engine: VLLMInProcessEngine, root: Path, seed: int) -> None:
        import concurrent.futures
        import random

        self.host, self.engine, self.root = host, engine, root
        self.rng = random.Random(seed)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="walk-call")
        self.version = 0
        self.content: dict[str, int] = {}  # served name -> index of the adapter it was published from
        self.rollouts: list[tuple[Any, int, str]] = []  # (future, adapter index, served name)
        # keep=3 over vLLM's 2-entry cache: evictions and rebuilds; drain_timeout=0: a version
        # leaving the window under a rollout is retired anyway (forced), its weights kept for it.
        self.options: dict[str, Any] = dict(name="walk", keep=3, drain_timeout=0.0, root=root, grace=0.0)
        self.publisher = Publisher(engine, **self.options)

    def call(self, fn: Any, *args: Any) -> Any:
        import concurrent.futures

        future = self.pool.submit(fn, *args)
        try:
            return future.result(timeout=WALK_DEADLINE_S)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"{getattr(fn, '__qualname__', fn)} hung for {WALK_DEADLINE_S:.0f} s") from None

    def rollout_running(self) -> bool:
        return any(not f.done() for f, _, _ in self.rollouts)

    def publish(self) -> None:
        self.version += 1
        index = self.rng.randrange(len(DATA["adapters"]))
        transport = self.rng.choice(["ipc", "ipc", "disk"])
        if transport != self.options.get("transport", "ipc"):
            self.reopen(transport=transport)
        report = self.call(lambda: self.publisher.publish(Adapter.load(DATA["adapters"][index]), version=self.version).raise_for_errors().settled())
        served = report.served_name
        if report.results[0].status == "unchanged":
            assert self.content.get(served) == index, f"'unchanged' at {served}, which was published from adapter {self.content.get(served)}, not {index}"
        self.content[served] = index

    def rollout(self) -> None:
        listed = [n for n in self.engine.list_adapters() if n.startswith("walk@")]
        if not listed or (MODE == "llm" and self.rollout_running()):
            return
        served = self.rng.choice(listed)
        request = self.engine.lora_request(served)
        tokens = len(DATA["rollouts_expected"][0])
        if MODE == "async":
            future = self.host.submit(agenerate(self.host, request, DATA["rollout_prompt"], tokens))
        else:  # the caller's own generate in its thread; the walk's own generates wait for it (below)
            future = self.pool_for_rollouts().submit(generate_with, self.host, request, DATA["rollout_prompt"], tokens)
        self.rollouts.append((future, self.content[served], served))
        wait_until(lambda: served in (self.engine.adapters_in_use() or ()) or future.done(), f"the rollout on {served} did not start")
        for _ in range(3):  # while it decodes, its version leaves the window (keep=3): deferred, then forced
            self.publish()

    def pool_for_rollouts(self) -> Any:
        import concurrent.futures

        if not hasattr(self, "_rollout_pool"):
            self._rollout_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="walk-rollout")
        return self._rollout_pool

    def cancelled_publish(self) -> None:
        import asyncio

        self.version += 1
        index = self.rng.randrange(len(DATA["adapters"]))
        turns = self.rng.choice([0, 1, 2, 4, 8, 16, 64])

        async def cancelled() -> Any:
            task = asyncio.ensure_future(self.publisher.apublish(Adapter.load(DATA["adapters"][index]), version=self.version))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return None

        report = self.call(asyncio.run, cancelled())
        name = f"walk@v{self.version}"
        if report is not None and report.ok:
            self.content[report.served_name] = index
        else:
            self.content[name] = index  # what it may have left loaded holds this adapter, or nothing

    def collect(self) -> None:
        self.call(self.publisher.collect)

    def reopen(self, **change: Any) -> None:
        """Close the publisher (a trainer restart) and go on with a new one on the same run."""
        run = self.publisher.run
        self.call(self.publisher.close)
        self.options.update(change)
        self.publisher = Publisher(self.engine, run=run, **self.options)

    def check(self) -> None:
        """Every version the engine lists serves its adapter's PEFT tokens (one prompt each)."""
        if MODE == "llm":  # one generate at a time on a sync LLM: the rollout thread's first
            for future, _, _ in self.rollouts:
                future.result(timeout=WALK_DEADLINE_S)
        for served in self.engine.list_adapters():
            if not served.startswith("walk@"):
                continue
            index = self.content[served]
            got = self.call(generate_with, self.host, self.engine.lora_request(served), DATA["prompts"][0])
            assert got == DATA["expected"][index][0], f"{served} (adapter {index}) serves other weights"

    def finish(self) -> None:
        for future, index, served in self.rollouts:
            assert future.result(timeout=WALK_DEADLINE_S) == DATA["rollouts_expected"][index], f"the rollout on {served} decoded other weights"
        self.call(self.publisher.close)
        self.pool.shutdown(wait=False)


def test_random_walk_serves_exactly_what_each_report_names(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    import warnings

    walk = Walk(host, engine, tmp_path / "store", seed=20261202)
    steps = {"publish": 6, "rollout": 3, "cancelled_publish": 2, "collect": 1, "reopen": 1}
    done: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RetentionWarning)  # forced retirements are the point here
        walk.publish()
        for _ in range(WALK_STEPS):
            rule = walk.rng.choices(list(steps), weights=list(steps.values()))[0]
            getattr(walk, rule)()
            done.append(rule)
            walk.check()
        walk.finish()
    assert {"publish", "rollout", "cancelled_publish"} <= set(done), done
    assert walk.version >= 8
    forced = sum(issubclass(w.category, RetentionWarning) for w in caught)
    print(f"walk ({MODE}): {len(done)} steps {done}, {walk.version} versions, {len(walk.rollouts)} rollouts, {forced} forced retirements")


def test_sync_publish_on_the_asyncllm_loop_is_refused(host: Any, engine: VLLMInProcessEngine, tmp_path: Path) -> None:
    # Last: without the Publisher's guard the sync publish deadlocks the AsyncLLM's loop for good.
    only("async")
    publisher = Publisher(engine, name="onloop", root=tmp_path / "store")

    async def blocking() -> None:
        publisher.publish(Adapter.load(DATA["adapters"][0]), version=1)

    future = host.submit(blocking())
    try:
        with pytest.raises(ConfigError):
            future.result(timeout=60)
    finally:
        if future.done():
            publisher.close()
        