"""``dartree serve`` with a DSpark and an EAGLE-3 drafter (issue 18): three real processes, a tiny
random target, the served greedy answer of every method the drafter serves equals plain decoding,
and the server's default method is the drafter's own (``--default-method``)."""

from __future__ import annotations

import openai
import pytest

from services.drafter.model import save_drafter
from services.protocol import served_methods
from services.testing import served_ar_reference, start_server, tiny_dspark, tiny_eagle3
from services.verifier.target import TargetModel

from .tiny import TINY_FLAGS, make_tiny_models

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_served_methods_equal_plain_decoding(tmp_path_factory, kind):
    from gateway.text import TextModel

    target_dir, _ = make_tiny_models(tmp_path_factory.mktemp("tiny"))
    taps = [1, 2] if kind == "dspark" else [0, 1, 2]
    target = TargetModel.from_pretrained(target_dir, taps)
    drafter = tiny_dspark(target, seed=2) if kind == "dspark" else tiny_eagle3(target, seed=2)
    ddir = tmp_path_factory.mktemp(kind)
    save_drafter(drafter, ddir, omit_target_copies=kind == "dspark")
    default = "dspark-dartree" if kind == "dspark" else "eagle3"
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with start_server(*TINY_FLAGS, "--budget", "8", "--default-method", default, log=log, target=target_dir,
                      drafter=ddir) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
        ref = served_ar_reference(target_dir, TextModel(target_dir).encode("Hello world"), 20)
        for method in [None] + [m for m in served_methods(kind) if m != "ar"]:
            extra = {"return_token_ids": True, **({"speculative": {"method": method}} if method else {})}
            out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, extra_body=extra)
            ids = out.choices[0].model_extra["token_ids"]
            assert ids == ref[:len(ids)] and len(ids) == out.usage.completion_tokens, method
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                      extra_body={"speculative": {"method": "dartree-pruned" if kind == "eagle3"
                                                                  else "eagle3"}})
