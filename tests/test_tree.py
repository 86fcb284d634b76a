"""Draft trees (tree.py): the tree is the best-scoring prefix-closed set of continuations, its
mask lets each node see only its ancestors, and decoding through trees stays lossless (greedy
tokens equal the target's own; sampled continuations follow its distribution)."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashkit.decoding import speculative_generate
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.sampling import SamplingConfig
from dflashkit.tree import build_tree, chain_tree, walk_tree
from tests.conftest import EOS, MASK, VOCAB, tiny_target
from tests.test_decoding import cached_target, hf_greedy
from tests.test_sampling import ALPHA, chi_square_pvalue, exact_distribution


def _random_top(depth, k, seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.rand(depth, k, generator=g).mul(-5).sort(dim=-1, descending=True).values
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(depth)])
    return ids, lp


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(1, 5), k=st.integers(1, 4), budget=st.integers(1, 30), seed=st.integers(0, 10**6))
def test_tree_is_the_best_prefix_closed_set(depth, k, budget, seed):
    ids, lp = _random_top(depth, k, seed)
    tree = build_tree(7, ids, lp, budget)
    # brute force: every rank tuple, scored by its summed log-probs, best `budget` of them
    every = [r for d in range(1, depth + 1) for r in itertools.product(range(k), repeat=d)]
    score = {r: sum(float(lp[i, x]) for i, x in enumerate(r)) for r in every}
    best = sorted(every, key=lambda r: -score[r])[:budget]
    assert len(tree) == 1 + len(best)
    got = set()
    for i in range(1, len(tree)):   # recover each node's rank tuple from its path of tokens
        path, node = [], i
        while node > 0:
            path.append(node)
            node = tree.parents[node]
        ranks = tuple(int((ids[tree.depths[n] - 1] == tree.tokens[n]).nonzero()) for n in reversed(path))
        got.add(ranks)
        assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
    assert sorted(score[r] for r in got) == pytest.approx(sorted(score[r] for r in best))
    assert all(r[:-1] in got or len(r) == 1 for r in got)   # prefix-closed
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0


def test_mask_and_positions_follow_the_ancestors():
    ids, lp = _random_top(4, 3, 0)
    tree = build_tree(5, ids, lp, 12)
    mask = tree.attention_mask(10)[0, 0]
    pos = tree.positions(10)[0]
    assert mask.shape == (len(tree), 10 + len(tree)) and bool(mask[:, :10].all())
    for i in range(len(tree)):
        anc, node = {i}, i
        while tree.parents[node] >= 0:
            node = tree.parents[node]
            anc.add(node)
        assert set(torch.nonzero(mask[i, 10:]).flatten().tolist()) == anc
        assert int(pos[i]) == 10 + len(anc) - 1


def test_walk_follows_the_chosen_children():
    tree = chain_tree(1, [10, 11, 12])
    assert walk_tree(tree, {0: 10, 1: 11, 2: 40}.__getitem__) == ([1, 2], 40)
    ids = torch.tensor([[10, 20], [30, 31]])
    lp = torch.tensor([[-0.1, -0.2], [-0.1, -0.2]])
    tree = build_tree(1, ids, lp, 6)   # every node of depth <= 2, both ranks
    second = tree.tokens.index(20)
    child = next(i for i in range(len(tree)) if tree.parents[i] == second and tree.tokens[i] == 31)
    chosen = {0: 20, second: 31, child: 99}
    assert walk_tree(tree, chosen.__getitem__) == ([second, child], 99)


class OracleTopProposer:
    """Per slot, the true continuation's token at a random rank among decoys, so decoding walks
    branches other than the first and the accepted path sits at scattered rows of the block."""

    feature_layers = [0]

    def __init__(self, continuation, prompt_len, k=3, seed=0):
        self.continuation, self.prompt_len, self.k = continuation, prompt_len, k
        self.g = torch.Generator().manual_seed(seed)

    def begin(self):
        pass

    def propose_top(self, committed, new_features, num_slots, k):
        done = committed.shape[-1] - self.prompt_len
        truth = self.continuation[done:done + num_slots]
        truth = truth + [3] * (num_slots - len(truth))
        ids = torch.zeros(num_slots, self.k, dtype=torch.long)
        for j, t in enumerate(truth):
            decoys = [x for x in torch.randperm(VOCAB - 4, generator=self.g).add(3).tolist() if x != t]
            row = decoys[:self.k]
            if torch.rand((), generator=self.g) < 0.9:   # usually present, at a random rank
                row[int(torch.randint(self.k, (), generator=self.g))] = t
            ids[j] = torch.tensor(row)
        lp = torch.tensor([-0.1 * (r + 1) for r in range(self.k)]).expand(num_slots, self.k)
        return ids, lp


@pytest.mark.parametrize("fast", [True, False])
def test_oracle_tree_is_lossless_through_scattered_paths(family, fast):
    """Accepted paths through non-first branches: the cache keeps exactly their rows."""
    target, _ = cached_target(family)
    prompt = [7, 11, 13, 17, 19]
    ref = hf_greedy(target, prompt, 60, eos=None)
    target.set_fast_path(fast)
    try:
        oracle = OracleTopProposer(ref, len(prompt))
        res = speculative_generate(target, oracle, prompt, max_new_tokens=60, block_size=6,
                                   stop_token_ids=[], tree=40)
    finally:
        target.set_fast_path(True)
    assert res.tokens == ref
    # the truth is at rank 0 of a slot only a third of the time: such acceptance needs branches
    assert res.stats.tau > 2.5 and max(res.stats.verify_sizes) == 41


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, VOCAB - 2), min_size=1, max_size=20),
       budget=st.sampled_from([1, 3, 7, 20]), block_size=st.sampled_from([2, 4, 16]),
       max_new=st.integers(1, 30))
@pytest.mark.parametrize("family_name", ["qwen2", "llama"])
def test_greedy_tree_with_a_drafter_equals_hf_generate(family_name, prompt, budget, block_size, max_new):
    target, drafter = cached_target(family_name)
    ref = hf_greedy(target, prompt, max_new)
    res = speculative_generate(target, drafter, prompt, max_new_tokens=max_new, block_size=block_size,
                               stop_token_ids=[EOS], tree=budget)
    assert res.tokens == ref
    assert sum(res.stats.acceptance_lengths) + 1 == len(res.tokens)
    assert all(1 <= a <= block_size for a in res.stats.acceptance_lengths)


@pytest.mark.parametrize("proposer_kind,sampling", [
    ("oracle", SamplingConfig(temperature=1.0, top_k=3)),
    ("random", SamplingConfig(temperature=0.8, top_k=4)),
])
def test_tree_sampling_matches_target_distribution(proposer_kind, sampling):
    target = tiny_target("qwen2", seed=1, temperature_scale=0.6)
    prompt, length, n = [9, 14, 27, 3], 3, 1000
    dist = exact_distribution(target, prompt, length, sampling)
    if proposer_kind == "random":
        proposer = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    else:   # the greedy continuation, at random ranks among decoys
        proposer = OracleTopProposer(hf_greedy(target, prompt, length, eos=None), len(prompt))
    samples = []
    for seed in range(n):
        s = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, seed=seed)
        res = speculative_generate(target, proposer, prompt, max_new_tokens=length, sampling=s,
                                   block_size=4, stop_token_ids=[], tree=6)
        samples.append(tuple(res.tokens))
    p = chi_square_pvalue(samples, dist)
    assert p > ALPHA, f"tree samples deviate from the target's distribution (p={p:.2e})"


@pytest.mark.parametrize("kwargs,match", [
    ({"tree": 0}, "positive number"),
    ({"tree": True}, "positive number"),
    ({"tree": 4, "block_size": "auto"}, "sets its own size"),
    ({"tree": 4, "lookup": True}, "cannot be combined"),
    ({"tree": 4, "block_size": 1}, "block_size >= 2"),
    ({"tree": 4, "acceptance": "rejection", "sampling": SamplingConfig(temperature=1.0)}, "match"),
])
def test_bad_tree_arguments_raise_clear_errors(kwargs, match):
    target, drafter = cached_target("qwen2")
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, drafter, [5, 6, 7], max_new_tokens=4, **kwargs)


def test_a_tree_needs_per_slot_distributions():
    from tests.test_decoding import OracleProposer
    target, _ = cached_target("qwen2")
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        speculative_generate(target, OracleProposer([4, 5], 3), [5, 6, 7], max_new_tokens=4, tree=3)
