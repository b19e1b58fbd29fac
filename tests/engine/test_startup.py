"""Start-up footprint and diagnostics: the KV reservation follows its documented formula (slots from
``--max-running``, positions from the context allowed, the activation dtype), its pages are committed
only as used, a configuration that cannot fit is refused in one line naming the flag, the weight
choice runs in a throw-away process, and ``dartree doctor`` prints its screen."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil
import pytest
import torch

from services import startup
from services.testing import REPO
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.kv_cache import SlotKVCache
from services.verifier.target import TargetModel
from tests.service.tiny import make_tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_kv_cache_follows_the_documented_formula(tiny, weights):
    target_dir, _ = tiny
    target = TargetModel.from_pretrained(target_dir, [1, 2], weights=weights)
    engine = SpecEngine(target, None, EngineConfig(max_running=3, max_context=100, prefill_chunk=32))
    cache = engine.runner.cache
    cfg = json.loads((target_dir / "config.json").read_text())
    cap = startup.kv_capacity(100, cfg["max_position_embeddings"], 32)
    assert cache.capacity == cap and cache.num_slots == 3
    assert cache.dtype == (torch.float32 if weights == "float32" else torch.bfloat16)  # the activation dtype
    assert cache.nbytes() == startup.kv_bytes(cfg, 3, cap, weights)
    fp = startup.serve_footprint(target_dir, weights, weights, 3, 100, 32)
    assert fp["kv"] == cache.nbytes() and fp["kv_capacity"] == cap
    n_params = sum(p.numel() for p in target.model.parameters())
    assert fp["weights"] == int(n_params * startup.weight_bytes_per_param(weights))
    buffers = sum(b.numel() * b.element_size() for b in target.model.buffers())  # rotary inv_freq
    assert startup.module_bytes(target.model) == n_params * (4 if weights == "float32" else 2) + buffers


def test_kv_pages_are_committed_as_contexts_use_them():
    before = psutil.Process().memory_info().rss
    cache = SlotKVCache(2, 8, 64, 8, 16384, torch.float32)  # 1 GiB reserved
    assert cache.nbytes() == 2**30
    grown = psutil.Process().memory_info().rss - before
    assert grown < 32 * 2**20, grown
    cache.prepare([0], 1024)  # one slot's first 1,024 columns written: 8 MiB
    assert startup.kv_committed_bytes(cache) == 8 * 2**20
    assert psutil.Process().memory_info().rss - before < 48 * 2**20


def test_a_cache_that_cannot_fit_is_refused_naming_the_flags(tiny):
    target_dir, _ = tiny
    fp = startup.check_fits(target_dir, "float32", "float32", 2, 0, 256, available=1 << 40)
    with pytest.raises(ValueError) as e:
        startup.check_fits(target_dir, "float32", "float32", 2, 0, 256, available=fp["kv"] // 2)
    msg = str(e.value)
    assert "\n" not in msg and "--max-running" in msg and "--max-context" in msg and "KV cache" in msg


def test_serve_plan_refuses_a_kv_cache_beyond_the_ram(tiny, tmp_path, monkeypatch):
    from services.serve import add_serve_args
    from services.serve_plan import plan

    target_dir, drafter_dir = tiny
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1 << 20})())
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--target", str(target_dir), "--drafter", str(drafter_dir), "--weights", "float32",
                              "--port", "18451", "--verifier-metrics-port", "18452", "--drafter-metrics-port", "18453"])
    with pytest.raises(ValueError, match="lower --max-running"):
        plan(args)


def test_the_weight_choice_runs_in_a_throw_away_process(tiny):
    target_dir, _ = tiny
    got = startup.choose_in_child(str(target_dir), "bfloat16", None, "cpu", "WARNING")
    assert got[0] == str(target_dir) and got[1:3] == ("bfloat16", "bfloat16") and got[3] in ("float32", "bfloat16")
    with pytest.raises(ValueError, match="GGUF"):
        startup.choose_in_child(str(target_dir), "q4", None, "cpu", "WARNING")


def test_phase_and_memory_lines(caplog):
    with caplog.at_level("INFO", logger="dartree.startup"):
        with startup.phase("verifier", "target weights loaded"):
            pass
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("start-up verifier: target weights loaded ") and line.endswith(" s")
    mem = startup.memory_line("drafter", {"weights": 3 * 2**20, "KV cache": "none"})
    assert mem.startswith("resident memory drafter: RSS ") and "weights 3 MB" in mem and "KV cache none" in mem


def test_doctor_prints_capabilities_and_cached_choices(tmp_path):
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "weights_choice.json").write_text(json.dumps({"Test CPU|k": {
        "choice": "q4", "ms": {"q4": {"1-row": 24.5}}, "when": "2026-12-01T00:00:00", "time": time.time() - 7200}}))
    (cache / "cost_model.json").write_text(json.dumps({"host|m|q4": {"time": time.time() - 90,
                                                                     "samples": [[1, 0.0245], [9, 0.031]]}}))
    (cache / "onednn_rows.json").write_text(json.dumps({"Test CPU|threads 1|limit 128": {
        "time": time.time() - 3 * 86400, "rows": {"576 x 1536": 1, "49152 x 576": 128}}}))
    (cache / "calibration.json").write_text(json.dumps({"smollm2/q4/cpu/drafter": {
        "time": time.time() - 5 * 86400, "state": {"tables": {}}}}))
    (cache / "q4").mkdir()
    (cache / "q4" / "smollm2-135m-instruct-0123abcd.safetensors").write_bytes(b"\0" * 3 * 2**20)
    (cache / "inductor" / "ab").mkdir(parents=True)  # compiled steps' kernels (torch inductor's cache)
    (cache / "inductor" / "ab" / "kernel.so").write_bytes(b"\0" * 2 * 2**20)
    models = tmp_path / "models"
    (models / "tiny-model").mkdir(parents=True)
    (models / "tiny-model" / "config.json").write_text("{}")
    env = {"PATH": "/usr/bin:/bin", "DARTREE_CACHE": str(models), "DARTREE_CACHE_DIR": str(cache),
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "services.cli", "doctor"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ISA        torch " in out and "bfloat16   native " in out and "int4 (q4)" in out
    assert f"models          {models} ($DARTREE_CACHE): tiny-model" in out
    assert f"state           {cache} ($DARTREE_CACHE_DIR)" in out
    assert "q4: ms {\"q4\": {\"1-row\": 24.5}}, 2 h old" in out
    assert "rows:ms 1:24.5 9:31.0, 2 min old" in out or "rows:ms 1:24.5 9:31.0, 1 min old" in out
    assert "576 x 1536: 1, 49152 x 576: 128, 3 d old" in out
    assert "smollm2-135m-instruct-0123abcd.safetensors: 3 MB, " in out
    assert "  smollm2/q4/cpu/drafter, 5 d old" in out
    assert f"compiled steps  {cache / 'inductor'}" in out and "  1 files, 2 MB, newest " in out
    assert len(out.splitlines()) < 29  # one screen


def test_a_kv_cache_beyond_the_ram_is_a_one_line_configuration_error():
    from services.verifier.kv_cache import KVCacheTooLarge

    with pytest.raises(KVCacheTooLarge) as e:
        SlotKVCache(100, 64, 128, 1000, 100_000, torch.float32)  # ~1.2 PiB
    assert isinstance(e.value, ValueError) and isinstance(e.value, MemoryError)
    assert "\n" not in str(e.value) and "lower --max-running or --max-context" in str(e.value)


def test_doctor_remeasure_on_a_tiny_target(tmp_path):
    from services.testing import tiny_gguf_target_dir
    from services.weights import int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("torch without the int4 CPU kernel")
    target = tiny_gguf_target_dir(tmp_path / "t")
    env = {"PATH": "/usr/bin:/bin", "DARTREE_CACHE": str(tmp_path / "c"), "DARTREE_CACHE_DIR": str(tmp_path / "c"),
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "services.cli", "doctor", "--remeasure", "--target", str(target)],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert "re-measured:" in r.stdout and "weights auto -> " in r.stdout and "cost sweep (" in r.stdout
    assert "rows:ms 1:" in r.stdout and " 8:" in r.stdout
    chosen = r.stdout.split("weights auto -> ")[1].split()[0]
    assert (", compiled steps)" in r.stdout) == (chosen == "q4")  # the steps the server runs by default


_PLAN_SCRIPT = """
import argparse, json, sys

