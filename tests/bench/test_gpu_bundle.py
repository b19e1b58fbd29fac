"""``make gpu-bundle`` and ``gpu_check --bundle``: wheels unpacked into a scratch target and imported
from there (tiny wheels built here: no network), the whole ``--smoke`` check with a bundle, and the
download command's plan (pins, platforms, what the image brings, the size cap)."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import gpu_bundle, gpu_check


def _wheel(folder: Path, name: str, files: dict[str, str], top_level: bool = True) -> Path:
    """A minimal wheel of distribution ``name`` 0.1 holding ``files`` (path -> source)."""
    info = f"{name}-0.1.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if top_level:  # what setuptools writes: the top-level packages and modules
        files[f"{info}/top_level.txt"] = "\n".join(sorted(p.split("/")[0].removesuffix(".py") for p in files
                                                          if not p.startswith(name + "-"))) + "\n"
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def _bundle(folder: Path, prefix: str) -> Path:
    """Two wheels: a package with a ``.data/purelib`` module and no top_level.txt (its RECORD names
    its modules), and two modules with a top_level.txt."""
    folder.mkdir()
    _wheel(folder, f"{prefix}_pkg", {f"{prefix}_pkg/__init__.py": "__version__ = '0.1'\n",
                                     f"{prefix}_pkg-0.1.data/purelib/{prefix}_extra.py": "VALUE = 7\n"},
           top_level=False)
    _wheel(folder, f"{prefix}_mod", {f"{prefix}_mod.py": "__version__ = '0.2'\n",
                                     f"{prefix}_broken.py": "raise ImportError('needs something')\n"})
    return folder


def test_install_unpacks_wheels_and_reports_where_modules_come_from(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path / "b", "probe_one")
    target = tmp_path / "t"
    assert gpu_bundle.install(bundle, target) == ["probe_one_mod-0.1-py3-none-any.whl",
                                                  "probe_one_pkg-0.1-py3-none-any.whl"]
    assert (target / "probe_one_extra.py").is_file() and not list(target.glob("*.data"))
    assert gpu_bundle.top_level_modules(target) == ["probe_one_broken", "probe_one_extra", "probe_one_mod",
                                                    "probe_one_pkg"]
    monkeypatch.syspath_prepend(str(target))
    report = gpu_bundle.import_report(target, ("json",))
    assert report["json"]["from"] == "environment"
    assert report["probe_one_pkg"] == {"version": "0.1", "from": "bundle"}
    assert report["probe_one_mod"] == {"version": "0.2", "from": "bundle"}
    assert report["probe_one_extra"]["from"] == "bundle"
    assert report["probe_one_broken"] == {"error": "ImportError: needs something"}
    with pytest.raises(ValueError, match="no wheel"):
        gpu_bundle.install(tmp_path / "t", tmp_path / "t2")


def _smoke_with_bundle(tmp_path, monkeypatch, *args: str) -> dict:
    """``gpu_check --smoke --bundle`` (one tiny wheel) with ``args``; returns the JSON."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    bundle = tmp_path / "b"
    bundle.mkdir()
    _wheel(bundle, "probe_two", {"probe_two/__init__.py": "__version__ = '0.1'\n"})
    out = tmp_path / "gc"
    assert gpu_check.main(["--smoke", "--bundle", str(bundle), "--out", str(out), "--methods", "ar",
                           "--budgets", "4", "--rounds", "1", *args]) == 0
    return json.loads((out / "gpu_check.json").read_text())


