"""``make gpu-bundle``: the wheels a bare GPU image lacks, in one folder, and their install there.

Question answered: what must travel with the working tree so that ``python3 -m benchmarks.gpu_check
--bundle DIR`` runs on a machine with no network whose image has Python 3.12, torch, transformers,
triton, safetensors, prometheus-client, msgpack, httpx and uvloop, but not the serving stack?

:func:`download` (on a CPU machine with network to PyPI) runs ``pip download --only-binary=:all:
--python-version 3.12 --platform manylinux*_x86_64 ...`` for :data:`BUNDLE` at the versions pinned in
``requirements*.txt`` (their dependencies resolved by pip), drops the wheels of what the image
brings (:data:`IMAGE_PROVIDES`: torch's and transformers' own dependencies, numpy first among them,
whose ABI must match the image's torch), writes ``bundle.json`` (wheels, bytes) and refuses a
bundle over :data:`MAX_BYTES`. :func:`install` (on the GPU machine, no pip needed) unpacks every
wheel into a scratch target directory; :func:`import_report` then imports :data:`MODULES` and
every top-level module of the bundle and says where each came from; :func:`activate` does both
for ``gpu_check --bundle`` (a fresh scratch target first on ``sys.path`` and on the tests'
``PYTHONPATH``).

Usage: ``make gpu-bundle [BUNDLE=dir]`` or ``python -m benchmarks.gpu_bundle --out DIR``; the last
stdout line is one JSON object. Exit code 0 on success, 1 when pip fails or the bundle is too large.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the served stack, the gpu-marked tests and the check's PNG need beyond the image
BUNDLE = ("fastapi", "uvicorn", "sse-starlette", "pydantic", "pyzmq", "msgspec", "llguidance", "gguf", "psutil",
          "matplotlib", "pytest", "pytest-timeout")
# import names checked after the install (starlette and pydantic-core come as dependencies)
MODULES = ("fastapi", "starlette", "uvicorn", "sse_starlette", "pydantic", "pydantic_core", "zmq", "msgspec",
           "llguidance", "gguf", "psutil", "matplotlib", "pytest")
# distributions the image brings with torch / transformers / httpx: never bundled (numpy's ABI must
# be the one the image's torch was built against)
IMAGE_PROVIDES = frozenset({"numpy", "pyyaml", "tqdm", "requests", "urllib3", "certifi", "charset-normalizer", "idna",
                            "packaging", "filelock", "fsspec", "jinja2", "markupsafe", "huggingface-hub",
                            "safetensors", "tokenizers", "regex", "torch", "transformers", "triton", "sympy",
                            "mpmath", "networkx", "prometheus-client", "msgpack", "httpx", "httpcore", "uvloop"})
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")
PYTHON = "3.12"
MAX_BYTES = 60 * 2**20


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Pydantic_Core`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(names=BUNDLE, files=("requirements.txt", "requirements-dev.txt")) -> list[str]:
    """``name==version`` for each of ``names`` pinned in the repository's requirements files (the
    tested versions), bare ``name`` where none pins it."""
    pins: dict[str, str] = {}
    for f in files:
        for line in (REPO / f).read_text().splitlines():
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
            if m:
                pins[canonical(m.group(1))] = m.group(2)
    return [f"{n}=={pins[canonical(n)]}" if canonical(n) in pins else n for n in names]


def pip_command(out: Path, requirements: list[str]) -> list[str]:
    """The ``pip download`` command line for cp312 manylinux x86_64 binary wheels into ``out``."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", PYTHON,
           "--implementation", "cp", "--abi", "cp" + PYTHON.replace(".", ""), "--abi", "abi3", "--abi", "none",
           "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + requirements


def wheel_distribution(path: Path) -> str:
    """The canonical distribution name of a wheel file (``pydantic_core-2.1-...whl`` -> ``pydantic-core``)."""
    return canonical(path.name.split("-")[0])


def prune(out: Path) -> list[Path]:
    """Delete the wheels of :data:`IMAGE_PROVIDES` from ``out``; returns the wheels kept (sorted)."""
    kept = []
    for whl in sorted(out.glob("*.whl")):
        if wheel_distribution(whl) in IMAGE_PROVIDES:
            whl.unlink()
        else:
            kept.append(whl)
    return kept


