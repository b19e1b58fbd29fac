"""The ``dartree`` command line: serve, serve-ray, gateway, verifier, drafter, generate, bench, train-drafter, doctor.

Building the parser imports no torch: heavy imports happen inside each sub-command, and the flags of
``train-drafter``, ``bench`` and ``doctor`` (defined beside their code; the first two need torch) are
added only once that sub-command is chosen, so ``dartree gateway`` runs on a machine without torch.
Bad input ends with a one-line ``dartree: error: ...`` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.command_line import Parser, run_command
from services.runtime import DTYPES, WEIGHT_CHOICES, default_weights
from services.spec import DEFAULT_METHOD, DEFAULT_POLICY, METHODS, POLICIES


def _seed(text: str) -> int:
    """``--seed``: an int in the HTTP API's range [-2**63, 2**63) (torch's generator takes 64 bits)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not -(2**63) <= v < 2**63:
        raise argparse.ArgumentTypeError(f"{v} is outside [-2**63, 2**63) (a 64-bit seed)")
    return v


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate one completion in-process (no server)")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=METHODS,
                   help=f"speculative method ('ar' = plain decoding; default: {DEFAULT_METHOD})")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--seed", type=_seed, default=None, help="sampling seed, 64-bit (default: random)")
    p.add_argument("--budget", type=int, default=None, help="default tree budget B, as serve's: the tree of "
                   "every round under --spec-policy fixed, the policy's maximum B_max under goodput "
                   "(default: 8 on CPU, 64 on CUDA)")
    p.add_argument("--width", type=int, default=None, help="tree width W: children kept per node (default: 12)")
    p.add_argument("--depth-bonus", type=float, default=None, help="depth bonus beta <= 0 of the pruned "
                   "DARTree score (default: -0.2)")
    p.add_argument("--candidates", type=int, default=None, help="candidate pool K per depth (default: 64)")
    p.add_argument("--target", default=None, help="target: default SmolLM2-135M-Instruct, a local HF dir or a "
                   "hub id, org/name (docs/models.md)")
    p.add_argument("--drafter", default=None, help="drafter: a local dir or a hub id (default: the shipped drafter "
                   "when it fits the target; 'none': a random one, for --method ar)")
    p.add_argument("--weights", default=default_weights(), choices=list(WEIGHT_CHOICES),
                   help="target weight format: float32, bfloat16, q4 (the GGUF's own 4-bit blocks, bfloat16 "
                        "activations, CPU) or auto (default: the fastest here, measured once and cached; "
                        "env DARTREE_WEIGHTS)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="older spelling: pins --weights to this dense precision when --weights is auto")
    p.add_argument("--no-packed-gemm", dest="packed_gemm", action="store_false",
                   help="do not pre-pack float32 CPU weights for the round's row counts (services/cpu_gemm.py)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the target's steps (CUDA graphs on a GPU) and the drafter's block forward through "
                        "torch.compile (a warm-up of about a minute the first time on a small CPU, seconds once "
                        "its kernels are cached); default (unset): the target's steps only, for a q4 llama "
                        "target on CPU; --no-compile: eager")
    p.add_argument("--spec-policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="goodput (default): each round's tree budget (0 = plain decoding) is chosen to maximise "
                        "tokens/s from calibrated acceptance and a measured cost model, --budget is its maximum; "
                        "fixed: every round verifies the whole tree of --budget")
    p.add_argument("--ngram-draft", choices=("on", "off"), default="off",
                   help="on: each drafted tree also gets a chain continuing the longest repeated 3- or 2-gram "
                        "of the prompt and output (no drafter forward; pays where text repeats); default: off")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)


def _generate(a) -> int:
    from services.generate import run_generate

    return run_generate(a)


def _add_train(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a DFlash + Domino (with --dspark: DSpark) drafter for a target",
                       add_flags=_train_flags)
    p.set_defaults(func=_train)


def _train_flags(p: argparse.ArgumentParser) -> None:
    from services.training.train import build_args

    build_args(p)


def _train(a) -> int:
    from services.training.train import run

    run(a)
    return 0


def _add_workers(sub) -> None:
    from services import serve

    for name, add, main, what in (
            ("serve", serve.add_serve_args, serve.serve_main, serve.SERVE_DESCRIPTION),
            ("gateway", serve.add_gateway_args, serve.gateway_main, "run the HTTP gateway alone"),
            ("verifier", serve.add_verifier_args, serve.verifier_main, "run the verifier worker alone"),
            ("drafter", serve.add_drafter_args, serve.drafter_main, "run the drafter worker alone")):
        p = sub.add_parser(name, help=what, description=what)
        add(p)
        p.set_defaults(func=main)


def _add_serve_ray(sub) -> None:
    from services.ray_config import add_serve_ray_args

    p = sub.add_parser("serve-ray", help="N units behind Ray Serve: routing, autoscaling, failover (needs ray)")
    add_serve_ray_args(p)
    p.set_defaults(func=_serve_ray)


def _serve_ray(a) -> int:
    try:
        from services.ray_serve import serve_ray_main
    except ImportError as e:
        raise RuntimeError(f"dartree serve-ray needs Ray Serve ({e}); install it with "
                           "pip install -r requirements-ray.txt") from None
    return serve_ray_main(a)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="CPU capabilities, cached weight choices and cost sweeps (--remeasure)",
                       add_flags=_doctor_flags)
    p.set_defaults(func=_doctor)


def _doctor_flags(p: argparse.ArgumentParser) -> None:
    from services.doctor import add_doctor_args

    add_doctor_args(p)


def _doctor(a) -> int:
    from services.doctor import doctor_main

    return doctor_main(a)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods and peers side by side (tables and figures)",
                       add_flags=_bench_flags)
    p.set_defaults(func=_bench)


def _bench_flags(p: argparse.ArgumentParser) -> None:
    try:
        from benchmarks.bench import add_bench_args
    except ImportError as e:  # an install without the benchmarks' dependencies
        p.error(f"dartree bench needs the benchmarks package and its dependencies ({e})")
    add_bench_args(p)


def _bench(a) -> int:
    from benchmarks.bench import bench_main

    return bench_main(a)


class _SubParser(Parser):
    """A sub-command's parser whose flags may be added on first use (``add_flags``: parsing, or
    ``--help``), so that building the ``dartree`` parser imports none of that sub-command's modules."""

    def __init__(self, *args, add_flags: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_flags = add_flags

    def ensure_flags(self) -> _SubParser:
        """Add the deferred flags now (once); this parser."""
        if self._add_flags is not None:
            add, self._add_flags = self._add_flags, None
            add(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.ensure_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.ensure_flags()
        return super().format_help()


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of sub-command ``name`` of ``parser`` (:func:`build_parser`), every flag added."""
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name].ensure_flags()


def build_parser() -> argparse.ArgumentParser:
    """The full ``dartree`` parser (every parser in it is a one-line-error :class:`Parser`)."""
    ap = Parser(prog="dartree", description="DARTree Serve: lossless tree speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_SubParser)
    _add_workers(sub)
    _add_serve_ray(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_doctor(sub)
    _add_train(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):  # argparse would only say
        ap.error(f"unrecognized arguments: {argv[0]}; the command comes first: "  # "command is required"
                 "dartree COMMAND [options]")
    args, extra = ap.parse_known_args(argv)
    if extra:  # name the subcommand whose options were wrong
        sub = f"{ap.prog} {args.command}"
        ap.exit(2, f"{sub}: error: unrecognized arguments: {' '.join(extra)} (see {sub} --help)\n")
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
