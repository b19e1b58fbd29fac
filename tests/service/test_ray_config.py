"""``dartree serve-ray`` settings without Ray: flags, app args, deployment options, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.ray_config import ScaleConfig, config_from_args
from services.ray_unit import REPO, UnitSpec, check_unit_flags


def test_deployment_options_fixed_and_autoscaling():
    fixed = ScaleConfig(replicas=3, num_cpus=2, num_gpus=1).deployment_options(unit_max_running=6, drain_timeout_s=30)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 6  # = the unit's --max-running
    assert fixed["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert fixed["graceful_shutdown_timeout_s"] == 60
    auto = ScaleConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=3).deployment_options(8, 30)
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["min_replicas"] == 1 and auto["autoscaling_config"]["max_replicas"] == 4
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 3


def test_app_args_parse_and_refuse_typos():
    cfg = config_from_args({"replicas": "2", "num_gpus": 1, "unit_flags": "--drafter none --max-running 4",
                            "unit_host": "auto"})
    assert cfg.scale.replicas == 2 and cfg.scale.num_gpus == 1.0
    assert cfg.unit.flags == ("--drafter", "none", "--max-running", "4") and cfg.unit.host == "auto"
    with pytest.raises(ValueError, match="unknown app argument.*max_replica\\b"):
        config_from_args({"max_replica": 2})
    with pytest.raises(ValueError, match="bad app argument"):
        config_from_args({"replicas": "two"})
    with pytest.raises(ValueError, match="--min-replicas <= --max-replicas"):
        config_from_args({"min_replicas": 3, "max_replicas": 2})


@pytest.mark.parametrize("flags,msg", [(["--port", "9000"], "--port is set by each replica"),
                                       (["--metrics-host=0.0.0.0"], "--metrics-host is set by each replica"),
                                       (["--max-runing", "3"], "unknown dartree serve flag"),
                                       (["--max-running", "x"], "bad unit flag")])
def test_unit_flags_are_checked(flags, msg):
    with pytest.raises(ValueError, match=msg):
        check_unit_flags(flags)
    with pytest.raises(ValueError, match=msg):
        UnitSpec(tuple(flags))


@pytest.mark.parametrize("argv,msg", [(["--replicas", "0"], "--replicas must be >= 1"),
                                      (["--", "--port", "1"], "--port is set by each replica"),
                                      (["--http-port", "70000"], "--http-port must be in 1..65535")])
def test_cli_bad_input_is_one_line(argv, msg):
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve-ray", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"dartree: error: {r.stderr.strip()[len('dartree: error: '):]}"]
    assert msg in r.stderr
