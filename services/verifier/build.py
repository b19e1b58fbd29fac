"""The one assembly of a :class:`SpecEngine`: runner, GEMM packs, warm-up, policy, engine, in that order.

The verifier worker, ``dartree generate``, the training scripts, the benchmarks and the test
helpers all build their engine here, so they run the same object built the same way:

1. a :class:`ModelRunner` over the target (its slot KV cache reserved);
2. the target's float32 CPU GEMM packs, by one rule (:func:`pack_rule`), lazily;
3. with ``compile``, the runner's steps warmed up (the packs are part of what is compiled);
4. the speculation policy, built before the engine: ``goodput`` seeds its cost model from a
   start-up sweep timed on the runner (:func:`time_forward`, with lazy packing paused so the sweep's
   row counts pack nothing), ``fixed`` needs nothing;
5. the engine, handed the runner and the policy.
"""

from __future__ import annotations

import logging

import torch

from services.spec import DEFAULT_KNOBS, TreeKnobs, TreeSchedule
from services.tree.batch import causal_segment
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.runner import ModelRunner

log = logging.getLogger("verifier")


def make_runner(target, config: EngineConfig) -> ModelRunner:
    """The runner an engine with ``config`` uses over ``target`` (:func:`SpecEngine.kv_positions` per slot).

    Raises:
        MemoryError: the slot KV cache does not fit (one line).
    """
    return ModelRunner(target, config.max_running, SpecEngine.kv_positions(target, config), config.kv_bucket,
                       compile=config.compile, cuda_graphs=config.cuda_graphs)


def time_forward(runner: ModelRunner, rows: int) -> float:
    """Seconds of one target forward of ``rows`` causal rows in a free slot, leaving no state (the
    goodput policy's start-up cost sweep): on CUDA between two CUDA events around the step
    (:func:`services.devices.cuda_event_seconds`), else the runner's own wall time.

    Raises:
        ValueError: no free KV slot, or ``rows`` beyond a slot's capacity.
    """
    from services.devices import cuda_event_seconds

    cache = runner.cache
    if cache.num_free() == 0:
        raise ValueError("no free KV slot to time a forward in")
    slot = cache.alloc()
    try:
        def step():
            return runner.execute([causal_segment([0] * rows, 0, slot)], torch.tensor([rows - 1]))

        if torch.device(runner.target.device).type == "cuda":
            return cuda_event_seconds(step, torch.cuda)[0]
        return step().seconds
    finally:
        cache.free(slot)


def pack_rule(budget: int, max_draft_depth: int, max_running: int, drafts: bool) -> tuple[int, int, int]:
    """``(budget, max_draft_depth, max_running)`` for :meth:`TargetModel.pack_for_steps`: the default
    tree's rows with a drafter; one row per request (plain decoding) without one."""
    return (budget, max_draft_depth, max_running) if drafts else (1, 1, max_running)


def sweep_key(model: str, weights: str, device: str, runner: ModelRunner) -> str:
    """The cost-sweep cache key of ``runner``'s steps (:func:`services.verifier.cost_model.cache_key`
    at torch's current thread count): compiled steps cost what eager ones do not, so they get a key
    of their own (``<weights>+compiled``), and a change of the formats' kernels
    (:data:`services.weights.KERNELS_VERSION`) sweeps again."""
    from services.verifier.cost_model import cache_key
    from services.weights import KERNELS_VERSION

    fmt = f"{weights}{'+compiled' if runner.compiled else ''}|kernels {KERNELS_VERSION}"
    return cache_key(model, fmt, device, torch.get_num_threads())


def build_policy(name: str, runner: ModelRunner, defaults: TreeKnobs = DEFAULT_KNOBS,
                schedule: TreeSchedule | None = None, max_budget: int | None = None, cost_sweep: bool = True,
                cost_key: tuple[str, str, str] = ("model", "float32", "cpu")):
    """The named speculation policy (:data:`services.spec.POLICIES`); ``goodput``'s cost model starts
    from a sweep timed on ``runner`` (cached per machine / ``cost_key`` = ``(model, weights, device)`` and
    whether the runner's steps are compiled; none with ``cost_sweep=False``).

    Raises:
        ValueError: unknown policy name, or a bad ``max_budget`` / ``defaults``.
    """
    from services.cpu_gemm import lazy_packing_paused
    from services.verifier import policy as pol

    if name != "goodput":
        return pol.make_policy(name, schedule=schedule, defaults=defaults)
    from services.verifier.cost_model import sweep_rows

    model, dtype, device = cost_key
    key = sweep_key(model, dtype, device, runner)
    rows = sweep_rows(max_budget or defaults.budget)  # every row count a verify of the budget reaches
    with lazy_packing_paused():  # the sweep times row counts serving may never run: it packs none
        return pol.goodput_with_sweep(lambda rows: time_forward(runner, rows), key, max_budget, cost_sweep,
                                      dtype=dtype, threads=torch.get_num_threads(), rows=rows,
                                      device=str(runner.target.device), schedule=schedule, defaults=defaults)


def build_engine(target, drafter, config: EngineConfig = EngineConfig(), *, max_draft_depth: int = 16,
                 drafter_max_position: int | None = None, policy: str = "fixed",
                 defaults: TreeKnobs = DEFAULT_KNOBS, schedule: TreeSchedule | None = None,
                 max_budget: int | None = None, cost_sweep: bool = True,
                 cost_key: tuple[str, str, str] | None = None, packed_gemm: bool = True) -> SpecEngine:
    """A :class:`SpecEngine` over a loaded ``target`` and a drafter client (None = plain decoding only).

    Args:
        config: the engine's limits (``compile``: the runner's steps are warmed up here, rows 1 and
            the default tree's B + 1).
        max_draft_depth, drafter_max_position: the drafter's limits (see :class:`SpecEngine`).
        policy: ``"fixed"`` or ``"goodput"``; defaults, schedule, max_budget: its knob resolution
            (:class:`services.verifier.policy.FixedPolicy`, :class:`~services.verifier.policy.GoodputPolicy`);
            cost_sweep, cost_key: goodput's start-up sweep (:func:`build_policy`; ``cost_key`` None =
            the target directory's name, its weight format and its device).
        packed_gemm: pack the target's float32 CPU GEMMs by :func:`pack_rule`, each row count on its
            first use (numerics unchanged).
    Raises:
        MemoryError: the KV cache does not fit; ValueError: unknown policy or bad knobs.
    """
    runner = make_runner(target, config)
    if packed_gemm:
        target.pack_for_steps(*pack_rule(defaults.budget, max_draft_depth, config.max_running, drafter is not None),
                              lazy=True)
    if config.compile:
        rows = (1, defaults.budget + 1 if drafter is not None else 2)
        log.info("compiling the target's steps (%s, rows %s) ...",
                 "CUDA graphs" if runner.graphed else "torch.compile", rows)
        log.info("compiled steps ready in %.1f s", runner.warm_up(rows))
        from services.weights import release_freed_memory

        release_freed_memory()  # tracing and code generation free ~100 MB that glibc would keep resident
    if cost_key is None:
        cost_key = (getattr(target, "name", "model"), str(getattr(target, "weights", "float32")), str(target.device))
    spec_policy = build_policy(policy, runner, defaults, schedule, max_budget, cost_sweep, cost_key)
    log.info("speculation policy: %s", spec_policy.name)
    return SpecEngine(target, drafter, config, max_draft_depth=max_draft_depth,
                      drafter_max_position=drafter_max_position, policy=spec_policy, runner=runner)
