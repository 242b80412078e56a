"""TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``, TRL 1.16) syncing its adapter
through lorasync: :class:`LoraSyncAsyncGRPOTrainer`.

TRL syncs a PEFT policy to its vLLM server in one of two ways: adapter-only (``save_pretrained``
into ``<output_dir>/.vllm_lora/trl-policy-vN``, ``/v1/load_lora_adapter``, an unload
``max_staleness + 1`` versions later) or merged (fold the adapter into every base weight and
stream all of them over NCCL). It drops to merged whenever the server reports
``data_parallel_size > 1``, because a load "reaches only the replica that answered it".

That holds for several API servers, which vLLM refuses to start with runtime LoRA updating at
all. With ``--api-server-count 1`` (the only data-parallel vLLM that takes runtime loads) the one
API server hands every load to every data-parallel engine core: lorasync's test
``tests/engines/test_vllm_data_parallel.py`` checks both cores serve the published tensors
exactly, and ``tests/integrations/test_trl_async_grpo.py`` runs this trainer against such a
server. So this subclass keeps the adapter path for a data-parallel server and publishes through
a :class:`~lorasync.Publisher`:

* each sync publishes the adapter as ``<name>@v<N>`` (shared memory into vLLM's workers where
  lorasync's worker extension is loaded, else lorasync's versioned files), and the rollout loop
  asks for that served name;
* retirement is lorasync's: the ``max_staleness + 1`` newest versions stay loaded, and a version
  a running request still names is never unloaded (TRL unloads by count alone);
* a publish that fails raises its typed ``lorasync.errors`` error on every rank, after vLLM was
  resumed, and the version the rollouts ask for does not move.

It overrides TRL's private ``_init_lora_sync`` and ``_sync_weight_lora`` and the rollout loop's
``_request_model``; :func:`check_trl` refuses a TRL whose trainer lacks them
(:class:`~lorasync.errors.ConfigError`) instead of training with the wrong sync.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

from lorasync.adapter._names import served_name, validate_name
from lorasync.errors import ConfigError, LoraSyncError
from lorasync.exporters.fsdp import export
from lorasync.publisher._publisher import Publisher

try:  # TRL's experimental package: import errors say what to install
    from trl.experimental.async_grpo import async_grpo_trainer as _trainer_module
    from trl.experimental.async_grpo import async_rollout_worker as _worker_module
except ImportError as exc:  # pragma: no cover - depends on the installed TRL
    raise ImportError(f"lorasync.integrations.trl_async_grpo needs TRL's AsyncGRPOTrainer (trl>=1.16): {exc}") from exc

__all__ = ["LoraSyncAsyncGRPOTrainer", "check_trl"]

log = logging.getLogger(__name__)

_NEEDED = {
    _trainer_module.AsyncGRPOTrainer: ("_init_lora_sync", "_sync_weight_lora", "_sync_weight", "_inner_training_loop"),
    _worker_module.AsyncRolloutWorker: ("_loop_cls", "update_model_version"),
    _worker_module._AsyncRolloutLoop: ("_request_model",),
}


def check_trl() -> None:
    """Refuse a TRL whose AsyncGRPO trainer lacks what this subclass overrides.

    Raises:
        ConfigError: names the missing attributes and the TRL version that has them.
    """
    missing = [f"{cls.__name__}.{name}" for cls, names in _NEEDED.items() for name in names if not hasattr(cls, name)]
    if missing:
        import trl

        raise ConfigError(
            f"TRL {trl.__version__}'s AsyncGRPOTrainer lacks {', '.join(missing)}, which lorasync's AsyncGRPO "
            "integration overrides (written for TRL 1.16); pin trl==1.16.* or use lorasync.integrations.trl.LoraSyncCallback"
        )


class _ServedNameLoop(_worker_module._AsyncRolloutLoop):
    """TRL's rollout loop asking vLLM for lorasync's served name of the current version."""

    @property
    def _request_model(self) -> str:
        if self.lora_name is None:
            return self.model_name
        return served_name(self.lora_name, self.model_version)


class LoraSyncAsyncGRPOTrainer(_trainer_module.AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose adapter syncs are lorasync publishes (see the module docstring).

    Args:
        *args, **kwargs: ``AsyncGRPOTrainer``'s own (``model`` must be a PEFT model, or be given
            ``peft_config``, for adapter syncs; otherwise TRL's merged sync runs unchanged).
        lorasync_name (`str`): the served name's prefix: version N is ``<name>@vN``.
        lorasync_engines: engine specs or clients to publish to (default: the config's
            ``vllm_server_base_url`` as ``vllm:URL``; a ``vllm-router:URL`` publishes to every
            worker of a router).
        lorasync_transport (`str`): the Publisher's ``transport=`` (``"auto"``: shared memory
            where vLLM has lorasync's worker extension, else files).
        lorasync_root (`str | PathLike`, *optional*): where versioned files go (a filesystem the
            server sees at the same path; default lorasync's).

    Attributes:
        publisher (`Publisher | None`): on the main process while training runs.
        reports (`list[PublishReport]`): every publish of this trainer, in order (main process).

    Raises:
        ConfigError: a TRL this integration does not fit, or a bad ``lorasync_name``.
    """

    def __init__(
        self,
        *args: Any,
        lorasync_name: str = "policy",
        lorasync_engines: Any = None,
        lorasync_transport: str = "auto",
        lorasync_root: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl()
        self._lorasync_name = validate_name(lorasync_name)
        self._lorasync_engines = lorasync_engines
        self._lorasync_transport = lorasync_transport
        self._lorasync_root = lorasync_root
        self.publisher: Publisher | None = None
        self.reports: list[Any] = []
        super().__init__(*args, **kwargs)
        worker = getattr(self, "rollout_worker", None)
        if self._lora_sync and isinstance(worker, _worker_module.AsyncRolloutWorker):
            worker._loop_cls = _ServedNameLoop  # the spawned child builds this loop (a module-level class)

    def _init_lora_sync(self, model: Any) -> bool:
        """TRL's probe, with a data-parallel server kept on the adapter path (module docstring)."""
        self.vllm_client.wait_for_server_ready()
        info = self.vllm_client.get_server_info()
        parallel = info.get("parallel_config") or {}
        if int(parallel.get("data_parallel_size", 1) or 1) > 1:
            log.info(
                "vLLM at %s runs %s data-parallel engine cores behind one API server: lorasync's publish reaches every one",
                self.args.vllm_server_base_url,
                parallel.get("data_parallel_size"),
            )
            info = copy.deepcopy(info)
            info["parallel_config"]["data_parallel_size"] = 1
        lora_sync = _trainer_module.select_adapter_sync(info, model, self.args)  # TRL's own checks: rank, slots, adapter kind
        if lora_sync:
            self._lora_name = self._lorasync_name
        return lora_sync

    def _publisher(self) -> Publisher:
        if self.publisher is None:
            engines = self._lorasync_engines or [f"vllm:{self.args.vllm_server_base_url}"]
            self.publisher = Publisher(
                engines,
                name=self._lorasync_name,
                transport=self._lorasync_transport,
                keep=self.args.max_staleness + 1,  # every version a sample may still be drawn from stays loaded
                root=self._lorasync_root,
            )
        return self.publisher

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """Pause vLLM, export the adapter (collective under FSDP/ZeRO-3), publish it on the main
        process, resume vLLM; then move the version the rollouts ask for. TRL's phase marks."""
        version = self.model_version + 1
        model = self.accelerator.unwrap_model(self.model)
        main = self.accelerator.is_main_process
        if main:
            self.vllm_client.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        adapter = export(model, adapter_name=self._adapter_name)  # every rank: gathering a shard is collective
        failure: LoraSyncError | None = None
        if main:
            try:
                report = self._publisher().publish(adapter, version=version)
                self.reports.append(report)
                report.raise_for_errors()
            except LoraSyncError as exc:
                failure = exc
            finally:
                self.vllm_client.resume()  # a failed publish leaves the previous version serving
        t_transfer = time.time()
        if self.accelerator.num_processes > 1:
            from lorasync.distributed._agree import agree_on_error

            failure = agree_on_error(failure, src=0)
        if failure is not None:
            raise failure
        self.accelerator.wait_for_everyone()
        if main:
            self.model_version = version
            if self.rollout_worker:
                self.rollout_worker.update_model_version(version)
        return t_pause, t_barrier, t_transfer

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self.publisher is not None:
                self.publisher.close()
                self.publisher = None
