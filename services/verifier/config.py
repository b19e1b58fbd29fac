"""The verifier's settings: :class:`EngineConfig` (the engine's limits) inside :class:`VerifierWorkerConfig`.

One record per concern, no copies: the worker's config holds the engine's as its ``engine``
sub-object, and :func:`services.verifier.build.build_verifier` hands that sub-object to the engine
as it is (``compile=None``, "auto", resolved against the loaded target). The command line flattens
the sub-object: each of its fields is a flag of its own (``--max-running``, not
``--engine-max-running``; :func:`services.config_cli.add_config_args`). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.memory_plan import DEFAULT_MAX_RUNNING
from services.protocol import METHODS
from services.runtime import WEIGHT_CHOICES, check_device, check_dtype
from services.transport_config import TransportConfig
from services.spec import (DEFAULT_MAX_REQUEST_BUDGET, DEFAULT_METHOD, DEFAULT_POLICY, MAX_BUDGET, POLICIES,
                           TreeKnobs, check_tree_knobs, default_tree_knobs, parse_tree_schedule,
                           request_tree_limits)


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits (:class:`services.verifier.engine.SpecEngine`).

    Attributes:
        max_context: context window (0 or None = the target's position limit; on CUDA the longest that
            fits when that does not).
        max_running: requests decoded concurrently, each in its own KV slot, all in one batched step
            (unset: 8 on CPU; on CUDA planned from the device's free memory, at most 8: see
            docs/memory-plan.md).
        prefill_chunk: prompt tokens a request prefills per step (chunked prefill rides along with the
            running requests' rounds); max_step_tokens: rows one step may hold (verify rows + chunks;
            requests beyond it wait for the next step, the order rotates so none starves; a step always
            holds at least one request); kv_bucket: a step reads the KV cache up to its longest context
            rounded up to this (fewer shapes).
        overlap: split the running drafting requests into two groups that take turns: while the
            target verifies one group, the drafter drafts the other's next trees (submitted right
            after their commit); ``ar`` requests run in every step. Same tokens; pays off when the
            drafter has its own core / GPU stream.
        compile: run the target's batched steps through ``torch.compile`` (warm-up at start, logged;
            about a minute the first time on a small CPU, seconds once inductor's disk cache under the
            state directory is warm; on a CUDA target: CUDA graphs of padded steps). None (auto):
            compiled for a q4 llama target on CPU (:func:`services.verifier.runner.auto_compile`,
            resolved when the engine is built), eager otherwise.
        cuda_graphs: on a CUDA target, pad every verify step to a bucket and replay the CUDA graphs
            captured at start for a grid of rows x KV lengths (:class:`ModelRunner`'s ``cuda_graphs``;
            :mod:`services.verifier.graph_grid`; steps past the grid run eagerly and are counted in
            ``dartree_graph_eager_steps_total``). None (auto) = on for a CUDA device; False
            (``--no-cuda-graphs``): eager unpadded steps; True on another device is refused at start
            in the verifier process (engines built directly run the padded steps eagerly there, the
            CPU test of the padding).
        prefix_cache: a finished request's KV slot keeps its conversation (KV and target features);
            a request whose prompt starts with it prefills only the rest (chat turns resend the whole
            conversation): it takes the free slot sharing the longest prefix with its prompt, or copies
            the leading columns another slot has committed, or waits for a request prefilling the same
            prompt. Same tokens as a cold prefill, speculation included. False: every prompt is prefilled.
        device_walk: commit a step's decode rounds on the device: one batched accept walk, one KV
            compaction of every accepted path, and one device-to-host copy of the committed tokens
            per step (:mod:`services.verifier.step_commit`); False: each round walks on the host and
            commits its own KV (the reference; same tokens); None: on unless the target runs on the
            CPU, where the host walk is cheaper. Not a command-line setting.
    """

    max_context: int | None = None
    max_running: int | None = 8
    prefill_chunk: int = 256
    max_step_tokens: int = 512
    kv_bucket: int = 64
    overlap: bool = False
    compile: bool | None = False
    cuda_graphs: bool | None = None
    prefix_cache: bool = True
    device_walk: bool | None = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_chunk", "max_step_tokens", "kv_bucket"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_context is not None and self.max_context < 0:
            raise ValueError(f"max_context must be >= 0 (got {self.max_context})")


