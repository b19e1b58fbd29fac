"""The ``dartree`` command line: help texts, and ``dartree generate``'s output on the tiny models."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys

import pytest

from services.cli import build_parser, command_parser
from services.testing import REPO

from .tiny import make_tiny_models

ENV_KEYS = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _sub(name: str):
    return command_parser(build_parser(), name)


_SUFFIX = re.compile(r"\s*\(env DARTREE_\w+; default: .*\)$", re.S)


@pytest.mark.parametrize("command", ["generate", "train-drafter", "serve", "gateway", "verifier", "drafter",
                                     "serve-ray"])
def test_every_flag_has_a_help_text(command):
    """Every flag says what it does: at least three words besides the env variable and the default."""
    flags = [a for a in _sub(command)._actions if a.option_strings and a.dest != "help"]
    vague = [a.option_strings[0] for a in flags if len(_SUFFIX.sub("", a.help or "").split()) < 3]
    assert flags and not vague


def test_serve_help_is_grouped_by_concern_with_the_docstrings_words():
    parser = _sub("serve")
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    for title in ("Gateway", "Verifier: scheduling", "Verifier: speculation", "Verifier: tree defaults",
                  "Start, restart and drain", "Observability"):
        assert groups.get(title), title
    assert "spec_policy" in groups["Verifier: speculation"] and "max_running" in groups["Verifier: scheduling"]
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["max_running"].startswith("requests decoded concurrently, each in its own KV slot")
    assert "queued" not in helps["max_running"]  # "max_running: ...; max_waiting: ..." is split at the field name
    assert helps["max_restarts"].endswith("(env DARTREE_MAX_RESTARTS; default: 5)")
    assert "``" not in parser.format_help()


def test_field_docs_reads_shared_and_chained_attribute_entries():
    from dataclasses import dataclass

    from services.config_cli import field_docs

    @dataclass
    class Toy:
        """Toy.

        Attributes:
            host, port: where it
                listens.
            a: first; b: second ``code``.
            c: uses a: colon; d is not a field.
        """

        host: str = ""
        port: int = 0
        a: int = 0
        b: int = 0
        c: int = 0

    assert field_docs(Toy) == {"host": "where it listens", "port": "where it listens", "a": "first",
                               "b": "second code", "c": "uses a: colon; d is not a field"}


def test_help_texts_carry_no_cross_reference_markup():
    """``--help`` is read by users: docstring roles (``:func:`services.x.name```) read as the name."""
    from dataclasses import dataclass

    from services.config_cli import field_docs

    @dataclass
    class Toy:
        """Toy.

        Attributes:
            a: forked from one forkserver (:func:`services.runtime.worker_context`), a
                :class:`~services.x.Thing` each.
        """

        a: int = 0

    assert field_docs(Toy) == {"a": "forked from one forkserver (worker_context), a Thing each"}
    text = _sub("serve").format_help()
    assert not any(role in text for role in (":func:", ":class:", ":meth:", ":mod:", ":data:")), text


def test_spec_names_come_from_one_place():
    from services.spec import DEFAULT_METHOD, DEFAULT_POLICY, METHODS, POLICIES

    gen = {a.dest: a for a in _sub("generate")._actions}
    serve = {a.dest: a for a in _sub("serve")._actions}
    assert tuple(gen["method"].choices) == METHODS == tuple(serve["default_method"].choices)
    assert tuple(gen["spec_policy"].choices) == POLICIES == tuple(serve["spec_policy"].choices)
    assert gen["method"].default == DEFAULT_METHOD == serve["default_method"].default
    assert gen["spec_policy"].default == DEFAULT_POLICY == serve["spec_policy"].default


def test_bench_device_help_names_no_internal_function():
    pytest.importorskip("benchmarks.bench")
    device = next(a for a in _sub("bench")._actions if a.dest == "device")
    assert "build_inprocess" not in device.help and "cpu" in device.help


@pytest.mark.parametrize("as_json", [False, True])
def test_generate_ends_with_a_newline_and_names_the_drafter_once(tmp_path, as_json):
    import os

    target_dir, drafter_dir = make_tiny_models(tmp_path)
    cmd = [sys.executable, "-m", "services.cli", "generate", "hi", "--max-tokens", "4", "--target", str(target_dir),
           "--drafter", str(drafter_dir), *(["--json"] if as_json else [])]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **ENV_KEYS})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.endswith("\n")
    if as_json:
        assert json.loads(r.stdout)["drafter"] == str(drafter_dir)


def test_generate_with_a_drafter_dir_without_config_is_a_one_line_error(tmp_path):
    import os

    r = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--drafter", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **ENV_KEYS})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"dartree: error: drafter directory {str(tmp_path)!r} has no config.json"


def test_generate_with_a_method_the_drafter_does_not_serve_prints_no_text(tmp_path, capsys):
    """The method is checked against the drafter's config.json before any model loads: nothing on
    stdout, no model-loading progress on stderr, one error line naming what the drafter serves (the
    prefill's token used to be printed first, then the weights' loading bars)."""
    import os

    target_dir, drafter_dir = make_tiny_models(tmp_path)
    r = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--max-tokens", "4", "--method",
                        "eagle3", "--target", str(target_dir), "--drafter", str(drafter_dir)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **ENV_KEYS})
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("dartree: error: method 'eagle3' is not served by this drafter") and "dartree-pruned" in last
    from services.cli import main  # before the target is even looked for

    capsys.readouterr()
    assert main(["generate", "hi", "--method", "eagle3", "--target", str(tmp_path / "none"),
                 "--drafter", str(drafter_dir)]) == 2
    assert "method 'eagle3' is not served by this drafter" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_compile_reports_its_warm_up(tmp_path):
    """``--compile``: the warm-up time is printed (stderr) and in the --json result."""
    import os

    target_dir, drafter_dir = make_tiny_models(tmp_path)
    base = [sys.executable, "-m", "services.cli", "generate", "hi", "--max-tokens", "4", "--compile", "--target",
            str(target_dir), "--drafter", str(drafter_dir)]
    env = {**os.environ, **ENV_KEYS}
    r = subprocess.run(base + ["--json"], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["compile_warm_up_s"] > 0
    r = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "[dartree] compiled steps ready in " in r.stderr


@pytest.mark.parametrize("argv, prog, msg", [
    (["generate", "hi", "--method", "nope"], "dartree generate", "invalid choice: 'nope'"),
    (["generate", "hi", "--bogus-flag"], "dartree generate", "unrecognized arguments: --bogus-flag"),
    (["generate"], "dartree generate", "required: prompt"),
    (["nope"], "dartree", "invalid choice: 'nope'"),
    (["--bogus"], "dartree", "unrecognized arguments: --bogus; the command comes first"),
    (["generate", "hi", "--seed", str(2**70)], "dartree generate", "outside [-2**63, 2**63)"),
    (["generate", "hi", "--seed", "x1"], "dartree generate", "invalid int value: 'x1'"),
    (["bench", "--prompts-per-dataset", "-1"], "dartree bench", "must be >= 1, got -1"),
    (["bench", "--max-new-tokens", "0"], "dartree bench", "must be >= 1, got 0"),
])
def test_argument_errors_are_one_line_naming_the_subcommand(capsys, argv, prog, msg):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and msg in lines[0], lines
    assert lines[0].endswith(f"(see {prog} --help)")


@pytest.mark.parametrize("flags, msg", [(["--budget", "0"], "--budget must be in [1, "),
                                        (["--depth-bonus", "1"], "--depth-bonus must be a finite number <= 0"),
                                        (["--width", "0"], "--width must be in [1, ")])
def test_generate_knob_errors_name_the_flags(capsys, flags, msg):
    """A bad tree knob is refused before any model loads, in the CLI's own words (not the HTTP
    request's ``speculative.budget``)."""
    from services.cli import main

    assert main(["generate", "hi", "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "speculative." not in err[0], err


def test_round_tokens_counts_the_dropped_terminator():
    """τ of ``generate``: an ``ar`` round ending on EOS produced one token even though the engine
    drops the EOS from ``token_ids`` (``ar`` showed τ 0.92 before)."""
    from services.generate import round_tokens
    from services.verifier.engine import RoundOutput

    assert round_tokens(RoundOutput([], "stop")) == 1
    assert round_tokens(RoundOutput([5, 6], "stop")) == 3
    assert round_tokens(RoundOutput([5, 6], "length")) == 2
    assert round_tokens(RoundOutput([5, 6, 7], None)) == 3


def test_generate_refusal_prints_only_the_error_line(tmp_path):
    """A request the engine refuses (prompt + max_tokens past the context) prints its one error line
    and nothing else: no "[dartree] drafter" banner before it, and no set-up warning either (on a
    busy CPU the step cost sweep warns that it fell back to the rule-based curve: held, then dropped)."""
    import os

    target_dir, drafter_dir = make_tiny_models(tmp_path)
    r = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--max-tokens", "100000000",
                        "--target", str(target_dir), "--drafter", str(drafter_dir)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, **ENV_KEYS})
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dartree: error: ") and "context" in lines[0], lines


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("error, shown", [(None, ["load: slow", "sweep: busy"]), (ValueError, []),
                                          (RuntimeError, []), (KeyError, ["load: slow", "sweep: busy"])])
