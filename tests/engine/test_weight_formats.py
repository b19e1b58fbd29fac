"""The weight-format registry (services/weight_formats.py): every consumer reads a format from it, so
a format registered here (one entry plus its module) is a ``--weights`` choice, loads through its
``prepare`` hook, ranks in ``auto``'s rule, sizes the fit check and sets the compile default."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from services import startup, weight_choice, weight_formats as WF, weights as W
from services.testing import tiny_gguf_target_dir


def test_the_registry_holds_the_served_formats_in_auto_rule_order():
    assert WF.names() == ("float32", "bfloat16", "q4")
    from services.runtime import WEIGHT_CHOICES, WEIGHT_FORMATS

    assert WEIGHT_FORMATS == WF.names() and WEIGHT_CHOICES == ("auto", *WF.names())
    assert [f.name for f in WF.by_rank(["float32", "bfloat16", "q4"])] == ["q4", "bfloat16", "float32"]
    assert WF.kernels_version() == 6  # the newest format's: the cached choices and sweeps keep their keys
    assert [WF.get(n).act_dtype for n in WF.names()] == ["float32", "bfloat16", "bfloat16"]
    assert [n for n in WF.names() if WF.get(n).compile_default] == ["q4"]
    with pytest.raises(ValueError, match=r"^weights 'q8' is not supported \(choose from float32, bfloat16, q4\)"):
        WF.get("q8")
    with pytest.raises(ValueError, match="already registered"):
        WF.register(WF.WeightFormat("q4", "bfloat16", 0.6, 5, 10, "again"))


def test_q4_availability_comes_from_its_hooks(tmp_path):
    q4 = WF.get("q4")
    assert q4.unavailable("cuda").startswith("weights 'q4' run on CPU only")
    assert "GGUF" in q4.unavailable("cpu", tmp_path)  # no GGUF source in an empty directory
    if W.int4_kernel_available():
        assert q4.available("cpu") and q4.available("cpu", tiny_gguf_target_dir(tmp_path / "t"))
    assert W.q4_unavailable(tmp_path) == q4.unavailable("cpu", tmp_path)


@pytest.fixture
def toy_format(monkeypatch):
    """A format ``toy`` registered for this test only: bfloat16 activations, a ``prepare`` hook that
    marks the model, 1.5 bytes a parameter, the best rank, compiled by default; its hooks live in a
    module of their own, as a real format's would."""
    mod = types.ModuleType("toy_weights")
    mod.prepared = []
    mod.device_unavailable = lambda device: None if device == "cpu" else "toy runs on CPU only"
    mod.target_unavailable = lambda target_dir: None
    mod.prepare = lambda model, target_dir, device: mod.prepared.append((type(model).__name__, device))
    monkeypatch.setitem(sys.modules, "toy_weights", mod)
    fmt = WF.WeightFormat("toy", act_dtype="bfloat16", bytes_per_param=1.5, kernels_version=9, rank=1,
                          reason="the toy reads the fewest bytes", compile_default=True,
                          device_check="toy_weights:device_unavailable",
                          target_check="toy_weights:target_unavailable", prepare="toy_weights:prepare")
    monkeypatch.setitem(WF.FORMATS, "toy", fmt)
    return mod


def test_a_registered_format_is_loaded_ranked_sized_and_compiled_from_its_entry(toy_format, tmp_path, monkeypatch):
    target = tiny_gguf_target_dir(tmp_path / "t")
    assert "toy" in W.available_formats(target) and "toy" not in W.available_formats(target, "cuda")
    assert W.compute_dtype("toy") == torch.bfloat16
    model = W.load_causal_lm(target, "toy")
    assert model.dtype == torch.bfloat16 and toy_format.prepared == [(type(model).__name__, "cpu")]
    assert weight_choice.rule_choice(["float32", "q4", "toy"]) == ("toy", "the toy reads the fewest bytes")
    assert startup.weight_bytes_per_param("toy") == 1.5 and startup.weight_bytes_per_param("float16") == 2.0
    assert WF.kernels_version() == 9
    from services.verifier import runner

    monkeypatch.setattr(runner, "lean_step_enabled", lambda: True)
    monkeypatch.setattr(runner.LeanLlamaStep, "supports", staticmethod(lambda m: True))
    assert runner.auto_compile(SimpleNamespace(device="cpu", weights="toy", model=None))
    assert not runner.auto_compile(SimpleNamespace(device="cpu", weights="bfloat16", model=None))
    with pytest.raises(ValueError, match="toy runs on CPU only"):
        W.choose_weights("toy", target, "cuda")
