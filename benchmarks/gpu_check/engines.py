"""Random-weight engines of real shapes and the per-phase timing of their rounds (``gpu_check``).

Both targets and their DFlash + Domino drafters are **random weights** built from configs in code
(no downloads), so acceptance is ~0 and only the timings mean anything. Rounds run through the
engine itself (:class:`services.verifier.engine.SpecEngine`, one request, T = 0, ``ignore_eos``);
the phase times are its :class:`~services.verifier.engine.RoundOutput` ``timings``, with a device
synchronisation added around the target forward and the drafter block (instrumentation only) so GPU
time lands in the phase that queued it. The graph probe times one no-KV forward of B + 1 rows
eagerly and replayed from a :class:`services.cuda_graphs.GraphedStep`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

PHASES = ("draft", "tree_build", "verify", "commit", "round")


def shapes(smoke: bool) -> dict[str, dict]:
    """Target configs (HF kwargs + arch) and drafter overrides by shape name: the real shapes
    (SmolLM2-135M, Qwen3-4B, Qwen3-8B), or two tiny ones for ``--smoke``."""
    if smoke:
        tiny = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
        return {"tiny-llama": {"arch": "llama", "target": tiny, "drafter": dict(num_hidden_layers=1, block_size=8)},
                "tiny-qwen3": {"arch": "qwen3", "target": {**tiny, "head_dim": 8},
                               "drafter": dict(num_hidden_layers=1, block_size=8)}}
    smollm2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    qwen3 = dict(vocab_size=151936, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6)
    qwen3_4b = dict(qwen3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
    qwen3_8b = dict(qwen3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
    drafter = dict(num_hidden_layers=5, block_size=16)
    return {"qwen3-4b": {"arch": "qwen3", "target": qwen3_4b, "drafter": drafter},
            "qwen3-8b": {"arch": "qwen3", "target": qwen3_8b, "drafter": drafter},
            "smollm2-135m": {"arch": "llama", "target": smollm2, "drafter": dict(num_hidden_layers=2, block_size=16)}}



def build_target(spec: dict, device: str, dtype: torch.dtype):
    """A :class:`~services.verifier.target.TargetModel` of ``spec``'s shape with random weights, and
    its tapped layers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from services.models.layers import default_target_layer_ids
    from services.verifier.target import TargetModel

    t = spec["target"]
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if spec["arch"] == "llama" else (Qwen3Config,
                                                                                           Qwen3ForCausalLM)
    cfg = cfg_cls(**t, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg).to(dtype).eval()
    n = t["num_hidden_layers"]
    layers = default_target_layer_ids(n) if n >= 6 else sorted({0, n - 1})  # tiny smoke targets: first + last
    return TargetModel(model, layers), layers


def build_engine(spec: dict, device: str, dtype: torch.dtype, max_context: int, graphs: bool = False):
    """A :class:`SpecEngine` over a random target and a random DFlash + Domino drafter of ``spec``'s
    shape; ``graphs``: its runner pads every step to a bucket and replays CUDA graphs, and the
    drafter's block forward replays its own (False: both eager)."""
    from services.drafter.model import DFlashDrafter, DrafterConfig
    from services.drafter.build import build_drafter
    from services.spec import default_tree_knobs
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig

    t = spec["target"]
    target, layers = build_target(spec, device, dtype)
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim", t["hidden_size"] // heads)
    dcfg = DrafterConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         vocab_size=t["vocab_size"], rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                         max_position_embeddings=t["max_position_embeddings"],
                         num_target_layers=t["num_hidden_layers"], target_hidden_size=t["hidden_size"],
                         mask_token_id=t["vocab_size"] - 1, target_layer_ids=layers, projector_type="domino",
                         **spec["drafter"])
    with torch.device(device):
        drafter = DFlashDrafter(dcfg).to(dtype).eval()
    service = build_drafter(drafter, target.embed_tokens(), target.lm_head(),
                            description="random weights (gpu_check)", packed_gemm=False,
                            cuda_graphs=graphs)  # the drafter block captured with the verify step, or neither
    engine = build_engine(target, InprocDrafterClient(service), EngineConfig(max_running=1, max_context=max_context,
                                                                         cuda_graphs=graphs),
                          max_draft_depth=dcfg.num_draft_slots, defaults=default_tree_knobs(device), packed_gemm=False)
    if device.startswith("cuda"):
        synchronize_phases(engine, service)
    return engine


def synchronize_phases(engine, service) -> None:
    """Instrument (instance attributes only) the target forward and the drafter block so each ends
    with a device synchronisation: the GPU time of a phase is then counted in that phase."""
    execute = engine.runner.execute

    def synced_execute(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = execute(*args, **kwargs)
        torch.cuda.synchronize()
        return dataclasses.replace(out, seconds=time.perf_counter() - t0)

    def synced(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            return out
        return wrapped

    engine.runner.execute = synced_execute
    service.block_logits_batch = synced(service.block_logits_batch)


def measure(engine, method: str, budget: int | None, prompt: list[int], rounds: int, rid: str) -> dict:
    """Mean ms per phase over ``rounds`` rounds of one request: the engine's ``timings`` (draft,
    tree_build, verify, commit) and ``round``, the wall time of the whole engine step that ran the
    round (what a user waits; "other" = round - the four phases: bookkeeping, tree derive, policy)."""
    from services.params import SamplingParams, SpecParams

    sampling = SamplingParams(max_tokens=rounds + 1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    nodes = []
    gen = engine.generate(rid, prompt, sampling, SpecParams(method, budget=budget))
    while True:
        t0 = time.perf_counter()
        out = next(gen, None)
        wall = time.perf_counter() - t0
        if out is None:
            break
        if out.is_prefill:
            continue
        for p in PHASES[:4]:
            times[p].append(out.timings.get(p, 0.0))
        times["round"].append(wall)
        nodes.append(out.num_draft_tokens)
    n = len(nodes)
    return {"rounds": n, "mean_nodes": sum(nodes) / n if n else None,
            "phase_ms": {p: 1000 * sum(v) / n for p, v in times.items()} if n else {},
            "round_median_ms": 1000 * statistics.median(times["round"]) if n else None}


def graph_probe(model, rows: int, device: str, reps: int) -> dict:
    """Median ms of a no-KV forward of ``rows`` rows: eager, and replayed from a CUDA graph (None off CUDA)."""
    from services.cuda_graphs import GraphedStep

    def fwd(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    ids = torch.randint(100, 400, (1, rows), device=device)
    pos = torch.arange(rows, device=device)[None]

    def timed(fn) -> float:
        fn(ids, pos)
        xs = []
        for _ in range(reps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(ids, pos)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            xs.append(time.perf_counter() - t0)
        return 1000 * statistics.median(xs)

    with torch.inference_mode():
        eager = timed(fwd)
        step = GraphedStep(fwd, [ids, pos])
        graphed = timed(step) if step.captured else None
        # nothing to compare when nothing was captured (off CUDA the "graph" is the eager call itself)
        equal = (bool(torch.allclose(step(ids, pos).float(), fwd(ids, pos).float(), rtol=1e-2, atol=1e-2))
                 if step.captured else None)
    return {"rows": rows, "eager_ms": eager, "graph_ms": graphed, "captured": step.captured,
            "graph_equals_eager": equal}