def test_generate_holds_the_set_up_warnings_until_the_request_is_accepted(error, shown):
    """The set-up's warnings (a busy CPU during the cost sweep) reach the handlers only once the
    request is accepted, in order; a one-line refusal drops them (its error line prints alone); a
    bug's exception releases them before its traceback."""
    from services.generate import HeldLogs

    root, collect = logging.getLogger(), _Collect()
    root.addHandler(collect)
    try:
        with contextlib.suppress(ValueError, RuntimeError, KeyError):
            with HeldLogs() as held:
                logging.getLogger("dartree.test").warning("load: %s", "slow")
                logging.getLogger("dartree.test.sweep").warning("sweep: busy")
                assert collect.messages == [] and len(held.records) == 2  # held, nobody saw them yet
                if error is not None:
                    raise error("refused")
                held.pass_on()  # the request was accepted
                assert collect.messages == ["load: slow", "sweep: busy"]
                logging.getLogger("dartree.test").warning("decoding")  # after: straight through
        assert collect in root.handlers and held not in root.handlers
        assert collect.messages == shown + (["decoding"] if error is None else [])
    finally:
        root.removeHandler(collect)


def test_log_level_is_case_insensitive_and_listed_once(monkeypatch):
    parser = _sub("serve")
    action = next(a for a in parser._actions if a.dest == "log_level")
    assert list(action.choices) == ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    assert parser.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    monkeypatch.setenv("DARTREE_LOG_LEVEL", "warning")
    assert _sub("serve").parse_args([]).log_level == "WARNING"


