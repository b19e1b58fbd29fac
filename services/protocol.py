"""Every message that crosses a process boundary (gateway <-> verifier <-> drafter), versioned.

Torch-free by design (the gateway imports it). Rules (docs/design.md, "Wire protocol" and "Handshake"):

- Each message is a ``msgspec.Struct`` (``array_like=True, omit_defaults=True, gc=False``) encoded
  as msgpack. Nothing on a socket is ever pickled.
- A ZMQ message is ``[type byte, msgpack body, *tensor frames]`` (a ROUTER socket prepends the peer
  identity). The one-byte :class:`MessageType` tag lets a receiver dispatch, and check size limits,
  before decoding the body.
- Tensors never go into the body: a :class:`TensorMeta` ``(dtype, shape, slot)`` describes each one;
  ``slot = -1`` means "the next side frame" (CPU zero-copy path), ``slot >= 0`` a slot of the
  sender's CUDA-IPC pool, whose :class:`PoolHandle` was exchanged once in the handshake.
- The first message on every link is :class:`Hello` -> :class:`HelloAck`. Both sides compare
  :class:`PeerInfo` with :func:`check_compatible` and refuse to serve a mismatched pair.

Field units: times in seconds, sizes in bytes, ids are token ids unless named ``*_id`` (strings).
Validation (shape of every field, value ranges, sizes) happens in :mod:`services.wire` on decode; a
message that fails it raises :class:`ProtocolError`, which receivers log and drop.
"""

from __future__ import annotations

import hashlib
import json
import math
from enum import IntEnum
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

# The method names live in services.spec; re-exported for the modules that read them here.
from services.spec import (DFLASH_METHODS, EAGLE3_METHODS, HEAD_METHODS, MARKOV_METHODS,  # noqa: F401
                           METHODS, TreeKnobs, served_methods)
# A request's parameters are one type from the gateway to the engine (services.params); re-exported.
from services.params import (MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS,  # noqa: F401
                             SamplingParams, SpecParams)

# v2: SamplingSpec.logprobs, RoundChunk.logprobs; v3: DraftBatch; v4: drafts travel only in DraftBatch
# (DraftRequest is its job, no longer a message of its own: tag 20 is unused); v5: PeerInfo.default_spec
# is gone (the verifier owns the tree defaults; every draft job carries resolved knobs); v6:
# SamplingSpec.grammar (structured output and tool calls); v7: RoundChunk.stop_token_id; v8: Generate
# carries services.params' SamplingParams / SpecParams (ranges checked by their check(), not on
# decode), a DraftRequest its method and its TreeKnobs (SamplingSpec / SpecSpec are gone), PeerInfo
# its build's WIRE_SCHEMA (a change of a message's layout is refused at handshake without a bump);
# v9: PeerInfo.context_bytes (the drafter's device bytes per context position, for the memory plan)
PROTOCOL_VERSION = 9

LOGPROB_FLOOR = -9999.0     # logprobs are clamped to [LOGPROB_FLOOR, 0] (finite, JSON-safe; vLLM's floor)

# Allowed tensor dtypes on the wire and their item sizes (names as torch/numpy spell them).
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "uint8": 1, "bool": 1,
}

NonNeg = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
RequestId = Annotated[str, Meta(min_length=1, max_length=200)]
ShortStr = Annotated[str, Meta(max_length=256)]
MessageStr = Annotated[str, Meta(max_length=4096)]
LogProb = Annotated[float, Meta(ge=LOGPROB_FLOOR, le=0.0)]
TopK = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class ProtocolError(ValueError):
    """A message on the wire is malformed, oversize or of the wrong version (log and drop it)."""


class MessageType(IntEnum):
    """One-byte tag in frame 0 of every message."""

    HELLO = 1
    HELLO_ACK = 2
    PING = 3
    PONG = 4
    GENERATE = 10        # gateway -> verifier
    ROUND = 11           # verifier -> gateway: tokens one round emitted
    ABORT = 12           # gateway -> verifier
    REQUEST_ERROR = 13   # verifier -> gateway: the request failed or was refused
    DRAFT_REPLY = 21     # drafter -> verifier
    RELEASE = 22         # verifier -> drafter: forget a request's context
    DRAFT_BATCH = 23     # verifier -> drafter: several requests' drafts, one drafter forward


def _opts() -> dict:
    return {"array_like": True, "omit_defaults": True, "gc": False, "forbid_unknown_fields": True}


# --------------------------------------------------------------------------------------- shared parts

