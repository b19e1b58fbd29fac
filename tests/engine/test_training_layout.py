"""Training uses the inference layout: one batched block per anchor (per-row positions, context
masked to positions < anchor) equals running each anchor's block alone over its own context."""

import torch

from services.drafter.model import DFlashDrafter, DrafterConfig


def test_batched_anchor_blocks_equal_per_anchor_inference():
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=50, target_hidden_size=32,
                      target_layer_ids=[0, 1], gru_hidden_dim=8, emb_dim=8, block_size=4)
    m = DFlashDrafter(c).eval()
    t, q = 12, c.block_size
    feats = torch.randn(1, t, c.feature_dim)
    anchors = torch.tensor([3, 7, 10])
    a = anchors.numel()
    kv = [(k.expand(a, -1, -1, -1), v.expand(a, -1, -1, -1)) for k, v in m.context_kv(feats, torch.arange(t))]
    mask = (torch.arange(t)[None, None, :] < anchors[:, None, None]).expand(a, q, t)
    pos = anchors[:, None] + torch.arange(q)[None, :]
    emb = torch.randn(a, q, c.hidden_size)
    with torch.no_grad():
        batched = m.block_forward(emb, pos, kv, mask)
        for i, anchor in enumerate(anchors.tolist()):
            alone = m.block_forward(emb[i:i + 1], torch.arange(anchor, anchor + q),
                                    m.context_kv(feats[:, :anchor], torch.arange(anchor)))
            torch.testing.assert_close(batched[i], alone[0], atol=1e-5, rtol=1e-5)
