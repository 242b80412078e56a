"""One adapter published to its engines: :class:`~._publisher.Publisher` and
``publish_adapter`` (:mod:`._api`), and the parts a publish passes through: the torn-read watch
and hash (:mod:`._digest`), transport choice (:mod:`._select`), one engine's handle
(:mod:`._handle`: load, verify, retire), the versioned files (:mod:`._files`), retention
(:mod:`._retention`), the report (:mod:`._report`) and what runs after (:mod:`._aftercare`,
:mod:`._session`, :mod:`._cancelled`, :mod:`._leaks`, :mod:`._capacity`).

May import: everything below it (errors, wire, runtime, adapter, exporters, transports,
engines); never :mod:`lorasync.fleet` or :mod:`lorasync.distributed`.
"""
