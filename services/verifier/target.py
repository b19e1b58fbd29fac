"""The target model: prefill, one-forward tree verify with a 4-D tree mask, and KV compaction.

Source: DART/DDT ``prepare_tree_attention_inputs``, ``compact_dynamic_cache`` (docs/algorithms.md §5).
Features for the drafter are the outputs of ``target_layer_ids`` decoder layers, taken with
forward hooks (DART's approach: no ``output_hidden_states`` materialisation).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from services import hf_compat
from services.models.architectures import served_context
from services.tree.draft_tree import VerifyBuffers


class TargetModel:
    """A HF causal LM of a served architecture (:data:`services.models.architectures.SERVED`)
    wrapped for speculative verification.

    Args:
        model: a loaded ``*ForCausalLM`` in eval mode (SDPA or eager attention).
        target_layer_ids: 0-based decoder layers whose outputs are tapped as drafter features.
    Attributes:
        vocab_size, max_context (``max_position_embeddings``, capped at a sliding window in use:
        :func:`services.models.architectures.served_context`), eos_token_id, hidden_size,
        feature_dim (``len(target_layer_ids) * hidden_size``), dtype.
    Raises:
        UnsupportedArchitecture (a ValueError): a target not served exactly, one line.
        ValueError: a tapped layer id out of range.
    """

    def __init__(self, model, target_layer_ids: list[int]):
        self.model = model.eval()
        cfg = model.config
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = served_context(cfg.to_dict(), repr(getattr(cfg, "_name_or_path", "") or ""))
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        self.hidden_size = int(cfg.hidden_size)
        self.target_layer_ids = list(target_layer_ids)
        self.feature_dim = len(self.target_layer_ids) * self.hidden_size
        self.dtype = next(model.parameters()).dtype
        self.weights = str(self.dtype).removeprefix("torch.")  # the weight format (services.weights)
        self.device = next(model.parameters()).device
        self._taps: dict[int, Tensor] = {}
        self._cache_kw = next(iter(hf_compat.cache_kwargs(model, None)))
        layers = model.model.layers
        for i in self.target_layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(f"target layer id {i} out of range for a {len(layers)}-layer target")
            layers[i].register_forward_hook(self._hook(i))

    @classmethod
    def from_pretrained(cls, path: str | Path, target_layer_ids: list[int] | None = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu",
                        weights: str | None = None) -> "TargetModel":
        """Load a local HF directory with SDPA attention (needed for the 4-D tree mask).

        Args:
            dtype: precision when ``weights`` is None (float32 / bfloat16 dense weights).
            weights: a concrete :mod:`services.weights` format (``float32``, ``bfloat16``, ``q4``: the
                GGUF's 4-bit blocks, bfloat16 activations); overrides ``dtype``.
        Raises:
            ValueError: a format that cannot run here, or an architecture not served exactly
                (:class:`~services.models.architectures.UnsupportedArchitecture`, checked before
                anything loads), one line.
        """
        from services.models.architectures import read_config
        from services.models.layers import default_target_layer_ids
        from services.weights import load_causal_lm

        served_context(read_config(path), repr(str(path)))

        if weights is None:
            weights = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
        if weights is None:  # float16 and others: plain HF load in that dtype
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").to(device)
            weights = str(dtype).removeprefix("torch.")
        else:
            model = load_causal_lm(path, weights, device)
        ids = target_layer_ids or default_target_layer_ids(model.config.num_hidden_layers)
        target = cls(model, ids)
        target.weights = weights
        return target

    def pack_gemm(self, rows, lazy: bool = False) -> int:
        """Pre-pack the target's float32 CPU linears for verifies of ``rows`` rows (``[B + 1]`` for a
        B-node tree; :mod:`services.cpu_gemm`; ``lazy``: each row count on its first call). Returns
        bytes added now; 0 on other devices/dtypes or without MKL. Numerics are unchanged (the same
        sgemm kernel, without per-call packing)."""
        from services.cpu_gemm import pack_linears

        if self.device.type != "cpu" or self.dtype != torch.float32:
            return 0
        return pack_linears(self.model, [r for r in rows if r >= 2], lazy=lazy)

    def pack_for_rounds(self, budget: int, max_draft_depth: int, lazy: bool = False) -> int:
        """:meth:`pack_gemm` for a server's rounds: a ``budget``-node tree's verify (B + 1 rows) and a
        chain method's (one row per draft slot, + 1). Returns bytes added now."""
        return self.pack_gemm(sorted({budget + 1, max_draft_depth + 1}), lazy)

    def pack_for_steps(self, budget: int, max_draft_depth: int, max_running: int, lazy: bool = False) -> int:
        """:meth:`pack_gemm` for batched steps: a ladder of row counts so that every step of up to
        ``max_running`` requests' trees (``B + 1`` rows each) or ``ar`` rows finds a pack at most
        ~2x its rows (``PackedLinear`` uses the smallest pack ``R`` with ``R/2 < rows <= R``):
        4, then ``B + 1`` doubling (``2R - 1``) up to ``max_running * (B + 1)``, and a chain
        method's ``max_draft_depth + 1`` (no 2-row pack: at 1 thread MKL's packed 2-row kernel was
        slower than the plain one, 244 vs 185 us for a 576 x 1536 linear; 4 rows: 250 vs 323 us).
        ``lazy``: each row count is packed on its first call, so only the steps that really run
        cost memory. Returns bytes added now (each pack ~ the linears' weight size)."""
        rows = {4, max_draft_depth + 1}
        r = budget + 1
        rows.add(r)
        while r < max_running * (budget + 1):
            r = 2 * r - 1
            rows.add(r)
        return self.pack_gemm(sorted(x for x in rows if x >= 2), lazy)

    def _hook(self, i: int):
        def fn(_module, _inp, out):
            self._taps[i] = out[0] if isinstance(out, tuple) else out
        return fn

    def _features(self) -> Tensor:
        """``[T, F]`` concatenated tapped layer outputs of the last forward (ascending layer id)."""
        feats = torch.cat([self._taps[i][0] for i in self.target_layer_ids], dim=-1)
        self._taps.clear()
        return feats

    def embed_tokens(self) -> torch.nn.Module:
        """The target's input embedding (borrowed by the drafter)."""
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Module:
        """The target's output projection (borrowed by the drafter)."""
        return self.model.get_output_embeddings()

    def new_cache(self):
        """An empty per-request KV cache."""
        return hf_compat.new_dynamic_cache(self.config)

    @torch.inference_mode()
    def prefill(self, ids: list[int], cache) -> tuple[Tensor, Tensor]:
        """Run the prompt causally into an empty ``cache``.

        Returns:
            ``logits [V]`` float32 at the last position and ``features [T, F]``.
        """
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1].float(), self._features()

    @torch.inference_mode()
    def teacher_forced(self, ids: list[int]) -> tuple[Tensor, Tensor]:
        """One causal forward without a cache: ``(argmax next token [T], features [T, F])`` (training data)."""
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
        return out.logits[0].argmax(-1), self._features()

    @torch.inference_mode()
    def verify(self, buffers: VerifyBuffers, cache, start: int) -> tuple[Tensor, Tensor]:
        """Score a whole tree in one forward over the committed cache (length ``start``).

        Row 0 is the root at position ``start``; row ``i`` sits at ``start + depth_i`` and attends to
        the cached prefix and to its ancestors-or-self only (4-D additive mask).

        Returns:
            ``logits [N+1, V]`` float32 and ``features [N+1, F]``. The cache grows by N + 1 rows
            (call :meth:`commit` next).
        """
        assert hf_compat.cache_length(cache) == start, "cache length must equal the committed length"
        n1 = buffers.input_ids.numel()
        mask = None  # a lone root (AR round) sees the whole cache: no mask needed
        if n1 > 1:
            mask = torch.zeros(1, 1, n1, start + n1, dtype=self.dtype, device=self.device)
            mask[0, 0, :, start:] = torch.where(buffers.tree_mask.to(self.device), 0.0, torch.finfo(self.dtype).min)
        pos = (start + buffers.position_offsets).to(self.device)[None]
        out = self.model(input_ids=buffers.input_ids.to(self.device)[None], position_ids=pos, attention_mask=mask,
                         use_cache=True, **{self._cache_kw: cache})
        return out.logits[0].float(), self._features()

    @staticmethod
    @torch.inference_mode()
    def commit(cache, start: int, accepted_rows: Tensor) -> None:
        """Compact the cache after a verify: rows ``start + accepted_rows[i]`` move to ``start + i``,
        then crop to ``start + L``. No second forward. A contiguous prefix path is a plain crop.
        """
        rows = accepted_rows.tolist()
        length = len(rows)
        if rows != list(range(length)):
            src = torch.tensor(rows) + start
            for i, (k, v) in enumerate(hf_compat.cache_layers(cache)):
                idx = src.to(k.device)
                k[:, :, start:start + length] = k.index_select(2, idx)
                v[:, :, start:start + length] = v.index_select(2, idx)
        hf_compat.crop_cache(cache, start + length)
