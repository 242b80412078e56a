"""Reading vLLM's successful answers: model lists, completions, the LoRA requests gauge, and a
router's worker list.

Pure functions of response bodies (no I/O), shared by the HTTP client's operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from lorasync.engines._http import body_json
from lorasync.engines.vllm._errors import dig
from lorasync.engines.vllm._protocol import LORA_GAUGE

__all__ = ["Completion", "adapter_roots", "completion_of", "lora_in_use", "router_workers", "shown_url"]


@dataclass(frozen=True)
class Completion:
    """A greedy completion: generated token ids and, when asked for, their logprobs.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]``; ``top_logprobs[i]`` maps the
    top-k token ids at step ``i`` to theirs.
    """

    model: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[dict[int, float], ...] | None = None
    text: str = ""




def router_workers(response: httpx.Response) -> list[str] | None:
    """The worker URLs in a router's ``/list_workers`` answer (vllm-router and the SGLang router:
    ``{"urls": [...]}``); None when it is no such answer (a vLLM server's 404, another page)."""
    urls = dig(body_json(response), "urls") if response.status_code == 200 else None
    if isinstance(urls, list) and all(isinstance(u, str) for u in urls):
        return list(urls)
    return None


def shown_url(url: str) -> str:
    """A worker URL as messages may show it: scheme, host, port and path, never its
    ``user:password@`` or ``?query`` (where engine URLs carry secrets)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<a URL that does not parse>"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme and host else "<a URL without a host>"


def adapter_roots(response: httpx.Response) -> dict[str, str | None]:
    """Adapter name → path from a ``/v1/models`` answer (adapters are the cards with a parent)."""
    cards = dig(body_json(response), "data") if response.status_code == 200 else None
    if not isinstance(cards, list):
        return {}
    return {
        card["id"]: card.get("root")
        for card in cards
        if isinstance(card, dict) and card.get("parent") and isinstance(card.get("id"), str)
    }


def lora_in_use(text: str) -> frozenset[str] | None:
    """Running and waiting adapter names from a Prometheus exposition, or None without the gauge.

    vLLM sets the gauge's value to the current time under labels naming the adapters and never
    removes older label sets, so every past combination stays listed: only the newest sample(s)
    describe the engine now (several share the newest time only when engines log together).

    Raises:
        ValueError: the text is not in Prometheus' exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    # vLLM's exposition runs to hundreds of histogram lines; prometheus_client parses only the
    # gauge's own lines (its HELP/TYPE comments and samples), which makes this ~20x cheaper on the
    # retirement path (a line-prefix filter; the parsing itself stays the library's).
    own = "\n".join(line for line in text.splitlines() if LORA_GAUGE in line) + "\n"
    samples = [
        sample
        for family in text_string_to_metric_families(own)
        if family.name == LORA_GAUGE
        for sample in family.samples
        if sample.name == LORA_GAUGE
    ]
    if not samples:
        return None if LORA_GAUGE not in text else frozenset()
    newest = max(sample.value for sample in samples)
    names: set[str] = set()
    for sample in samples:
        if sample.value == newest:
            for label in ("running_lora_adapters", "waiting_lora_adapters"):
                names.update(n for n in sample.labels.get(label, "").split(",") if n)
    return frozenset(names)


def _token_id(token: str) -> int | None:
    return int(token[len("token_id:") :]) if token.startswith("token_id:") else None


def completion_of(choice: dict[str, Any], model: str, with_logprobs: bool) -> Completion | None:
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else None
    ids = choice.get("token_ids")
    if not isinstance(ids, list) and lp is not None:  # servers without return_token_ids
        parsed = [_token_id(t) for t in lp.get("tokens") or []]
        ids = parsed if all(i is not None for i in parsed) else None
    if not isinstance(ids, list):
        return None
    logprobs = top = None
    if with_logprobs and lp is not None:
        logprobs = tuple(float(x) for x in lp.get("token_logprobs") or [])
        top = tuple(
            {tid: float(v) for k, v in (step or {}).items() if (tid := _token_id(k)) is not None}
            for step in lp.get("top_logprobs") or []
        )
    return Completion(
        model=model,
        token_ids=tuple(int(i) for i in ids),
        logprobs=logprobs,
        top_logprobs=top,
        text=str(choice.get("text") or ""),
    )
