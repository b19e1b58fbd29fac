"""Test fixtures for the engine tests: tiny random targets and drafters, trees, a whole server.

Everything here runs in milliseconds on a CPU (float32 by default):

- :func:`tiny_causal_lm` / :func:`tiny_target`: a random-weight HF llama or qwen3 causal LM with SDPA
  attention (needed for the 4-D tree mask), optionally wrapped as a :class:`TargetModel`.
- :func:`tiny_drafter_config` / :func:`tiny_drafter` / :func:`tiny_service`: a real-architecture
  random DFlash drafter (with or without the Domino head) sized for a tiny target.
- :func:`greedy_reference`: plain greedy decoding with ``model.generate(do_sample=False)``.
- :func:`tree_from_nodes` / :func:`random_tree`: a :class:`DraftTree` from lists / a random valid one
  (the scripted drafter clients built on them live in ``tests/doubles``).
- :func:`start_server`: a whole ``dartree serve`` (supervisor, gateway, verifier, drafter) on free
  loopback ports, for the process-level tests and the load test; :func:`run_uvicorn`: one ASGI app
  (e.g. the gateway on a scripted engine) under a real uvicorn on a thread.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from services.runtime import free_loopback_ports
from services.tree.draft_tree import DraftTree

ARCHS = ("llama", "qwen3")
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Tiny targets and drafters
# ----------------------------------------------------------------------------------------------
def tiny_causal_lm(arch: str = "llama", *, vocab_size: int = 128, hidden_size: int = 32, intermediate_size: int = 64,
                   num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2, max_position_embeddings: int = 256,
                   eos_token_id: int | None = 2, init_std: float = 0.1, tie_word_embeddings: bool = False,
                   seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random-weight HF ``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` in eval mode, SDPA attention.

    ``init_std`` (``initializer_range``) of 0.1 gives varied greedy continuations (0.02 loops fast).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r} (choose from {ARCHS})")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, eos_token_id=eos_token_id, bos_token_id=1,
                  pad_token_id=0, initializer_range=init_std, tie_word_embeddings=tie_word_embeddings,
                  attn_implementation="sdpa")
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden_size // num_heads, **common))
    model.config._attn_implementation = "sdpa"
    return model.to(dtype).eval()


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's converter permutation of q/k rows (HF rotary halves -> interleaved pairs), numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf_target_dir(path: str | Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """A tiny llama target saved as a HF directory *and* as ``model.gguf`` whose decoder linears are Q4_1
    (q/k rows permuted as llama.cpp stores them) and whose ``output.weight`` is Q8_0, the HF weights
    being their exact dequantization, as the default SmolLM2 target's converted directory is. Shapes
    fit the int4 kernel (N % 16, K % 32).
    Returns the directory (for ``--weights q4``: :func:`services.weights.gguf_source` finds the file).
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    path = Path(path)
    model = tiny_causal_lm("llama", hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=4,
                           num_kv_heads=2, init_std=0.1, seed=seed)
    cfg = model.config
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    q41 = gguf.GGMLQuantizationType.Q4_1
    writer = gguf.GGUFWriter(str(path / "model.gguf"), "llama")
    path.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for hf, gg in names.items():
                lin = layer.get_submodule(hf)
                w = lin.weight.float().numpy()
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(gg)
                stored = llama_cpp_permute(w, heads) if heads else w
                raw = quantize(stored, q41)
                writer.add_tensor(f"blk.{i}.{gg}.weight", raw, raw_dtype=q41)
                deq = dequantize(raw, q41).reshape(w.shape)
                if heads:  # undo the permutation: [n_head, dim, 2] <- [n_head, 2, dim]
                    deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(deq)))
        q80 = gguf.GGMLQuantizationType.Q8_0  # the output projection as Q8_0 (SmolLM2's GGUF: its tied embedding)
        raw = quantize(model.lm_head.weight.float().numpy(), q80)
        writer.add_tensor("output.weight", raw, raw_dtype=q80)
        model.lm_head.weight.copy_(torch.from_numpy(dequantize(raw, q80).reshape(model.lm_head.weight.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(path)
    return path


def tiny_target(arch: str = "llama", target_layer_ids: list[int] | None = None, **kw):
    """A :class:`TargetModel` over :func:`tiny_causal_lm` (tapped layers default to ``[0, L-1]``)."""
    from services.verifier.target import TargetModel

    model = tiny_causal_lm(arch, **kw)
    n = model.config.num_hidden_layers
    return TargetModel(model, target_layer_ids if target_layer_ids is not None else sorted({0, n - 1}))


def _randomize(module, std: float) -> None:
    """Every parameter but the norms' scales ~ N(0, std), in place (tiny random drafters)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, std)


def tiny_drafter_config(target, *, projector_type: str | None = "domino", block_size: int = 8,
                        shift_label: bool | None = None, num_layers: int = 1, mask_token_id: int | None = None,
                        gru_hidden_dim: int = 16, emb_dim: int = 8):
    """A :class:`DrafterConfig` matching a tiny :class:`TargetModel` (same hidden size and vocabulary).

    ``shift_label`` defaults to True with a Domino head and False without (the released layouts).
    ``mask_token_id`` defaults to the last vocabulary id.
    """
    from services.drafter.model import DrafterConfig

    cfg = target.config
    heads = int(cfg.num_attention_heads)
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.num_key_value_heads),
        head_dim=target.hidden_size // heads, vocab_size=target.vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=target.max_context, block_size=block_size,
        num_target_layers=int(cfg.num_hidden_layers), target_hidden_size=target.hidden_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=list(target.target_layer_ids), projector_type=projector_type,
        shift_label=(projector_type is not None) if shift_label is None else shift_label,
        pure_draft_prefix_len=1 if projector_type else 0, gru_hidden_dim=gru_hidden_dim, emb_dim=emb_dim)


def tiny_drafter(target, seed: int = 1, std: float = 0.2, **kw):
    """A random DFlash(+Domino) drafter for ``target`` (weights ~ N(0, std); norms stay 1)."""
    from services.drafter.model import DFlashDrafter

    torch.manual_seed(seed)
    d = DFlashDrafter(tiny_drafter_config(target, **kw))
    _randomize(d, std)
    return d.to(target.dtype).eval()


def tiny_dspark(target, seed: int = 1, std: float = 0.2, rank: int = 8, block_size: int = 7,
                confidence: bool = False, num_layers: int = 1):
    """A random DSpark drafter for ``target``: backbone + Markov head ~ N(0, std) (norms 1), its own
    embedding / lm_head copied from the target (docs/algorithms.md §3)."""
    import dataclasses

    from services.drafter.model import DFlashDrafter

    cfg = dataclasses.replace(tiny_drafter_config(target, projector_type=None, block_size=block_size,
                                                  num_layers=num_layers),
                              projector_type="markov", shift_label=True, pure_draft_prefix_len=0, markov_rank=rank,
                              enable_confidence_head=confidence)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    _randomize(d, std)
    d.copy_target_io(target.embed_tokens().weight.detach().float(), target.lm_head().weight.detach().float())
    return d.to(target.dtype).eval()


def tiny_eagle3(target, seed: int = 1, std: float = 0.2, draft_vocab_size: int | None = None, depth: int = 4,
                top_k: int = 3):
    """A random EAGLE-3 drafter for a tiny target tapping exactly 3 layers; the draft vocabulary is a
    random subset of ``draft_vocab_size`` ids (default: 3/4 of the vocabulary)."""
    from services.drafter.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = target.config
    heads = int(cfg.num_attention_heads)
    n = draft_vocab_size or (3 * target.vocab_size) // 4
    c = Eagle3Config(hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size,
                     num_attention_heads=heads, num_key_value_heads=int(cfg.num_key_value_heads),
                     head_dim=target.hidden_size // heads, vocab_size=target.vocab_size, draft_vocab_size=n,
                     rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=target.max_context,
                     target_hidden_size=target.hidden_size, num_target_layers=int(cfg.num_hidden_layers),
                     target_layer_ids=list(target.target_layer_ids), depth=depth, top_k=top_k)
    torch.manual_seed(seed)
    d = Eagle3Drafter(c)
    _randomize(d, std)
    g = torch.Generator().manual_seed(seed)
    d.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:n])
    return d.to(target.dtype).eval()


def tiny_service(target, drafter=None, options: dict | None = None, **kw):
    """A :class:`DrafterService` borrowing ``target``'s embedding and lm_head (``options``: further
    service settings, e.g. ``ngram_nodes``; ``kw``: :func:`tiny_drafter`'s, without ``drafter``)."""
    from services.drafter.build import build_drafter

    drafter = drafter if drafter is not None else tiny_drafter(target, **kw)
    return build_drafter(drafter, target.embed_tokens(), target.lm_head(), **(options or {}))


def draft_job(request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int, spec,
              max_depth: int | None = None):
    """A :class:`services.verifier.drafter_client.DraftJob` for ``spec`` (anything with ``method,
    budget, width, depth_bonus, candidates``), its unset knobs taken from
    :data:`services.spec.DEFAULT_KNOBS` (as the engine's default policy resolves them)."""
    from services.spec import DEFAULT_KNOBS, TreeKnobs
    from services.verifier.drafter_client import DraftJob

    knobs = TreeKnobs(spec.budget, spec.width, spec.depth_bonus, spec.candidates).filled_from(DEFAULT_KNOBS)
    return DraftJob(request_id, committed_ids, features, root_token, start, spec.method, knobs, max_depth)


def draft_one(service, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int,
              spec, max_depth: int | None = None) -> tuple[DraftTree, dict[str, float]]:
    """One request's draft as a batch of one (``service.draft_batch``, the job from :func:`draft_job`):
    ``(tree, timings in s)``.

    Raises:
        whatever the job raised (e.g. ValueError for an inconsistent context).
    """
    out = service.draft_batch([draft_job(request_id, committed_ids, features, root_token, start, spec, max_depth)])[0]
    if isinstance(out, BaseException):
        raise out
    return out


def block_logits_one(service, request_id: str, features: Tensor, root_token: int, start: int) -> tuple[Tensor, Tensor]:
    """Append ``features [n, F]`` (positions ``[start - n, start)``) to a :class:`DrafterService`
    context and run the request's block alone: ``(hd [D, H], base_logits [D, N] float32)``.

    Raises:
        ValueError: the context does not end at ``start - n``.
    """
    service.append_context(request_id, features, start)
    return service.block_logits_batch([(request_id, root_token, start)])[0]


def greedy_reference(model, prompt_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt_ids`` with ``model.generate(do_sample=False)`` (EOS ignored)."""
    x = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


# ----------------------------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------------------------
def served_ar_reference(target_dir, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding of a saved target in this process (what a served greedy answer equals)."""
    from services.verifier.build import build_engine
    from services.params import SamplingParams, SpecParams
    from services.spec import Method
    from services.verifier.target import TargetModel

    engine = build_engine(TargetModel.from_pretrained(target_dir, [1, 2]), None, packed_gemm=False)
    out = []
    for r in engine.generate("ref", prompt_ids, SamplingParams(max_tokens=max_tokens), SpecParams(method=Method.AR)):
        out += r.token_ids
    return out


def tree_from_nodes(tokens: list[int], parents: list[int]) -> DraftTree:
    """A :class:`DraftTree` from lists (parents topological, ``-1`` = child of the root)."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        assert -1 <= p < i, "parents must be topological"
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(depths, dtype=torch.long), torch.zeros(len(tokens), dtype=torch.float32))


def _shuffle_topological(tokens: list[int], parents: list[int], depths: list[int], rng: random.Random
                         ) -> tuple[list[int], list[int]]:
    """Reorder nodes by (depth, random key): still topological, but the true path is scattered."""
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], rng.random()))
    new_of = {old: new for new, old in enumerate(order)}
    return [tokens[i] for i in order], [-1 if parents[i] < 0 else new_of[parents[i]] for i in order]


def random_tree(rng: random.Random, vocab_size: int, num_nodes: int, max_depth: int,
                exclude: tuple[int, ...] = ()) -> DraftTree:
    """A random valid tree: random parents (depth <= ``max_depth``), unique sibling tokens.

    Tokens in ``exclude`` are never used (e.g. a MASK id). Returns fewer nodes only when the
    vocabulary cannot supply distinct siblings.
    """
    allowed = [t for t in range(vocab_size) if t not in exclude]
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    used: dict[int, set[int]] = {}
    if max_depth <= 0:
        return DraftTree.empty()
    for _ in range(num_nodes):
        options = [-1] + [i for i in range(len(tokens)) if depths[i] < max_depth]
        p = rng.choice(options)
        sib = used.setdefault(p, set())
        free = [t for t in allowed if t not in sib]
        if not free:
            continue
        tok = rng.choice(free)
        sib.add(tok)
        tokens.append(tok)
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    return tree_from_nodes(tokens, parents)


# ----------------------------------------------------------------------------------------------
# A whole server in subprocesses
# ----------------------------------------------------------------------------------------------
@dataclass
class Server:
    """A ``dartree serve`` started by :func:`start_server`.

    Attributes:
        base: the gateway's URL (``http://127.0.0.1:<port>``); proc: the supervisor process.
        metrics_ports: ``(verifier, drafter)`` metrics ports; target_dir: the ``target`` passed (or None);
        log: the file holding the supervisor's and the workers' stdout and stderr.
    """

    base: str
    proc: subprocess.Popen
    metrics_ports: tuple[int, int]
    target_dir: Path | None
    log: Path

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def child(self, comm: str):
        """The live worker process (``psutil.Process``) whose title is ``comm`` (e.g. "dartree-drafter")."""
        import psutil

        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if c.name() == comm and c.status() != psutil.STATUS_ZOMBIE:
                    return c
            except psutil.NoSuchProcess:
                continue
        raise LookupError(f"no child {comm}:\n{self.log_tail()}")

    def wait_replaced(self, comm: str, old_pid: int, timeout: float = 30.0):
        """Wait until the supervisor has started a new ``comm`` worker in place of ``old_pid``; returns it.

        Raises:
            TimeoutError: no new worker within ``timeout`` seconds (log tail attached).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                child = self.child(comm)
                if child.pid != old_pid:
                    return child
            except LookupError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{comm} (pid {old_pid}) was not replaced within {timeout:.0f} s:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 180.0, want: bool = True) -> float:
        """Poll ``/health/ready`` until it is 200 (``want``) or not; seconds waited.

        Raises:
            RuntimeError: the supervisor exited; TimeoutError: the state never came (log tail attached).
        """
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                ok = httpx.get(self.base + "/health/ready", timeout=2, trust_env=False).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok == want:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"readiness never became {want} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the drain), then SIGKILL after ``timeout`` s; only this server's own supervisor is signalled."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def start_server(*flags: str, log: str | Path, target: str | Path | None = None, drafter: str | Path | None = None,
                 env: dict[str, str] | None = None, ready_timeout: float = 180.0,
                 stop_timeout: float = 60.0) -> Iterator[Server]:
    """Run ``python -m services.serve`` on free loopback ports until the block ends.

    Args:
        *flags: extra ``dartree serve`` flags (``"--budget", "8"``, ``"--api-key", KEY``, ...).
        log: file that receives the server's stdout and stderr (overwritten).
        target, drafter: ``--target`` / ``--drafter`` (None: the server's defaults, SmolLM2 and the
            shipped drafter; ``drafter="none"``: plain decoding).
        env: variables added to this process's environment (``PYTHONUNBUFFERED=1`` is always set).
        ready_timeout: seconds to wait for ``/health/ready``; stop_timeout: SIGTERM drain budget at exit.

    Yields:
        a :class:`Server` whose ``/health/ready`` answered 200. At exit it is stopped (SIGTERM, then
        SIGKILL after ``stop_timeout``) unless it already exited.

    Raises:
        RuntimeError: the server exited before it was ready; TimeoutError: not ready in time (both
        carry the log tail). The server is stopped before either propagates.
    """
    port, vport, dport = free_loopback_ports(3)
    cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
           "--drafter-metrics-port", str(dport)]
    cmd += ["--target", str(target)] if target is not None else []
    cmd += ["--drafter", str(drafter)] if drafter is not None else []
    log = Path(log)
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, *flags], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    srv = Server(f"http://127.0.0.1:{port}", proc, (vport, dport), Path(target) if target is not None else None, log)
    try:
        srv.wait_ready(timeout=ready_timeout)
        yield srv
    finally:
        srv.stop(stop_timeout)


@contextlib.contextmanager
def run_uvicorn(app, ready_path: str = "/health/live", timeout: float = 10.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a daemon thread; yields the base URL.

    Waits until ``ready_path`` answers 200 (TimeoutError after ``timeout`` s); stops the server at exit.
    """
    import threading

    import httpx
    import uvicorn

    (port,) = free_loopback_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(base + ready_path, timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{base}{ready_path} did not answer 200 within {timeout:g} s")
            time.sleep(0.02)
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
