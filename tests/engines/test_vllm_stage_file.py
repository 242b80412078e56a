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
