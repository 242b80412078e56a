"""Multi-node publish over torch.distributed: engines on other hosts, no shared filesystem.

A trainer's engines may run on hosts whose disks it cannot write. :class:`DistributedPublisher`
uses the process group the trainer already runs: the exporting rank (``src``) serialises the
adapter once, one rank per node (the node *leader*) receives it, writes it under a node-local
root and publishes it to that node's engines with an ordinary :class:`~lorasync.Publisher`.
Every leader's results come back to ``src`` as one :class:`DistributedPublishReport`.

:class:`DistributedFleet` does the same for many adapters trained at once (multi-LoRA): one
leader per node serves every tenant through a node-local :class:`~lorasync.Fleet`.

Modules: :mod:`.publisher` (the protocol), :mod:`.fleet` (the multi-LoRA one, reported by
:mod:`._fleet_report`), :mod:`._roles` (nodes, leaders, agreement checks),
:mod:`._wire` (adapter, result and error encodings, no pickle), :mod:`._report` (what comes
back). The JSON collectives are :mod:`lorasync.runtime._collectives`, shared with the Megatron exporter.

May import: every package below it (publisher, fleet and their floors); never cli,
integrations or testing.
"""

from lorasync.distributed._fleet_report import DistributedFleetReport
from lorasync.distributed._report import DistributedPublishReport, NodeResult
from lorasync.distributed._wire import decode_adapter, encode_adapter
from lorasync.distributed.fleet import DistributedFleet
from lorasync.distributed.publisher import DistributedPublisher

__all__ = ["DistributedFleet", "DistributedFleetReport", "DistributedPublishReport", "DistributedPublisher", "NodeResult", "decode_adapter", "encode_adapter"]
