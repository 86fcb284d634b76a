"""Draft trees: verify several continuations of one drafter block in a single target pass.

A DFlash block gives a distribution per slot, all predicted at once from the same context, so
slot k's ranking of tokens does not depend on which token slot k-1 holds. A tree node at depth
d is a choice of rank at each slot 1..d; its score is the sum of the chosen tokens' log-probs.
The ``budget`` best-scoring nodes (found best-first, EAGLE-2's dynamic tree applied to a block
drafter) form a prefix-closed tree: a node's score never exceeds its parent's or its elder
sibling's. The target verifies every node in one forward pass, each node attending to the
context and its own ancestors only, at position start + depth.

Acceptance walks from the root: at each node the target picks its own next token (argmax, or a
sample from its distribution); if a child holds that token the walk moves there, otherwise the
token is the bonus and the step ends. Every committed token is therefore the target's own
choice given the committed prefix, exactly as in the chain, so the output (greedy) and its
distribution (sampling) are the target's. The chain is the tree whose nodes are all rank 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch


def check_tree_size(tree) -> None:
    """``tree``: a positive number of drafted tokens (checked before any model runs)."""
    if isinstance(tree, bool) or not isinstance(tree, int) or tree < 1:
        raise ValueError(f"tree must be a positive number of drafted tokens, got {tree!r}")


@dataclass
class DraftTree:
    """Nodes in verify order (every parent before its children); node 0 is the root, the last
    committed token."""

    tokens: list[int]
    parents: list[int]   # parent node of each node; -1 for the root
    depths: list[int]    # 0 for the root

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestors(self) -> torch.Tensor:
        """Boolean [n, n]: node i may see node j (j is i or one of its ancestors)."""
        n = len(self.tokens)
        see = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            see[i, i] = True
            if self.parents[i] >= 0:
                see[i] |= see[self.parents[i]]
        return see

    def attention_mask(self, context: int, device=None) -> torch.Tensor:
        """``[1, 1, n, context + n]`` boolean: every node sees the whole context (the cache of
        ``context`` tokens) and its ancestors, itself included."""
        n = len(self.tokens)
        mask = torch.ones(n, context + n, dtype=torch.bool)
        mask[:, context:] = self.ancestors()
        return mask[None, None].to(device)

    def positions(self, start: int, device=None) -> torch.Tensor:
        """``[1, n]``: node at depth d sits at position start + d."""
        return (start + torch.tensor(self.depths, dtype=torch.long))[None].to(device)

    def children(self) -> list[dict[int, int]]:
        """Per node: child token -> child node."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i, p in enumerate(self.parents):
            if p >= 0:
                kids[p][self.tokens[i]] = i
        return kids


def build_tree(root: int, ids: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The ``budget`` highest-scoring nodes under ``root``.

    ids / logprobs: ``[depth, k]`` the drafter's top-k tokens per slot, best first, with their
    log-probabilities. Best-first search where a node's successors are its first child (rank 0
    at the next slot) and its next sibling (the next rank at its own slot): both score no more
    than the node, so nodes come out best first and every parent before its children.
    """
    if budget < 1:
        raise ValueError(f"a draft tree needs at least one node besides the root, got budget {budget}")
    depth, k = ids.shape
    lp = logprobs.float().tolist()
    tok = ids.tolist()
    chosen: list[tuple[int, ...]] = []
    heap = [(-lp[0][0], (0,))] if depth else []
    while heap and len(chosen) < budget:
        neg, node = heapq.heappop(heap)
        chosen.append(node)
        d, r = len(node), node[-1]
        if r + 1 < k:   # next sibling: the next rank at the same slot
            heapq.heappush(heap, (neg + lp[d - 1][r] - lp[d - 1][r + 1], node[:-1] + (r + 1,)))
        if d < depth:   # first child
            heapq.heappush(heap, (neg - lp[d][0], node + (0,)))
    chosen.sort(key=len)   # stable: by depth, best first within a depth
    index = {(): 0}
    tokens, parents, depths = [root], [-1], [0]
    for node in chosen:
        index[node] = len(tokens)
        tokens.append(tok[len(node) - 1][node[-1]])
        parents.append(index[node[:-1]])
        depths.append(len(node))
    return DraftTree(tokens, parents, depths)


def chain_tree(root: int, proposals: list[int]) -> DraftTree:
    """The chain as a tree (one node per depth): what block decoding verifies."""
    n = len(proposals)
    return DraftTree([root] + list(proposals), list(range(-1, n)), list(range(n + 1)))


def walk_tree(tree: DraftTree, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """Accepted nodes (root excluded, in order) and the bonus token.

    ``choose(i)`` is the target's own next token after node i (argmax or a sample of its
    distribution at row i); it is called once per visited node, in order.
    """
    kids = tree.children()
    node, path = 0, []
    while True:
        y = choose(node)
        nxt = kids[node].get(y)
        if nxt is None:
            return path, y
        path.append(nxt)
        node = nxt
