"""Resident memory of the verifier and drafter processes by mapping kind, sampled while a server runs.

Polls every ``--every`` seconds for processes titled ``dartree-verifier`` / ``dartree-drafter``,
reads ``/proc/<pid>/smaps`` and sums Rss / Pss per kind of mapping: ``file`` (libraries, mapped
weights), ``heap`` (glibc's main arena, ``[heap]``), ``kv`` (anonymous mappings exactly the size of
one layer's keys or values, ``--kv-bytes``: the KV cache, committed pages only), ``arena`` (anonymous
mappings of glibc's 64 MiB thread arenas), ``anon_large`` (other anonymous mappings >= 1 MiB: torch's
large tensors, mmapped by glibc) and ``anon_small``. Keeps, per process, the sample with the largest
total Rss and the last one; writes one JSON at SIGINT / SIGTERM or when ``--seconds`` ran out.

    python smaps_parts.py --out parts.json --kv-bytes 28311552 --seconds 400 &
"""

from __future__ import annotations

import argparse
import json
import signal
import time

import psutil

ARENA = 64 << 20


def parts(pid: int, kv_bytes: int) -> dict[str, dict[str, float]]:
    """``{kind: {"rss_mb", "pss_mb", "n"}}`` of one process (module doc)."""
    out: dict[str, dict[str, float]] = {}
    cur = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size, name = hi - lo, head[5] if len(head) > 5 else ""
                if name == "[heap]":
                    kind = "heap"
                elif name.startswith("/"):
                    kind = "file"
                elif name:
                    kind = "other"
                elif kv_bytes <= size <= kv_bytes + 8192:
                    kind = "kv"
                elif lo % ARENA == 0 and size <= ARENA and size >= ARENA // 2 or (head[1] == "---p" and size < ARENA):
                    kind = "arena"
                elif size >= 1 << 20:
                    kind = "anon_large"
                else:
                    kind = "anon_small"
                cur = out.setdefault(kind, {"rss_mb": 0.0, "pss_mb": 0.0, "n": 0})
                cur["n"] += 1
            elif head[0] == "Rss:" and cur is not None:
                cur["rss_mb"] += int(head[1]) / 1024
            elif head[0] == "Pss:" and cur is not None:
                cur["pss_mb"] += int(head[1]) / 1024
    return {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-bytes", type=int, required=True, help="bytes of one layer's keys (= values) tensor")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=float, default=0.5)
    args = ap.parse_args()
    result: dict = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    t0 = time.monotonic()
    while not stop and time.monotonic() - t0 < args.seconds:
        for p in psutil.process_iter(["name"]):
            name = (p.info["name"] or "")[:15]
            role = next((r for r in ("verifier", "drafter") if f"dartree-{r}"[:15] == name), None)
            if role is None:
                continue
            try:
                snap = parts(p.pid, args.kv_bytes)
            except OSError:
                continue
            total = sum(v["rss_mb"] for v in snap.values())
            rec = result.setdefault(role, {"peak_rss_mb": 0.0})
            rec["last"] = {"t": round(time.monotonic() - t0, 1), "rss_mb": round(total, 1), "parts": snap}
            if total > rec["peak_rss_mb"]:
                rec["peak_rss_mb"] = round(total, 1)
                rec["peak"] = rec["last"]
        time.sleep(args.every)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