class TensorMeta(Struct, **_opts()):
    """Describes one tensor travelling outside the msgpack body."""

    dtype: str                               # a key of DTYPE_SIZES
    shape: tuple[NonNeg, ...]                # row-major, contiguous
    slot: Annotated[int, Meta(ge=-1)] = -1   # -1: next side frame; >= 0: slot in the sender's CUDA-IPC pool

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


class PoolHandle(Struct, **_opts()):
    """A CUDA-IPC tensor pool exported once at handshake (fields of ``UntypedStorage._share_cuda_()``)."""

    device: NonNeg                 # CUDA device index in the exporting process
    handle: bytes                  # cudaIpcMemHandle of the allocation
    size_bytes: NonNeg             # storage size
    offset_bytes: NonNeg           # storage offset inside the allocation
    ref_counter_handle: bytes      # torch's shared ref-counter file
    ref_counter_offset: NonNeg
    event_handle: bytes            # cudaIpcEventHandle (may be empty)
    event_sync_required: bool
    num_slots: NonNeg              # ring of equal slots
    slot_bytes: NonNeg             # bytes per slot


class Limits(Struct, **_opts()):
    """Admission and size limits a worker enforces (0 = unlimited / not applicable)."""

    max_context: NonNeg = 0        # prompt + generated tokens
    max_prompt_tokens: NonNeg = 0
    max_tokens: NonNeg = 0         # generated tokens per request
    max_budget: NonNeg = 0         # tree budget B (draft nodes)
    max_running: NonNeg = 0        # requests decoded concurrently
    max_waiting: NonNeg = 0        # requests queued for admission
    max_tensor_bytes: NonNeg = 0   # largest tensor frame accepted
    max_width: NonNeg = 0          # tree width W a request may ask for
    max_candidates: NonNeg = 0     # candidate pool K a request may ask for


class PeerInfo(Struct, **_opts()):
    """What a process tells its peer at handshake; compared by :func:`check_compatible`."""

    role: ShortStr                          # "gateway" | "verifier" | "drafter"
    epoch: ShortStr                         # random id of this process start (a restart changes it)
    tokenizer_hash: ShortStr = ""           # sha256 of tokenizer.json ("" = unknown, not compared)
    vocab_size: NonNeg = 0                  # 0 = unknown, not compared
    eos_token_id: int = -1
    special_token_ids: tuple[int, ...] = ()
    block_size: NonNeg = 0                  # drafter block K (0 = not applicable)
    feature_dim: NonNeg = 0                 # width of the target features the drafter consumes
    target_layer_ids: tuple[NonNeg, ...] = ()  # target layers whose outputs are the features
    max_position: NonNeg = 0                # drafter's position limit
    max_context: NonNeg = 0                 # target context window (prompt + generated tokens)
    model: ShortStr = ""                    # served model name
    methods: tuple[ShortStr, ...] = ()      # speculative methods this peer serves
    limits: Limits | None = None
    device: ShortStr = ""                   # "cpu", "cuda:0", ...
    pool: PoolHandle | None = None          # this peer's CUDA-IPC send pool
    context_bytes: NonNeg = 0               # v9, drafter: device bytes its context takes a position (0 = unknown)
    wire_schema: ShortStr = ""              # v8: WIRE_SCHEMA of the sender's build ("" on init: this build's)

    def __post_init__(self) -> None:
        if not self.wire_schema:
            self.wire_schema = WIRE_SCHEMA


# ----------------------------------------------------------------------------------------- messages

class Hello(Struct, **_opts()):
    """First message on a link (client -> server). ``protocol_version`` stays field 0 forever."""

    protocol_version: int
    info: PeerInfo


class HelloAck(Struct, **_opts()):
    """Handshake answer; ``ok = False`` means the server refuses the pair (``reason`` says why)."""

    protocol_version: int
    ok: bool
    info: PeerInfo
    reason: MessageStr = ""


class Ping(Struct, **_opts()):
    """Liveness probe; answered by the receiver's I/O thread, never queued behind compute."""

    nonce: int


class Pong(Struct, **_opts()):
    """Answer to :class:`Ping` with a status snapshot of the answering process."""

    nonce: int
    epoch: ShortStr
    ready: bool                 # model loaded (a verifier serves plainly while its drafter is down)
    draining: bool = False
    num_running: NonNeg = 0
    num_waiting: NonNeg = 0
    detail: MessageStr = ""     # why not ready; while ready, a notice (verifier: the drafter is down)


