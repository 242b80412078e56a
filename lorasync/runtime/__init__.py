"""The runtime every other room stands on: the publisher's background event loop and its rules
(:mod:`._loop`), object lifecycles and fork safety (:mod:`._lifecycle`), background work that
outlives a call (:mod:`._background`), the retry policy (:mod:`._retry`) and collectives over
``torch.distributed`` (:mod:`._collectives`).

May import: :mod:`lorasync.errors`, :mod:`lorasync.wire`. Nothing here knows what an adapter is.
"""
