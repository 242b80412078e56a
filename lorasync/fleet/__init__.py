"""Many tenants (adapters) on shared engines: :class:`~._fleet.Fleet`, its tenants
(:mod:`._tenant`), the shared slot plan and reports (:mod:`._plan`), the engines it manages
(:mod:`._engines`), one publish round (:mod:`._round`) and the round's unchanged check
(:mod:`._hash`). Every tenant publishes through :mod:`lorasync.publisher`'s own parts.

May import: everything below it (errors, wire, runtime, adapter, exporters, transports,
engines, publisher); never :mod:`lorasync.distributed`.
"""