def test_smoke_check_with_a_bundle(tmp_path, monkeypatch, capsys):
    """The --smoke check (no served part) with --bundle: wheels unpacked into a scratch target first on
    sys.path and on the tests' PYTHONPATH, every module the check needs imported, one JSON, one PNG;
    an API this torch lacks is listed under ``skipped`` and its part (the CUDA-graph cells) left out."""
    from benchmarks.gpu_check import compat

    monkeypatch.setattr(compat, "FEATURES", (*compat.FEATURES, compat.Feature("torch.cuda.graph_v99", "a test",
                                                                              "graphs")))
    res = _smoke_with_bundle(tmp_path, monkeypatch, "--no-serve", "--shapes", "tiny-llama")
    out = tmp_path / "gc"
    assert not any(c["graphs"] for c in res["breakdown"]) and res["config"]["graphs"] is False
    assert "graphs" not in {c["mode"] for c in res["verify_curve"]}
    assert any(s.startswith("torch.cuda.graph_v99: not in torch") and s.endswith("(graphs left out)")
               for s in res["skipped"])
    b = res["bundle"]
    assert b["status"] == "ok" and b["wheels"] == ["probe_two-0.1-py3-none-any.whl"]
    assert b["imports"]["probe_two"] == {"version": "0.1", "from": "bundle"}
    assert set(gpu_bundle.MODULES) <= set(b["imports"]) and not b["failed_imports"]
    assert not Path(b["target"]).is_relative_to(out)  # the scratch target stays out of the results
    assert sys.path[0] == b["target"] and os.environ["PYTHONPATH"].split(os.pathsep)[0] == b["target"]
    assert res["png"] == "gpu_check.png" and (out / "gpu_check.png").is_file()
    assert any(s.startswith("tests:") and "no CUDA device" in s for s in res["skipped"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bundle"] == "ok"


@pytest.mark.slow
def test_whole_smoke_check_with_the_served_part(tmp_path, monkeypatch, capsys):
    """The whole --smoke check, served part included (minutes on 2 busy cores: ``dartree serve`` starts a
    supervisor, gateway, verifier and drafter process): 8 concurrent streams equal to ``ar`` on the same
    server, over the CPU transport; every process it started is gone afterwards."""
    res = _smoke_with_bundle(tmp_path, monkeypatch, "--time-limit", "1200")  # the server starts in 1-2 min here
    served = res["served"]
    assert served["status"] == "ok" and served["mps"]["status"] == "not available"
    (run,) = served["runs"]
    assert run["status"] == "ok" and run["transport"] == "frames" and run["mps"] is False
    assert {"dartree-gateway", "dartree-verifie", "dartree-drafter"} <= set(run["processes"])  # comm: 15 chars
    assert run["requests"] == run["equal"] == 8 and run["mismatches"] == []
    assert run["ar"]["tokens"] == run["dartree-pruned"]["tokens"] == 8 * run["max_tokens"]  # ignore_eos
    assert run["ready_s"] > 0 and run["dartree-pruned"]["tokens_per_s"] > 0
    assert not [p for p in run["pids"] if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert any(s.startswith("mps: not available") for s in res["skipped"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["served"] == "ok"


def test_bad_bundle_and_old_versions_are_one_line(tmp_path, monkeypatch, capsys):
    assert gpu_check.main(["--smoke", "--out", str(tmp_path / "x"), "--bundle", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert gpu_check.main(["--smoke", "--out", str(tmp_path / "x"), "--bundle", str(tmp_path / "empty")]) == 2
    assert "no wheel" in capsys.readouterr().err
    monkeypatch.setitem(gpu_check.MIN_VERSIONS, "torch", "99.0")
    assert gpu_check.main(["--smoke", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "older than the 99.0" in err and len(err.splitlines()) == 1


def test_download_plan_pins_the_tested_versions_for_cp312_manylinux():
    reqs = gpu_bundle.pinned_requirements()
    assert len(reqs) == len(gpu_bundle.BUNDLE)
    for req in reqs:  # every bundled distribution at the version installed (and tested) here
        name, _, version = req.partition("==")
        assert version == metadata.version(name), req
    cmd = gpu_bundle.pip_command(Path("/o"), reqs)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert "manylinux2014_x86_64" in cmd and cmd[-len(reqs):] == reqs


def test_prune_drops_what_the_image_brings_and_the_size_is_capped(tmp_path):
    for name in ("numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl", "PyYAML-6.0-cp312-cp312-x.whl",
                 "fastapi-0.1-py3-none-any.whl", "pydantic_core-2.5-cp312-cp312-x.whl"):
        (tmp_path / name).write_bytes(b"x" * 10)
    kept = gpu_bundle.prune(tmp_path)
    assert [w.name for w in kept] == ["fastapi-0.1-py3-none-any.whl", "pydantic_core-2.5-cp312-cp312-x.whl"]
    manifest = gpu_bundle.write_manifest(tmp_path, kept, ["fastapi==0.1"])
    assert manifest["total_bytes"] == 20 and json.loads((tmp_path / "bundle.json").read_text()) == manifest
    with open(tmp_path / "big-1-py3-none-any.whl", "wb") as f:
        f.truncate(gpu_bundle.MAX_BYTES)  # sparse: 60 MiB on paper, nothing on disk
    with pytest.raises(ValueError, match="over 60 MiB"):
        gpu_bundle.write_manifest(tmp_path, gpu_bundle.prune(tmp_path), [])
