"""``dartree generate``: one prompt through the in-process engine, with per-phase timings."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from pathlib import Path

import torch

from services.spec import Method


def build_inprocess(target_ref: str | None, drafter_ref: str | None, dtype: torch.dtype, defaults=None,
                    packed_gemm: bool = True, weights: str | None = None, compile: bool | None = False,
                    compile_drafter: bool | None = None, spec_policy: str = "fixed", ngram_draft: bool = False):
    """Load target + drafter in one process: ``(engine, tokenizer, drafter_note)``; the engine is
    assembled by :func:`services.verifier.build.build_engine`, as the verifier's is.

    ``defaults``: the engine's default tree knobs (a :class:`services.spec.TreeKnobs`, every one set;
    None = :func:`services.spec.default_tree_knobs` on CPU), what a request leaves unset is taken from
    them by the engine's policy, ``spec_policy`` (``goodput``: its cost sweep runs here).
    ``packed_gemm``: pre-pack float32 CPU weights for the target's steps
    (:func:`services.verifier.build.pack_rule`) and the drafter's block (:mod:`services.cpu_gemm`).

    ``compile``: the target's steps and the drafter's block forward through ``torch.compile`` (both
    warmed up here, after packing); None: the target's steps where
    :func:`services.verifier.runner.auto_compile` says so, the drafter eager; ``compile_drafter``
    (None = ``compile``) can leave the drafter eager (``ar`` never calls it).
    ``weights``: the target's format (:mod:`services.weights`; None = dense ``dtype``); ``dtype`` is
    the activations' precision; the drafter runs in :func:`services.weights.drafter_dtype` of it
    (float32 on a CPU without native bfloat16). ``ngram_draft``: n-gram chains join every drafted
    tree (:func:`services.drafter.build.ngram_options`).

    The drafter borrows the target's embedding and lm_head modules (float32 copies when the target's
    are bfloat16 and the drafter float32). Without a trained drafter (``drafter_ref`` ``"none"``, or
    none shipped) a randomly initialised one is used (tau ~ 1) and ``drafter_note`` says so.
    """
    from transformers import AutoTokenizer

    from services.hf_compat import quiet_progress_bars

    from services.drafter.model import DFlashDrafter, DrafterConfig, load_drafter
    from services.models.layers import default_target_layer_ids
    from services.drafter.build import build_drafter, ngram_options
    from services.drafter.worker import check_drafter_dir
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.spec import default_tree_knobs
    from services.verifier.build import build_engine
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.target import TargetModel
    from services.weights import drafter_dtype

    quiet_progress_bars()
    tdir = resolve_target(target_ref)
    tok = AutoTokenizer.from_pretrained(tdir)
    ddir = None if drafter_ref == "none" else check_drafter_dir(drafter_ref) if drafter_ref else DEFAULT_DRAFTER_DIR
    note = f"drafter: {ddir}"
    ddtype = drafter_dtype(dtype, "cpu")
    if ddir is not None and (ddir / "config.json").exists():
        drafter = load_drafter(ddir, dtype=ddtype)
    else:
        import json as _json

        tcfg = _json.loads((tdir / "config.json").read_text())
        torch.manual_seed(0)
        drafter = DFlashDrafter(DrafterConfig(
            vocab_size=tcfg["vocab_size"], hidden_size=tcfg["hidden_size"], target_hidden_size=tcfg["hidden_size"],
            num_target_layers=tcfg["num_hidden_layers"],
            target_layer_ids=default_target_layer_ids(tcfg["num_hidden_layers"]))).to(ddtype).eval()
        note = "drafter: RANDOMLY INITIALISED (no trained drafter found): expect tau ~ 1, no speedup"
    target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, dtype=dtype, weights=weights)
    defaults = defaults or default_tree_knobs("cpu")
    service = build_drafter(drafter, target.embed_tokens(), target.lm_head(), ddtype, description=note,
                            packed_gemm=packed_gemm, compile=bool(compile) and compile_drafter is not False,
                            warm_up=False, **ngram_options(drafter, ngram_draft))  # warmed up below, after the packs
    from services.verifier.config import EngineConfig

    engine = build_engine(target, InprocDrafterClient(service), EngineConfig(compile=None if compile is None
                                                                             else bool(compile)),
                          max_draft_depth=drafter.config.num_draft_slots, policy=spec_policy, defaults=defaults,
                          cost_key=(tdir.name, str(target.weights), "cpu"), packed_gemm=packed_gemm)
    if getattr(service, "compiled", False):
        service.warm_up()
    return engine, tok, note


def encode(tok, prompt: str, chat: bool) -> list[int]:
    """Prompt ids: the chat template with a generation prompt, or plain text."""
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tok.encode(prompt)


def round_tokens(out) -> int:
    """Tokens a round produced (τ's numerator, bonus included): ``out.token_ids`` plus the terminator
    it ended on, which the engine drops from ``token_ids`` (an ``ar`` round that emits only EOS
    still produced one token). ``out``: a :class:`services.verifier.engine.RoundOutput`."""
    return len(out.token_ids) + (out.finish_reason == "stop")


def _check_served(method: str, served, note: str) -> None:
    """ValueError (one line, before any text is printed) when ``method`` is not in ``served``."""
    if method not in served:
        raise ValueError(f"method {method!r} is not served by this drafter ({note}); it serves {', '.join(served)}")


class HeldLogs(logging.Handler):
    """The log records of ``dartree generate``'s set-up (model loading, the weight-format and step
    cost measurements), held until the request is accepted, so that a refused request prints its
    one error line alone: a warning such as "the timing process got 26% of its CPU time" is about
    speed, which a refused request never reaches.

    Used as a context manager: the handler sits on the root logger inside the block (the records
    reach no other handler meanwhile); :meth:`pass_on` hands the held records on, in order, to the
    handlers they would have reached (with none configured: stderr, as Python prints a warning by
    default). An error a command prints as one line (ValueError, OSError, RuntimeError) leaving the
    block drops the held records; any other exception releases them before it propagates.
    """

    ONE_LINE_ERRORS = (ValueError, OSError, RuntimeError)

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._held = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "HeldLogs":
        root = logging.getLogger()
        self._others, root.handlers[:] = root.handlers[:], [self]
        self._held = True
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and issubclass(kind, self.ONE_LINE_ERRORS):
            self.records.clear()
        self.pass_on()

    def pass_on(self) -> None:
        """Stop holding: restore the root logger's handlers and pass the held records to them."""
        if not self._held:
            return
        self._held = False
        logging.getLogger().handlers[:] = self._others
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


