"""docker-compose.gpu.yml over docker-compose.yml: what CUDA IPC between the two worker containers
needs (one IPC and one PID namespace), the Hugging Face cache as a model volume, and the target and
drafter taken from DARTREE_TARGET / DARTREE_DRAFTER as the workers' own flag parsers read them.

Docker is not needed: the files are read with PyYAML (anchors and merge keys), the override merged
onto the base as compose merges services (environment by key, volumes by mount point), and
``${VAR:-default}`` interpolated as compose does. Where ``docker compose`` is installed,
``docker compose config`` checks the merge too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("drafter", "verifier")


def _interpolate(value, env: dict[str, str]):
    """compose's ``${VAR}`` / ``${VAR:-default}`` substitution (default when unset or empty)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def _merged(env: dict[str, str]) -> dict:
    """The services of ``docker-compose.yml`` with ``docker-compose.gpu.yml`` merged over them."""
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    out = {}
    for name in base.keys() | gpu.keys():
        b, o = base.get(name, {}), gpu.get(name, {})
        svc = {**b, **o}
        svc["environment"] = {**b.get("environment", {}), **o.get("environment", {})}
        mounts = {v.split(":")[1]: v for v in b.get("volumes", []) + o.get("volumes", [])}
        svc["volumes"] = list(mounts.values())
        out[name] = svc
    return _interpolate(out, env)


def _mount(svc: dict, target: str) -> str | None:
    return next((v for v in svc["volumes"] if v.split(":")[1] == target), None)


def test_the_workers_share_ipc_and_pid_namespaces_and_start_in_order():
    svc = _merged({})
    assert all(svc[w]["ipc"] == "host" for w in WORKERS)
    assert svc["verifier"]["pid"] == "service:drafter"  # joins the drafter's PID namespace
    assert "drafter" in svc["verifier"]["depends_on"]  # so the drafter's container exists first


def test_the_hugging_face_cache_is_the_model_volume():
    svc = _merged({"DARTREE_HF_CACHE": "/data/hf"})
    for name in ("prepare", *WORKERS, "gateway"):
        home = svc[name]["environment"]["HF_HOME"]
        mount = _mount(svc[name], home)
        assert mount is not None and mount.startswith("/data/hf:"), name
    assert _mount(svc["gateway"], "/hf-cache").endswith(":ro")
    assert _merged({})["drafter"]["volumes"][-1].startswith("~/.cache/huggingface:")  # the default


@pytest.mark.parametrize("env, target, drafter", [
    ({"DARTREE_TARGET": "Qwen/Qwen3-4B", "DARTREE_DRAFTER": "org/qwen3-4b-drafter"}, "Qwen/Qwen3-4B",
     "org/qwen3-4b-drafter"),
    ({}, "smollm2-135m-instruct", ""),
])
def test_target_and_drafter_come_from_the_environment(env, target, drafter, monkeypatch):
    """What each worker's own parser reads from the container environment compose sets."""
    from services.config_cli import config_from_args
    from services.drafter.worker import DrafterWorkerConfig
    from services.serve import add_drafter_args, add_verifier_args
    from services.verifier.worker import VerifierWorkerConfig

    svc = _merged(env)
    for name, add, cls in (("verifier", add_verifier_args, VerifierWorkerConfig),
                           ("drafter", add_drafter_args, DrafterWorkerConfig)):
        for key in [k for k in os.environ if k.startswith("DARTREE_")]:
            monkeypatch.delenv(key)
        for key, value in svc[name]["environment"].items():
            monkeypatch.setenv(key, str(value))
        parser = argparse.ArgumentParser()
        add(parser)
        cfg = config_from_args(cls, parser.parse_args([]))
        assert cfg.target == target and cfg.device == "cuda:0", name
    assert cfg.drafter == drafter  # the drafter worker's
    assert svc["gateway"]["environment"]["DARTREE_TARGET"] == target


def test_prepare_fetches_both_models_into_the_cache(tmp_path):
    """``prepare``'s command resolves the target and the drafter by hub id (here offline, from a
    cache holding both) and prints where they are."""
    from services.tiny_models import make_tiny_models

    target, drafter = make_tiny_models(tmp_path / "m")
    for repo, src in (("org/t", target), ("org/d", drafter)):
        d = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--"))
        shutil.copytree(src, d / "snapshots" / "c0ffee")
        (d / "refs").mkdir()
        (d / "refs" / "main").write_text("c0ffee")
    svc = _merged({"DARTREE_TARGET": "org/t", "DARTREE_DRAFTER": "org/d"})["prepare"]
    env = {**os.environ, **svc["environment"], "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *svc["command"][1:]], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "hf" / "hub" / f"models--org--{n}" / "snapshots" / "c0ffee")
                                for n in ("t", "d")]


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no docker compose")
def test_docker_compose_accepts_the_merge():
    r = subprocess.run(["docker", "compose", "-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml", "config",
                        "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
