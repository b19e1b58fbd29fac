"""What the worker forkserver imports once, so that the workers it forks share these pages.

``dartree serve`` on CPU starts its workers (and the throw-away weight-choice child) from one
:mod:`multiprocessing` forkserver (:func:`services.runtime.worker_context`). The forkserver imports
this module before it forks anything: torch, transformers' Llama, the worker modules and the gateway
app, about 250 MB of Python objects and allocator state that every worker would otherwise build for
itself in a fresh interpreter. Forked workers share those pages copy-on-write, so the server's
proportional memory (PSS) counts them about once, and each worker skips ~3 s of imports.

Nothing here starts a thread that matters across ``fork`` (numpy's OpenBLAS pool has fork handlers)
or touches CUDA (the forkserver is used only when every model runs on CPU).

In the forkserver process itself (and only there) SIGTERM is ignored: a SIGTERM sent to every
process of the server (systemd ``KillMode=control-group``) must drain the workers, not kill the
process that reports their exit codes to the supervisor. The forkserver exits with the supervisor
(its "alive" pipe closes). Workers restore the default action at once
(:func:`services.runtime.restore_stop_signals`).
"""

from __future__ import annotations

import gc
import signal
import sys

import torch  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401

import gateway.app  # noqa: F401
import services.colocated  # noqa: F401
import services.drafter.worker  # noqa: F401
import services.startup  # noqa: F401
import services.verifier.process  # noqa: F401
import services.verifier.worker  # noqa: F401


def _in_forkserver() -> bool:
    """True in the process :mod:`multiprocessing.forkserver` runs (``python -c 'from
    multiprocessing.forkserver import main; main(...)'``)."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


if _in_forkserver():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # what the imports built moves to the permanent generation: a worker's cyclic GC then never
    # writes to those objects' headers, which would copy every page of them into each worker
    gc.collect()
    gc.freeze()
