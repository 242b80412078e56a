"""The in-process vLLM case of ``lorasync bench vllm``: a ``vllm.LLM`` living in the trainer's own
process (``connect("vllm-inprocess", llm=llm)``), beside the HTTP rows, on the same tiny model,
adapters, prompt and trainer tokens.

vLLM is importable only in the engine venv, so the LLM and the timed rounds run there, in a
subprocess (:mod:`benchmarks._vllm_inprocess_peer`, which documents the three ways measured).
:class:`InProcessCase` starts it early — its LLM start-up overlaps the HTTP server's — and lets
it run its rounds only once the HTTP server is gone, so no measurement shares the box with
another vLLM doing work. Its samples have the HTTP modes' shape and join them in the same table,
JSON and plot. Off with ``lorasync bench vllm --no-inprocess`` (``Options(inprocess=False)``, or ``LORASYNC_BENCH_INPROCESS=0``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["MODES", "InProcessCase", "enabled"]

MODES = ("in-process", "in-process disk", "in-process bare add_lora")
REPO = Path(__file__).resolve().parent.parent


def enabled(opts: Any) -> bool:
    """On unless ``Options.inprocess`` is False or ``LORASYNC_BENCH_INPROCESS=0``."""
    return bool(getattr(opts, "inprocess", True)) and os.environ.get("LORASYNC_BENCH_INPROCESS", "1") != "0"


class InProcessCase:
    """The engine-venv subprocess that hosts the ``vllm.LLM`` and times its rounds.

    Args:
        tmp (`Path`): a working directory (adapters, stores, the log).
        python (`Path`): the engine venv's python.
        base_dir (`Path`): the tiny base model the HTTP server serves too.
        trainers (`list[dict]`): ``{"model": PeftModel, "adapter": Adapter}`` per alternating version.
        prompt (`list[int]`), refs (`list[int]`): the prompt and each trainer's greedy next token.
        repeats (`int`), warmup (`int`): timed and untimed rounds.

    Use: ``start()`` early, ``wait_ready()`` before other measurements begin, ``run()`` once
    nothing else measures, ``close()`` always.
    """

    def __init__(self, tmp: Path, python: Path, base_dir: Path, trainers: list[dict[str, Any]], prompt: list[int], refs: list[int], repeats: int, warmup: int) -> None:
        self.tmp, self.python = tmp, python
        self.log_path = tmp / "vllm-inprocess.log"
        self.spec = {
            "base_dir": str(base_dir),
            "adapters": [],
            "peft_dirs": [],
            "prompt": list(prompt),
            "refs": list(refs),
            "repeats": repeats,
            "warmup": warmup,
            "work": str(tmp / "work"),
            "result": str(tmp / "result.json"),
        }
        self._trainers = trainers
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self.waited_s = 0.0

    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        for k, t in enumerate(self._trainers):
            self.spec["adapters"].append(str(t["adapter"].save(self.tmp / f"adapter{k}")))
            t["model"].save_pretrained(str(self.tmp / f"peft{k}"))  # what the bare baseline's users have
            self.spec["peft_dirs"].append(str(self.tmp / f"peft{k}"))
        spec_path = self.tmp / "spec.json"
        spec_path.write_text(json.dumps(self.spec))
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a large share of RAM
        )
        self._proc = subprocess.Popen(
            [str(self.python), "-m", "benchmarks._vllm_inprocess_peer", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, env=env, cwd=str(REPO), start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        """Copy the child's output (vLLM logs to stdout) to the log; spot its ``ready``."""
        assert self._proc is not None and self._proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self._proc.stdout:
                if line.strip() == "ready":
                    self._ready.set()
                log.write(line)
                log.flush()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until the LLM is built and has compiled (the time waited is ``waited_s``)."""
        start = time.perf_counter()
        while not self._ready.wait(0.5):
            if self._proc is None or self._proc.poll() is not None or time.perf_counter() - start > timeout:
                raise RuntimeError(f"the in-process vLLM did not start; see {self.log_path}:\n{self._tail()}")
        self.waited_s += time.perf_counter() - start

    def run(self, timeout: float = 600.0) -> dict[str, Any]:
        """Let the child time its rounds; returns ``{"modes": {mode: samples}, "startup_s", ...}``."""
        self.wait_ready(timeout)
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()
        result = Path(self.spec["result"])
        deadline = time.perf_counter() + timeout
        while not result.exists() and self._proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.2)
        if not result.exists():
            raise RuntimeError(f"the in-process vLLM rounds failed; see {self.log_path}:\n{self._tail()}")
        return json.loads(result.read_text())

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()  # a child still waiting for "go" exits
            except OSError:
                pass
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        self._proc = None

    def _tail(self) -> str:
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])
        except OSError:
            return ""
