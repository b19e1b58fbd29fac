"""Pure speculative-tree algorithms (torch only: no models, sockets, metrics or globals).

Glossary (shapes in comments use these symbols):

- ``V`` vocabulary size; ``D`` draft depth (number of draft slots a drafter predicts);
  ``K`` candidates kept per depth (DARTree shares one top-K set per depth);
  ``W`` supertree width (children kept per depth, DARTree-pruned); ``B`` tree budget
  (number of *draft* nodes, root excluded); ``N`` number of draft nodes in a tree (``N <= B``);
  ``P`` frontier size (parents expanded at one depth) or number of root-to-leaf paths;
  ``S`` width of a correction-head state.
- Verify rows: row 0 is the **root** (the last committed token, whose KV is not yet cached),
  row ``i + 1`` is draft node ``i``. Verify buffers therefore have ``N + 1`` rows.
- Token kinds: *draft* tokens are proposed by the drafter; *accepted* tokens are draft tokens the
  target agrees with; the *bonus* token is the target's own token after the last accepted node;
  *emitted* tokens of a round = accepted + bonus.
- ``accept_length`` counts accepted draft tokens (bonus excluded), so a round emits
  ``accept_length + 1`` tokens. The paper's mean acceptance length tau includes the bonus.
- Aliases used by the DARTree reference code (docs/algorithms.md): ``visibility`` -> ``tree_mask``,
  ``node_tokens`` -> ``draft_tokens``, ``node_depths`` -> ``depths``, ``child_maps`` -> derived
  by :func:`walk` on the fly.
"""

from services.tree.accept import (
    AcceptResult,
    rejection_accept_chain,
    sample_target_tokens,
    walk,
)
from services.tree.builders import chain, chain_rollout, ddtree, domino_ddtree
from services.tree.dartree import dartree, dartree_reference, seqheap
from services.tree.draft_tree import DraftTree, VerifyBuffers, derive_buffers
from services.tree.scorer import MarkovScorer, TableScorer, TreeScorer

__all__ = [
    "AcceptResult",
    "DraftTree",
    "MarkovScorer",
    "TableScorer",
    "TreeScorer",
    "VerifyBuffers",
    "chain",
    "chain_rollout",
    "dartree",
    "dartree_reference",
    "ddtree",
    "derive_buffers",
    "domino_ddtree",
    "rejection_accept_chain",
    "sample_target_tokens",
    "seqheap",
    "walk",
]