class Generate(Struct, **_opts()):
    """A generation request (gateway -> verifier). The prompt is already tokenized."""

    request_id: RequestId
    prompt_ids: list[TokenId]
    sampling: SamplingParams            # checked by SamplingParams.check (gateway and engine)
    spec: SpecParams                    # method None / knobs None: the verifier's defaults


class TokenLogprobs(Struct, **_opts()):
    """Raw target logprobs (log_softmax of the logits, before temperature/top-p/top-k) of a round's
    emitted tokens, one row per token: the token's own logprob and its top-k alternatives
    (most likely first; ``k = SamplingParams.logprobs``, rows empty when k is 0)."""

    logprobs: list[LogProb]
    top_ids: list[Annotated[list[TokenId], Meta(max_length=MAX_TOP_LOGPROBS)]] = []
    top_logprobs: list[Annotated[list[LogProb], Meta(max_length=MAX_TOP_LOGPROBS)]] = []

    def __post_init__(self) -> None:
        n = len(self.logprobs)
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) not in (0, n):
            raise ValueError(f"top_ids / top_logprobs need 0 or {n} rows")
        if any(len(i) != len(v) for i, v in zip(self.top_ids, self.top_logprobs)):
            raise ValueError("top_ids and top_logprobs rows differ in length")


class RoundChunk(Struct, **_opts()):
    """The tokens one round emitted for one request (verifier -> gateway)."""

    request_id: RequestId
    token_ids: list[TokenId]            # accepted + bonus, cut at EOS/stop id/max_tokens (terminator excluded)
    finish_reason: ShortStr | None = None   # None while running; "stop" | "length"
    num_draft_tokens: NonNeg = 0        # tree nodes proposed this round
    accept_length: NonNeg = 0           # accepted draft tokens emitted (bonus excluded)
    logprobs: TokenLogprobs | None = None   # only when the request asked; one row per token_ids entry
    stop_token_id: TokenId | None = None    # finish "stop" on an entry of stop_token_ids (not EOS): that id

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs.logprobs)} logprobs for {len(self.token_ids)} tokens")


class Abort(Struct, **_opts()):
    """Stop a request and free its state at the next round boundary (idempotent)."""

    request_id: RequestId
    reason: ShortStr = "client"         # client | deadline | stop_string | shutdown | error


class RequestError(Struct, **_opts()):
    """The request was refused or failed; shaped like the HTTP error the gateway returns."""

    request_id: RequestId
    status: int                 # HTTP status: 400, 429, 500, 503, ...
    message: MessageStr
    param: ShortStr | None = None
    code: ShortStr | None = None


class DraftRequest(Struct, **_opts()):
    """One request's draft job inside a :class:`DraftBatch` (verifier -> drafter); its tensor
    (``features``) rides outside, in the batch's side frame of the job's index."""

    request_id: RequestId
    round_id: NonNeg                    # matches the reply; stale replies are dropped
    committed_ids: list[TokenId]        # tokens committed since the last call (first call: the prompt)
    features: TensorMeta                # [len(committed_ids), F] target features at those positions
    root_token: TokenId                 # last committed token (root of the tree)
    start: NonNeg                       # position of the root
    method: ShortStr                    # a services.spec.Method that drafts
    knobs: TreeKnobs                    # every tree knob set (resolved by the verifier's policy)
    max_depth: NonNeg | None = None     # cap on tree depth (context-window limit)


class DraftReply(Struct, **_opts()):
    """A draft tree (drafter -> verifier): four tensors ride outside, or an error string."""

    request_id: RequestId
    round_id: NonNeg
    epoch: ShortStr                     # drafter process start id (a change = contexts lost)
    tree: tuple[TensorMeta, ...] = ()   # draft_tokens [N] int64, parents [N] int64, depths [N] int64, scores [N] float32
    timings: dict[ShortStr, float] = {}  # draft, tree_build (seconds, drafter clock)
    error: MessageStr = ""


MAX_BATCH_JOBS = 256  # draft jobs one DraftBatch may carry


class DraftBatch(Struct, **_opts()):
    """Several requests' :class:`DraftRequest` jobs drafted in ONE drafter forward (verifier ->
    drafter); job ``i``'s ``features`` rides in side frame ``i``. Answered by one
    :class:`DraftReply` per job (each with its own ``round_id``)."""

    jobs: Annotated[list[DraftRequest], Meta(min_length=1, max_length=MAX_BATCH_JOBS)]


class Release(Struct, **_opts()):
    """Forget a request's drafter context (idempotent)."""

    request_id: RequestId


