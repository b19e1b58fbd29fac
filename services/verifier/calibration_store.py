"""Keeps the goodput policy's learnt acceptance calibration between server starts.

A new server's calibration starts at the drafter's own confidence and learns the real acceptance
from the first requests' labels; until it has, those requests pay for the policy's exploration
(on a q4 CPU the first pass over MT-Bench ran ~12 % below plain decoding,
benchmarks/results/2026-12-03-cpu-small-trees section 4). The store saves the learnt tables
(:meth:`AcceptanceCalibrator.state`) per key (machine-independent: target, weight format, device,
drafter) in ``$DARTREE_CACHE_DIR/calibration.json`` (default ``~/.cache/dartree``), and the next
start loads them as its prior, refined online as before. A missing, unreadable or mismatching
file is a cold start, never an error.
"""

from __future__ import annotations

import time
from pathlib import Path

from services.machine_cache import read_entries, state_dir, write_entry

CALIBRATION = "calibration.json"


def default_store_path() -> Path:
    """``<state dir>/calibration.json`` (:func:`services.machine_cache.state_dir`)."""
    return state_dir() / CALIBRATION


class CalibrationStore:
    """One key's saved calibration in a JSON file of ``{key: {"time": unix seconds, "state": ...}}``
    (:func:`services.machine_cache.write_entry`).

    Args:
        key: what the calibration belongs to (:func:`calibration_key`).
        path: the file (None = :func:`default_store_path`).
        max_age_s: an entry older than this is ignored (the drafter or the traffic may have changed).
    """

    def __init__(self, key: str, path: Path | None = None, max_age_s: float = 30 * 86400):
        self.key, self.path, self.max_age_s = key, Path(path) if path else default_store_path(), max_age_s

    def load(self) -> dict | None:
        """The saved state of the key (None when absent, stale or unreadable)."""
        entry = read_entries(self.path).get(self.key)
        if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
            return None
        if time.time() - float(entry.get("time", 0)) > self.max_age_s:
            return None
        return entry["state"]

    def save(self, state: dict) -> None:
        """Write the key's state (other keys kept; atomic replace; best effort: an I/O error is logged)."""
        write_entry(self.path, self.key, {"state": state})


def calibration_key(target: str, weights: str, device: str, drafter: str) -> str:
    """``target/weights/device/drafter``: a calibration is the drafter's confidence against this
    target's tokens (the weight format changes them slightly; the device's kernels too)."""
    return "/".join((target, weights, device.split(":")[0], drafter or "drafter"))
