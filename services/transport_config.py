"""What the verifier and drafter processes share about their links: the CUDA-IPC feature pool
(:func:`services.ipc_pool.make_transport`) and the address their Prometheus endpoints listen on.

Both worker configs hold it as their ``transport`` sub-object; the command line flattens it (one
flag per field, ``--cuda-ipc``, ``--metrics-host``: :mod:`services.config_cli`), so ``dartree serve``
sets both processes' copies with one flag. Each process's metrics port stays its own field
(``--verifier-metrics-port``, ``--drafter-metrics-port``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportConfig:
    """A worker's link settings (CLI ``--field-name``, env ``DARTREE_FIELD_NAME``).

    Attributes:
        cuda_ipc: share feature tensors through a CUDA-IPC pool (used only on a CUDA device; zero-copy
            frames otherwise).
        ipc_slots: slots of that pool; ipc_slot_bytes: bytes of one slot.
        metrics_host: where the process's Prometheus endpoint listens (its port is the worker's own
            setting; port 0 = off).
    """

    cuda_ipc: bool = True
    ipc_slots: int = 16
    ipc_slot_bytes: int = 8 << 20
    metrics_host: str = "127.0.0.1"
