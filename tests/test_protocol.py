"""Wire protocol: every message round-trips, tensors ride as side frames, bad input is refused."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from services import protocol as p
from services.spec import TreeKnobs
from services.wire import decode, encode, frame_to_array, frame_to_tensor, tensor_to_frame


def _info(**kw) -> p.PeerInfo:
    base = dict(role="verifier", epoch="e1", tokenizer_hash="abc", vocab_size=100, eos_token_id=2,
                special_token_ids=(0, 1, 2), block_size=16, feature_dim=32)
    base.update(kw)
    return p.PeerInfo(**base)


EXAMPLES = [
    p.Hello(p.PROTOCOL_VERSION, _info()),
    p.HelloAck(p.PROTOCOL_VERSION, True, _info(role="drafter", limits=p.Limits(max_context=2048))),
    p.Ping(7),
    p.Pong(7, "e1", True, num_running=2, num_waiting=1),
    p.Generate("r1", [1, 2, 3], p.SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop_token_ids=(9,), logprobs=5),
               p.SpecParams(method="dartree-pruned", budget=16, depth_bonus=-0.2)),
    p.RoundChunk("r1", [4, 5, 6], "stop", num_draft_tokens=16, accept_length=2),
    p.RoundChunk("r1", [4], "stop", stop_token_id=9),
    p.RoundChunk("r1", [4, 5], None, logprobs=p.TokenLogprobs([-0.5, -9999.0], [[4, 7], [1, 5]],
                                                              [[-0.5, -1.5], [-0.1, -2.0]])),
    p.RoundChunk("r1", [4], "length", logprobs=p.TokenLogprobs([0.0])),
    p.Abort("r1", "deadline"),
    p.RequestError("r1", 429, "full", param=None, code="overloaded"),
    p.Release("r1"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    dec = decode(encode(msg))
    assert dec.msg == msg
    assert dec.type == p.MESSAGE_TYPES[type(msg)]


def test_every_message_type_has_an_example_or_tensor_test():
    covered = {type(m) for m in EXAMPLES} | {p.DraftReply, p.DraftBatch}
    assert covered == set(p.MESSAGE_CLASSES.values())


def test_draft_batch_carries_one_frame_per_job_and_is_bounded():
    """v3: several jobs, job i's features in side frame i; empty batches and too many frames refused."""
    torch = pytest.importorskip("torch")
    from services.ipc_pool import FrameTransport

    feats = [torch.randn(n, 8) for n in (3, 1, 5)]
    metas, frames = FrameTransport().pack(feats)
    jobs = [p.DraftRequest(f"r{i}", i, list(range(len(f))), m, 7, 10 + i, "ddtree",
                           TreeKnobs(4, 2, -0.2, 8))
            for i, (f, m) in enumerate(zip(feats, metas))]
    dec = decode(encode(p.DraftBatch(jobs), frames))
    assert dec.type == p.MessageType.DRAFT_BATCH and dec.msg.jobs == jobs
    got = FrameTransport().unpack([j.features for j in dec.msg.jobs], dec.frames)
    assert all(torch.equal(a, b) for a, b in zip(got, feats))
    with pytest.raises(p.ProtocolError):
        decode(encode(p.DraftBatch([]), []))


def test_draft_job_is_no_message_of_its_own():
    """v4: a draft travels only as a job of a DraftBatch."""
    assert p.DraftRequest not in p.MESSAGE_TYPES and 20 not in set(p.MessageType)


def test_draft_batch_with_torch_tensor_frame_round_trips_zero_copy():
    torch = pytest.importorskip("torch")
    feats = torch.randn(3, 8).to(torch.bfloat16)  # [L, F]
    meta, buf = tensor_to_frame(feats)
    msg = p.DraftBatch([p.DraftRequest("r", 4, [5, 6, 7], meta, root_token=7, start=10,
                                       method="ddtree", knobs=TreeKnobs(budget=3))])
    parts = encode(msg, [buf])
    dec = decode([bytes(x) for x in parts])
    assert dec.msg == msg and len(dec.frames) == 1
    out = frame_to_tensor(dec.msg.jobs[0].features, dec.frames[0])
    assert out.dtype == torch.bfloat16 and torch.equal(out, feats)


def test_draft_reply_with_four_numpy_frames():
    arrays = [np.arange(4, dtype=np.int64), np.array([-1, 0, 0, 1]), np.array([1, 2, 2, 3]),
              np.linspace(0, 1, 4, dtype=np.float32)]
    metas, frames = zip(*(tensor_to_frame(a) for a in arrays))
    msg = p.DraftReply("r", 1, "ep", tree=tuple(metas), timings={"draft": 0.01, "tree_build": 0.002})
    dec = decode(encode(msg, frames))
    for meta, frame, ref in zip(dec.msg.tree, dec.frames, arrays):
        np.testing.assert_array_equal(frame_to_array(meta, frame), ref)


