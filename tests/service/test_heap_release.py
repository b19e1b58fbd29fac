"""Freed heap goes back to the system where a process frees much at once: the drafter after a draft
batch that carried a prompt's features and when its last context is released (never after the
rounds' small batches), the gateway after parsing its tokenizer (glibc keeps freed heap pages
resident otherwise); and the drafter's borrowed embedding stays a view of the target's file,
resident only where read."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import protocol as p
from services.spec import TreeKnobs
from services.drafter.worker import DrafterWorker
from services.ipc_pool import FrameTransport
from services.wire import decode, encode
from tests.doubles import FakeDrafterService

torch = pytest.importorskip("torch")


def _spec() -> p.SpecParams:
    return p.SpecParams(method="dartree-pruned", budget=3)


def _worker(release_after_bytes: int):
    calls: list[int] = []
    service, transport = FakeDrafterService(), FrameTransport()
    worker = DrafterWorker(service, p.PeerInfo(role="drafter", epoch="d1", vocab_size=400), transport,
                           send=lambda *a: None, release_memory=lambda: calls.append(len(service.contexts)),
                           release_after_bytes=release_after_bytes)
    return worker, calls, transport


def _post(worker: DrafterWorker, transport: FrameTransport, jobs: dict[str, int]) -> None:
    """Queue one DRAFT_BATCH: per request id, that many feature rows (float32, 8 wide: 32 B a row)."""
    feats = [torch.ones(n, 8) for n in jobs.values()]
    metas, frames = transport.pack(feats)
    reqs = [p.DraftRequest(rid, 1, [1] * n, m, n, n, "dartree-pruned", TreeKnobs(3, 12, -0.2, 64)) for (rid, n), m in zip(jobs.items(), metas)]
    worker.inbox.put((b"v", decode(encode(p.DraftBatch(reqs), [bytes(f) for f in frames]))))
    worker.run_once(timeout=1)


def test_released_after_a_prompt_sized_batch_only():
    worker, calls, transport = _worker(release_after_bytes=1024)
    _post(worker, transport, {"a": 2, "b": 3})  # 160 B of features: a round's
    assert calls == []
    _post(worker, transport, {"c": 40})  # 1,280 B: a prompt's
    assert calls == [3]
    _post(worker, transport, {"d": 20, "e": 12})  # 1,024 B over two jobs
    assert calls == [3, 5]


def test_released_when_the_last_context_goes():
    worker, calls, transport = _worker(release_after_bytes=1 << 30)
    _post(worker, transport, {"a": 2, "b": 2})
    for rid, want in (("a", []), ("b", [0]), ("b", [0])):  # the last one, then nothing left to release
        worker.inbox.put((b"v", decode(encode(p.Release(rid)))))
        worker.run_once(timeout=1)
        assert calls == want


def test_no_release_on_idle_iterations():
    worker, calls, _ = _worker(release_after_bytes=0)
    worker.run_once(timeout=0.01)
    assert calls == []


def _file_mapped(t: torch.Tensor, path: Path) -> bool:
    """Whether ``t``'s data lies in a mapping of ``path`` (``/proc/self/maps``)."""
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return bool(rest) and rest[-1] == str(path.resolve())
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
@pytest.mark.parametrize("tied", [True, False])
def test_mapped_embedding_is_a_view_of_the_file_with_the_converted_rows(tmp_path, tied):
    from services.drafter.build import MappedEmbedding, load_borrowed_weights
    from services.startup import object_memory_parts
    from services.testing import tiny_causal_lm

    model = tiny_causal_lm("qwen3", vocab_size=64, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    embed, head = load_borrowed_weights(tmp_path, torch.bfloat16, mapped=True)
    copied, copied_head = load_borrowed_weights(tmp_path, torch.bfloat16)
    assert isinstance(embed, MappedEmbedding) and embed.weight.dtype == torch.float32
    assert _file_mapped(embed.weight, file)  # not a [V, H] copy
    assert not _file_mapped(head.weight, file) and head.weight.dtype == torch.bfloat16  # its own copy
    assert torch.equal(head.weight, copied_head.weight)
    ids = torch.tensor([0, 7, 63, 7])
    assert torch.equal(embed(ids).to(torch.bfloat16), copied(ids))  # the rows a converted table gives

    class Holder:
        def __init__(self):
            self.embed, self.lm_head = embed, head

    parts = object_memory_parts(Holder())
    assert parts["weights"] == head.weight.nbytes  # the file's mapping is not counted as weights
    assert parts["mapped embedding"].startswith(f"{embed.weight.nbytes / 2**20:,.0f} MB")


def test_gateway_trims_the_heap_after_loading_its_tokenizer(monkeypatch, bytelevel_dir):
    import gateway.server as server
    from gateway.config import GatewayConfig

    events: list[str] = []
    real = server.TextModel
    monkeypatch.setattr(server, "TextModel", lambda path: events.append("tokenizer") or real(path))
    monkeypatch.setattr(server, "trim_heap", lambda: events.append("trim"))
    server.build_app(GatewayConfig(target=str(bytelevel_dir)))
    assert events == ["tokenizer", "trim"]


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, cur = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":") and len(head) >= 5:
            cur = len(head) > 5 and head[5] == str(path.resolve())
        elif cur and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_drop_file_pages_unmaps_clean_weight_pages_and_keeps_written_ones(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from services.runtime import drop_file_pages

    clean_file, dirty_file = tmp_path / "clean.safetensors", tmp_path / "dirty.safetensors"
    want = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    save_file({"w": want}, clean_file)
    save_file({"w": want}, dirty_file)
    with safe_open(str(clean_file), "pt") as f:
        clean = f.get_tensor("w")
    with safe_open(str(dirty_file), "pt") as f:
        dirty = f.get_tensor("w")
    dirty[0] = -1.0  # a copy-on-write page: that mapping must be left alone
    assert float(clean.sum()) == float(want.sum()) and float(dirty[1:].sum()) == float(want[1:].sum())
    assert _mapped_rss(clean_file) >= 4 << 20 and _mapped_rss(dirty_file) >= 4 << 20
    assert drop_file_pages() >= 4 << 20
    assert _mapped_rss(clean_file) == 0  # read once, then nothing resident
    assert _mapped_rss(dirty_file) >= 4 << 20
    assert torch.equal(clean, want)  # read again: faulted back from the file
    assert float(dirty[0]) == -1.0
