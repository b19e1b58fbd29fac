"""The step profile's split of op time by kind (benchmarks.profile_step)."""

from types import SimpleNamespace

import pytest

from benchmarks.profile_step import KINDS, build_args, op_kind, split_profile


def test_op_kinds():
    assert op_kind("aten::_weight_int4pack_mm_for_cpu") == "int4_linears"
    assert op_kind("mkldnn::_linear_pointwise") == "dense_linears"
    assert op_kind("aten::addmm") == "dense_linears"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("aten::bmm") == "attention"
    assert op_kind("aten::mul") == "other_ops"


def test_split_is_per_step_and_the_rest_is_outside_ops():
    ev = [SimpleNamespace(key="aten::_weight_int4pack_mm_for_cpu", self_cpu_time_total=8000.0),
          SimpleNamespace(key="mkldnn::_linear_pointwise", self_cpu_time_total=4000.0),
          SimpleNamespace(key="aten::_scaled_dot_product_flash_attention_for_cpu", self_cpu_time_total=2000.0),
          SimpleNamespace(key="aten::add", self_cpu_time_total=2000.0)]
    ms = split_profile(ev, steps=2, wall_s=0.020)      # 2 steps, 10 ms each
    assert ms["int4_linears"] == pytest.approx(4.0) and ms["dense_linears"] == pytest.approx(2.0)
    assert ms["attention"] == pytest.approx(1.0) and ms["other_ops"] == pytest.approx(1.0)
    assert ms["outside_ops"] == pytest.approx(2.0)
    assert sum(ms[k] for k in KINDS) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        split_profile(ev, steps=0, wall_s=1.0)


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        build_args(["--tokens", "1"])
    assert "--tokens" in capsys.readouterr().err
