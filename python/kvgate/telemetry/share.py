"""BoardShare: the workers of ``--workers N`` share one poll of each engine.

What: a :class:`~kvgate.telemetry.poller.PollShare` over the poll board of the admission
core's shared-memory region (``AdmissionController.publish_board`` / ``read_board``: one entry
per backend, a sequence lock, at most ``BOARD_PAYLOAD_BYTES`` a record). Worker ``i`` of ``N``
polls the backends whose core id is ``i`` modulo ``N`` and publishes a record after each poll;
the others follow those records (:class:`~kvgate.telemetry.poller.MetricsPoller`).

Why: without it every worker scraped every engine's metrics and health every interval: ``N``
scrapes a second on each engine, and ``N`` times the pollers' CPU (about 0.3 ms a poll, 30 % of
a core for 1,000 backends, in each worker).

Inputs: the worker's controller (attached to the shared region), backend name → core id, the
worker's index and the number of workers. Nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BoardShare"]


class BoardShare:
    """Backend polls shared through the core's poll board (see the module docstring).

    Args:
        controller: a ``kvgate.AdmissionController`` on the shared region.
        backend_ids: backend name → its id in the core.
        worker: this worker's index, ``0 <= worker < workers``.
        workers: the number of workers (≥ 1).

    Raises:
        ValueError: a worker index outside ``0..workers``.
    """

    __slots__ = ("_ctl", "_ids", "_mine", "max_record")

    def __init__(
        self, controller: Any, backend_ids: Mapping[str, int], worker: int, workers: int
    ) -> None:
        from kvgate._core import BOARD_PAYLOAD_BYTES

        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is not one of 0..{workers - 1}")
        self._ctl = controller
        self._ids = dict(backend_ids)
        self._mine = {name for name, i in self._ids.items() if i % workers == worker}
        #: Largest record :meth:`publish` takes, in bytes.
        self.max_record = BOARD_PAYLOAD_BYTES

    def polls(self, backend: str) -> bool:
        """Whether this worker polls ``backend`` (its core id is this worker's index modulo
        the number of workers); a backend the share does not know is polled."""
        return backend in self._mine or backend not in self._ids

    def publish(self, backend: str, record: bytes) -> None:
        """Publishes ``record`` on ``backend``'s board entry (dropped while another process
        writes it; nothing for a backend the share does not know).

        Raises:
            InvalidConfigError: a record over ``BOARD_PAYLOAD_BYTES`` bytes.
        """
        i = self._ids.get(backend)
        if i is not None:
            self._ctl.publish_board(i, record)

    def read(self, backend: str) -> tuple[int, bytes] | None:
        """The record last published for ``backend`` and its sequence number, or ``None``."""
        i = self._ids.get(backend)
        if i is None:
            return None
        try:
            got: tuple[int, bytes] | None = self._ctl.read_board(i)
        except ValueError:
            return None
        return got