def test_empty_tensor_round_trips():
    torch = pytest.importorskip("torch")
    meta, buf = tensor_to_frame(torch.zeros(0, 5))
    assert frame_to_tensor(meta, bytes(buf)).shape == (0, 5)


@pytest.mark.parametrize("parts, match", [
    ([b"\x63", b""], "unknown message type"),
    ([b"\x03"], "at least 2"),
    ([b"\x03", b"\xc1\xff"], "malformed PING"),
    ([bytes((p.MessageType.GENERATE,)), msgspec.msgpack.encode(["r", [1, -5], [5], []])], "malformed GENERATE"),
    ([b"\x03", msgspec.msgpack.encode([1]), b"extra"], "side frames"),
    ([bytes((p.MessageType.ABORT,)), b"\x91" + b"\xa1x" * 70000], "over the"),
])
def test_malformed_messages_raise_protocol_error(parts, match):
    with pytest.raises(p.ProtocolError, match=match):
        decode(parts)


def _round(*logprobs_fields, ids=(4, 5)) -> list:
    return [bytes((p.MessageType.ROUND,)), msgspec.msgpack.encode(["r", list(ids), None, 0, 0, list(logprobs_fields)])]


@pytest.mark.parametrize("parts", [
    _round([-0.5]),                                      # 1 logprob for 2 tokens
    _round([-0.5, 0.1]),                                 # a logprob > 0
    _round([-0.5, float("nan")]),                        # NaN
    _round([-0.5, -1e5]),                                # below the floor
    _round([-0.5, -0.5], [[1]], [[-1.0]]),               # top rows for 1 of 2 tokens
    _round([-0.5, -0.5], [[1], [2]], [[-1.0], []]),      # row lengths differ
    _round([-0.5, -0.5], [[1] * 21] * 2, [[-1.0] * 21] * 2),  # more than MAX_TOP_LOGPROBS alternatives
], ids=["count", "positive", "nan", "floor", "top-rows", "row-lengths", "top-21"])
def test_bad_logprobs_are_refused(parts):
    with pytest.raises(p.ProtocolError):
        decode(parts)


def test_a_generate_carries_its_params_as_they_are_and_their_check_refuses_a_bad_one():
    """v8: the wire checks types, the params' ``check()`` their ranges (the engine calls it at
    admission, so the verifier answers such a request with a 400 naming the field)."""
    body = msgspec.msgpack.encode(["r", [1], [5, 0.0, 1.0, 0, None, [], False, 21], []])
    dec = decode([bytes((p.MessageType.GENERATE,)), body])
    assert dec.msg.sampling == p.SamplingParams(max_tokens=5, logprobs=21) and dec.msg.spec == p.SpecParams()
    with pytest.raises(ValueError, match="logprobs") as e:
        dec.msg.sampling.check()
    assert e.value.param == "logprobs"
    with pytest.raises(p.ProtocolError):  # a type the params do not have is still refused on decode
        decode([bytes((p.MessageType.GENERATE,)), msgspec.msgpack.encode(["r", [1], [5, "hot"], []])])


def test_a_whole_round_with_top_20_logprobs_fits_the_body_limit():
    from services.spec import MAX_BUDGET

    n, k = MAX_BUDGET + 1, p.MAX_TOP_LOGPROBS  # every draft node accepted plus the bonus
    lp = p.TokenLogprobs([-1234.5678901] * n, [[2**31 - 1] * k] * n, [[-1234.5678901] * k] * n)
    parts = encode(p.RoundChunk("r" * 200, [2**31 - 1] * n, "length", 2**31, 2**31, logprobs=lp))
    assert len(parts[1]) < p.MAX_BODY_BYTES[p.MessageType.ROUND]
    assert decode(parts).msg.logprobs == lp


def test_frame_size_must_match_its_metadata():
    meta = p.TensorMeta("float32", (2, 3))
    msg = p.DraftBatch([p.DraftRequest("r", 0, [1, 2], meta, 2, 2, "ddtree", TreeKnobs())])
    with pytest.raises(p.ProtocolError, match="frame of 20 bytes"):
        decode(encode(msg, [b"\0" * 20]))
    with pytest.raises(p.ProtocolError, match="not allowed"):
        bad = p.DraftRequest("r", 0, [1], p.TensorMeta("object", (1,)), 1, 1, "ddtree", TreeKnobs())
        decode(encode(p.DraftBatch([bad]), [b"\0"]))
    with pytest.raises(p.ProtocolError, match="over the 16 limit"):
        decode(encode(msg, [b"\0" * 24]), max_tensor_bytes=16)
    with pytest.raises(p.ProtocolError, match="describes 1 framed"):
        decode(encode(msg))


