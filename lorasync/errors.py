"""Every error lorasync raises, in one tree.

Callers catch ``LoraSyncError`` for "anything lorasync refused or could not do", or a leaf for
one failure. Leaves also inherit the builtin a caller would already catch (``ValueError`` for bad
input, ``ConnectionError`` for an unreachable engine, ``TimeoutError``...). Foreign errors
(httpx, torch, OS) are translated at the boundary and chained with ``raise ... from exc``.
Every message says what to do next.

    LoraSyncError
    ├── AdapterError (ValueError)            an Adapter that must not be served
    │   ├── InvalidKeyError                  a key that is not a PEFT LoRA weight name
    │   ├── MissingPairError                 lora_A without lora_B, or the reverse
    │   ├── ShapeMismatchError               shapes disagree with each other or with r
    │   ├── DtypeMismatchError               mixed or non-floating dtypes
    │   ├── NonFiniteError                   NaN or inf in a tensor (optional check)
    │   └── PaddedRankError                  max-rank padding that is not exactly zero
    ├── ExportError (ValueError)             trainer state that cannot be exported
    │   ├── UnknownAdapterNameError          the requested PEFT adapter name is absent
    │   ├── MissingShardError                a TP/PP/EP shard is missing
    │   ├── GeometryError                    head counts, TP size and shapes do not fit
    │   ├── UnknownModuleError               a module name no rule translates
    │   └── InexactExportError               valid state no PEFT LoRA reproduces (DoRA, ...)
    │       └── ExpertLayoutError (AdapterError)  fused-expert LoRA that has no exact per-expert form
    ├── ConfigError (ValueError)             bad options or configuration
    │   ├── BlockingCallError (RuntimeError)  a blocking call where it would deadlock (names the async twin)
    │   └── PublisherClosedError             the publisher was closed, or belongs to the parent of this fork
    ├── InvalidNameError (ValueError)        adapter names/versions unsafe as paths or ids
    ├── RegistryError                        engine registry problems
    │   ├── UnknownEngineError (KeyError)    no engine registered under that name
    │   └── DuplicateRegistrationError       a name registered twice with different targets
    ├── EngineError                          an engine refused or failed; carries engine/url/adapter
    │   ├── EngineUnavailableError (ConnectionError)   unreachable, 5xx, retries spent
    │   │   ├── EngineTimeoutError (TimeoutError)      no answer in time
    │   │   └── EngineDeadError                        the engine process died (restart it)
    │   ├── EngineProtocolError              an answer lorasync cannot interpret
    │   │   └── UnsupportedEngineVersionError  an engine major version lorasync does not know
    │   ├── AuthenticationError              401/403, or a client without its key here (unpickled)
    │   ├── LoraNotEnabledError              the engine was started without LoRA
    │   ├── CapabilityError                  the engine cannot do what was asked
    │   │   ├── RuntimeLoraDisabledError     runtime LoRA routes are switched off
    │   │   └── ReplicatedEngineError        the URL is several engines (a router): a load reaches one
    │   ├── AdapterRejectedError             the engine refused the adapter's content
    │   │   ├── RankTooLargeError            rank above the engine's max rank
    │   │   └── IncompatibleAdapterError     modules/features the engine cannot serve
    │   ├── AdapterAlreadyLoadedError        name already loaded
    │   ├── AdapterNotFoundError             unknown name on unload, or path without adapter
    │   └── CapacityError                    the engine has no free adapter slot
    ├── TransportError                       moving bytes to an engine failed
    │   ├── StorageError (OSError)           disk/shared-memory I/O failed
    │   ├── WireFormatError (ValueError)     bytes or a stage spec that are not a valid wire format
    │   │   └── UnsupportedDtypeError (TypeError)   a dtype the wire format cannot name
    │   └── CudaIpcUnavailableError (RuntimeError)  this process cannot map the producer's GPU memory
    └── PublishError                         publisher-level refusals
        ├── StaleVersionError                an older version would replace a newer one
        ├── VerificationError                the engine does not reproduce the trainer's probe
        │   └── UnverifiedUnreachableError (EngineUnavailableError)  failed, and unreachable to withdraw it
        └── AdapterChangedError              the trainer changed the tensors while the publish read them

Warnings derive from ``LoraSyncWarning`` (a ``UserWarning``), never from ``LoraSyncError``:

    LoraSyncWarning (UserWarning)
    └── SlotLeakWarning                      an engine answered an unload but still holds the adapter
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdapterAlreadyLoadedError",
    "AdapterChangedError",
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterRejectedError",
    "AuthenticationError",
    "BlockingCallError",
    "CapabilityError",
    "CapacityError",
    "ConfigError",
    "CudaIpcUnavailableError",
    "DtypeMismatchError",
    "DuplicateRegistrationError",
    "EngineDeadError",
    "EngineError",
    "EngineProtocolError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "ExpertLayoutError",
    "ExportError",
    "GeometryError",
    "IncompatibleAdapterError",
    "InexactExportError",
    "InvalidKeyError",
    "InvalidNameError",
    "LoraNotEnabledError",
    "LoraSyncError",
    "LoraSyncWarning",
    "MissingPairError",
    "MissingShardError",
    "NonFiniteError",
    "PaddedRankError",
    "PublishError",
    "PublisherClosedError",
    "RankTooLargeError",
    "RegistryError",
    "ReplicatedEngineError",
    "RuntimeLoraDisabledError",
    "ShapeMismatchError",
    "SlotLeakWarning",
    "StaleVersionError",
    "StorageError",
    "TransportError",
    "UnknownAdapterNameError",
    "UnknownEngineError",
    "UnknownModuleError",
    "UnsupportedDtypeError",
    "UnsupportedEngineVersionError",
    "UnverifiedUnreachableError",
    "VerificationError",
    "WireFormatError",
]


class LoraSyncError(Exception):
    """Root of every lorasync error. Extra context travels as keyword attributes."""

    def __init__(self, message: str = "", **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable across processes (publishers fan out to workers), context included.
        return (_rebuild, (type(self), self.message, self.context))


def _rebuild(cls: type[LoraSyncError], message: str, context: dict[str, Any]) -> LoraSyncError:
    return cls(message, **context)


class LoraSyncWarning(UserWarning):
    """Root of lorasync warnings."""


class SlotLeakWarning(LoraSyncWarning):
    """An engine answered an unload but still holds the adapter (its slot, its memory).

    Attributes (on the warning's ``args[0]``-carrying instance): ``engine``, ``url``,
    ``adapters`` (the served names still held).
    """

    def __init__(self, message: str = "", *, engine: str = "", url: str = "", adapters: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.engine, self.url, self.adapters = engine, url, tuple(adapters)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only context survives pickling (warnings cross to Ray drivers and worker pools).
        return (_rebuild_warning, (type(self), self.args[0] if self.args else "", self.engine, self.url, self.adapters))


def _rebuild_warning(cls: type[SlotLeakWarning], message: str, engine: str, url: str, adapters: tuple[str, ...]) -> SlotLeakWarning:
    return cls(message, engine=engine, url=url, adapters=adapters)


# -- adapters -------------------------------------------------------------------------------


class AdapterError(LoraSyncError, ValueError):
    """An Adapter's tensors or config are not servable."""


class InvalidKeyError(AdapterError):
    """A key is not ``base_model.model.<module>.lora_{A,B}.weight``."""


class MissingPairError(AdapterError):
    """A module has lora_A but no lora_B, or the reverse."""


class ShapeMismatchError(AdapterError):
    """A/B shapes disagree with each other or with the configured rank."""


class DtypeMismatchError(AdapterError):
    """Tensors of one adapter have different or non-floating dtypes."""


class NonFiniteError(AdapterError):
    """A tensor holds NaN or inf."""


class PaddedRankError(AdapterError):
    """Rank padding that should be zero holds trained values."""


# -- exporters ------------------------------------------------------------------------------


class ExportError(LoraSyncError, ValueError):
    """Trainer state cannot be turned into an Adapter."""


class UnknownAdapterNameError(ExportError):
    """The requested PEFT adapter name is not in the model or state dict."""


class MissingShardError(ExportError):
    """A rank's shard is missing from the export input."""


class GeometryError(ExportError):
    """Model geometry (heads, KV heads, TP size, shapes) does not fit together."""


class UnknownModuleError(ExportError):
    """A trainer module name that no translation rule covers."""


class InexactExportError(ExportError):
    """The trainer state is valid but computes something no PEFT LoRA adapter reproduces exactly
    (DoRA magnitudes, Megatron's expert fc2 at expert-TP > 1); refused rather than approximated."""


class ExpertLayoutError(InexactExportError, AdapterError):
    """PEFT ``target_parameters`` LoRA on fused MoE experts that lorasync cannot convert exactly into
    one LoRA pair per expert (an unknown expert layout, shapes that do not split, a parameter no
    engine serves as LoRA). Context: ``parameter``, the targeted parameter's path."""


# -- configuration, names, registry ----------------------------------------------------------


class ConfigError(LoraSyncError, ValueError):
    """Options or configuration values are invalid."""


class BlockingCallError(ConfigError, RuntimeError):
    """A blocking (sync) call made where it would deadlock or stall: on the event loop that runs
    the publisher's async work, on a loop an engine needs (an AsyncLLM's), or from inside the
    publisher's own call. The message names the async method to await instead."""


class PublisherClosedError(ConfigError):
    """The publisher was closed (or is being closed), or was made by the parent of this forked
    process; make a new ``Publisher``."""


class InvalidNameError(LoraSyncError, ValueError):
    """An adapter name or version is unsafe (path traversal, separators, NUL, length)."""


class RegistryError(LoraSyncError):
    """Engine registry problems."""


class UnknownEngineError(RegistryError, KeyError):
    """No engine is registered under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class DuplicateRegistrationError(RegistryError):
    """A name is already registered with a different target."""


# -- engines --------------------------------------------------------------------------------


class EngineError(LoraSyncError):
    """An engine refused or failed a request. Context: ``engine``, ``url``, ``adapter``,
    ``status`` (HTTP status or None), ``attempts``."""


class EngineUnavailableError(EngineError, ConnectionError):
    """The engine could not be reached, or kept failing with 5xx until retries ran out."""


class EngineTimeoutError(EngineUnavailableError, TimeoutError):
    """The engine did not answer within the timeout."""


class EngineDeadError(EngineUnavailableError):
    """The engine's core died (vLLM's ``EngineDeadError``): every request fails until it restarts."""


class EngineProtocolError(EngineError):
    """The engine answered something lorasync cannot interpret."""


class UnsupportedEngineVersionError(EngineProtocolError):
    """The engine reports a major version lorasync has no protocol table for (it refuses to
    guess). Context: ``version``, ``known``."""


class AuthenticationError(EngineError):
    """The engine rejected the credentials (HTTP 401/403), or a client lacks them in this process
    (unpickled without its literal secret: ``status`` is None and nothing was sent)."""


class LoraNotEnabledError(EngineError):
    """The engine was started without LoRA support."""


class CapabilityError(EngineError):
    """The engine cannot perform the requested operation."""


class RuntimeLoraDisabledError(CapabilityError):
    """The engine's runtime LoRA routes are switched off (vLLM: no
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` in its environment)."""


class ReplicatedEngineError(CapabilityError):
    """The URL given as one engine is several (a router in front of servers): a load sent there
    reaches one of them. The message names the engine kind that publishes to every one
    (``vllm-router:URL``)."""


class AdapterRejectedError(EngineError):
    """The engine refused the adapter's content."""


class RankTooLargeError(AdapterRejectedError):
    """The adapter's rank exceeds the engine's maximum LoRA rank."""


class IncompatibleAdapterError(AdapterRejectedError):
    """The adapter targets modules or uses features the engine cannot serve."""


class AdapterAlreadyLoadedError(EngineError):
    """An adapter with that name is already loaded."""


class AdapterNotFoundError(EngineError):
    """The engine does not know that adapter (unload), or found no adapter at the path (load)."""


class CapacityError(EngineError):
    """The engine has no free adapter slot; loading more would evict a served adapter."""


# -- transports and publishing ---------------------------------------------------------------


class TransportError(LoraSyncError):
    """Moving adapter bytes to an engine failed."""


class StorageError(TransportError, OSError):
    """Disk or shared-memory I/O failed."""


class WireFormatError(TransportError, ValueError):
    """Bytes (a safetensors layout, a shared-memory segment) or a stage spec that are not a
    valid lorasync wire format: truncated, corrupt, or written by something else."""


class UnsupportedDtypeError(WireFormatError, TypeError):
    """A tensor dtype the safetensors wire format cannot name (cast the tensors first)."""


class CudaIpcUnavailableError(TransportError, RuntimeError):
    """This process cannot map the producer's GPU memory (no CUDA, the GPU is not visible, or
    the driver refused the handle); the caller falls back to host shared memory."""


class PublishError(LoraSyncError):
    """The publisher refused or could not complete a publish."""


class StaleVersionError(PublishError):
    """An older version would replace a newer one; nothing was changed."""


class VerificationError(PublishError):
    """The engine's output for the probe differs from the trainer's reference."""


class UnverifiedUnreachableError(VerificationError, EngineUnavailableError):
    """A version did not pass its verification and could not be taken out of service because the
    engine cannot be reached (killed, restarting): it may still serve, unverified, and is
    withdrawn before the next load. Both a VerificationError and an EngineUnavailableError, so
    either handler sees it: restart or wait for the engine, then publish again."""


class AdapterChangedError(PublishError):
    """The adapter's tensors changed while the publish read them (a no-copy export that the
    trainer stepped mid-publish): the torn version was taken out of service, nothing of it is
    remembered as served. Publish between optimizer steps, or export with ``copy=True``."""
