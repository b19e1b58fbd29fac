"""guidellm (a third-party load client) as a second opinion on a served benchmark.

``guidellm`` lives in its own virtualenv, ``.venv-guidellm`` (``make bench-guidellm``; it pins its own
torch and transformers, so never the project's ``.venv``). :func:`guidellm_argv` builds one
``guidellm run`` against one OpenAI-compatible server: streamed chat completions of a synthetic
workload (``prompt_tokens`` tokens in, exactly ``output_tokens`` out: guidellm sends ``ignore_eos``),
T = 0, a concurrent profile with one benchmark per stream count, each stopped after ``seconds``; its
JSON report is read by :func:`parse_report` into, per level, output tokens/s and the median TTFT and
ITL (inter-token latency) in milliseconds. guidellm counts tokens with the tokenizer of the served
model's local HF directory (nothing comes from a model hub: ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_llama import find_executable

GUIDELLM_HINT = "make bench-guidellm (installs guidellm into .venv-guidellm)"
VENV = Path(__file__).resolve().parents[1] / ".venv-guidellm"
# guidellm's JSON report: per benchmark, these metrics' "successful" distribution; what we keep of each
METRICS = {"output_tps": ("output_tokens_per_second", "mean"),
           "ttft_ms": ("time_to_first_token_ms", "median"),
           "itl_ms": ("inter_token_latency_ms", "median")}


def find_guidellm(path: str | None = None, venv: Path | None = None) -> Path:
    """The ``guidellm`` executable: ``path``, else ``venv/bin/guidellm`` (default :data:`VENV`), else
    the one on PATH.

    Raises:
        PeerUnavailableError: no such executable (one line naming the make target).
    """
    venv = VENV if venv is None else venv
    return find_executable("guidellm", path, "--guidellm-bin", venv / "bin", GUIDELLM_HINT)


def guidellm_argv(binary: Path, target: str, tokenizer: Path, streams: list[int], seconds: float,
                  prompt_tokens: int, output_tokens: int, out_json: Path, seed: int = 42) -> list[str]:
    """``guidellm run`` against the server at ``target`` (base URL): streamed chat completions at
    T = 0 of ``prompt_tokens``-token synthetic prompts and ``output_tokens`` generated tokens, one
    concurrent benchmark per entry of ``streams``, each for ``seconds``; prompts counted with the
    tokenizer in ``tokenizer`` (a local HF directory); the JSON report to ``out_json``. Every
    configuration is one JSON object (guidellm's ``--backend``-style options take JSON)."""
    def js(obj: dict) -> str:
        return json.dumps(obj, separators=(",", ":"))

    backend = {"kind": "openai_http", "target": target, "request_format": "/v1/chat/completions",
               "http2": False, "timeout": 600.0, "extras": {"body": {"temperature": 0}}}
    data = {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    return [str(binary), "run",
            "--backend", js(backend),
            "--profile", js({"kind": "concurrent", "streams": list(streams)}),
            "--constraint", js({"kind": "max_duration", "seconds": seconds}),
            "--data", js(data),
            "--tokenizer", js({"kind": "huggingface_auto", "model": str(tokenizer)}),
            "--seed", js({"kind": "static", "value": seed}),
            "--output", js({"kind": "json", "path": str(out_json)}),
            "--disable-console-interactive"]


def guidellm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment guidellm runs in: ``base`` (default: this process's) without a Python path
    of ours (it has its own interpreter and packages) and with every model hub offline."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _streams(bench: dict) -> int | None:
    """The concurrency of one benchmark of the report (its strategy's ``streams``), else None."""
    config = bench.get("config") or {}
    for holder in (config.get("strategy"), config.get("profile"), config):
        if isinstance(holder, dict):
            val = holder.get("streams")
            if isinstance(val, int):
                return val
            if isinstance(val, list) and len(val) == 1 and isinstance(val[0], int):
                return val[0]
    return None


def _stat(metrics: dict, name: str, stat: str) -> float | None:
    """``metrics[name]["successful"][stat]`` (guidellm's successful-request distribution), else None."""
    dist = (metrics.get(name) or {}).get("successful") or {}
    val = dist.get(stat)
    return round(float(val), 3) if isinstance(val, int | float) else None


def parse_report(report: dict) -> dict:
    """A guidellm JSON report as ``{"guidellm_version", "levels": {"c<N>": {...}}}``; per concurrency
    level ``output_tps`` (guidellm's output tokens/s over the benchmark: tokens of its successful
    requests over its duration), ``ttft_ms`` and ``itl_ms`` (medians over the successful requests,
    milliseconds) and the ``requests`` / ``errored`` / ``incomplete`` counts (those still in flight at
    the time limit); a missing metric is None.

    Raises:
        ValueError: no benchmarks, or a benchmark whose concurrency cannot be found (one line).
    """
    benches = report.get("benchmarks")
    if not isinstance(benches, list) or not benches:
        raise ValueError("guidellm report holds no benchmarks")
    levels: dict[str, dict] = {}
    for bench in benches:
        streams = _streams(bench)
        if streams is None:
            raise ValueError("guidellm report: a benchmark without its concurrency (config.strategy.streams)")
        metrics = bench.get("metrics") or {}
        row = {key: _stat(metrics, name, stat) for key, (name, stat) in METRICS.items()}
        totals = metrics.get("request_totals") or {}
        row.update(requests=totals.get("successful"), errored=totals.get("errored"),
                   incomplete=totals.get("incomplete"))
        levels[f"c{streams}"] = row
    return {"guidellm_version": (report.get("metadata") or {}).get("guidellm_version"), "levels": levels}


def run_guidellm(argv: list[str], log_path: Path, timeout_s: float) -> dict:
    """Run ``argv`` (:func:`guidellm_argv`; its output to ``log_path``) and parse its JSON report
    (:func:`parse_report`).

    Raises:
        RuntimeError: it failed, ran past ``timeout_s`` or wrote no readable report (one line, naming the log).
    """
    out_json = Path(json.loads(argv[argv.index("--output") + 1])["path"])
    out_json.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=guidellm_env(),
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"guidellm ran past {timeout_s:.0f} s; see {log_path}") from None
    if rc != 0:
        raise RuntimeError(f"guidellm exited ({rc}); see {log_path}")
    try:
        return parse_report(json.loads(out_json.read_text()))
    except (OSError, ValueError) as e:
        raise RuntimeError(f"guidellm's report {out_json}: {e}; see {log_path}") from None


def ratios(levels: dict[str, dict[str, dict]], x: str, y: str) -> dict[str, dict]:
    """Per level both servers ran (``levels``: server -> :func:`parse_report`'s levels), ``x``'s value
    over ``y``'s for each metric (for TTFT and ITL, below 1 is ``x`` faster); None where either lacks it."""
    out = {}
    for level in sorted(set(levels.get(x, {})) & set(levels.get(y, {})), key=lambda c: int(c[1:])):
        a, b = levels[x][level], levels[y][level]
        out[level] = {k: round(a[k] / b[k], 3) if a.get(k) is not None and b.get(k) else None for k in METRICS}
    return out


def table(levels_by_server: dict[str, dict[str, dict]]) -> str:
    """``levels_by_server`` (server -> :func:`parse_report`'s levels) as a text table, one line per
    server and level."""
    lines = [f"{'guidellm':<14}{'level':>6}{'out tok/s':>11}{'TTFT ms':>10}{'ITL ms':>9}{'ok/err/inc':>12}"]
    for name, levels in levels_by_server.items():
        for level, r in sorted(levels.items(), key=lambda kv: int(kv[0][1:])):
            cells = [f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in ("output_tps", "ttft_ms", "itl_ms")]
            counts = "/".join(str(r.get(k)) for k in ("requests", "errored", "incomplete"))
            lines.append(f"{name:<14}{level:>6}{cells[0]:>11}{cells[1]:>10}{cells[2]:>9}{counts:>12}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m benchmarks.guidellm_peer REPORT.json: the parsed levels
    print(json.dumps(parse_report(json.loads(Path(sys.argv[1]).read_text())), indent=2))
