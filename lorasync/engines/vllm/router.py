"""A router in front of vLLM servers, as the engines behind it (engine kind ``vllm-router``).

vLLM's own router (``vllm-router`` on PyPI, from the SGLang router) and the SGLang router list
their workers at ``GET /list_workers`` (``{"urls": [...]}``). A runtime LoRA load sent to the
router is forwarded to one worker, so requests the router sends to the others answer 404 for the
new version, or serve an older one. Given ``vllm-router:URL``, lorasync asks the router for its
workers and publishes to each one as an engine of its own (``lorasync.engines._group``): every
worker loads and verifies the version, and the report has a result per worker.

The plain ``vllm`` client refuses a router's URL (:class:`~lorasync.errors.ReplicatedEngineError`)
when it sees one (``_bodies.router_workers``), instead of loading into whichever worker the
router picks.
"""

from __future__ import annotations

from typing import Any
from lorasync.engines._group import EngineGroup
from lorasync.engines._http import Call, Operation
from lorasync.engines._hosts import server_key
from lorasync.engines.vllm._bodies import router_workers, shown_url
from lorasync.engines.vllm._client import VLLMEngine
from lorasync.engines.vllm._errors import generic
from lorasync.engines.vllm._protocol import LIST_WORKERS_ROUTE
from lorasync.errors import CapabilityError, EngineProtocolError

__all__ = ["VLLMRouter"]


class VLLMRouter(EngineGroup):
    """The vLLM servers behind a router (``vllm-router``, or an SGLang-router-compatible one).

    Args:
        url (`str`): the router's URL.
        **options: the worker clients' options (:class:`VLLMEngine`: ``api_key``,
            ``api_key_env``, ``timeout``, ``retries``, ``max_rank``, ``max_loras``,
            ``same_host``); the router is asked with the same key and timeout.

    Credentials inside the router's URL (``user:password@``, ``?key=``) are sent to the router
    only; ``api_key=`` / ``api_key_env=`` go to the router and to every worker it lists, so give
    them only for a router whose worker list you trust.

    Example:
        >>> pub = Publisher(["vllm-router:http://127.0.0.1:30000"], name="policy")  # doctest: +SKIP
        >>> [r.url for r in pub.publish(adapter, version=1).results]  # one per worker  # doctest: +SKIP
    """

    kind = "vllm-router"

    def __init__(self, url: str = "http://127.0.0.1:30000", **options: Any) -> None:
        self._front = VLLMEngine(url, **options)  # checks the options once, for every worker too
        self._front.kind = self.kind  # errors name the router as what it is
        self.url = self._front.url
        self._options = options

    def members(self) -> list[VLLMEngine]:
        """Clients of the router's workers, as it lists them now (the caller closes them).

        Raises:
            CapabilityError: the URL lists no workers (not a router, or a router without any).
            EngineProtocolError: a worker URL that is not ``http(s)://host:port``.
            EngineUnavailableError, AuthenticationError: the router did not answer, or refused the key.
        """
        urls = self._front._run(self._list())
        return [VLLMEngine(u, **self._options) for u in urls]

    def _list(self) -> Operation[list[str]]:
        response = yield Call("GET", LIST_WORKERS_ROUTE)
        urls = router_workers(response)
        context = self._front.error_context(LIST_WORKERS_ROUTE, None, response)
        if urls is None:
            if response.status_code in (404, 405):
                raise CapabilityError(
                    f"{self.url} has no {LIST_WORKERS_ROUTE}: it is not a vllm-router (or SGLang router); for one vLLM "
                    f"server use 'vllm:{self.url}', for several list each one",
                    **context,
                )
            if response.status_code != 200:
                raise generic(self._front, response, LIST_WORKERS_ROUTE, None, response.text[:300], "listing the router's workers")
            raise EngineProtocolError(f"{self.url}{LIST_WORKERS_ROUTE} answered {response.text[:300]!r}, not a list of worker URLs", **context)
        if not urls:
            raise CapabilityError(
                f"the router at {self.url} has no workers: start its vLLM servers (or add them: POST /add_worker?url=...) "
                "before publishing, or every request would fail",
                **context,
            )
        # One client per server: a router may list one server under two spellings (127.0.0.1 and
        # localhost/), which the publisher's duplicate check would refuse as given twice.
        by_server: dict[object, str] = {}
        for u in urls:
            key = server_key(u)
            if key is None:
                raise EngineProtocolError(
                    f"the router at {self.url} lists a worker that is not an http(s) URL with a host ({shown_url(u)}); "
                    "lorasync can publish only to servers it reaches over HTTP",
                    **context,
                )
            by_server.setdefault(key, u)
        return sorted(by_server.values())

    def close(self) -> None:
        self._front.close()

    async def aclose(self) -> None:
        await self._front.aclose()
