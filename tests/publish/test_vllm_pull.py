"""Pull mode against a real vLLM CPU server started with its filesystem LoRA resolver: a publish
writes ``name@vN`` where the resolver looks, requests select it with no load call, versions
switch, kept versions still answer, and unsafe names are refused."""

import json

import pytest

from lorasync import Probe, Publisher
from lorasync.engines import connect
from lorasync.errors import AdapterAlreadyLoadedError, AdapterNotFoundError, InvalidNameError
from lorasync.exporters.fsdp import export

from .conftest import PROMPTS, reference

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pull_server(vllm_python, tiny_model_dir, tmp_path_factory):
    """One vLLM CPU server for this module, its resolver reading a fresh folder."""
    from lorasync.testing.vllm_server import VLLMServer

    pull_dir = tmp_path_factory.mktemp("pull")
    log = tmp_path_factory.mktemp("vllm-logs") / "vllm-pull.log"
    with VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        served_model_name="tiny-base",
        log_path=log,
        env={"VLLM_LORA_RESOLVER_CACHE_DIR": str(pull_dir), "VLLM_PLUGINS": "lora_filesystem_resolver"},
    ) as server:
        yield server, pull_dir


@pytest.fixture
def pull(pull_server):
    server, pull_dir = pull_server
    engine = connect("vllm-pull", server.url, pull_dir=pull_dir, keep=2, timeout=120)
    yield engine
    engine.close()


def test_pull_publishes_versions_exact_against_peft(pull, pull_server, trainer, tiny_model_dir, tmp_path):
    pub = Publisher([pull], name="pol", transport="disk", root=tmp_path / "store", keep=1)
    models, tokens = {}, {}
    for version, seed in ((1, 41), (2, 42)):
        model = models[version] = trainer(seed=seed)
        probe = Probe.from_model(model, PROMPTS[0], max_tokens=4, atol=1e-3)
        report = pub.publish(export(model), version=version, verify=probe)
        assert report.ok, report
        served = report.served_name
        assert served == f"pol@v{version}"
        written = pull.pull_dir / served
        config = json.loads((written / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_model_dir)
        tokens[version] = [pull.greedy(served, list(p), 6)[0] for p in PROMPTS]
        assert tokens[version] == [reference(model, p) for p in PROMPTS]
    assert tokens[1] != tokens[2]
    # vLLM's resolver loaded them (no load call): its own log line says so.
    log = pull_server[0].log_path.read_text()
    for served in ("pol@v1", "pol@v2"):
        assert f"Resolved and loaded LoRA adapter '{served}' using FilesystemResolver" in log
    # No temporary directory is left where the resolver looks.
    assert sorted(p.name for p in pull.pull_dir.iterdir() if p.name.startswith("pol")) == ["pol@v1", "pol@v2"]
    # The publisher retired v1 (keep=1), but the engine keeps the newest two directories: a
    # replica may still load v1, and it answers with v1's weights when asked.
    assert [pull.greedy("pol@v1", list(p), 6)[0] for p in PROMPTS] == tokens[1]
    pub.close()


def test_retention_deletes_only_past_keep(pull, trainer, tmp_path):
    pub = Publisher([pull], name="ret", transport="disk", root=tmp_path / "store", keep=1)
    for version in (1, 2, 3):
        assert pub.publish(export(trainer(seed=50 + version)), version=version).ok
    # v1 is the third newest: once unloaded and unused here, its directory goes (at the
    # publisher's retirement or, when that came while v1 was still kept, at the next sweep).
    pub.collect()
    if "ret@v1" in pull.list_adapters():
        pull.unload_adapter("ret@v1")
    pull.unload_adapter("ret@v2")  # unloaded, but among the newest two: its directory stays
    names = sorted(p.name for p in pull.pull_dir.iterdir() if p.name.startswith("ret"))
    assert names == ["ret@v2", "ret@v3"]
    pub.close()


@pytest.mark.parametrize("bad", ["../escape", "a/b", ".hidden", "x\x00y", "p@v01/..", ""])
def test_unsafe_names_are_refused(pull, trainer, tmp_path, bad):
    before = sorted(p.name for p in pull.pull_dir.iterdir())
    adapter_dir = tmp_path / "a"
    trainer(seed=3).save_pretrained(adapter_dir)
    with pytest.raises(InvalidNameError):
        pull.load_adapter(bad, adapter_dir)
    assert sorted(p.name for p in pull.pull_dir.iterdir()) == before
    assert not (pull.pull_dir.parent / "escape").exists()


def test_wrong_base_model_is_refused_and_leaves_nothing(pull_server, trainer, tmp_path):
    server, pull_dir = pull_server
    engine = connect("vllm-pull", server.url, pull_dir=pull_dir, base_model="not-the-served-model", timeout=120)
    adapter_dir = tmp_path / "a"
    trainer(seed=5).save_pretrained(adapter_dir)
    with pytest.raises(AdapterNotFoundError, match="VLLM_LORA_RESOLVER_CACHE_DIR"):
        engine.load_adapter("wrong@v1", adapter_dir)
    assert not (pull_dir / "wrong@v1").exists()
    engine.close()


def test_a_version_is_never_overwritten(pull, trainer, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    trainer(seed=6).save_pretrained(first)
    trainer(seed=7).save_pretrained(second)
    pull.load_adapter("same@v1", first)
    tokens = pull.greedy("same@v1", list(PROMPTS[0]), 6)[0]
    pull.load_adapter("same@v1", first)  # a retried publish of the same files is fine
    with pytest.raises(AdapterAlreadyLoadedError):
        pull.load_adapter("same@v1", second)
    assert pull.greedy("same@v1", list(PROMPTS[0]), 6)[0] == tokens