@dataclass(frozen=True)
class VerifierWorkerConfig:
    """Verifier process settings (CLI ``--field-name``, env ``DARTREE_FIELD_NAME``).

    Attributes:
        target: target model (default name or local HF directory).
        verifier_endpoint: where the verifier listens for the gateway ("" = default ipc:// socket).
        drafter_endpoint: the drafter's endpoint ("" = default ipc:// socket; "none" = no drafter, AR only).
        device, dtype: where and in which precision the target runs.
        weights: the target's weight format (``services/weight_formats.py``): float32, bfloat16, q4 (the
            GGUF's 4-bit blocks, bfloat16 activations) or auto (the fastest here, measured once and
            cached); a concrete format overrides ``dtype``.
        max_waiting: requests queued beyond ``engine.max_running`` (429 after).
        gpu_memory_utilization: on CUDA, the fraction of the device's memory the server may use
            (weights, KV cache, feature history, drafter contexts, step buffers); the start-up plan
            derives or checks the running requests and the context window against it
            (docs/memory-plan.md).
        engine: the engine's limits (:class:`EngineConfig`: max_running, max_context, prefill_chunk,
            max_step_tokens, kv_bucket, overlap, compile, prefix_cache; one flag each); its
            ``compile`` None (auto) is resolved against the loaded target, an unset ``max_running``
            to 8 on CPU and by the memory plan on CUDA.
        default_method: method when a request names none (must be one the drafter serves).
        spec_policy: ``goodput`` (default): per step, each request's tree budget (0 = plain decoding,
            no drafter call) is chosen to maximise expected emitted tokens per second of the whole
            step, from calibrated per-node acceptance and a measured step cost model
            (``services/verifier/policy.py``); ``fixed``: every drafting request drafts and verifies
            its whole tree every round (the behaviour before the policy existed).
        spec_max_budget: the goodput policy's B_max, the budget of its drafter calls and the most nodes
            it verifies per request (0 = ``budget``, the default tree budget).
        max_request_budget: the largest tree a request may ask for in ``speculative``: budget and
            width up to it, candidates up to it or 64; the gateway refuses more with a 400 naming the
            knob. One request's tree is verified in the step all running requests share, so this
            bounds what one client can cost the others.
        cost_sweep: with ``goodput``, time a few target forwards at start-up (1-8, 9, 17, 33 rows and
            on to B + 1 of the budget, e.g. 65 on CUDA, timed with CUDA events there; a few seconds,
            cached per machine / model / dtype in ``~/.cache/dartree/cost_model.json`` when its
            repeats agree; on a busy CPU a rule-based curve, not cached).
        tree_schedule: manual override, load-dependent tree budget/width, ``"1:16x12,2:12x8,4:8x6,8:4x4"``
            (``N:BxW`` = at >= N running requests, B nodes and width W; only for requests that leave
            budget/width unset). "" = off. With ``goodput`` the pick is the drafter call's budget and the
            policy may still verify fewer nodes (docs/configuration.md, "Tree defaults").
        budget, width, depth_bonus, candidates: the default tree knobs, for what a request leaves
            unset (None = :func:`services.spec.default_tree_knobs` of ``device``: B=8 on CPU, 64 on
            CUDA; W=12, beta=-0.2, K=64). The policy resolves every draft's knobs from them and
            the drafter receives resolved knobs only; the GEMM packs are sized by ``budget``.
        draft_timeout_s: deadline of one drafter round trip; drafter_wait_s: how long to wait for the
            drafter at start; health_interval_s: period of the drafter heartbeat (a thread of its own,
            so a hung drafter is seen within this period + 2 s even while requests run, and
            the verifier decodes without speculation until it answers again).
        drain_timeout_s: on SIGTERM, how long running requests may finish.
        transport: the CUDA-IPC feature pool (CUDA devices only) and ``metrics_host``
            (:class:`~services.transport_config.TransportConfig`, shared with the drafter; one flag each).
        packed_gemm: on a float32 CPU, pack the target's GEMM weights for the step sizes of the
            batched steps (4, B + 1 doubling up to max_running x (B + 1), a chain method's block + 1
            rows), each on the first step of that size (``services/cpu_gemm.py``: same numerics;
            SmolLM2: ~0.5 GB per step size used).
        verifier_metrics_port: Prometheus endpoint's port (0 = off; its host: ``transport.metrics_host``).
        prefix_cache_mib: memory bound, in MiB, on what cached prefixes hold beyond the reserved KV
            slots: one target feature row per cached position (SmolLM2-135M with the default
            drafter: 11.25 KiB a position in float32) plus its token id; past it the least recently
            used prefixes are evicted (a running request's KV never is). 0 keeps no prefix.
        prefix_cache_ram_mib: memory bound, in MiB, on the host-RAM store of prefixes evicted from
            their KV slot (llama-server's ``--cache-ram``): a cached prefix of at least 256 positions
            whose slot another request takes is saved there (every layer's K and V, its feature
            rows, its token ids; SmolLM2-135M: ~56 KiB a position in float32) and copied back into
            a slot for a later prompt that shares it; past the bound the least recently used entries
            are dropped. Host memory on every device. 0 = off.
        restart_after_compile: when a start compiled the target's steps from a cold cache (the
            warm-up wrote inductor's disk cache), end the process right after the warm-up so that the
            supervisor starts it again: the restarted process loads the compiled steps from the disk
            cache in seconds and holds none of the compiler's in-memory state (~50 MB on SmolLM2-135M).
            None (auto): only under ``dartree serve``'s supervisor, which restarts it once.
        background_compile: compile a CPU lean step off the critical path
            (:mod:`services.verifier.compile_swap`): ready on the eager step (or on the compiled one
            when inductor's disk cache holds it), the compile in a low-priority child process, the
            compiled step swapped in when no request runs. False: compile during the start.
    """

    target: str = "smollm2-135m-instruct"
    verifier_endpoint: str = ""
    drafter_endpoint: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "auto"
    max_waiting: int = 64
    engine: EngineConfig = EngineConfig(max_context=0, max_running=None, compile=None)
    default_method: str = DEFAULT_METHOD
    spec_policy: str = DEFAULT_POLICY
    spec_max_budget: int = 0
    max_request_budget: int = DEFAULT_MAX_REQUEST_BUDGET
    cost_sweep: bool = True
    tree_schedule: str = ""
    budget: int | None = None
    width: int | None = None
    depth_bonus: float | None = None
    candidates: int | None = None
    draft_timeout_s: float = 30.0
    drafter_wait_s: float = 600.0
    health_interval_s: float = 1.0
    drain_timeout_s: float = 30.0
    transport: TransportConfig = TransportConfig()
    packed_gemm: bool = True
    verifier_metrics_port: int = 8001
    log_level: str = "INFO"
    prefix_cache_mib: int = 256
    prefix_cache_ram_mib: int = 1024
    restart_after_compile: bool | None = None
    background_compile: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.engine.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"--cuda-graphs needs a CUDA device (got --device {self.device}); "
                             "leave it unset or pass --no-cuda-graphs")
        if self.engine.max_running is None and not self.device.startswith("cuda"):  # CUDA: the memory plan sets it
            object.__setattr__(self, "engine", replace(self.engine, max_running=DEFAULT_MAX_RUNNING))
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (got {self.max_waiting})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.prefix_cache_mib < 0:
            raise ValueError(f"prefix_cache_mib must be >= 0 (got {self.prefix_cache_mib})")
        if self.prefix_cache_ram_mib < 0:
            raise ValueError(f"prefix_cache_ram_mib must be >= 0 (got {self.prefix_cache_ram_mib})")
        check_dtype(self.dtype)
        check_device(self.device)
        if self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights {self.weights!r} is not supported (choose from {', '.join(WEIGHT_CHOICES)})")
        if self.default_method not in METHODS:
            raise ValueError(f"unknown default_method {self.default_method!r} (choose from {', '.join(METHODS)})")
        parse_tree_schedule(self.tree_schedule, MAX_BUDGET, self.engine.max_running)  # ValueError: one line
        check_tree_knobs(self.budget, self.width, self.depth_bonus, self.candidates, prefix="")
        if self.spec_policy not in POLICIES:
            raise ValueError(f"unknown spec_policy {self.spec_policy!r} (choose from {', '.join(POLICIES)})")
        if not 0 <= self.spec_max_budget <= MAX_BUDGET:
            raise ValueError(f"spec_max_budget must be in [0, {MAX_BUDGET}] (got {self.spec_max_budget})")
        request_tree_limits(self.max_request_budget)  # ValueError: one line


def default_knobs(config: VerifierWorkerConfig) -> TreeKnobs:
    """The verifier's default :class:`~services.spec.TreeKnobs`: the config's, each unset one from
    :func:`services.spec.default_tree_knobs` of its device."""
    knobs = TreeKnobs(config.budget, config.width, config.depth_bonus, config.candidates)
    return knobs.filled_from(default_tree_knobs(config.device))
