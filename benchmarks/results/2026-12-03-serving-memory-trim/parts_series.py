"""PSS of every process of a running ``dartree serve`` by mapping kind, sampled every ``--every`` s.

Finds the processes titled ``dartree-{gateway,verifier,drafter}`` and the forkserver (``-c from
multiprocessing.forkserver``), reads ``/proc/<pid>/smaps`` and sums Pss (and Rss) per kind:
``lib`` (shared objects), ``file`` (other mapped files: weights), ``heap`` (glibc's main arena),
``anon`` (anonymous mappings >= 1 MiB: torch's large tensors, glibc's mmapped blocks and arenas)
and ``small`` (other anonymous mappings). Writes the whole series and each role's sample at its
largest total Pss to one JSON when ``--seconds`` ran out or at SIGINT / SIGTERM.

    python parts_series.py --out parts.json --seconds 300 &
"""

from __future__ import annotations

import argparse
import json
import signal
import time

import psutil


def role(p: psutil.Process) -> str | None:
    """``gateway``, ``verifier``, ``drafter``, ``forkserver`` or None (another process)."""
    name = (p.info["name"] or "")[:15]
    for r in ("gateway", "verifier", "drafter"):
        if f"dartree-{r}"[:15] == name:
            return r
    cmd = " ".join(p.info["cmdline"] or [])
    return "forkserver" if "multiprocessing.forkserver import main" in cmd else None


def parts(pid: int) -> dict[str, dict[str, float]]:
    """``{kind: {"pss_mb", "rss_mb"}}`` of one process (module doc)."""
    out: dict[str, dict[str, float]] = {}
    cur = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":") and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                if name == "[heap]":
                    kind = "heap"
                elif name.startswith("/"):
                    kind = "lib" if ".so" in name else "file"
                elif name:
                    kind = "small"
                else:
                    kind = "anon" if hi - lo >= 1 << 20 else "small"
                cur = out.setdefault(kind, {"pss_mb": 0.0, "rss_mb": 0.0})
            elif cur is not None and head[0] in ("Pss:", "Rss:"):
                cur[head[0][:3].lower() + "_mb"] += int(head[1]) / 1024
    return {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=0.5)
    args = ap.parse_args()
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    series, peak = [], {}
    t0 = time.monotonic()
    while not stop and time.monotonic() - t0 < args.seconds:
        row: dict = {"t": round(time.monotonic() - t0, 1)}
        for p in psutil.process_iter(["name", "cmdline"]):
            r = role(p)
            if r is None:
                continue
            try:
                row[r] = parts(p.pid)
            except OSError:
                continue
            total = sum(v["pss_mb"] for v in row[r].values())
            if total > peak.get(r, {}).get("pss_mb", 0):
                peak[r] = {"t": row["t"], "pss_mb": round(total, 1), "parts": row[r]}
        if len(row) > 1:
            series.append(row)
        time.sleep(args.every)
    with open(args.out, "w") as f:
        json.dump({"peak": peak, "series": series}, f)


if __name__ == "__main__":
    main()
