"""The one assembly of a :class:`SpecEngine`: runner, GEMM packs, warm-up, policy, engine, in that order.

The verifier worker (:func:`build_verifier`: the target loaded from a :class:`VerifierWorkerConfig`,
then :func:`build_engine`), ``dartree generate``, the training scripts, the benchmarks and the test
helpers all build their engine here, so they run the same object built the same way:

1. a :class:`ModelRunner` over the target (its slot KV cache reserved);
2. the target's float32 CPU GEMM packs, by one rule (:func:`pack_rule`), lazily;
3. with ``compile``, the runner's steps warmed up (the packs are part of what is compiled);
4. the speculation policy, built before the engine: ``goodput`` seeds its cost model from a
   start-up sweep timed on the runner (:func:`time_forward`, with lazy packing paused so the sweep's
   row counts pack nothing) and loads its acceptance calibration from the store it is given,
   ``fixed`` needs nothing;
5. the engine, handed the runner and the policy.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch

from services.protocol import PeerInfo
from services.runtime import drop_file_pages
from services.spec import DEFAULT_KNOBS, TreeKnobs, TreeSchedule, parse_tree_schedule
from services.tree.batch import causal_segment
from services.verifier.config import EngineConfig, VerifierWorkerConfig, default_knobs
from services.verifier.engine import SpecEngine
from services.verifier.runner import ModelRunner, auto_compile

log = logging.getLogger("verifier")


def make_runner(target, config: EngineConfig) -> ModelRunner:
    """The runner an engine with ``config`` uses over ``target`` (:func:`SpecEngine.kv_positions` per slot).

    Raises:
        MemoryError: the slot KV cache does not fit (one line).
    """
    return ModelRunner(target, config.max_running, SpecEngine.kv_positions(target, config), config.kv_bucket,
                       compile=config.compile, cuda_graphs=config.cuda_graphs)


def time_forward(runner: ModelRunner, rows: int) -> float:
    """Seconds of one target forward of ``rows`` causal rows in a free slot with logits for every
    row, as a tree verify computes them, leaving no state (the goodput policy's start-up cost sweep;
    the last row's logits alone made a 4-row q4 verify look 6 % cheaper on a 2-core CPU and a
    9-row one 19 %: ``benchmarks/results/2026-12-07-cpu-round-costs``): on CUDA between two CUDA events around the step
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
            return runner.execute([causal_segment([0] * rows, 0, slot)])

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
    (:func:`services.weight_formats.kernels_version`, or the integer-dot kernels switched on or off:
    :func:`services.int_dot.enabled`) sweeps again."""
    from services import int_dot
    from services.verifier.cost_model import cache_key
    from services.weight_formats import kernels_version

    kernels = f"kernels {kernels_version()}{'+int_dot' if int_dot.enabled() else ''}"
    fmt = f"{weights}{'+compiled' if runner.compiled else ''}|{kernels}|all-row logits"
    return cache_key(model, fmt, device, torch.get_num_threads())


def build_policy(name: str, runner: ModelRunner, defaults: TreeKnobs = DEFAULT_KNOBS,
                 schedule: TreeSchedule | None = None, max_budget: int | None = None, cost_sweep: bool = True,
                 cost_key: tuple[str, str, str] = ("model", "float32", "cpu"), store=None):
    """The named speculation policy (:data:`services.spec.POLICIES`); ``goodput``'s cost model starts
    from a sweep timed on ``runner`` (cached per machine / ``cost_key`` = ``(model, weights, device)`` and
    whether the runner's steps are compiled; none with ``cost_sweep=False``), and its acceptance
    calibration from ``store`` (a :class:`~services.verifier.calibration_store.CalibrationStore`; None =
    a cold start, nothing saved). ``fixed`` ignores ``store``.

    Raises:
        ValueError: unknown policy name, or a bad ``max_budget`` / ``defaults``.
    """
    from services.cpu_gemm import lazy_packing_paused
    from services.verifier import policy_build as pol

    if name != "goodput":
        return pol.make_policy(name, schedule=schedule, defaults=defaults)
    from services.verifier.cost_model import sweep_rows

    model, dtype, device = cost_key
    key = sweep_key(model, dtype, device, runner)
    rows = sweep_rows(max_budget or defaults.budget)  # every row count a verify of the budget reaches
    with lazy_packing_paused():  # the sweep times row counts serving may never run: it packs none
        policy = pol.goodput_with_sweep(lambda rows: time_forward(runner, rows), key, max_budget, cost_sweep,
                                        dtype=dtype, threads=torch.get_num_threads(), rows=rows,
                                        device=str(runner.target.device), schedule=schedule, defaults=defaults,
                                        store=store)
    if cost_sweep:
        policy.cost.resweep = functools.partial(resweep, policy.cost, runner, cost_key, rows)
    return policy


def resweep(cost, runner: ModelRunner, cost_key: tuple[str, str, str], rows: tuple[int, ...]) -> str:
    """Take the goodput policy's start-up sweep again on ``runner``'s current step (its own cache key:
    :func:`sweep_key`) and :meth:`~services.verifier.cost_model.StepCostModel.reseed` ``cost`` with it:
    a verifier that started on the eager step calls it when the compiled step is swapped in, whose
    forwards cost less and grow differently with the row count. Returns the sweep's source line."""
    from services.cpu_gemm import lazy_packing_paused
    from services.verifier.policy_build import sweep_into

    model, dtype, device = cost_key
    with lazy_packing_paused():
        return sweep_into(cost, lambda r: time_forward(runner, r), sweep_key(model, dtype, device, runner), dtype,
                          rows, torch.get_num_threads(), str(runner.target.device),
                          step="compiled" if runner.compiled else "eager", replace=True)


def build_engine(target, drafter, config: EngineConfig = EngineConfig(), *, max_draft_depth: int = 16,
                 drafter_max_position: int | None = None, policy: str = "fixed",
                 defaults: TreeKnobs = DEFAULT_KNOBS, schedule: TreeSchedule | None = None,
                 max_budget: int | None = None, cost_sweep: bool = True,
                 cost_key: tuple[str, str, str] | None = None, packed_gemm: bool = True,
                 calibration_store=None, compile_off_path: bool = False) -> SpecEngine:
    """A :class:`SpecEngine` over a loaded ``target`` and a drafter client (None = plain decoding only).

    Args:
        config: the engine's limits (``compile``: the runner's steps are warmed up here, rows 1 and
            the default tree's B + 1; None = :func:`~services.verifier.runner.auto_compile` of ``target``;
            a runner with ``cuda_graphs``, the default on CUDA, captures its grid here instead:
            :func:`capture_graphs`).
        max_draft_depth, drafter_max_position: the drafter's limits (see :class:`SpecEngine`).
        policy: ``"fixed"`` or ``"goodput"``; defaults, schedule, max_budget: its knob resolution
            (:class:`services.verifier.policy.FixedPolicy`, :class:`~services.verifier.policy.GoodputPolicy`);
            cost_sweep, cost_key: goodput's start-up sweep (:func:`build_policy`; ``cost_key`` None =
            the target directory's name, its weight format and its device); calibration_store: where
            goodput loads and saves its acceptance calibration (None: neither).
        packed_gemm: pack the target's float32 CPU GEMMs by :func:`pack_rule`, each row count on its
            first use (numerics unchanged).
        compile_off_path: with ``compile`` on a CPU lean step (:func:`deferrable`), never compile on
            the critical path (:mod:`services.verifier.compile_swap`): steps warm in inductor's disk
            cache are loaded here (eager on a load failure, one log line); otherwise the runner
            starts eager with ``deferred_rows`` set, for the caller to build them in the background.
    Raises:
        MemoryError: the KV cache does not fit; ValueError: unknown policy or bad knobs.
    """
    if config.compile is None:
        config = replace(config, compile=auto_compile(target))
    rows = (1, defaults.budget + 1 if drafter is not None else 2)  # the warm-up's row counts
    defer = compile_off_path and bool(config.compile) and deferrable(target, config)
    runner = make_runner(target, replace(config, compile=False) if defer else config)
    if packed_gemm:
        target.pack_for_steps(*pack_rule(defaults.budget, max_draft_depth, config.max_running, drafter is not None),
                              lazy=True)
    if runner.graphed:
        capture_graphs(runner, config, (max_budget or defaults.budget) + 1 if drafter is not None else 1)
    elif defer:
        _load_or_defer(runner, rows)
    elif config.compile:
        _warm_up(runner, rows)
    if cost_key is None:
        cost_key = (getattr(target, "name", "model"), str(getattr(target, "weights", "float32")), str(target.device))
    spec_policy = build_policy(policy, runner, defaults, schedule, max_budget, cost_sweep, cost_key,
                               store=calibration_store)
    log.info("speculation policy: %s", spec_policy.name)
    return SpecEngine(target, drafter, config, max_draft_depth=max_draft_depth,
                      drafter_max_position=drafter_max_position, policy=spec_policy, runner=runner)


def capture_graphs(runner: ModelRunner, config: EngineConfig, segment_rows: int) -> dict:
    """Capture ``runner``'s verify-step grid at start (:meth:`ModelRunner.capture_graphs`): a request
    verifies at most ``segment_rows`` rows (B + 1; 1 without a drafter), a step at most
    ``max_running x segment_rows`` rows bounded by ``config.max_step_tokens``. Logged with its memory."""
    max_rows = min(config.max_step_tokens, config.max_running * segment_rows)
    info = runner.capture_graphs(max_rows, segment_rows)
    from services.weights import release_freed_memory

    release_freed_memory()
    return info


def deferrable(target, config: EngineConfig) -> bool:
    """Whether ``target``'s compiled steps can be built off the critical path and swapped in: a lean
    step on CPU (:attr:`~services.verifier.swap_in.CompiledSwapIn.can_swap_in_compiled`; not CUDA
    graphs, not padded steps)."""
    from services.verifier.lean_step import LeanLlamaStep, lean_step_enabled

    return (torch.device(target.device).type == "cpu" and not config.cuda_graphs and lean_step_enabled()
            and LeanLlamaStep.supports(target.model))


def _load_or_defer(runner: ModelRunner, rows: tuple[int, ...]) -> None:
    """Swap the compiled steps of ``rows`` into the eager ``runner`` now when inductor's disk cache
    holds them (:func:`~services.verifier.warm_steps.cache_is_warm`), else set ``runner.deferred_rows``;
    a failed load leaves the runner eager (one log line) and defers."""
    from services.verifier import warm_steps

    key = warm_steps.steps_key(runner.target, rows)
    if warm_steps.cache_is_warm(key):
        try:
            seconds = runner.use_compiled(rows)
        except Exception as exc:  # noqa: BLE001 - the eager step serves; one line says why
            warm_steps.forget_warm(key)
            log.warning("the compiled steps did not load from the disk cache (%s); starting on the eager step",
                        warm_steps.one_line(exc))
        else:
            log.info("compiled steps loaded from the disk cache in %.1f s", seconds)
            return
    runner.deferred_rows = rows
    log.info("starting on the eager step; the compiled steps (rows %s) are built in the background", rows)


def _warm_up(runner: ModelRunner, rows: tuple[int, ...]) -> None:
    """Compile (or load from inductor's disk cache) ``runner``'s steps of ``rows`` rows, logged."""
    log.info("compiling the target's steps (%s, rows %s) ...", "CUDA graphs" if runner.graphed else "torch.compile",
             rows)
    log.info("compiled steps ready in %.1f s", runner.warm_up(rows))
    from services.weights import release_freed_memory

    release_freed_memory()  # tracing and code generation free ~100 MB that glibc would keep resident


# ------------------------------------------------------------------------------------ the verifier

def load_target(config: VerifierWorkerConfig, drafter: PeerInfo | None):
    """The verifier's target, loaded per ``config`` and tapping the layers ``drafter`` reads:
    ``(target, target_dir)``.

    Raises:
        RuntimeError: the drafter's feature width is not the target's; FileNotFoundError / ValueError:
            an unknown target or weight format (one line).
    """
    from services.models.registry import resolve_target
    from services.startup import phase
    from services.verifier.target import TargetModel
    from services.weights import resolve_cli_weights

    target_dir = resolve_target(config.target)
    layer_ids = list(drafter.target_layer_ids) if drafter and drafter.target_layer_ids else None
    weights, _ = resolve_cli_weights(config.weights, config.dtype if config.dtype != "float32" else None,
                                     target_dir, config.device)  # the supervisor passes a concrete one
    with phase("verifier", f"target weights loaded ({weights or config.dtype})"):
        target = TargetModel.from_pretrained(target_dir, layer_ids, dtype=getattr(torch, config.dtype),
                                             device=config.device, weights=weights)
    if drafter is not None and drafter.feature_dim and drafter.feature_dim != target.feature_dim:
        raise RuntimeError(f"drafter expects {drafter.feature_dim}-wide features, the target taps {target.feature_dim}")
    return target, target_dir


def build_verifier(config: VerifierWorkerConfig, drafter_client, drafter: PeerInfo | None):
    """The verifier process's engine: the target loaded (:func:`load_target`), then :func:`build_engine`
    with ``config.engine`` (its ``compile`` auto resolved against the target, its limits by
    :func:`engine_limits`: as given on CPU, the memory plan's on CUDA), the drafter's limits from its
    handshake ``drafter`` (None: no drafter, plain decoding) and, with a drafter, the goodput
    policy's calibration store keyed by target, weights, device and :func:`drafter_tag`. Returns
    ``(engine, target, target_dir)``.

    Raises:
        MemoryError: the KV cache does not fit; RuntimeError, ValueError: see :func:`load_target`.
    """
    from services.startup import phase
    from services.weights import release_freed_memory

    target, target_dir = load_target(config, drafter)
    compile = auto_compile(target) if config.engine.compile is None else config.engine.compile
    running, context = engine_limits(config, target, drafter, drafter_client, compile)
    engine_config = replace(config.engine, max_running=running, max_context=context, compile=compile)
    store = None
    if drafter is not None:
        from services.verifier.calibration_store import CalibrationStore, calibration_key

        store = CalibrationStore(calibration_key(target_dir.name, str(target.weights), config.device,
                                                 drafter_tag(drafter)))
    with phase("verifier", "engine built (KV cache, GEMM packs, step cost model)"):
        engine = build_engine(target, drafter_client, engine_config,
                              max_draft_depth=drafter.block_size if drafter and drafter.block_size else 16,
                              drafter_max_position=(drafter.max_position or None) if drafter else None,
                              policy=config.spec_policy, defaults=default_knobs(config),
                              schedule=parse_tree_schedule(config.tree_schedule),
                              max_budget=config.spec_max_budget or None, cost_sweep=config.cost_sweep,
                              cost_key=(target_dir.name, str(target.weights), config.device),
                              packed_gemm=config.packed_gemm, calibration_store=store,
                              compile_off_path=config.background_compile)
    cache = engine.runner.cache
    cache.prefix.max_bytes = config.prefix_cache_mib * 2**20
    cache.prefix.ram.max_bytes = config.prefix_cache_ram_mib * 2**20
    log.info("KV cache: %d slots x %d positions, %.2f GiB reserved (%s, %s; %s)", cache.num_slots, cache.capacity,
             cache.nbytes() / 2**30, target.weights, config.device,
             "allocated on the device" if config.device.startswith("cuda") else "pages committed as used")
    release_freed_memory()  # what the engine build freed (the cost sweep's activations) leaves the RSS
    # the q4 packs file's pages: the lean step's fused copies superseded most of them; the linears
    # still read (o/down projections) fault theirs back at the first step
    log.info("weight file pages dropped: %.0f MB resident before", drop_file_pages() / 2**20)
    log_memory(target, engine)
    return engine, target, target_dir


def engine_limits(config: VerifierWorkerConfig, target, drafter: PeerInfo | None, drafter_client,
                  compile: bool) -> tuple[int, int | None]:
    """``(max_running, max_context)`` of the engine: ``config.engine``'s on CPU (context None = the
    target's); on CUDA, after both models loaded, the memory plan's (derived or checked, logged:
    :func:`services.memory_plan.plan_verifier_memory`; CUDA graphs unless ``engine.cuda_graphs`` is False).

    Raises:
        ValueError: the limits do not fit the device (one line naming the flag).
    """
    if not config.device.startswith("cuda"):
        return config.engine.max_running, config.engine.max_context or None
    from services.memory_plan import plan_verifier_memory

    mem = plan_verifier_memory(config, target, drafter, graphed=config.engine.cuda_graphs is not False,
                               transport=getattr(drafter_client, "transport", None))
    return mem.max_running, mem.max_context


def drafter_tag(drafter: PeerInfo) -> str:
    """The drafter as its handshake describes it (description, block, tapped layers, methods): the
    key of its saved acceptance calibration."""
    layers = ",".join(str(i) for i in drafter.target_layer_ids)
    name = (drafter.model or "drafter").rstrip("/").rsplit("/", 1)[-1]  # a directory: its name, not the machine's path
    return f"{name}|K{drafter.block_size}|L{layers}|{','.join(drafter.methods)}"


def log_memory(target, engine) -> None:
    """One line: the verifier's resident memory by part (weights, GEMM packs, KV cache, prefix cache)."""
    from services.cpu_gemm import packed_bytes
    from services.startup import kv_committed_bytes, mb, memory_line, module_bytes, prefix_cache_part

    cache = engine.runner.cache
    log.info("%s", memory_line("verifier", {
        "weights": module_bytes(target.model), "GEMM packs": packed_bytes(target.model),
        "KV cache": f"{mb(kv_committed_bytes(cache))} written of {mb(cache.nbytes())} reserved in "
                    f"{str(cache.dtype).removeprefix('torch.')}",
        "prefix cache": prefix_cache_part(cache.prefix)}))