MESSAGE_CLASSES: dict[MessageType, type[Struct]] = {
    MessageType.HELLO: Hello, MessageType.HELLO_ACK: HelloAck, MessageType.PING: Ping,
    MessageType.PONG: Pong, MessageType.GENERATE: Generate, MessageType.ROUND: RoundChunk,
    MessageType.ABORT: Abort, MessageType.REQUEST_ERROR: RequestError,
    MessageType.DRAFT_REPLY: DraftReply, MessageType.RELEASE: Release, MessageType.DRAFT_BATCH: DraftBatch,
}
MESSAGE_TYPES: dict[type[Struct], MessageType] = {cls: t for t, cls in MESSAGE_CLASSES.items()}


def wire_schema(classes) -> str:
    """A 16-hex-digit digest of the layout of ``classes`` (msgspec structs: their JSON schema)."""
    return hashlib.sha256(msgspec.json.encode(msgspec.json.schema_components(tuple(classes)))).hexdigest()[:16]


# WIRE_SCHEMA: a digest of every message's layout (fields, types, bounds; services.params' structs
# and TreeKnobs included), compared at handshake (check_compatible): two builds whose messages differ refuse each
# other even when nobody bumped PROTOCOL_VERSION (a new request option is a new SamplingParams field).
WIRE_SCHEMA = wire_schema(MESSAGE_CLASSES.values())

# Largest msgpack body accepted per type (tensor frames are bounded separately by Limits).
MAX_BODY_BYTES: dict[MessageType, int] = {t: 64 * 1024 for t in MessageType}
MAX_BODY_BYTES[MessageType.GENERATE] = 8 * 1024 * 1024      # a prompt of up to ~1M token ids
MAX_BODY_BYTES[MessageType.ROUND] = 1024 * 1024     # a full 1025-token round with top-20 logprobs is ~0.3 MiB
# Number of tensor side frames each type may carry.
MAX_TENSOR_FRAMES: dict[MessageType, int] = {t: 0 for t in MessageType}
MAX_TENSOR_FRAMES[MessageType.DRAFT_REPLY] = 4
MAX_BODY_BYTES[MessageType.DRAFT_BATCH] = 32 * 1024 * 1024
MAX_TENSOR_FRAMES[MessageType.DRAFT_BATCH] = MAX_BATCH_JOBS


def check_compatible(local: PeerInfo, remote: PeerInfo) -> str | None:
    """First reason two peers cannot serve together, or ``None`` when they can.

    Compared when both sides know the value: the wire layout (:data:`WIRE_SCHEMA`), tokenizer
    hash, vocab size, EOS and special ids, block size and feature width.
    """
    checks = [
        ("wire schema", local.wire_schema, remote.wire_schema, ""),
        ("tokenizer hash", local.tokenizer_hash, remote.tokenizer_hash, ""),
        ("vocab size", local.vocab_size, remote.vocab_size, 0),
        ("eos token id", local.eos_token_id, remote.eos_token_id, -1),
        ("special token ids", local.special_token_ids, remote.special_token_ids, ()),
        ("block size", local.block_size, remote.block_size, 0),
        ("feature dim", local.feature_dim, remote.feature_dim, 0),
        ("target layer ids", local.target_layer_ids, remote.target_layer_ids, ()),
    ]
    for name, a, b, unknown in checks:
        if a != unknown and b != unknown and a != b:
            return f"{name} mismatch: {local.role} has {a!r}, {remote.role} has {b!r}"
    return None


def check_hello_version(version: int) -> str | None:
    """Reason to refuse a peer speaking another protocol version, or ``None``."""
    if version != PROTOCOL_VERSION:
        return f"protocol version mismatch: peer speaks v{version}, this process speaks v{PROTOCOL_VERSION}"
    return None


def peek_protocol_version(body: bytes) -> int | None:
    """Field 0 of a HELLO/HELLO_ACK body, readable even when the rest has another layout."""
    try:
        obj = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, list) and obj and isinstance(obj[0], int):
        return obj[0]
    return None


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 (hex, first 16 bytes) of ``tokenizer.json`` in a model directory ("" if absent)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return ""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def special_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Sorted ids of the special added tokens in ``tokenizer.json`` (``()`` if absent)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return ()
    added = json.loads(path.read_text()).get("added_tokens", [])
    return tuple(sorted(int(t["id"]) for t in added if t.get("special")))


def config_eos_token_id(model_dir: str | Path) -> int:
    """First ``eos_token_id`` of ``config.json`` (-1 if unknown)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return -1
    eos = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(eos) if isinstance(eos, int) else -1
