"""The drafter inside the verifier process (``--drafter-placement verifier``; docs/design.md
"Drafter placement").

This module is the one place that builds a drafter for the verifier's process: the verifier package
never imports the drafter package (nor the other way round). The supervisor binds
:func:`inproc_drafter` to the drafter's config and hands it to
:func:`services.verifier.process.run_verifier_process`, which calls it with its epoch. Importing this
module imports no torch.
"""

from __future__ import annotations

import logging

log = logging.getLogger("verifier")


def inproc_drafter(drafter_config, epoch: str):
    """Build the drafter in this process: ``(client, drafter info, drafter metrics)``.

    Args:
        drafter_config: a :class:`services.drafter.worker.DrafterWorkerConfig`. Its
            ``drafter_threads`` > 0 sets the intra-op threads while drafting; 0 (auto) keeps the
            verifier's own (the two never compute at the same time in one process). Its Prometheus
            registry is served on ``drafter_metrics_port``, as a drafter process serves it.
        epoch: the verifier's epoch (the drafter info carries it, as a handshake would).

    Returns:
        an :class:`services.verifier.drafter_client.InprocDrafterClient`, the drafter's
        :class:`services.protocol.PeerInfo` and its :class:`services.metrics.DrafterMetrics`.

    Raises:
        ValueError, OSError, RuntimeError: a bad drafter directory or setting (as the drafter
            process raises them; the supervisor reports them as one line).
    """
    from services.drafter.build import build_from_config
    from services.drafter.worker import drafter_info
    from services.ipc_pool import make_transport
    from services.metrics import DrafterMetrics
    from services.runtime import start_metrics_server
    from services.startup import memory_line, object_memory_parts, phase
    from services.verifier.drafter_client import InprocDrafterClient

    with phase("verifier", "drafter loaded (in the verifier process)"):
        service, target_dir = build_from_config(drafter_config)
    log.info("%s", memory_line("drafter", object_memory_parts(service)))
    info = drafter_info(service, target_dir, epoch, drafter_config.device,
                        make_transport(drafter_config.device, False))
    metrics = DrafterMetrics(drafter=info.model)
    if getattr(service, "ngram", None) is not None:
        metrics.track_ngram(service.ngram.counts)
    start_metrics_server(drafter_config.drafter_metrics_port, drafter_config.transport.metrics_host, metrics.registry)
    threads = drafter_config.drafter_threads or None
    client = InprocDrafterClient(service, metrics, threads=threads)
    log.info("drafter runs in the verifier process (block %d, methods %s; drafting threads: %s)",
             info.block_size, ", ".join(info.methods), threads or "the verifier's")
    return client, info, metrics
