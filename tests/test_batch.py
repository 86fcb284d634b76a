"""Batched decoding: every row gets exactly what it gets alone (greedy), and the target's
distribution when sampling."""

import random

import pytest
import torch

from dflashkit.batch import BatchRequest, batch_generate
from dflashkit.costs import CostCurve
from dflashkit.decoding import speculative_generate
from dflashkit.policy import AdaptiveBlockSize
from dflashkit.sampling import SamplingConfig
from tests.conftest import EOS
from tests.test_decoding import cached_target, hf_greedy
from tests.test_sampling import ALPHA, _TargetAsDrafter, chi_square_pvalue, exact_distribution

PROMPTS = [[3, 4, 5], [9] * 12, list(range(20, 40)), [77, 5], list(range(50, 57))]


class NoisyOracle:
    """Knows every row's true continuation but corrupts some slots: acceptance differs from
    row to row and step to step, which is what batching must get right."""

    feature_layers = [0]

    def __init__(self, continuations: dict[tuple, list[int]], every: int = 3):
        self.continuations, self.every = continuations, every

    def begin(self):
        pass

    def propose(self, committed, new_features, num_slots, sampling, generator):
        seq = committed.tolist()
        for prompt, cont in self.continuations.items():
            if tuple(seq[:len(prompt)]) == prompt:
                done = len(seq) - len(prompt)
                out = (cont + [3] * 64)[done:done + num_slots]
                wrong = [random.Random(f"{len(prompt)}-{done + k}").random() < 1 / self.every
                         for k in range(len(out))]
                return torch.tensor([(t + 1) % 90 if w else t for t, w in zip(out, wrong)]), None
        raise AssertionError("unknown row")


@pytest.mark.parametrize("family_name", ["qwen2", "llama"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 7])
def test_batched_greedy_rows_equal_generation_alone(family_name, block_size):
    target, drafter = cached_target(family_name)
    budgets = [30, 7, 25, 1, 18]
    results = batch_generate(target, drafter, [
        BatchRequest(p, max_new_tokens=n, stop_token_ids=[EOS]) for p, n in zip(PROMPTS, budgets)],
        block_size=block_size)
    for p, n, res in zip(PROMPTS, budgets, results):
        assert res.tokens == hf_greedy(target, p, n)
        alone = speculative_generate(target, drafter, p, n, stop_token_ids=[EOS], block_size=block_size)
        assert res.tokens == alone.tokens and res.stop_reason == alone.stop_reason


@pytest.mark.parametrize("every", [2, 3, 5])
def test_rows_commit_their_own_number_of_tokens(every):
    target, _ = cached_target("qwen3")
    refs = {tuple(p): hf_greedy(target, p, 40, eos=None) for p in PROMPTS}
    results = batch_generate(target, NoisyOracle(refs, every), [
        BatchRequest(p, max_new_tokens=40, stop_token_ids=[]) for p in PROMPTS], block_size=6)
    lengths = set()
    for p, res in zip(PROMPTS, results):
        assert res.tokens == refs[tuple(p)]
        lengths |= set(res.stats.acceptance_lengths)
    assert len(lengths) > 3      # rows really accepted different numbers of tokens


def test_adaptive_block_size_in_a_batch_is_lossless():
    target, drafter = cached_target("qwen2")
    curve = CostCurve("t", "fast", 256, {q: 5.0 + 0.2 * q for q in range(1, 65)}, draft_ms=0.5)
    policy = AdaptiveBlockSize(curve, max_drafts=15, explore_every=2)
    results = batch_generate(target, drafter, [BatchRequest(p, 24, stop_token_ids=[EOS]) for p in PROMPTS],
                             block_size=policy)
    for p, res in zip(PROMPTS, results):
        assert res.tokens == hf_greedy(target, p, 24)
    assert sum(policy.observed) > 0


def test_a_row_that_stops_early_leaves_the_others_untouched():
    target, drafter = cached_target("llama")
    seen = []

    def stop_after_three(new_ids, from_draft):
        seen.extend(new_ids)
        return len(seen) < 3

    reqs = [BatchRequest(p, 20, stop_token_ids=[]) for p in PROMPTS[:3]]
    reqs[1].on_commit = stop_after_three
    results = batch_generate(target, drafter, reqs, block_size=3)
    assert results[1].stop_reason == "aborted" and 3 <= len(results[1].tokens) < 20
    for i in (0, 2):
        assert results[i].tokens == hf_greedy(target, PROMPTS[i], 20, eos=None)


def test_bad_requests_raise_clear_errors():
    target, drafter = cached_target("qwen2")
    with pytest.raises(ValueError, match="empty"):
        batch_generate(target, drafter, [BatchRequest([], 4)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        batch_generate(target, drafter, [BatchRequest([3], 0)])
    with pytest.raises(ValueError, match="token ids must be in"):
        batch_generate(target, drafter, [BatchRequest([3, 10_000], 4)])
    assert batch_generate(target, drafter, []) == []


@pytest.mark.parametrize("acceptance,kind", [("match", "random"), ("rejection", "random"),
                                             ("rejection", "target")])
def test_batched_sampling_matches_target_distribution(acceptance, kind):
    from dflashkit.drafter import config_for_target, init_drafter
    from tests.conftest import MASK, tiny_target
    target = tiny_target("qwen2", seed=1, temperature_scale=0.6)
    prompt, other, length = [9, 14, 27, 3], [5, 6, 7, 8, 9, 10, 11], 3
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    dist = exact_distribution(target, prompt, length, sampling)
    proposer = (init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
                if kind == "random" else _TargetAsDrafter(target, len(prompt)))
    samples = []
    for batch in range(250):     # 4 rows of the prompt + 2 rows of another one per batch
        reqs = [BatchRequest(prompt if j < 4 else other, length, stop_token_ids=[],
                             sampling=SamplingConfig(1.0, 1.0, 3, seed=batch * 6 + j)) for j in range(6)]
        res = batch_generate(target, proposer, reqs, block_size=4, acceptance=acceptance)
        samples += [tuple(r.tokens) for r in res[:4]]
    p = chi_square_pvalue(samples, dist)
    assert p > ALPHA, f"batched samples deviate from the target's distribution (p={p:.2e})"


@pytest.mark.parametrize("fast", [True, False])
def test_requests_joining_a_running_batch_get_their_own_output(fast):
    """Continuous batching: rows admitted at later steps (prompts longer and shorter than the
    running cache) still equal generation alone, and so do the rows already running."""
    from dflashkit.batch import BatchDecoder
    target, drafter = cached_target("qwen2")
    target.set_fast_path(fast)
    try:
        finished = {}
        decoder = BatchDecoder(target, drafter, block_size=4)

        def req(i, p, n):
            return BatchRequest(p, n, stop_token_ids=[EOS],
                                on_finish=lambda res, i=i: finished.setdefault(i, res))
        jobs = {0: ([3, 4, 5], 30), 1: ([9] * 12, 25), 2: (list(range(20, 60)), 20),
                3: ([77, 5], 18), 4: (list(range(50, 57)), 12)}
        decoder.add([req(0, *jobs[0]), req(1, *jobs[1])])
        for step in range(12):
            if step == 2:
                decoder.add([req(2, *jobs[2])])          # longer than the running cache
            if step == 6:
                decoder.add([req(3, *jobs[3]), req(4, *jobs[4])])   # shorter ones
            decoder.step()
        while decoder.active:
            decoder.step()
        assert sorted(finished) == [0, 1, 2, 3, 4]
        for i, (p, n) in jobs.items():
            assert finished[i].tokens == hf_greedy(target, p, n), i
    finally:
        target.set_fast_path(True)
