"""The fleet against the real vLLM CPU server started with ``--max-loras 3 --max-cpu-loras 3``:
three tenants trained together for 10 steps while requests run on each, a fourth refused, a
retirement, and a server restart. Every completion is checked against PEFT's own greedy tokens
for the version its served name says."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lorasync import Fleet
from lorasync.engines import connect
from lorasync.errors import CapacityError, LoraSyncError, PublisherClosedError
from lorasync.exporters.fsdp import export
from tests.reliability._trust import step

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 99, 230, 41]
N = 6


@pytest.fixture(scope="module")
def server(vllm_python, tiny_model_dir, tmp_path_factory):
    from lorasync.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-fleet") / "vllm-fleet.log"
    with VLLMServer(tiny_model_dir, python=vllm_python, served_model_name="tiny-base", max_loras=3, max_cpu_loras=3, log_path=log) as s:
        yield s


def reference(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), max_new_tokens=N, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


class Clients:
    """One thread per tenant sending requests, each on the version it leases, until stopped or
    the tenant retires; records (tenant, version, tokens) and every error (a lost request)."""

    def __init__(self, url: str, tenants: dict) -> None:
        self.url, self.done, self.lost, self.stop = url, [], [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in tenants.values()]
        for thread in self.threads:
            thread.start()

    def _run(self, tenant) -> None:
        client = connect("vllm", self.url, timeout=120)
        try:
            while not self.stop.is_set():
                version = tenant.version
                try:
                    with tenant.lease(version) as model:
                        tokens, _ = client.greedy(model, PROMPT, N)
                    self.done.append((tenant.name, version, tokens))
                except PublisherClosedError:
                    return  # retired: its client stops
                except LoraSyncError as exc:
                    self.lost.append((tenant.name, version, repr(exc)))
        finally:
            client.close()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def test_three_tenants_with_requests_in_flight_on_vllm(server, trainer, tmp_path):
    engine = connect("vllm", server.url, timeout=120)
    models = {name: trainer(seed=s) for name, s in (("a", 1), ("b", 2), ("c", 3))}
    refs: dict[tuple[str, int], list[int]] = {}
    with Fleet([engine], root=tmp_path, transport="disk") as fleet:
        tenants = {name: fleet.register(name, keep=1, grace=0.5) for name in models}
        fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 1)).raise_for_errors()
        refs.update({(n, 1): reference(m) for n, m in models.items()})
        clients = Clients(server.url, tenants)
        try:
            for version in range(2, 11):
                for i, model in enumerate(models.values()):
                    step(model, seed=10 * version + i)
                refs.update({(n, version): reference(m) for n, m in models.items()})
                report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version))
                assert report.ok, report
                time.sleep(0.3)  # let requests run on this version
            # Only what stepped is sent: one tenant changed, one load; the others keep v10.
            step(models["b"], seed=999)
            refs[("b", 11)] = reference(models["b"])
            report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, 11))
            assert [report[n].status for n in "abc"] == ["unchanged", "loaded", "unchanged"]
            assert (fleet.tenants["a"].version, fleet.tenants["b"].version) == (10, 11)
            # A fourth tenant: refused before anything is unloaded.
            listed = sorted(engine.list_adapters())
            with pytest.raises(CapacityError, match="3 adapter slots"):
                fleet.register("d")
            assert sorted(engine.list_adapters()) == listed
            # Retiring c (its requests drain) frees its slot; d then registers and serves.
            fleet.retire("c")
            assert not any(n.startswith("c@") for n in engine.list_adapters())
            d = trainer(seed=4)
            fleet.register("d", keep=1)
            fleet.publish({"d": export(d, copy=True)}, versions={"d": 1}).raise_for_errors()
            assert engine.greedy("d@v1", PROMPT, N)[0] == reference(d)
            clients.join()  # every request sent so far must have come back (checked below)
            # The server restarts: the fleet restores every current version, versions unchanged.
            server.stop()
            server.start()
            restored = fleet.restore()
            assert sorted(restored.restored) == ["a", "b", "d"]
            assert {n: t.version for n, t in restored.tenants.items()} == {"a": 10, "b": 11, "d": 1}
            assert sorted(engine.list_adapters()) == ["a@v10", "b@v11", "d@v1"]
            assert engine.greedy("b@v11", PROMPT, N)[0] == refs[("b", 11)]
        finally:
            clients.join()
    engine.close()
    assert clients.lost == [], clients.lost  # 0 requests lost through 11 rounds and a retirement
    wrong = [(n, v, t, refs[(n, v)]) for n, v, t in clients.done if t != refs[(n, v)]]
    assert wrong == [], wrong
    assert {n for n, _, _ in clients.done} == {"a", "b", "c"} and len(clients.done) >= 30


def test_a_vllm_server_added_to_a_running_fleet_serves_every_current_version(server, trainer, tiny_model_dir, tmp_path):
    """A rollout node joins mid-run: the fleet (so far on the PEFT engine) restores every tenant's
    current version on the vLLM server, versions unchanged; requests then run there while the
    tenants step, and removing it drains and unloads the fleet's versions, files kept."""
    from lorasync.engines.peft import PeftEngine

    engine = PeftEngine(base_model_path=tiny_model_dir, max_loras=6)  # room for the leased versions beside the current ones
    vllm = connect("vllm", server.url, timeout=120)
    for name in vllm.list_adapters():  # what an earlier test's fleet left serving
        vllm.unload_adapter(name)
    models = {name: trainer(seed=s) for name, s in (("p", 5), ("q", 6), ("r", 7))}
    refs: dict[tuple[str, int], list[int]] = {}
    with Fleet([engine], root=tmp_path, transport="disk") as fleet:
        tenants = {name: fleet.register(name, keep=1, grace=0.5) for name in models}
        for version in (1, 2):
            for i, model in enumerate(models.values()):
                step(model, seed=10 * version + i)
            refs.update({(n, version): reference(m) for n, m in models.items()})
            fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version)).raise_for_errors()
        report = fleet.add_engine(vllm)
        assert sorted(report.restored) == ["p", "q", "r"] and report.ok, report
        assert {n: (t.version, t.restored_on) for n, t in report.tenants.items()} == {n: (2, [f"vllm at {vllm.url}"]) for n in models}
        assert sorted(vllm.list_adapters()) == ["p@v2", "q@v2", "r@v2"]
        assert all(vllm.greedy(f"{n}@v2", PROMPT, N)[0] == refs[(n, 2)] for n in models)
        clients = Clients(server.url, tenants)
        try:
            for version in range(3, 7):
                for i, model in enumerate(models.values()):
                    step(model, seed=10 * version + i)
                refs.update({(n, version): reference(m) for n, m in models.items()})
                report = fleet.publish({n: export(m, copy=True) for n, m in models.items()}, versions=dict.fromkeys(models, version))
                assert report.ok, report
                assert all(len(report[n].results) == 2 for n in models)
                time.sleep(0.3)
        finally:
            clients.join()
        listed = sorted(vllm.list_adapters())  # v5s leased during the last round retire at the next one
        assert {"p@v6", "q@v6", "r@v6"} <= set(listed) <= {"p@v5", "q@v5", "r@v5", "p@v6", "q@v6", "r@v6"}
        assert sorted(fleet.remove_engine(vllm)) == listed
        assert vllm.list_adapters() == [] and fleet.engines == [engine]
        assert (tmp_path / "p" / tenants["p"].registration / "v6").is_dir()  # the PEFT engine still serves it
    vllm.close()
    engine.close()
    assert clients.lost == [], clients.lost
    wrong = [(n, v, t, refs[(n, v)]) for n, v, t in clients.done if t != refs[(n, v)]]
    assert wrong == [], wrong
    assert {n for n, _, _ in clients.done} == {"p", "q", "r"}
