"""Shared fixtures: a tiny local base model on disk (built once per session, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory with the tiny GQA Llama (safetensors + tokenizer + config.json)."""
    from lorasync.testing import make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


@pytest.fixture
def dead_url():
    """``http://127.0.0.1:<port>`` where nothing listens, for the whole test: the port is held bound
    (not listening), so no other process, such as the other worker's vLLM, can take it meanwhile."""
    from lorasync.testing.vllm_server import refused_url

    with refused_url() as url:
        yield url


# -- real vLLM server (tests marked @pytest.mark.vllm) --------------------------------------------


def ready_engine_python(engine: str, require_variable: str) -> Path:
    """The ready python of ``engine``'s venv (``lorasync.testing.venvs``: the ready marker, not
    just a file); skips with what to run, or fails when ``require_variable`` is ``1`` (CI)."""
    import os

    from lorasync.testing.venvs import engine_venv

    venv = engine_venv(engine)
    if not venv.ready:
        if os.environ.get(require_variable) == "1":
            pytest.fail(venv.problem or "", pytrace=False)
        pytest.skip(venv.problem or "")
    return venv.python


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM engine venv's python; skips (or fails with LORASYNC_REQUIRE_VLLM=1) when it is
    missing or half-built."""
    return ready_engine_python("vllm", "LORASYNC_REQUIRE_VLLM")


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The SGLang venv's python; skips (or fails with LORASYNC_REQUIRE_SGLANG=1) when it is
    missing or half-built."""
    return ready_engine_python("sglang", "LORASYNC_REQUIRE_SGLANG")


@pytest.fixture(scope="session")
def megatron_python() -> Path:
    """The Megatron venv's python; skips (or fails with LORASYNC_REQUIRE_MEGATRON=1) when it is
    missing or half-built."""
    return ready_engine_python("megatron", "LORASYNC_REQUIRE_MEGATRON")


@pytest.fixture(scope="session")
def aibrix_python() -> Path:
    """The AIBrix runtime venv's python (``scripts/aibrix-venv.sh``); skips (or fails with
    LORASYNC_REQUIRE_AIBRIX=1) when it is missing or half-built."""
    return ready_engine_python("aibrix", "LORASYNC_REQUIRE_AIBRIX")


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM CPU server for the whole run, on the tiny model, served as ``tiny-base``:
    LoRA on (max rank 16, 4 slots), runtime updating on, dev mode on, lorasync's worker
    extension loaded (IPC and merged transports)."""
    from lorasync.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-logs") / "vllm-main.log"
    with VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        served_model_name="tiny-base",
        log_path=log,
        extra_args=("--worker-extension-cls", "lorasync.engines.vllm_worker.LoraSyncWorkerExtension"),
    ) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_dp_server(vllm_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A data-parallel vLLM CPU server: two engine cores behind one API server
    (``--data-parallel-size 2 --api-server-count 1``, the only data-parallel form that takes
    runtime LoRA loads), otherwise as :func:`vllm_server`. Its tests share one xdist worker
    (``SHARED_WORKER["vllm-dp"]``), so it starts once."""
    import os

    from lorasync.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm-dp-logs") / "vllm-dp.log"
    # vLLM CPU splits VLLM_CPU_OMP_THREADS_BIND per data-parallel rank at "|": the one core an xdist
    # worker's engines get (pytest_configure below) left the second rank an empty list, and its
    # engine core died at start ("Given number of CPU id list [] doesn't match local world size 1").
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{bind}|{bind}"} if bind and "|" not in bind and bind != "auto" else None
    with VLLMServer(
        tiny_model_dir,
        python=vllm_python,
        served_model_name="tiny-base",
        log_path=log,
        extra_args=(
            "--worker-extension-cls",
            "lorasync.engines.vllm_worker.LoraSyncWorkerExtension",
            "--data-parallel-size",
            "2",
            "--api-server-count",
            "1",
        ),
        env=env,
    ) as server:
        yield server


