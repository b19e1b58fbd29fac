"""Config dataclasses <-> command line: one ``--field-name`` flag per field, grouped by concern.

A field that holds a config dataclass of its own (the verifier's ``engine``:
:class:`services.verifier.config.EngineConfig`) is flattened: each of its fields is a flag of its own,
its default the container's default's value, its help that class's docstring entry; a field with
``metadata={"flag": False}`` has no flag.

Every flag is also read from ``DARTREE_<FIELD>`` (``DARTREE_MAX_RUNNING=4``); a flag beats the
variable, and a bad variable is an argparse error like a bad flag (exit 2). Each flag's help is its
field's entry in the ``Attributes:`` section of the dataclass docstring, followed by the variable's
name and the default. Torch-free: ``python -m gateway`` builds its flags here.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import types
import typing
from dataclasses import MISSING, fields, is_dataclass

from services.runtime import DRAFTER_PLACEMENTS, DTYPES, START_METHODS, WEIGHT_CHOICES
from services.spec import METHODS, POLICIES


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _parser_type(tp):
    """argparse ``type`` for a field annotation (``int | None`` accepts "none")."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = next(a for a in args if a is not type(None))
        return lambda s: None if s.lower() in ("none", "") else inner(s)
    return tp


class _EnvValue(str):
    """A flag's default read from ``DARTREE_<FIELD>``: argparse converts string defaults with the flag's
    ``type`` only when the flag is not given, so a bad variable is an argparse error (exit 2) and a
    flag overrides it."""

    var: str


def _env_var(name: str) -> str:
    """The environment variable that gives field ``name``'s default: ``DARTREE_<NAME>``."""
    return f"DARTREE_{name.upper()}"


def _env_default(name: str, default):
    raw = os.environ.get(_env_var(name))
    if raw is None:
        return default
    value = _EnvValue(raw)
    value.var = _env_var(name)
    return value


class _StoreGiven(argparse.Action):
    """``store`` that also records the flag as given on the command line (``args._given``), so that a
    check can tell ``--flag VALUE`` from the same value arriving as the default (see :func:`given_by`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace._given = getattr(namespace, "_given", frozenset()) | {self.dest}


def given_by(args: argparse.Namespace, name: str) -> str | None:
    """Where field ``name``'s value came from: ``"--name"`` (the flag), ``"DARTREE_NAME"`` (the env
    var) or None (the dataclass default)."""
    if name in getattr(args, "_given", ()):
        return "--" + name.replace("_", "-")
    return _env_var(name) if _env_var(name) in os.environ else None


def _checked(convert, type_name: str, choices=None):
    """An argparse ``type``: ``convert`` with a one-line error that names the env var a bad default
    came from. ``choices``: the allowed values, checked here for an env var's value (argparse checks
    ``choices`` only for values given on the command line, never for a default)."""
    def parse(s: str):
        try:
            value = convert(s)
        except (ValueError, TypeError):
            where = f"{s.var}={str(s)!r}" if isinstance(s, _EnvValue) else repr(s)
            raise argparse.ArgumentTypeError(f"{where} is not a valid {type_name}") from None
        if choices is not None and isinstance(s, _EnvValue) and value not in choices:
            raise argparse.ArgumentTypeError(f"{s.var}={str(s)!r} is not one of: {', '.join(map(str, choices))}")
        return value

    parse.__name__ = type_name
    return parse


def _to_bool(s: str) -> bool:
    if s.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(s)
    return s.lower() in ("1", "true", "yes")


def _to_auto_bool(s: str) -> bool | None:
    """A ``bool | None`` field's environment value: a boolean, or ``auto`` (None)."""
    return None if s.lower() == "auto" else _to_bool(s)