def test_a_refused_setting_names_its_flag():
    """A value the configuration refuses is named as its flag, not as the field behind it."""
    from services.config_cli import config_from_args
    from services.verifier.worker import VerifierWorkerConfig

    args = _sub("serve").parse_args(["--max-running", "0"])
    with pytest.raises(ValueError, match=r"^--max-running must be >= 1"):
        config_from_args(VerifierWorkerConfig, args)


@pytest.mark.parametrize("flags, msg", [
    (["--default-temperature", "-1"], r"^--default-temperature must be a finite number >= 0"),
    (["--default-temperature", "nan"], r"^--default-temperature must be a finite number >= 0"),
    (["--max-request-budget", "0"], r"^--max-request-budget must be in \[1, 1024\]"),
    (["--device", "tpu"], r"device 'tpu' is not supported \(choose cpu, cuda or cuda:N\)"),
])
def test_serve_settings_refused_at_start(flags, msg):
    """Settings that would break every request later (a negative default temperature, no tree a
    request may ask for, a device torch has no workers for) are refused when the config is built."""
    from gateway.config import GatewayConfig
    from services.config_cli import config_from_args
    from services.verifier.worker import VerifierWorkerConfig

    args = _sub("serve").parse_args(flags)
    with pytest.raises(ValueError, match=msg):
        config_from_args(GatewayConfig, args)
        config_from_args(VerifierWorkerConfig, args)


