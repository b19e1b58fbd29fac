"""The one drafter assembly: a drafter model plus the target's embedding and lm_head -> a drafter service.

The drafter process and the drafter inside the verifier (:func:`build_from_config`: checkpoint and
borrowed weights read from their directories), ``dartree generate``, the held-out replay of the
trainer, the test helpers and the benchmarks (:func:`build_drafter`: a drafter and a loaded target's
modules) all build their drafter service here:

1. the target's ``embed_tokens`` / ``lm_head`` borrowed in the drafter's dtype
   (:func:`borrow_target_io`; from the target's files: :func:`load_borrowed_weights`);
2. the service for the drafter's family (:func:`make_service`: EAGLE-3 or the DFlash block drafter);
3. with ``compile``, its block forward warmed up (unless the caller warms it later).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from services.drafter.service import DrafterService, frozen_linear

log = logging.getLogger("drafter")


def build_drafter(drafter, embed: torch.nn.Module, lm_head: torch.nn.Module, dtype: torch.dtype | None = None, *,
                  description: str = "", packed_gemm: bool = True, compile: bool = False, warm_up: bool = True,
                  **options):
    """The drafter service of ``drafter`` (any model :func:`services.drafter.model.load_drafter` returns)
    over the target's ``embed`` ``[V, H]`` and ``lm_head`` ``[V, H]`` modules.

    Args:
        dtype: borrow the two modules in this dtype (:func:`borrow_target_io`: frozen copies when they
            are in another one); None: use them as they are.
        description, packed_gemm, compile: as :func:`make_service`; warm_up: with ``compile``, warm the
            block forward up here (False: the caller does, e.g. after packing the target).
        options: further :class:`DrafterService` settings (``block_rows``, ``spare_rows``,
            ``q4_linears``, ...; not for EAGLE-3).
    Raises:
        TypeError: an option the drafter's service does not take.
    """
    if dtype is not None:
        embed, lm_head = borrow_target_io(embed, lm_head, dtype)
    service = make_service(drafter, embed, lm_head, description=description, packed_gemm=packed_gemm,
                           compile=compile, **options)
    if warm_up and getattr(service, "compiled", False):
        log.info("compiling the drafter's block forward (torch.compile) ...")
        log.info("compiled drafter block ready in %.1f s", service.warm_up())
    if warm_up and getattr(service, "graphed", None) is not None:  # CUDA graphs of the block, at start
        service.warm_up_seconds += service.graphed.capture()["seconds"]
    return service


def build_from_config(config):
    """The drafter process's service (and the drafter inside the verifier's): the checkpoint of
    ``config.drafter`` ('' = the default drafter) and the target's embedding / lm_head read from its
    files, on ``config.device`` in ``config.dtype`` (a :class:`services.drafter.worker.DrafterWorkerConfig`).
    Returns ``(service, target_dir)``.

    Raises:
        FileNotFoundError, ValueError: a missing or damaged checkpoint or target, or a drafter not
            made for the target (one line).
    """
    from services.drafter.model import load_drafter
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_model_dir, resolve_target

    dtype = getattr(torch, config.dtype)
    target_dir = resolve_target(config.target)
    drafter_dir = resolve_model_dir(config.drafter) if config.drafter else DEFAULT_DRAFTER_DIR  # dir or hub id
    check_drafter_fits(drafter_dir, target_dir)
    drafter = load_drafter(drafter_dir, dtype=dtype, device=config.device)
    # on CPU the embedding stays a view of the target's file: only the rows drafted from become resident
    embed, head = load_borrowed_weights(target_dir, dtype, mapped=torch.device(config.device).type == "cpu")
    from services.drafter.eagle3 import Eagle3Drafter

    graphs = {} if config.cuda_graphs is None or isinstance(drafter, Eagle3Drafter) \
        else {"cuda_graphs": config.cuda_graphs}  # EAGLE-3: no block forward to capture
    service = build_drafter(drafter, embed.to(config.device), head.to(config.device), description=str(drafter_dir),
                            packed_gemm=config.packed_gemm, compile=config.compile, **graphs,
                            **ngram_options(drafter, getattr(config, "ngram_draft", "off") == "on"))
    return service, target_dir


def ngram_options(drafter, on: bool) -> dict:
    """The drafter-service options of n-gram drafting (``--ngram-draft on``): ``{"ngram_nodes": 4}``
    when ``on``, else none.

    Raises:
        ValueError: ``on`` with an EAGLE-3 drafter (its service builds trees of its own; one line).
    """
    from services.drafter.eagle3 import Eagle3Drafter
    from services.drafter.ngram_drafts import DEFAULT_NGRAM_NODES

    if not on:
        return {}
    if isinstance(drafter, Eagle3Drafter):
        raise ValueError("--ngram-draft on needs a DFlash, Domino or DSpark drafter; this one is EAGLE-3 "
                         "(pass --ngram-draft off)")
    return {"ngram_nodes": DEFAULT_NGRAM_NODES}


def check_drafter_fits(drafter_dir: Path, target_dir: Path) -> None:
    """ValueError (one line naming ``--drafter``) when the drafter was not made for the target
    (:func:`services.models.pairing.drafter_mismatch`)."""
    from services.models.architectures import read_config
    from services.models.pairing import drafter_mismatch

    why = drafter_mismatch(drafter_dir, read_config(target_dir))
    if why:
        raise ValueError(f"the drafter in {drafter_dir} does not fit the target in {target_dir}: {why}; pass "
                         "--drafter (DARTREE_DRAFTER) naming a drafter made for this target")


def make_service(drafter, embed: torch.nn.Module, lm_head: torch.nn.Module, description: str = "",
                 packed_gemm: bool = True, compile: bool = False, **options):
    """The drafter service for any drafter :func:`services.drafter.model.load_drafter` returns:
    :class:`services.drafter.eagle3_service.Eagle3Service` for EAGLE-3 (it needs only the embedding;
    never compiled), :class:`DrafterService` otherwise (DFlash, Domino, DSpark; ``compile``: its
    block forward compiled; ``options``: its further settings, see the class)."""
    from services.drafter.eagle3 import Eagle3Drafter

    if isinstance(drafter, Eagle3Drafter):
        from services.drafter.eagle3_service import Eagle3Service

        return Eagle3Service(drafter, embed, description=description, packed_gemm=packed_gemm, **options)
    return DrafterService(drafter, embed, lm_head, description=description, packed_gemm=packed_gemm,
                          compile=compile, **options)


def borrow_target_io(embed: torch.nn.Module, lm_head: torch.nn.Module,
                     dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The target's ``embed_tokens`` ``[V, H]`` and ``lm_head`` ``[V, H]`` for a drafter running in ``dtype``:
    the modules themselves when they already are in it, else frozen copies in ``dtype`` (a float32
    drafter next to a bfloat16 / q4 target, :func:`services.weights.drafter_dtype`)."""
    if embed.weight.dtype == dtype and lm_head.weight.dtype == dtype:
        return embed, lm_head
    return (torch.nn.Embedding.from_pretrained(embed.weight.detach().to(dtype), freeze=True),
            frozen_linear(lm_head.weight.detach().to(dtype)))


