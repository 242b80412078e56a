"""The SGLang engine: :class:`SGLangEngine` (registered as ``sglang``) and what it knows of SGLang.

Modules, lowest first: :mod:`.protocol` (versions, payloads, result types), :mod:`.rules`
(what SGLang refuses or serves wrongly: used by the client's pre-flight, the publisher's
``check_adapter`` and ``lorasync.inspection``), :mod:`.errors` (SGLang's answers into typed
errors) and :mod:`.client` (the sans-IO operations, driven sync and async).
"""

from lorasync.engines.sglang.client import SGLangEngine
from lorasync.engines.sglang.protocol import GenerateResult
from lorasync.engines.sglang.rules import served_leaves
from lorasync.transforms import pad_ranks

__all__ = ["GenerateResult", "SGLangEngine", "pad_ranks", "served_leaves"]
