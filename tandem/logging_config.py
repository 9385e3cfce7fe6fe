"""Log level of the command-line entry points and of spawned rank processes:
``TANDEM_LOGGING_LEVEL`` (default ``WARNING``, ``INFO`` for ``tandem serve``; ``INFO`` also shows
startup decisions such as the captured CUDA graph sizes and the dual-batch overlap split policy,
the load steps' times and the server's periodic stats line). Without the variable, spawned rank
processes take the level of the process that launched them."""

from __future__ import annotations

import logging

from tandem import envs


def configure_logging(default_level: str = "WARNING") -> None:
    """Configure the root logger from ``TANDEM_LOGGING_LEVEL`` (else ``default_level``).

    Raises:
        ValueError: the variable names no logging level.
    """
    level = envs.TANDEM_LOGGING_LEVEL or default_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