# -- two workers (pytest-xdist, ``-n 2 --dist loadgroup`` in scripts/test.sh) -----------------------
#
# Most of the suite's time is vLLM starting (three processes importing vLLM per server or in-process
# LLM), which keeps one core busy and the other idle; two workers use both. Every test gets a group:
# its file (a module-scoped peer, such as an in-process vLLM, starts once, on one worker), except
# the files below, which share a worker with each other.
SHARED_WORKER = {
    # Each starts a local Ray cluster (ray.init); one cluster on the machine at a time, so an
    # `ray.init()` never finds and joins another test's cluster. The docs run docs/engines/ray.md.
    "ray": (
        "tests/engines/test_ray_engine.py",
        "tests/engines/test_ray_trust.py",
        "tests/fleet/test_fleet_ray.py",
        "tests/docs/test_docs.py",
    ),
    # The data-parallel vLLM server (vllm_dp_server) starts once for both.
    "vllm-dp": (
        "tests/engines/test_vllm_data_parallel.py",
        "tests/integrations/test_trl_async_grpo.py",
    ),
}
_GROUP_OF_FILE = {path: group for group, paths in SHARED_WORKER.items() for path in paths}


def xdist_group_of(nodeid: str) -> str:
    """The worker group of the test ``nodeid``: its shared group, else its file."""
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF_FILE.get(path, path)


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker: the vLLM engines it starts (servers, in-process peers, doc blocks) bind
    their compute thread to a core of their own worker. vLLM CPU's ``auto`` binding puts every
    engine on the first core, so the two workers' engines took turns on one core while the other
    waited on them."""
    import os

    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:  # a binding of the user's own wins
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(str(workerinput["workerid"]).lstrip("gw") or 0)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[index % len(cpus)])


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when pytest runs without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's types
    """Under ``--dist loadgroup``: xdist's scope scheduling (a scope's tests run on one worker, in
    order) with :func:`xdist_group_of` as the scope. Not ``xdist_group`` marks: xdist turns them
    into a node-id suffix in a collection hook that runs before this conftest's, and pytest 9 no
    longer reads the attribute it writes, so the marks grouped nothing."""
    if config.getoption("dist", None) != "loadgroup":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """On an xdist worker: each test's last report carries the reliability figures it measured
    (tests/reliability/_figures.py) to the controller, which prints the one table; sent test by
    test, so a worker that dies later loses none of them."""
    report = yield
    if call.when == "teardown" and hasattr(item.config, "workerinput"):
        from reliability._figures import take_new

        new = take_new()
        if new:
            report.user_properties.append(("lorasync_figures", new))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The reliability figures (tests/reliability/_figures.py), once, after the run. Here, not in
    tests/reliability/conftest.py: under xdist only the controller prints, and it loads only this
    conftest."""
    from reliability._figures import FIGURES, FINDING_RUNS, table

    if FIGURES or FINDING_RUNS:
        terminalreporter.write_line("")
        for line in table().splitlines():
            terminalreporter.write_line(line)


# Tests begun and not yet torn down, by node id: what a run interrupted for running too long
# (scripts/test.sh, LORASYNC_SUITE_MINUTES) names, since its output shows only dots.
_RUNNING: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    import time

    _RUNNING[nodeid] = time.monotonic()


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    import os
    import sys
    import time

    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller names them, once
        return
    now = time.monotonic()
    for nodeid, began in sorted(_RUNNING.items(), key=lambda item: item[1]):
        print(f"[test] still running when interrupted, for {now - began:.0f} s: {nodeid}", file=sys.stderr, flush=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count how issue 28's regression tests ended (tests/reliability/_findings.py), for the
    reliability table's rows per class of finding. Here, not in tests/reliability: they live in
    several folders, and a folder's conftest sees only its own tests. On the xdist controller it
    also records the figures a worker's test measured (``pytest_runtest_makereport`` above)."""
    if getattr(report, "node", None) is not None:  # xdist sets it on the controller, for a worker's report
        from reliability._figures import record

        for name, value in report.user_properties:
            if name == "lorasync_figures":
                record(**value)
    if report.when == "teardown":
        _RUNNING.pop(report.nodeid, None)
    if report.when == "teardown" or (report.when == "setup" and report.passed):
        return
    from reliability._figures import record_finding_test  # tests/ is on sys.path: one module for both conftests
    from reliability._findings import class_of_test

    for klass in class_of_test(report.nodeid):
        record_finding_test(klass, report.outcome)