# Fields whose values come from a fixed set (argparse ``choices``: a typo is a one-line error at start).
CHOICES = {"dtype": DTYPES, "weights": WEIGHT_CHOICES, "default_method": METHODS, "spec_policy": POLICIES,
           "json_whitespace": ("flexible", "compact"), "ngram_draft": ("on", "off"),
           "start_method": START_METHODS, "drafter_placement": DRAFTER_PLACEMENTS,
           "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}
UPPER_CASE = frozenset({"log_level"})  # fields whose values are read case-insensitively (stored upper-case)


# Help of fields that several processes share (one flag sets them all) or that no docstring names; the
# rest come from the ``Attributes:`` entries of the config dataclasses' docstrings.
FIELD_HELP = {"drafter": "drafter checkpoint: a local directory or a hub id, org/name ('' = the shipped drafter "
                         "when it fits the target; in 'serve', 'none' in any case = no drafter: plain decoding, "
                         "method 'ar', only)",
              "default_method": "the method of requests that name none; without a drafter only 'ar'",
              "target": "the target model: the default name, a local HF directory or a hub id, org/name "
                        "(docs/models.md: served architectures, offline use)",
              "device": "where the models run: cpu, cuda, cuda:N",
              "dtype": "precision of the models' activations (a concrete --weights format overrides it)",
              "drain_timeout_s": "on SIGTERM, how long in-flight requests may finish (new ones get 503); each "
                                 "process drains with this budget, the gateway first",
              "log_level": "python logging level name",
              "compile": "run the target's steps and the drafter's block forward through torch.compile (a "
                         "warm-up at start: about a minute the first time on a small CPU, seconds once its kernels "
                         "are cached); unset (auto): the target's steps only, for a q4 llama target on CPU; "
                         "--no-compile: eager steps",
              "cuda_graphs": "on a CUDA device, capture the verify step's CUDA graphs at start (a grid of rows x KV "
                             "lengths; steps past it run eagerly) and replay them; unset (auto): on for a CUDA "
                             "device; --no-cuda-graphs: eager steps",
              "packed_gemm": "on a float32 CPU, pre-pack the GEMM weights for the rows of a round (same numerics, "
                             "faster rounds; more RAM)",
              "cuda_ipc": "share feature tensors between the workers through a CUDA-IPC pool (CUDA devices only)",
              "ipc_slots": "slots of the CUDA-IPC pool", "ipc_slot_bytes": "bytes of one CUDA-IPC pool slot",
              "metrics_host": "where the workers' Prometheus endpoints listen",
              "verifier_metrics_port": "port of the verifier's Prometheus endpoint (0 = off)",
              "drafter_metrics_port": "port of the drafter's Prometheus endpoint (0 = off)",
              "max_waiting": "requests queued beyond --max-running (429 after)",
              "budget": "default tree budget B, draft nodes per tree (unset: 8 on CPU, 64 on CUDA)",
              "width": "default tree width W, children kept per node (unset: 12)",
              "depth_bonus": "default depth bonus beta <= 0 of the pruned DARTree score (unset: -0.2)",
              "candidates": "default candidate pool K per depth (unset: 64)"}

# ``--help`` groups, one per concern, in this order; a field named in none goes to its class's group.
HELP_GROUPS = {
    "Model and device": ("target", "drafter", "device", "dtype", "weights", "compile", "packed_gemm"),
    "Gateway": (),
    "Verifier: scheduling": ("max_running", "max_waiting", "max_context", "prefill_chunk", "max_step_tokens",
                             "kv_bucket", "overlap", "prefix_cache", "prefix_cache_mib",
                             "prefix_cache_ram_mib"),
    "Verifier: speculation": ("default_method", "spec_policy", "spec_max_budget", "cost_sweep", "tree_schedule"),
    "Verifier: tree defaults": ("budget", "width", "depth_bonus", "candidates"),
    "Links between the processes": ("verifier_endpoint", "drafter_endpoint", "draft_timeout_s", "drafter_wait_s",
                                    "health_interval_s", "cuda_ipc", "ipc_slots", "ipc_slot_bytes",
                                    "max_tensor_bytes"),
    "Start, restart and drain": ("drain_timeout_s", "startup_timeout_s", "max_restarts", "restart_window_s"),
    "Observability": ("log_level", "metrics_host", "verifier_metrics_port", "drafter_metrics_port"),
}
CLASS_GROUP = {"GatewayConfig": "Gateway", "VerifierWorkerConfig": "Verifier: scheduling",
               "DrafterWorkerConfig": "Drafter", "SupervisorConfig": "Start, restart and drain"}
_GROUP_OF = {name: title for title, names in HELP_GROUPS.items() for name in names}
_ENTRY_RE = re.compile(r"^(\w+(?:,\s*\w+)*):\s+(.*)$")  # "name: text" or "a, b: text"
_INNER_RE = re.compile(r";\s+(\w+(?:,\s*\w+)*):\s+")  # "...; other_field: text" inside an entry
_ROLE_RE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")  # ":func:`~a.b.name`" -> "name" in --help


def field_docs(cls) -> dict[str, str]:
    """Each field's text in the ``Attributes:`` section of ``cls``'s docstring (``a, b: text`` gives
    both the text; ``a: text; b: more`` splits at a field name), code quotes and cross-reference
    markup removed (``:func:`services.x.name``` reads ``name``)."""
    names = {f.name for f in fields(cls)}
    entries: list[list] = []
    section = False
    for line in (inspect.getdoc(cls) or "").splitlines():
        if not line.startswith(" "):
            section = line.strip() == "Attributes:"
            continue
        m = _ENTRY_RE.match(line.strip())
        if section and m and line.startswith("    ") and not line.startswith("     ") and \
                set(re.split(r",\s*", m[1])) <= names:
            entries.append([m[1], m[2]])
        elif section and entries:
            entries[-1][1] += " " + line.strip()
    docs: dict[str, str] = {}
    for head, text in entries:
        for part in _split_entry(head, text, names):
            for name in re.split(r",\s*", part[0]):
                docs[name] = _ROLE_RE.sub(r"\1", part[1].replace("``", "")).strip().rstrip(".;")
    return docs


def _split_entry(head: str, text: str, names: set[str]) -> list[tuple[str, str]]:
    """``[(head, text)]`` with ``text`` cut at each ``; other_field:`` that names fields of the class."""
    parts, start = [], 0
    for m in _INNER_RE.finditer(text):
        if set(re.split(r",\s*", m[1])) <= names:
            parts.append((head, text[start:m.start()]))
            head, start = m[1], m.end()
    return parts + [(head, text[start:])]


def _help(name: str, doc: str, default) -> str:
    """A flag's help: what it means, then where its default comes from (``%`` escaped for argparse)."""
    shown = str(default) if isinstance(default, _EnvValue) else repr(default)
    meaning = FIELD_HELP.get(name) or doc
    return f"{meaning} (env {_env_var(name)}; default: {shown})".replace("%", "%%")


def _is_config(tp) -> bool:
    """Whether annotation ``tp`` is a config dataclass (a field of that type is flattened)."""
    return isinstance(tp, type) and is_dataclass(tp)


def _default(f, container_default=None):
    """Field ``f``'s default: its value in ``container_default`` (the enclosing field's default), else
    its own default (or factory)."""
    if container_default is not None:
        return getattr(container_default, f.name)
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def flag_fields(cls, container_default=None):
    """``(field, type, doc, default)`` of each flag of ``cls``, sub-configs flattened (module docstring)."""
    docs, hints = field_docs(cls), _hints(cls)
    for f in fields(cls):
        if not f.metadata.get("flag", True):
            continue
        if _is_config(hints[f.name]):
            yield from flag_fields(hints[f.name], _default(f, container_default))
        else:
            yield f, hints[f.name], docs.get(f.name, ""), _default(f, container_default)


def add_config_args(parser: argparse.ArgumentParser, *classes) -> None:
    """One ``--field-name`` flag per dataclass field (shared names once; sub-configs flattened), grouped
    by concern (:data:`HELP_GROUPS`), each with its docstring's meaning; env vars give defaults."""
    placed: dict[str, list] = {title: [] for title in HELP_GROUPS}
    seen: set[str] = set()
    for cls in classes:
        for f, tp, doc, default in flag_fields(cls):
            if f.name not in seen:
                seen.add(f.name)
                title = _GROUP_OF.get(f.name) or CLASS_GROUP.get(cls.__name__, cls.__name__)
                placed.setdefault(title, []).append((f, tp, doc, default))
    for title, items in placed.items():
        if items:
            group = parser.add_argument_group(title)
            for f, tp, doc, default in items:
                _add_field(group, f, tp, doc, default)


def _add_field(group, f, tp, doc: str, default) -> None:
    default = _env_default(f.name, default)
    flag, help_text = "--" + f.name.replace("_", "-"), _help(f.name, doc, default)
    if tp is bool or tp == (bool | None):  # bool | None: unset (None) means "auto"
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           type=_checked(_to_bool if tp is bool else _to_auto_bool,
                                         "boolean" if tp is bool else "boolean or auto"), help=help_text)
    else:
        name = getattr(typing.get_args(tp)[0] if typing.get_args(tp) else tp, "__name__", str(tp))
        convert = (lambda v: str(v).upper()) if f.name in UPPER_CASE else _parser_type(tp)
        group.add_argument(flag, dest=f.name, type=_checked(convert, name, CHOICES.get(f.name)),
                           default=default,
                           choices=CHOICES.get(f.name), help=help_text, action=_StoreGiven)


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` built from the parsed flags it has (plus ``overrides``, which may name a sub-config's
    fields too); a sub-config field is built from its own fields' flags, the rest from the field's default.

    Raises:
        ValueError: the class refused a value; a field name written in the message as an identifier
            (``max_running must be >= 1``) is given as its flag (``--max-running must be >= 1``).
    """
    names = [f.name for f, *_ in flag_fields(cls) if f.name not in overrides]
    try:
        return _build(cls, args, overrides)
    except ValueError as e:
        raise ValueError(_as_flags(str(e), names)) from None


def _build(cls, args: argparse.Namespace, overrides: dict, container_default=None):
    """``cls`` from ``args`` and ``overrides`` (sub-configs first, so that their refusals come first)."""
    hints, values = _hints(cls), {}
    for f in fields(cls):
        if _is_config(hints[f.name]) and f.name not in overrides:
            values[f.name] = _build(hints[f.name], args, overrides, _default(f, container_default))
        elif f.name in overrides:
            values[f.name] = overrides[f.name]
        elif hasattr(args, f.name) and f.metadata.get("flag", True):
            values[f.name] = getattr(args, f.name)
        elif container_default is not None:
            values[f.name] = getattr(container_default, f.name)
    return cls(**values)


def _as_flags(message: str, names: list[str]) -> str:
    """``message`` with each of ``names`` that has an underscore (an identifier, not an English word)
    written as its flag."""
    for name in sorted((n for n in names if "_" in n), key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){re.escape(name)}\b", "--" + name.replace("_", "-"), message)
    return message
