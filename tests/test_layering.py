"""Import layering (style.md R16): the gateway never imports torch; protocol modules stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN_IN_GATEWAY = ("torch", "transformers", "services.tree", "services.drafter", "services.verifier")


def _imported_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_gateway_imports_no_torch():
    mods = _imported_after("import gateway.app, gateway.engine_client, gateway.text, gateway.schemas, "
                           "gateway.requests, gateway.handlers, gateway.server")
    bad = sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_GATEWAY))
    assert not bad, f"gateway pulled in {bad}"


@pytest.mark.parametrize("module", ["services.protocol", "services.wire", "services.metrics", "services.ipc_pool",
                                    "services.runtime",
                                    "services.serve", "services.verifier.worker", "services.drafter.worker",
                                    "services.verifier.remote_drafter"])
def test_service_plumbing_is_torch_free_at_import(module):
    assert "torch" not in _imported_after(f"import {module}")
