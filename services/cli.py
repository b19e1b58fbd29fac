"""The ``dartree`` command line: serve, serve-ray, gateway, verifier, drafter, generate, bench, train-drafter.

Heavy imports happen inside each sub-command, so ``dartree gateway`` never imports torch.
Bad input ends with a one-line ``dartree: error: ...`` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from services.protocol import METHODS
from services.runtime import DTYPES, WEIGHT_CHOICES, default_weights, error_line


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
    p.add_argument("--method", default="dartree-pruned", choices=METHODS,
                   help="speculative method ('ar' = plain decoding; default: dartree-pruned)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--seed", type=_seed, default=None, help="sampling seed, 64-bit (default: random)")
    p.add_argument("--budget", type=int, default=None, help="tree budget B: nodes per draft tree "
                   "(default: the drafter's, 8 on CPU, 64 on CUDA)")
    p.add_argument("--width", type=int, default=None, help="tree width W: children kept per node (default: 12)")
    p.add_argument("--depth-bonus", type=float, default=None, help="depth bonus beta <= 0 of the pruned "
                   "DARTree score (default: -0.2)")
    p.add_argument("--candidates", type=int, default=None, help="candidate pool K per depth (default: 64)")
    p.add_argument("--target", default=None, help="target: default SmolLM2-135M-Instruct, or a local HF dir")
    p.add_argument("--drafter", default=None, help="drafter dir (default: the shipped drafter)")
    p.add_argument("--weights", default=default_weights(), choices=list(WEIGHT_CHOICES),
                   help="target weight format: float32, bfloat16, q4 (the GGUF's own 4-bit blocks, bfloat16 "
                        "activations, CPU) or auto (default: the fastest here, measured once and cached; "
                        "env DARTREE_WEIGHTS)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="older spelling: pins --weights to this dense precision when --weights is auto")
    p.add_argument("--no-packed-gemm", dest="packed_gemm", action="store_false",
                   help="do not pre-pack float32 CPU weights for the round's row counts (services/cpu_gemm.py)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run the target's steps (CUDA graphs on a GPU) and the drafter's block forward through "
                        "torch.compile (a warm-up of about a minute the first time on a small CPU, less once "
                        "inductor's disk cache is warm; default: off)")
    p.add_argument("--spec-policy", choices=["goodput", "fixed"], default="goodput",
                   help="goodput (default): each round's tree budget (0 = plain decoding) is chosen to maximise "
                        "tokens/s from calibrated acceptance and a measured cost model, --budget is its maximum; "
                        "fixed: every round verifies the whole tree of --budget")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)


def _generate(a) -> int:
    from services.generate import run_generate

    return run_generate(a)


def _add_train(sub) -> None:
    from services.training.train import build_args

    p = sub.add_parser("train-drafter", help="train a DFlash + Domino (with --dspark: DSpark) drafter for a target")
    build_args(p)
    p.set_defaults(func=_train)


def _train(a) -> int:
    from services.training.train import run

    run(a)
    return 0


def _add_workers(sub) -> None:
    from services import serve

    for name, add, main in (("serve", serve.add_serve_args, serve.serve_main),
                            ("gateway", serve.add_gateway_args, serve.gateway_main),
                            ("verifier", serve.add_verifier_args, serve.verifier_main),
                            ("drafter", serve.add_drafter_args, serve.drafter_main)):
        helps = {"serve": "start gateway + verifier + drafter, supervised (the main job)",
                 "gateway": "run the HTTP gateway alone", "verifier": "run the verifier worker alone",
                 "drafter": "run the drafter worker alone"}
        p = sub.add_parser(name, help=helps[name])
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


def _add_bench(sub) -> None:
    try:
        from benchmarks.bench import add_bench_args, bench_main
    except ImportError:
        return
    p = sub.add_parser("bench", help="benchmark methods and peers side by side (tables and figures)")
    add_bench_args(p)
    p.set_defaults(func=bench_main)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``<prog>: error: <what> (see <prog> --help)``, exit code 2
    (argparse's own prints the whole usage block first, a screenful for ``generate``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``dartree`` parser (its subcommand parsers are :class:`_Parser` too)."""
    ap = _Parser(prog="dartree", description="DARTree Serve: lossless tree speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_workers(sub)
    _add_serve_ray(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_train(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # name the subcommand whose options were wrong
        sub = f"{ap.prog} {args.command}"
        ap.exit(2, f"{sub}: error: unrecognized arguments: {' '.join(extra)} (see {sub} --help)\n")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # bad input, a path (permissions, a full disk): one line
        print(f"dartree: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
