"""One BLAS thread while the encoder tier multiplies a batch's vectors: small products, slow threads.

After ONNX Runtime's call, the tier's gate for unfamiliar inputs multiplies the batch's vectors by
its reference vectors ((n, 384) x (384, 484) on AG News), and heads that read the embedding alone
multiply them by their weights. OpenBLAS splits even products this small across its threads, and
its threads spin after each one, waiting for more: beside ONNX Runtime's threads and a server's
HTTP threads on the same cores, a spinning thread holds a core that work needs, and the caller
waits on a sibling descheduled for it. On 2 shared cores the gate took 16 ms of a batch of 32
inside ``Cascade.decide_batch`` (0.36 ms of CPU alone), and ``decide_batch`` 22.2 ms of CPU an
item against 18.9 on one BLAS thread (docs/benchmarks/serving.md). A distance may move by one
float32 unit in the last place (1.2e-7) with the thread count, as it already does with the
batch's size; the tier's replies to 800 AG News items, in batches of 1, 8, 32 and 800, were the
same bit for bit either way.

The thread count is OpenBLAS's, one per process, set through threadpoolctl (which scikit-learn
brings). Callers take turns for the body (a few hundred microseconds a batch), so that none puts
back a count another has lowered; each one's limit ends on its own thread, since threadpoolctl
lets only the thread that set OpenBLAS's count set it again until that thread's limits end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

_TURNS = threading.Lock()


@cache
def _controller() -> Any:
    """The BLAS libraries loaded (numpy's and scipy's OpenBLAS), found once: a scan of the loaded
    libraries costs milliseconds, a limit on them about 25 microseconds."""
    import numpy  # noqa: F401  (its BLAS is loaded before the scan)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the body with every loaded BLAS library on one thread; put back the counts after."""
    with _TURNS, _controller().limit(limits=1, user_api="blas"):
        yield
