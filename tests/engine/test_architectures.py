"""The architecture table (services/models/architectures.py): every served family decodes as
transformers' own ``generate`` does (``ar`` == HF greedy, speculative == ``ar``), and every family
whose attention the slot cache does not compute is refused at start with its reason.

Tiny random-weight float32 models on CPU, built from transformers' own config classes.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.models.architectures import (SERVED, UnsupportedArchitecture, check_architecture, check_target_dir,
                                           served_context)
from services.testing import greedy_reference, tiny_drafter, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from services.verifier.target import TargetModel

from tests.doubles import OracleDrafter

V = 128
N = 24  # generated tokens
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0,
              initializer_range=0.3, tie_word_embeddings=False)


def _model(kind: str, seed: int = 0, **extra):
    """A tiny random ``*ForCausalLM`` of ``kind`` (a served model_type), SDPA attention, eval mode."""
    import transformers as tf

    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
               "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
               # Qwen2 / Qwen3 carry a window that is unused without use_sliding_window: full attention
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"sliding_window": 16, "use_sliding_window": False}),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"sliding_window": 16, "use_sliding_window": False,
                                                             "head_dim": 8}),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                                       "moe_intermediate_size": 16, "head_dim": 8})}
    cfg_name, model_name, defaults = classes[kind]
    cfg = getattr(tf, cfg_name)(**{**COMMON, **defaults, **extra}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = getattr(tf, model_name)(cfg)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _prompt(seed: int, n: int = 9) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _tokens(engine, prompt, method="ar", n=N, **spec) -> list[int]:
    sampling = SamplingParams(max_tokens=n, ignore_eos=True)
    return [t for o in engine.generate("r", prompt, sampling, SpecParams(method, **spec)) for t in o.token_ids]


def test_the_table_lists_the_families_tested_here():
    assert set(SERVED) == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request):
    """``(kind, TargetModel)`` for each served family."""
    model = _model(request.param)
    assert served_context(model.config.to_dict()) == 256  # full attention over the whole context
    return request.param, TargetModel(model, [0, 2])


def test_ar_equals_transformers_greedy(served):
    kind, target = served
    for seed in (1, 2):
        prompt = _prompt(seed)
        ref = greedy_reference(target.model, prompt, N)
        assert len(set(ref)) > 3, f"{kind}: a degenerate reference proves little"
        assert _tokens(SpecEngine(target, None), prompt) == ref, kind


def test_speculative_equals_ar_with_full_acceptance_and_with_a_real_drafter(served):
    kind, target = served
    prompt = _prompt(3)
    ar = _tokens(SpecEngine(target, None), prompt)
    oracle = OracleDrafter({"r": prompt + ar}, depth=4, distractors=2, vocab_size=V, seed=3)
    assert _tokens(SpecEngine(target, oracle, max_draft_depth=4), prompt, "dartree-pruned") == ar, kind
    assert oracle.calls  # trees were drafted and verified
    service = tiny_service(target, tiny_drafter(target, block_size=8))
    engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=8)
    assert _tokens(engine, prompt, "dartree-pruned", budget=12, width=3, candidates=8) == ar, kind


# ------------------------------------------------------------------------------------ refusals
def _hf_config(name: str, **kw) -> dict:
    import transformers as tf

    return getattr(tf, name)(**kw).to_dict()


@pytest.mark.parametrize("cfg, reason", [
    (lambda: _hf_config("GptOssConfig"), "attention sinks"),
    (lambda: _hf_config("Qwen3NextConfig"), "hybrid linear-attention"),
    (lambda: _hf_config("Qwen3_5TextConfig"), "hybrid linear-attention"),
    (lambda: {**COMMON, "model_type": "qwen3", "layer_types": ["linear_attention", "full_attention"]},
     "layer_types has linear_attention layers"),
    (lambda: {**COMMON, "model_type": "llama", "layer_types": ["mamba", "full_attention"]}, "mamba layers"),
    (lambda: _hf_config("DeepseekV3Config"), "multi-head latent attention"),
    (lambda: {**COMMON, "model_type": "my_mla", "kv_lora_rank": 64}, "multi-head latent attention"),
    (lambda: _hf_config("Gemma3TextConfig"), "sliding-window"),
    (lambda: {**COMMON, "model_type": "gemma"}, "model_type 'gemma' is not one of the served architectures"),
    (lambda: {**COMMON}, "model_type None is not one of the served"),
])
def test_unserved_architectures_are_refused_with_their_reason(cfg, reason):
    with pytest.raises(UnsupportedArchitecture, match=reason) as err:
        served_context(cfg(), "'t'")
    assert "\n" not in str(err.value) and str(err.value).startswith("target 't' cannot be served exactly")


def test_a_sliding_window_in_use_is_served_only_inside_the_window():
    mistral = {**COMMON, "model_type": "mistral", "sliding_window": 16}
    assert served_context(mistral) == 16
    with pytest.raises(UnsupportedArchitecture, match=r"16-token window.*asked for is 256\): pass --max-context 16 or "
                                                      r"less"):
        check_architecture(mistral)
    assert check_architecture(mistral, max_context=16) == 16
    assert check_architecture({**mistral, "sliding_window": 4096}) == 256  # a window past the context: full
    assert check_architecture({**mistral, "sliding_window": None}) == 256
    # Qwen2/Qwen3: the window counts only with use_sliding_window, from layer max_window_layers on
    qwen = {**COMMON, "model_type": "qwen3", "sliding_window": 64, "max_window_layers": 1}
    assert check_architecture({**qwen, "use_sliding_window": False}) == 256
    assert check_architecture({**qwen, "use_sliding_window": True, "max_window_layers": 3}) == 256
    with pytest.raises(UnsupportedArchitecture, match="64-token window"):
        check_architecture({**qwen, "use_sliding_window": True})
    assert served_context(_hf_config("Qwen3Config", sliding_window=64, use_sliding_window=True,
                                     max_window_layers=0, max_position_embeddings=256)) == 64


def _swa_mistral_dir(path):
    """The issue's reproduction: a tiny random Mistral whose 16-token sliding window is in use."""
    model = _model("mistral", sliding_window=16)
    model.save_pretrained(path)  # no tokenizer: the refusal comes before anything loads
    return model