from services.serve import add_serve_args
from services.serve_plan import plan


def main():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(sys.argv[1:])  # every setting at its default but the model paths and ports
    _sup, _gw, verifier, drafter, rt = plan(args)
    print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                      "weights": verifier.weights, "drafter_dtype": drafter.dtype}))


if __name__ == "__main__":
    main()
"""


def test_the_supervisor_resolves_the_default_configuration_without_torch(tiny, tmp_path):
    """``dartree serve`` with the default settings (``--weights auto``, a drafter) resolves its whole
    plan (drafter kind, weight format in a throw-away process, the fit check) and never imports torch
    itself: torch's ~200 MB of RSS belong to the workers only."""
    target_dir, drafter_dir = tiny
    script = tmp_path / "plan.py"
    script.write_text(_PLAN_SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "DARTREE_CACHE": str(tmp_path / "c"), "DARTREE_CACHE_DIR": str(tmp_path / "c"),
           "XDG_RUNTIME_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(script), "--target", str(target_dir), "--drafter", str(drafter_dir),
                        "--port", "18461", "--verifier-metrics-port", "18462", "--drafter-metrics-port", "18463",
                        "--log-level", "WARNING"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["weights"] in ("float32", "bfloat16") and got["drafter_dtype"] in ("float32", "bfloat16")
    assert not got["torch"] and not got["transformers"], got


@pytest.mark.parametrize("with_drafter", [False, True])
def test_the_verifier_is_built_from_its_config_as_it_is(tiny, with_drafter):
    """``build_verifier``: the engine gets the config's ``engine`` sub-object (``compile`` auto
    resolved against the target: eager for a float32 target; on CPU the config's limits), the prefix
    cache its memory bounds (slots and host RAM), and the goodput policy its calibration store at construction, keyed by
    the drafter's handshake (no drafter: no store)."""
    from dataclasses import replace

    from services.protocol import PeerInfo
    from services.verifier.build import build_verifier, drafter_tag
    from services.verifier.config import EngineConfig, VerifierWorkerConfig

    target_dir, _ = tiny
    config = VerifierWorkerConfig(target=str(target_dir), weights="float32", cost_sweep=False, prefix_cache_mib=3,
                                  prefix_cache_ram_mib=5, engine=EngineConfig(max_context=0, max_running=2, compile=None))
    drafter = PeerInfo(role="drafter", epoch="e", block_size=8, target_layer_ids=(1, 2), model="/x/tiny-drafter",
                       methods=("ar", "dartree-pruned")) if with_drafter else None
    engine, target, got_dir = build_verifier(config, None, drafter)
    # compile auto: eager for a float32 target; context 0 and None both mean the target's
    assert got_dir == target_dir and engine.config == replace(config.engine, compile=False, max_context=None)
    assert engine.max_context == target.max_context and engine.runner.cache.num_slots == 2
    assert engine.runner.cache.prefix.max_bytes == 3 * 2**20
    assert engine.runner.cache.prefix.ram.max_bytes == 5 * 2**20
    assert engine.policy.name == "goodput"
    if with_drafter:
        assert engine.policy.store is not None and drafter_tag(drafter) in engine.policy.store.key
        assert drafter_tag(drafter) == "tiny-drafter|K8|L1,2|ar,dartree-pruned"
    else:
        assert engine.policy.store is None
