"""The tiny random-weight target and drafter (:mod:`services.tiny_models`) and the ``dartree serve``
flags every process-level test on them uses (CPU, seconds)."""

from __future__ import annotations

from services.tiny_models import CONTEXT, make_tiny_models  # noqa: F401 (the tests' import path)

# ``dartree serve`` flags every tiny-model server uses (see services.testing.start_server). The drafter
# runs in its own process, whose faults, restarts and metrics these tests exercise; the drafter inside
# the verifier (the CPU default, ``--drafter-placement auto``) has its own tests
# (tests/service/test_drafter_placement.py)
TINY_FLAGS = ("--served-model-name", "tiny", "--default-temperature", "0", "--ping-interval-s", "0.2",
              "--drafter-placement", "process")
