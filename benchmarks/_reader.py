"""The second process of IPC benchmarks: reads shared-memory segments on request.

Protocol (one line each way): ``read NAME NBYTES`` → tensor bytes copied out by
``read_segment``; ``copy NAME NBYTES`` → bytes copied by one raw memcpy; ``ping`` → ``ready``;
``stop``. Optional argument: torch intra-op threads.
"""

from __future__ import annotations

import sys
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from lorasync.wire.shm import read_segment


def _copy(name: str, nbytes: int) -> int:
    shm = shared_memory.SharedMemory(name=name, create=False)
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the producer owns it
    except Exception:
        pass
    dst = np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, np.frombuffer(shm.buf, dtype=np.uint8, count=nbytes))
    shm.close()
    return dst.nbytes


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    for line in sys.stdin:
        op, *args = line.split()
        try:
            if op == "stop":
                return
            if op == "ping":
                answer = "ready"
            elif op == "read":
                tensors, _ = read_segment(args[0], int(args[1]))
                answer = str(sum(t.numel() * t.element_size() for t in tensors.values()))
                del tensors
            elif op == "copy":
                answer = str(_copy(args[0], int(args[1])))
            else:
                answer = f"error unknown op {op}"
        except Exception as exc:  # report, keep serving
            answer = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
        print(answer, flush=True)


if __name__ == "__main__":
    main()
