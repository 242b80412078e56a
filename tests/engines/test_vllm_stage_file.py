"""The stage file a GPU publish leaves for the load that reads it (one round trip into vLLM):
owner-only, created exclusively under the random token, never written or read through a symlink,
gone after the load (tests/gpu checks the load itself on the H200)."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from lorasync.engines.vllm import _protocol
from lorasync.engines.vllm._protocol import CudaStage, read_stage_file, stage_file, write_stage_file
from lorasync.errors import ConfigError


@pytest.fixture
def stage_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_protocol, "STAGE_DIR", str(tmp_path))
    return tmp_path


def test_written_owner_only_and_read_back(stage_dir: Path) -> None:
    stage = CudaStage(token=uuid.uuid4().hex, ipc={"version": 1, "ipc": "handle"})
    path = write_stage_file(stage)
    assert path == stage_file(stage.token) and Path(path).parent == stage_dir
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    back = read_stage_file(stage.token)
    assert back == stage


def test_never_written_or_read_through_what_is_already_there(stage_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    token = uuid.uuid4().hex
    elsewhere = tmp_path_factory.mktemp("other") / "target.json"
    elsewhere.write_text('{"token": "x"}')
    os.symlink(elsewhere, stage_file(token))
    assert write_stage_file(CudaStage(token=token, ipc={"a": 1})) is None  # exclusive: the symlink is not followed
    assert elsewhere.read_text() == '{"token": "x"}'
    assert read_stage_file(token) is None  # nor read through
    taken = uuid.uuid4().hex
    assert write_stage_file(CudaStage(token=taken, ipc={"a": 1})) is not None
    assert write_stage_file(CudaStage(token=taken, ipc={"a": 2})) is None  # a second writer of one token


def test_missing_file_and_bad_tokens(stage_dir: Path) -> None:
    assert read_stage_file(uuid.uuid4().hex) is None
    for bad in ("", "../x", "a/b"):
        with pytest.raises(ConfigError):
            stage_file(bad)


def test_no_stage_directory_means_the_rpc_stage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_protocol, "STAGE_DIR", str(tmp_path / "absent"))
    assert write_stage_file(CudaStage(token=uuid.uuid4().hex, ipc={})) is None


def test_a_write_that_fails_leaves_no_file_and_means_the_rpc_stage(stage_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A full /dev/shm (ENOSPC) or a quota: no half-written spec for a worker to read, and the
    # caller stages by RPC instead of failing the publish (found by the outside attack).
    import errno

    stage = CudaStage(token=uuid.uuid4().hex, ipc={"a": "x" * 4096})
    real_fdopen = os.fdopen

    class _Full:
        def __init__(self, fd: int) -> None:
            self.f = real_fdopen(fd, "w")

        def __enter__(self) -> "_Full":
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_protocol.os, "fdopen", lambda fd, mode="r": _Full(fd))
    assert write_stage_file(stage) is None
    assert not os.path.exists(stage_file(stage.token))


def test_a_fifo_or_other_non_file_at_the_path_is_never_waited_on(stage_dir: Path) -> None:
    """Found by the outside attack: a FIFO made at a stage path held the engine's load in open()
    for ever. The reader opens without blocking and reads regular files only."""
    import threading

    fifo_token, dir_token, big_token = (uuid.uuid4().hex for _ in range(3))
    os.mkfifo(stage_file(fifo_token), 0o600)
    os.mkdir(stage_file(dir_token))
    Path(stage_file(big_token)).write_bytes(b" " * (_protocol.MAX_STAGE_BYTES + 1))
    answers: list[object] = []
    reader = threading.Thread(target=lambda: answers.extend(read_stage_file(t) for t in (fifo_token, dir_token, big_token)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "read_stage_file blocked on a FIFO"
    assert answers == [None, None, None]
