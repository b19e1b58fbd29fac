"""The step's row layout (:func:`services.verifier.step_items.logit_rows`) on literal steps: which
flattened rows the forward keeps logits for, and where each request's rows and logits sit."""

from __future__ import annotations

from services.tree.batch import causal_segment
from services.verifier.step_items import StepItem, logit_rows


def _item(rows: int, decode: bool = False, final_chunk: bool = False) -> StepItem:
    # a decode round is told apart by its verify buffers (any non-None value); a chunk has none
    return StepItem(f"r{rows}", None, causal_segment(list(range(rows)), 0, 0),
                    buffers=object() if decode else None, final_chunk=final_chunk)


def test_round_chunk_and_final_chunk():
    keep, spans, cu = logit_rows([_item(3, decode=True), _item(4), _item(2, final_chunk=True)])
    assert keep == [0, 1, 2, 8]
    assert spans == [(0, 3), (3, 3), (3, 4)]
    assert cu == [0, 3, 7, 9]


def test_only_decode_rounds_keep_every_row():
    keep, spans, cu = logit_rows([_item(1, decode=True), _item(5, decode=True)])
    assert keep == list(range(6)) and spans == [(0, 1), (1, 6)] and cu == [0, 1, 6]


def test_a_lone_chunk_before_the_last_keeps_nothing():
    assert logit_rows([_item(4)]) == ([], [(0, 0)], [0, 4])
