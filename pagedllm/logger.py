"""Package logging: one handler on the `pagedllm` logger, level from PAGEDLLM_LOGGING_LEVEL (INFO)."""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

_root = logging.getLogger("pagedllm")
if not _root.handlers:
    _h = logging.StreamHandler(sys.stderr)
    _h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    _root.addHandler(_h)
    _root.setLevel(envs.PAGEDLLM_LOGGING_LEVEL)
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