def write_manifest(out: Path, wheels: list[Path], requirements: list[str]) -> dict:
    """``bundle.json`` in ``out``: the requirements, every wheel with its bytes, the total.

    Raises:
        ValueError: the wheels weigh more than :data:`MAX_BYTES` (one line).
    """
    sizes = {w.name: w.stat().st_size for w in wheels}
    total = sum(sizes.values())
    manifest = {"python": PYTHON, "platforms": list(PLATFORMS), "requirements": requirements,
                "excluded": sorted(IMAGE_PROVIDES), "wheels": sizes, "total_bytes": total}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1))
    if total > MAX_BYTES:
        raise ValueError(f"the bundle weighs {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return manifest


def download(out: Path) -> dict:
    """Fill ``out`` with the bundle (module docstring); returns the manifest.

    Raises:
        RuntimeError: pip failed (its last lines); ValueError: the bundle is too large.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    requirements = pinned_requirements()
    r = subprocess.run(pip_command(out, requirements), capture_output=True, text=True)
    if r.returncode:
        tail = [ln for ln in (r.stdout + r.stderr).splitlines() if "ERROR" in ln][-2:]
        raise RuntimeError(f"pip download failed: {' / '.join(tail) or r.returncode}")
    return write_manifest(out, prune(out), requirements)


def install(bundle: Path, target: Path) -> list[str]:
    """Unpack every wheel of ``bundle`` into ``target`` (a directory for ``sys.path``), without pip:
    a wheel is a zip of its installed files, with ``<name>.data/purelib`` and ``platlib`` moved to
    the top (other ``.data`` parts, scripts and headers, are not needed to import).

    Returns:
        The wheel file names installed (sorted).
    Raises:
        ValueError: ``bundle`` holds no wheel.
    """
    wheels = sorted(Path(bundle).glob("*.whl"))
    if not wheels:
        raise ValueError(f"no wheel in {bundle} (make gpu-bundle writes them)")
    target.mkdir(parents=True, exist_ok=True)
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            z.extractall(target)
    for data in target.glob("*.data"):
        for part in ("purelib", "platlib"):
            for item in sorted((data / part).glob("*")):
                if item.is_dir():
                    shutil.copytree(item, target / item.name, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, target / item.name)
        shutil.rmtree(data)
    return [w.name for w in wheels]


def top_level_modules(target: Path) -> list[str]:
    """Top-level import names of the wheels unpacked in ``target`` (``top_level.txt`` when a wheel
    ships one, else the package directories and modules its ``RECORD`` lists)."""
    names: set[str] = set()
    for info in target.glob("*.dist-info"):
        top = info / "top_level.txt"
        if top.is_file():
            names |= {n.strip() for n in top.read_text().splitlines() if n.strip()}
            continue
        record = info / "RECORD"
        for line in record.read_text().splitlines() if record.is_file() else ():
            parts = line.split(",")[0].split("/")
            if parts[0].endswith(".data") and len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                parts = parts[2:]  # installed at the top by install()
            if len(parts) == 1 and parts[0].endswith(".py"):
                names.add(parts[0][:-3])  # a top-level module
            elif len(parts) > 1 and not parts[0].endswith((".dist-info", ".data", ".libs")):
                names.add(parts[0])  # a package directory
    return sorted(n for n in names if n.isidentifier() and not n.startswith("_"))


def import_report(target: Path, modules=MODULES) -> dict:
    """Import ``modules`` and the bundle's own top-level modules; per module its version and
    where it came from (``bundle`` = under ``target``, else ``environment``), or the error."""
    report = {}
    for name in dict.fromkeys([*modules, *top_level_modules(target)]):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (reported per module)
            report[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        where = Path(getattr(mod, "__file__", None) or "").resolve()
        report[name] = {"version": str(getattr(mod, "__version__", "") or ""),
                        "from": "bundle" if target.resolve() in where.parents else "environment"}
    return report


def activate(bundle: str) -> dict:
    """Unpack ``bundle``'s wheels into a scratch target, put it first on ``sys.path`` and on the
    ``PYTHONPATH`` of subprocesses (the tests), and import what the check needs
    (:func:`import_report`); ``gpu_check``'s JSON ``bundle`` section.

    Raises:
        ValueError: ``bundle`` holds no wheel.
    """
    target = Path(tempfile.mkdtemp(prefix="dartree-bundle-"))
    wheels = install(Path(bundle), target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    imports = import_report(target, MODULES)
    failed = sorted(m for m, r in imports.items() if "error" in r)
    return {"dir": str(bundle), "target": str(target), "wheels": wheels, "imports": imports,
            "status": "failed" if failed else "ok", "failed_imports": failed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bundle", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the wheels and bundle.json")
    a = p.parse_args(argv)
    try:
        manifest = download(Path(a.out))
    except (RuntimeError, ValueError) as e:
        print(f"gpu_bundle: {e}", file=sys.stderr)
        return 1
    for name, size in manifest["wheels"].items():
        print(f"{size / 2**20:7.2f} MiB  {name}")
    print(json.dumps({"out": a.out, "wheels": len(manifest["wheels"]),
                      "total_mib": round(manifest["total_bytes"] / 2**20, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