class MappedEmbedding(torch.nn.Embedding):
    """A frozen ``nn.Embedding`` whose ``weight [V, H]`` is a view of the target's safetensors file
    mapping, in the file's dtype (:func:`load_borrowed_weights` ``mapped=True``).

    Only the pages of rows looked up become resident (clean file pages, shared with any process
    mapping the same file), where a converted copy is a private ``[V, H]`` tensor that is resident
    whole: 56.6 MB for SmolLM2's 49,152 x 576 in bfloat16, of which a drafter reads the rows of a
    few tokens a round. Lookups return rows in the file's dtype; every caller casts them to its
    compute dtype (``embed(ids).to(dtype)``), which gives the values a converted table would
    (a dtype cast is elementwise). CPU only: moving the module copies the view.
    """

    mapped = True  # read by services.startup.object_memory_parts


def _read_tensor(files: list[Path], want: Callable[[str], bool]) -> Tensor | None:
    """The first tensor whose key ``want`` accepts, as a view of its own mapping of the file
    (each call maps the file anew, so a tensor read whole does not leave another's pages resident)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if want(key):
                    return st.get_tensor(key)
    return None


def load_borrowed_weights(target_dir: str | Path, dtype: torch.dtype = torch.float32, mapped: bool = False
                          ) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """Load only the target's ``embed_tokens`` and ``lm_head`` (tied models reuse the embedding).

    Used by a drafter process that does not hold the whole target.

    Args:
        target_dir: the target's HF directory (``*.safetensors``).
        dtype: the lm_head's dtype, and the embedding's unless ``mapped``.
        mapped: the embedding as a :class:`MappedEmbedding` (a view of the file's mapping in the
            file's dtype, resident only where looked up) instead of a ``[V, H]`` copy in ``dtype``;
            for a CPU drafter whose callers cast the rows (the drafter services do).
    Raises:
        FileNotFoundError: no ``embed_tokens`` weight in the directory's safetensors files.
    """
    files = sorted(Path(target_dir).glob("*.safetensors"))
    is_embed = lambda key: key.endswith("embed_tokens.weight")  # noqa: E731
    embed_w = _read_tensor(files, is_embed)
    if embed_w is None:
        raise FileNotFoundError(f"no embed_tokens weight in {target_dir}")
    # the head from its own mapping, copied: converting it reads every row, which would otherwise stay
    # resident in the embedding's mapping; without lm_head.weight the model is tied
    head_w = _read_tensor(files, lambda key: key == "lm_head.weight")
    head_w = (head_w if head_w is not None else _read_tensor(files, is_embed)).to(dtype, copy=True)
    if mapped:
        return MappedEmbedding.from_pretrained(embed_w, freeze=True), frozen_linear(head_w)
    return torch.nn.Embedding.from_pretrained(embed_w.to(dtype), freeze=True), frozen_linear(head_w)
