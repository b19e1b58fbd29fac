"""The engine both scripts of this folder time: the default q4 target with its compiled step, the
shipped drafter, 2 threads, one running request, the fixed policy. ``(engine, tokenizer)``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def compiled_engine():
    import torch

    from services.generate import build_inprocess
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig
    from services.weights import compute_dtype

    torch.set_num_threads(2)
    engine0, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4")
    engine = build_engine(engine0.target, engine0.drafter, EngineConfig(max_running=1, compile=True),
                          max_draft_depth=engine0.max_draft_depth, policy="fixed",
                          defaults=engine0.policy.defaults, cost_key=("smollm2-135m-instruct", "q4", "cpu"))
    return engine, tok
