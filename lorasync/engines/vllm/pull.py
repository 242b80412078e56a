"""Pull mode: publish to vLLM servers through their filesystem LoRA resolver, with no load call.

vLLM 0.32's ``lora_filesystem_resolver`` plugin (``vllm.general_plugins`` entry point) loads
``<VLLM_LORA_RESOLVER_CACHE_DIR>/<name>`` the first time a request names a model ``name`` the
server does not know, when that directory's ``adapter_config.json`` says ``peft_type: LORA`` and
``base_model_name_or_path`` equals the server's ``model_config.model`` (what ``--model`` was
given, not ``--served-model-name``). It runs only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.

:class:`VLLMPullEngine` (kind ``vllm-pull``) writes each version's directory there atomically
(a temporary directory in the same folder, then one ``rename``), with the base name the resolver
requires, and returns only once a completion with ``model=<name>`` succeeded. Every replica that
sees the directory serves the version on its first request for it. See docs/engines/vllm.md,
"Pull mode", for how to start vLLM and what retention deletes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from lorasync.adapter._names import parse_served_name, validate_name
from lorasync.engines._engine import Capabilities
from lorasync.engines._http import Call, Operation, body_json
from lorasync.engines.vllm._client import VLLMEngine
from lorasync.engines.vllm._errors import dig, generic, message_of
from lorasync.engines.vllm._protocol import MODELS_ROUTE
from lorasync.errors import (
    AdapterAlreadyLoadedError,
    AdapterNotFoundError,
    CapabilityError,
    ConfigError,
    EngineError,
    InvalidNameError,
)
from lorasync.runtime._loop import to_thread

__all__ = ["VLLMPullEngine"]

_TEMP = ".lorasync-tmp-"  # never a valid adapter name (names start with a letter or digit)


def checked_name(name: object) -> str:
    """``name`` if it is safe as one directory entry of the resolver's folder: a served name
    lorasync makes (``policy@v3``) or a plain adapter name.

    Raises:
        InvalidNameError: anything else (separators, ``..``, NUL, a leading dot, too long).
    """
    if isinstance(name, str) and parse_served_name(name) is not None:
        return name
    return validate_name(name)


class VLLMPullEngine(VLLMEngine):
    """A vLLM server (or any number of them sharing one folder) fed through its filesystem
    LoRA resolver: a load writes ``<pull_dir>/<name>`` and asks for a completion of it.

    Args:
        url (`str`): the server's URL (one replica that sees ``pull_dir``; verification asks it).
        pull_dir (`str | os.PathLike`): the server's ``VLLM_LORA_RESOLVER_CACHE_DIR``, as this
            process sees it (the same files, e.g. a shared volume).
        base_model (`str`, *optional*): what the server was given as ``--model`` (the resolver
            compares ``base_model_name_or_path`` with it). Default: read from the base model's
            ``root`` in the server's ``/v1/models``.
        keep (`int`, defaults to 2): the directories of each adapter's newest ``keep`` versions
            are never deleted by an unload, whatever this server lists: another replica may load
            them on its first request.
        **options: everything :class:`VLLMEngine` takes (``api_key``, ``timeout``, ...).

    Raises:
        ConfigError: ``pull_dir`` is not an existing directory, or ``keep`` < 1.
    """

    kind: ClassVar[str] = "vllm-pull"

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        pull_dir: str | os.PathLike[str],
        base_model: str | None = None,
        keep: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        self.pull_dir = Path(pull_dir).resolve()
        if not self.pull_dir.is_dir():
            raise ConfigError(f"pull_dir {str(pull_dir)!r} is not a directory; create it and start vLLM with VLLM_LORA_RESOLVER_CACHE_DIR set to it")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
        self.base_model = base_model
        self.keep = keep

    # -- paths ------------------------------------------------------------------------------------

    def directory_of(self, name: str) -> Path:
        """Where the resolver looks for ``name``: ``<pull_dir>/<name>``, checked to stay inside.

        Raises:
            InvalidNameError: an unsafe name.
        """
        target = self.pull_dir / checked_name(name)
        if target.parent != self.pull_dir:  # belt and braces: names have no separators anyway
            raise InvalidNameError(f"adapter name {name!r} would leave the resolver's directory {self.pull_dir}")
        return target

    # -- the Engine protocol ----------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        """The server's capabilities, as pull mode uses them: files only, no in-place swap.

        Raises:
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        caps = super().capabilities()
        return replace(caps, tensor_load=False, load_inplace=False, same_host=True, reloads_from_path=True,
                       notes=(*caps.notes, f"pull mode: versions are written to {self.pull_dir}"))

    async def acapabilities(self) -> Capabilities:
        return await to_thread(self.capabilities)

    def _refuse_router(self) -> Operation[None]:
        # Pull mode is made for many replicas behind one URL: each loads a version from the
        # shared folder on its first request for it, and the newest ``keep`` directories stay
        # whatever one replica lists. A router's URL is fine here (no load call to miss a worker).
        return
        yield  # an operation (a generator) that asks nothing

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        """Write the adapter at ``path`` to ``<pull_dir>/<name>`` atomically, then request it.

        The copy's ``adapter_config.json`` gets ``base_model_name_or_path`` set to the server's
        base model. An existing directory of that name with the very same files is reused (a
        retried publish); one with other files is refused, never overwritten (a replica may
        serve it).

        Args:
            name (`str`): the served name (``policy@v3``).
            path (`str | os.PathLike`): a PEFT adapter directory on this host.
            load_inplace (`bool`): must be False (pull mode has no in-place swap).

        Raises:
            InvalidNameError: an unsafe name.
            CapabilityError: ``load_inplace=True``.
            AdapterAlreadyLoadedError: ``<pull_dir>/<name>`` holds other files.
            AdapterNotFoundError: ``path`` holds no adapter, or the server did not resolve the
                name (its resolver is off or reads another folder, or the base model differs).
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        if load_inplace:
            raise CapabilityError("vllm-pull cannot replace adapters in place; publish versioned names", engine=self.kind)
        target = self.directory_of(name)
        source = Path(path)
        config_path = source / "adapter_config.json"
        if not config_path.is_file():
            raise AdapterNotFoundError(f"no adapter_config.json in {source}", engine=self.kind, url=self.url, adapter=name)
        base = self.base_model or self._run(self._base_model())
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = base
        temp = self.pull_dir / f"{_TEMP}{uuid.uuid4().hex}"
        try:
            # The config last: vLLM's resolver takes a directory only once it holds one, so a
            # staging directory left by a process that died mid-copy can never be loaded by name.
            shutil.copytree(source, temp, ignore=shutil.ignore_patterns("adapter_config.json"))
            (temp / "adapter_config.json").write_text(json.dumps(config, indent=2))
            wrote = self._publish_directory(temp, target, name)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        try:
            self.generate([0], model=name, max_tokens=1, logprobs=None)
        except AdapterNotFoundError as exc:
            if wrote:
                shutil.rmtree(target, ignore_errors=True)  # a failed load leaves nothing behind
            raise AdapterNotFoundError(
                f"vLLM at {self.url} did not resolve {name!r} from {target}: start it with "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and VLLM_LORA_RESOLVER_CACHE_DIR={self.pull_dir} (and, if "
                f"VLLM_PLUGINS is set, lora_filesystem_resolver in it); its --model must be {base!r}",
                engine=self.kind, url=self.url, adapter=name,
            ) from exc
        self._sweep(name)

    async def aload_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        await to_thread(self.load_adapter, name, path, load_inplace=load_inplace)

    def unload_adapter(self, name: str) -> None:
        """Stop this server serving ``name``; delete its directory only when retention allows.

        Rule (applied to every version of the adapter, here and after each load): a directory
        goes only if it is not among its adapter's newest ``keep`` versions in ``pull_dir`` and
        this server neither lists it nor reports a request using it; when the server cannot be
        asked, nothing goes. Replicas this client cannot see are protected by ``keep`` alone.

        Raises:
            InvalidNameError: an unsafe name.
            AdapterNotFoundError: neither served here nor present in ``pull_dir``.
            AuthenticationError, EngineUnavailableError, EngineError.
        """
        target = self.directory_of(name)
        try:
            super().unload_adapter(name)
        except AdapterNotFoundError:
            if not target.exists():
                raise
        self._sweep(name)

    async def aunload_adapter(self, name: str) -> None:
        await to_thread(self.unload_adapter, name)

    def adapter_sources(self) -> None:  # type: ignore[override]
        """``None``: the server reads the resolver's copy, not the publisher's path."""
        return None

    async def aadapter_sources(self) -> None:  # type: ignore[override]
        return None

    # -- helpers ----------------------------------------------------------------------------------

    def _publish_directory(self, temp: Path, target: Path, name: str) -> bool:
        """Rename ``temp`` to ``target`` (atomic on one filesystem). Returns whether it wrote."""
        try:
            os.rename(temp, target)  # refuses a non-empty target: never replaces a version
            return True
        except OSError:
            if target.is_dir() and _same_files(temp, target):
                return False
            raise AdapterAlreadyLoadedError(
                f"{target} already holds other files for {name!r}; publish a new version instead "
                "(a replica may be serving those)", engine=self.kind, url=self.url, adapter=name,
            ) from None

    def _sweep(self, name: str) -> None:
        """Delete the directories of ``name``'s adapter outside its newest ``keep`` versions that
        this server neither lists nor uses (so a version unloaded while still kept goes later)."""
        parsed = parse_served_name(name)
        if parsed is None:
            return
        pattern = re.compile(rf"{re.escape(parsed[0])}@v(?P<v>0|[1-9][0-9]*)")
        versions = sorted(
            (int(m["v"]) for entry in os.listdir(self.pull_dir) if (m := pattern.fullmatch(entry))), reverse=True
        )
        old = [f"{parsed[0]}@v{v}" for v in versions[self.keep :]]
        if not old:
            return
        try:
            busy = set(self.list_adapters()) | set(self.adapters_in_use() or ())
        except EngineError:
            return  # cannot tell what this server serves: keep everything
        for served in old:
            if served not in busy:
                shutil.rmtree(self.pull_dir / served, ignore_errors=True)

    def _base_model(self) -> Operation[str]:
        response = yield Call("GET", MODELS_ROUTE)
        if response.status_code != 200:
            raise generic(self, response, MODELS_ROUTE, None, message_of(response), "listing models")
        for card in dig(body_json(response), "data") or ():
            if isinstance(card, dict) and not card.get("parent") and isinstance(card.get("root"), str):
                return card["root"]
        raise EngineError(f"vLLM at {self.url} names no base model in {MODELS_ROUTE}; pass base_model= (its --model)", engine=self.kind, url=self.url)


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
