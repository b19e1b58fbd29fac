"""The default target's one-time GGUF conversion is safe when several processes start at once.

Two ``datagen --part`` jobs started together (the README's recipe) both found no converted target,
both converted into the same ``<dir>.tmp`` and the second rename failed with a traceback
(``Directory not empty``), after the two had written over each other's files (2026-12-02).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from services.models import registry


def _fake_save(calls: list[str]):
    def save(tmp: Path) -> None:
        calls.append(str(tmp))
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        time.sleep(0.3)  # long enough for the other thread to arrive while this one converts
        (tmp / "config.json").write_text("{}")
    return save


def test_concurrent_first_starts_convert_once(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_gguf_dir", lambda: tmp_path)
    monkeypatch.setattr(registry, "_save_converted", _fake_save(calls))
    results, errors = [], []

    def start():
        try:
            results.append(registry.resolve_target(None))
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    out = tmp_path / "cache" / registry.DEFAULT_TARGET
    assert results == [out] * 3
    assert len(calls) == 1, calls  # one conversion; the others waited for it and used it
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    leftovers = [p.name for p in out.parent.iterdir() if ".tmp" in p.name]
    assert leftovers == []


def test_failed_conversion_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_gguf_dir", lambda: tmp_path)

    def broken(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(registry, "_save_converted", broken)
    with pytest.raises(OSError, match="disk full"):
        registry.resolve_target(None)
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir()] == [registry.DEFAULT_TARGET + ".lock"]
    # the next start converts afresh
    calls: list[str] = []
    monkeypatch.setattr(registry, "_save_converted", _fake_save(calls))
    assert (registry.resolve_target(None) / "config.json").exists() and len(calls) == 1


def test_incomplete_target_dir_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_gguf_dir", lambda: tmp_path)
    stale = tmp_path / "cache" / registry.DEFAULT_TARGET
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")  # no config.json: never loaded
    calls: list[str] = []
    monkeypatch.setattr(registry, "_save_converted", _fake_save(calls))
    out = registry.resolve_target(None)
    assert len(calls) == 1 and (out / "config.json").exists()
    assert (out / "model.safetensors").read_bytes() == b"x" * 1000