def _request_settings(a):
    """``(sampling, spec, default tree knobs)`` of ``dartree generate``'s flags.

    Raises:
        ValueError: a refused flag, named as the flag (``--budget``), or an empty prompt.
    """
    from services.params import SamplingParams, SpecParams
    from services.spec import TreeKnobs, check_tree_knobs, default_tree_knobs

    sampling = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    try:
        check_tree_knobs(a.budget, a.width, a.depth_bonus, a.candidates)
        spec = SpecParams(a.method)
    except ValueError as e:  # the knob checks name the request fields (speculative.budget): name the flags
        raise ValueError(re.sub(r"speculative\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    defaults = TreeKnobs(a.budget, a.width, a.depth_bonus, a.candidates).filled_from(default_tree_knobs("cpu"))
    if not a.prompt.strip() and not a.chat:
        raise ValueError("the prompt is empty")
    return sampling, spec, defaults


def _load(a, defaults):
    """``(engine, tokenizer, drafter note)`` for ``dartree generate``: the target and drafter paired
    and the method checked against the drafter's kind before any model loads, then again (a random
    drafter's) once built.

    Raises:
        ValueError: a method the drafter does not serve, a target or drafter refused (one line).
    """
    from services.drafter.config import drafter_kind
    from services.models.pairing import resolve_pair
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.protocol import served_methods
    from services.weights import resolve_cli_weights

    given = Path(a.drafter) if a.drafter and a.drafter != "none" else None
    if given is not None and (given / "config.json").is_file():  # before the target is looked for
        _check_served(a.method, served_methods(drafter_kind(given)), f"drafter: {given}")
    pair = resolve_pair(a.target, a.drafter, ar_only=a.method == Method.AR, ar_flag="--method ar",
                        context_fix="'dartree serve --max-context {limit}' serves it exactly")
    target = str(pair.target_dir) if pair.target_dir is not None else a.target
    ddir = None if pair.drafter == "none" else Path(pair.drafter) if pair.drafter else DEFAULT_DRAFTER_DIR
    if ddir is not None and (ddir / "config.json").is_file():  # before any model loads (a random drafter: checked once built)
        _check_served(a.method, served_methods(drafter_kind(ddir)), f"drafter: {ddir}")
    weights, dtype = resolve_cli_weights(getattr(a, "weights", None), a.dtype, resolve_target(target))
    engine, tok, note = build_inprocess(target, pair.drafter, dtype, defaults,
                                        packed_gemm=getattr(a, "packed_gemm", True), weights=weights,
                                        compile=getattr(a, "compile", False),
                                        compile_drafter=Method(a.method).drafts,  # ar never calls the drafter
                                        spec_policy=getattr(a, "spec_policy", "fixed"),
                                        ngram_draft=getattr(a, "ngram_draft", "off") == "on")
    _check_served(a.method, engine.drafter.info()["methods"], note)  # its kind's methods, ar included
    return engine, tok, note


def _banner(engine, note: str) -> list[str]:
    """The lines printed once the request is accepted: the drafter, and the compiled steps' warm-up."""
    svc = getattr(engine.drafter, "service", None)
    info = [f"[dartree] {note}"]
    if engine.runner.compiled or engine.runner.graphed:
        kind = "CUDA-graph" if engine.runner.graphed else "compiled"
        info.append(f"[dartree] {kind} steps ready in {engine.runner.warm_up_seconds:.1f} s")
    if getattr(svc, "compiled", False):
        info.append(f"[dartree] compiled drafter block ready in {svc.warm_up_seconds:.1f} s")
    return info


def run_generate(a) -> int:
    """Entry of ``dartree generate``.

    ``--budget`` / ``--width`` / ``--depth-bonus`` / ``--candidates`` are the engine's default tree
    knobs, as ``dartree serve``'s are the verifier's: under ``--spec-policy fixed`` every round
    verifies a whole tree of ``--budget`` nodes; under ``goodput`` ``--budget`` is the policy's B_max
    (its drafter call's budget, the most nodes it verifies). Unset: :func:`services.spec.default_tree_knobs`.
    A refused request (e.g. past the context window) prints its one error line and nothing else
    (:class:`HeldLogs`).

    Raises:
        ValueError: a refused flag or request (the command prints it in one line).
    """
    sampling, spec, defaults = _request_settings(a)
    with HeldLogs() as held:
        engine, tok, note = _load(a, defaults)
        ids = encode(tok, a.prompt, a.chat)
        stream = _Stream(engine, tok, a, held, _banner(engine, note))
        stream.run(ids, sampling, spec)
    _report(a, engine, note, ids, stream)
    return 0


class _Stream:
    """One request through ``engine.generate``, its text printed as it comes (unless ``--json``), with
    the tokens, rounds, per-phase seconds and times collected for :func:`_report`."""

    def __init__(self, engine, tok, a, held: HeldLogs, info: list[str]):
        self.engine, self.tok, self.a, self.held, self.info = engine, tok, a, held, info
        self.tokens: list[int] = []
        self.emitted: list[int] = []
        self.phases: dict[str, float] = {}
        self.rounds, self.ttft, self.wall, self.finish = 0, 0.0, 0.0, None

    def run(self, ids: list[int], sampling, spec) -> None:
        t0 = time.perf_counter()
        for out in self.engine.generate(uuid.uuid4().hex, ids, sampling, spec):
            if self.info is not None:  # the request was accepted: a refused one prints its error line alone
                self.held.pass_on()
                if not self.a.json:
                    print("\n".join(self.info), file=sys.stderr)
                self.info = None
            self.tokens += out.token_ids
            if out.is_prefill:
                self.ttft = out.prefill_seconds
            else:
                self.rounds += 1
                self.emitted.append(round_tokens(out))
                for k, v in out.timings.items():
                    self.phases[k] = self.phases.get(k, 0.0) + v
            self.finish = out.finish_reason
            if not self.a.json:
                print(self.tok.decode(out.token_ids, skip_special_tokens=True), end="", flush=True)
        self.wall = time.perf_counter() - t0


def _report(a, engine, note: str, ids: list[int], st: _Stream) -> None:
    """The result: one JSON line (``--json``), else the closing stats line on stderr."""
    svc = getattr(engine.drafter, "service", None)
    steps_warmed = engine.runner.compiled or engine.runner.graphed
    drafter_compiled = getattr(svc, "compiled", False)
    tokens, rounds, policy = st.tokens, st.rounds, getattr(a, "spec_policy", "fixed")
    tau = sum(st.emitted) / rounds if rounds else 0.0
    decode = st.wall - st.ttft
    result = {"text": st.tok.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
              "finish_reason": st.finish, "method": a.method, "spec_policy": policy,
              "ngram_draft": getattr(a, "ngram_draft", "off"),
              "weights": engine.target.weights, "tau": round(tau, 3), "rounds": rounds, "prompt_tokens": len(ids),
              "completion_tokens": len(tokens), "ttft_s": round(st.ttft, 4), "wall_s": round(st.wall, 3),
              "tokens_per_s": round((len(tokens) - 1) / decode, 2) if decode > 0 and len(tokens) > 1 else None,
              "round_ms": {k: round(1000 * v / max(rounds, 1), 3) for k, v in st.phases.items()},
              "drafter": note.removeprefix("drafter: "),
              **({"compile_warm_up_s": round(engine.runner.warm_up_seconds, 1)} if steps_warmed else {}),
              **({"drafter_compile_warm_up_s": round(svc.warm_up_seconds, 1)} if drafter_compiled else {})}
    if not tokens and st.finish == "stop" and not a.chat:
        print("[dartree] the model ended at once (end-of-sequence as the first token); an instruct/chat model "
              "usually needs --chat", file=sys.stderr)
    if a.json:
        print(json.dumps(result))
        return
    print(flush=True)  # the streamed text ends with a newline
    rate = "n/a" if result["tokens_per_s"] is None else result["tokens_per_s"]  # < 2 tokens: no decode rate
    print(f"[dartree] {a.method}: tau {tau:.2f} over {rounds} rounds, {rate} tok/s, "
          f"finish {st.finish}", file=sys.stderr)