def test_help_names_no_internal_identifiers():
    """``serve --help`` speaks in flags and words, not in the code's function or class names."""
    text = " ".join(a.help or "" for a in _sub("serve")._actions)
    for name in ("worker_context", "resolve_drafter_placement", "DrafterHeartbeat", "request_tree_limits",
                 "metrics_auth)", "health_interval_s"):
        assert name not in text, name


def test_an_unusable_host_is_named_as_the_host_flag():
    from services.serve_plan import check_listen

    with pytest.raises(ValueError, match=r"^--host: '999\.1\.1\.1' is not a usable address"):
        check_listen("999.1.1.1", 8399, "--port")
    with pytest.raises(ValueError, match=r"^--metrics-host: "):
        check_listen("999.1.1.1", 8399, "--verifier-metrics-port", "--metrics-host")


def test_worker_exit_text_names_the_signal_that_stopped_it():
    """The supervisor's log line for a worker a signal ended names the signal, not a bare -N."""
    from services.serve import exit_text

    assert exit_text(2) == "exited with code 2"
    assert exit_text(0) == "exited with code 0"
    assert exit_text(-10) == "was stopped by SIGUSR1 (code -10)"
    assert exit_text(-9) == "was stopped by SIGKILL (code -9)"
    assert exit_text(-200) == "was stopped by signal 200 (code -200)"
    assert exit_text(None) == "has not exited"


def test_the_engine_limits_are_flags_of_the_verifier_config_held_once(monkeypatch):
    """``VerifierWorkerConfig`` holds the engine's limits as its ``engine`` sub-object (no field of
    its own repeats one); the command line flattens it: ``--max-running`` etc. set the sub-object,
    from the flag or ``DARTREE_<FIELD>``; the worker's defaults
    (context 0 = the target's, compile unset = auto) are its defaults."""
    from dataclasses import fields

    from services.config_cli import config_from_args
    from services.verifier.config import EngineConfig, VerifierWorkerConfig

    assert not {f.name for f in fields(VerifierWorkerConfig)} & {f.name for f in fields(EngineConfig)}
    monkeypatch.setenv("DARTREE_KV_BUCKET", "32")
    parser = _sub("serve")
    dests = {a.dest for a in parser._actions}
    assert {"max_running", "max_context", "prefill_chunk", "max_step_tokens", "kv_bucket", "overlap",
            "compile", "prefix_cache", "cuda_graphs"} <= dests and "engine" not in dests
    cfg = config_from_args(VerifierWorkerConfig, parser.parse_args(["--max-running", "3", "--overlap",
                                                                    "--no-prefix-cache", "--max-context", "512"]))
    assert cfg.engine == EngineConfig(max_context=512, max_running=3, kv_bucket=32, overlap=True, compile=None,
                                      prefix_cache=False)
    monkeypatch.delenv("DARTREE_KV_BUCKET")
    assert config_from_args(VerifierWorkerConfig, _sub("serve").parse_args([])).engine == VerifierWorkerConfig().engine
    assert VerifierWorkerConfig().engine.compile is None and VerifierWorkerConfig().engine.max_context == 0
    with pytest.raises(ValueError, match=r"^--max-context must be >= 0"):
        config_from_args(VerifierWorkerConfig, _sub("serve").parse_args(["--max-context", "-1"]))
