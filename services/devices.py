"""Device strings, normalised once at start, and the CUDA device each worker process binds.

``--device cuda`` (no index) means the current CUDA device, which in a process that has not used
CUDA yet is device 0 of those ``CUDA_VISIBLE_DEVICES`` shows. Every process of one server must name
the same device the same way: a tensor on ``cuda:0`` compares unequal to ``torch.device("cuda")``,
so a CUDA-IPC pool built for ``"cuda"`` would send every tensor as a host frame instead. The
supervisor therefore normalises the flag once (:func:`normalize_device`, before the workers'
configs are built), and each worker binds its device (:func:`bind_device`: ``torch.cuda.set_device``)
before it loads a model, so that kernels, graphs, streams and allocations without an explicit index
land on that device too.

Importable without torch; torch is imported only for a CUDA device.
"""

from __future__ import annotations

from services.runtime import check_device


def _torch_cuda():
    import torch

    return torch.cuda


def normalize_device(device: str, cuda=None) -> str:
    """``device`` with an explicit CUDA index: ``cpu`` unchanged, ``cuda`` -> ``cuda:N`` of the current
    device (0 in a process that has not initialised CUDA: querying it would create a CUDA context in
    the supervisor), ``cuda:N`` checked against the visible devices.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        cuda: the ``torch.cuda`` module (tests pass a stand-in); None imports torch for CUDA devices.
    Raises:
        ValueError: an unsupported string, no CUDA device visible, or an index past the visible
            devices (one line naming ``--device``).
    """
    check_device(device)
    if not device.startswith("cuda"):
        return device
    cuda = cuda or _torch_cuda()
    if not cuda.is_available():
        raise ValueError(f"--device {device}: this torch sees no CUDA device; use --device cpu")
    count = cuda.device_count()
    if device == "cuda":
        index = cuda.current_device() if cuda.is_initialized() else 0
    else:
        index = int(device.split(":", 1)[1])
    if index >= count:
        raise ValueError(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1}); "
                         "check CUDA_VISIBLE_DEVICES")
    return f"cuda:{index}"


def bind_device(device: str, cuda=None) -> str:
    """Normalise ``device`` (:func:`normalize_device`) and, for CUDA, make it this process's current
    device (``torch.cuda.set_device``). Returns the normalised string.

    Raises:
        ValueError: as :func:`normalize_device`.
    """
    device = normalize_device(device, cuda)
    if device.startswith("cuda"):
        (cuda or _torch_cuda()).set_device(int(device.split(":", 1)[1]))
    return device


def cuda_event_seconds(fn, cuda=None):
    """``(seconds, fn())``: the device time between two CUDA events recorded on the current stream
    before and after ``fn()`` (the host waits for the second; launches are asynchronous, so a host
    clock would time the launches, not the kernels).

    Args:
        fn: the work to time (it queues kernels on the current stream).
        cuda: the ``torch.cuda`` module (tests pass a stand-in); None imports torch.
    """
    cuda = cuda or _torch_cuda()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, out


def is_out_of_memory(exc: BaseException | str) -> bool:
    """Whether an exception (or an error text that carries its type name, as a drafter's error reply
    does) says a device or the host ran out of memory: ``torch.cuda.OutOfMemoryError``,
    ``MemoryError``, or a ``RuntimeError`` whose message says "out of memory"."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = exc if isinstance(exc, str) else str(exc) if isinstance(exc, RuntimeError) else ""
    return "OutOfMemoryError" in text or "out of memory" in text.lower()


def release_device_cache() -> None:
    """Hand the CUDA caching allocator's unused blocks back (after an out-of-memory error, so the
    next call starts from what is really in use); nothing when CUDA was never initialised."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