def test_unknown_fields_and_wrong_types_are_refused():
    body = msgspec.msgpack.encode(["r", 3])  # Abort(request_id, reason) with reason of the wrong type
    with pytest.raises(p.ProtocolError):
        decode([bytes((p.MessageType.ABORT,)), body])
    with pytest.raises(p.ProtocolError):
        decode([bytes((p.MessageType.ABORT,)), msgspec.msgpack.encode(["", "client"])])  # empty id


def test_version_mismatch_is_detected_even_with_another_layout():
    future = msgspec.msgpack.encode([p.PROTOCOL_VERSION + 1, {"some": "new layout"}])
    assert p.peek_protocol_version(future) == p.PROTOCOL_VERSION + 1
    assert "protocol version mismatch" in p.check_hello_version(p.PROTOCOL_VERSION + 1)
    assert p.check_hello_version(p.PROTOCOL_VERSION) is None


@pytest.mark.parametrize("field, value, word", [
    ("tokenizer_hash", "zzz", "tokenizer hash"), ("vocab_size", 101, "vocab size"),
    ("eos_token_id", 0, "eos token id"), ("special_token_ids", (0, 1), "special token ids"),
    ("block_size", 8, "block size"), ("feature_dim", 64, "feature dim"),
])
def test_handshake_refuses_mismatched_peers(field, value, word):
    assert p.check_compatible(_info(), _info(role="drafter")) is None
    reason = p.check_compatible(_info(), _info(role="drafter", **{field: value}))
    assert reason is not None and word in reason


def test_unknown_values_are_not_compared():
    assert p.check_compatible(_info(), p.PeerInfo(role="gateway", epoch="x")) is None


def test_tokenizer_hash(tmp_path):
    assert p.tokenizer_hash(tmp_path) == ""
    (tmp_path / "tokenizer.json").write_text("{}")
    h = p.tokenizer_hash(tmp_path)
    assert len(h) == 32 and h == p.tokenizer_hash(tmp_path)


def test_a_supervisors_runtime_dir_left_by_a_killed_one_is_removed(tmp_path, monkeypatch):
    """``dartree serve`` makes ``<runtime dir>-<pid>``; one killed with SIGKILL never removed its own.
    The next supervisor removes those of dead pids and keeps those of live processes."""
    import subprocess
    import sys

    from services.wire import runtime_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (dead, live.pid, "notapid"):
            (tmp_path / f"dartree-{pid}").mkdir(mode=0o700)
            (tmp_path / f"dartree-{pid}" / "verifier.sock").touch()
        mine = runtime_dir(unique=True)
        assert mine == tmp_path / f"dartree-{os.getpid()}" and mine.is_dir()
        assert not (tmp_path / f"dartree-{dead}").exists()
        assert (tmp_path / f"dartree-{live.pid}" / "verifier.sock").exists()
        assert (tmp_path / "dartree-notapid").is_dir()
    finally:
        live.kill()
        live.wait()


def test_a_v8_peer_is_refused_at_handshake():
    """v9 added ``PeerInfo.context_bytes``: a v8 build (which sends no such field) is refused by its
    version, in one line naming both."""
    assert p.PROTOCOL_VERSION == 9 and "context_bytes" in p.PeerInfo.__struct_fields__
    why = p.check_hello_version(8)
    assert why == "protocol version mismatch: peer speaks v8, this process speaks v9"
    old = msgspec.msgpack.encode([8, {"role": "drafter"}])
    assert p.peek_protocol_version(old) == 8


def test_the_wire_schema_follows_the_messages_layout_and_mismatched_builds_are_refused():
    """A new request option (a SamplingParams field) changes WIRE_SCHEMA; peers of builds whose
    layouts differ refuse each other at handshake, with no PROTOCOL_VERSION bump needed."""

    class WithTypicalP(p.SamplingParams):
        typical_p: float = 1.0

    assert p.wire_schema([p.SamplingParams]) != p.wire_schema([WithTypicalP])
    assert p.wire_schema([p.SamplingParams]) == p.wire_schema([p.SamplingParams])
    mine = p.PeerInfo(role="gateway", epoch="g")
    assert mine.wire_schema == p.WIRE_SCHEMA
    assert decode(encode(p.Hello(p.PROTOCOL_VERSION, mine))).msg.info.wire_schema == p.WIRE_SCHEMA
    other = p.PeerInfo(role="verifier", epoch="v", wire_schema="0123456789abcdef")
    assert p.check_compatible(mine, other).startswith("wire schema mismatch")
    assert p.check_compatible(mine, p.PeerInfo(role="verifier", epoch="v")) is None