def test_the_sliding_window_reproduction_is_refused_by_generate_and_serve(tmp_path, capsys):
    """A 33-token prompt on a Mistral with a 16-token window: full attention gives other tokens than
    transformers' own sliding-window generate, so ``dartree generate --method ar`` refuses it at
    start in one line, and ``dartree serve`` too unless ``--max-context`` keeps it inside the window."""
    from services.cli import main

    model = _swa_mistral_dir(tmp_path)
    prompt = _prompt(5, 33)
    full = _model("mistral", sliding_window=None)  # the same weights (same seed), full attention
    assert greedy_reference(model, prompt, 12) != greedy_reference(full, prompt, 12)  # the window matters
    capsys.readouterr()  # what saving the model printed
    code = main(["generate", "x" * 33, "--method", "ar", "--weights", "float32", "--target", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("dartree: error: target ")
    assert "sliding-window attention with a 16-token window" in err and "dartree serve --max-context 16" in err
    with pytest.raises(UnsupportedArchitecture, match="pass --max-context 16 or less"):
        check_target_dir(tmp_path)
    assert check_target_dir(tmp_path, max_context=16) == 16


def test_inside_its_window_the_sliding_window_model_is_served_exactly(tmp_path):
    """Capped at the window (the TargetModel's context), the slot cache's full attention is the
    model's own sliding-window attention: ``ar`` == transformers' greedy."""
    model = _model("mistral", sliding_window=16)
    target = TargetModel(model, [0, 2])
    assert target.max_context == 16
    prompt = _prompt(6, 6)
    assert _tokens(SpecEngine(target, None), prompt, n=10) == greedy_reference(model, prompt, 10)
    with pytest.raises(ValueError, match="context window of 16"):
        _tokens(SpecEngine(target, None), _prompt(6, 12), n=10)


def test_from_pretrained_refuses_before_loading(tmp_path):
    cfg = _hf_config("Qwen3NextConfig")
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: the check comes first
    with pytest.raises(UnsupportedArchitecture, match="model_type 'qwen3_next'"):
        TargetModel.from_pretrained(tmp_path)
