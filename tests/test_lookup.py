"""Context lookup: the index finds what a brute-force scan finds, and copying stays lossless."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashkit.bench import check_method_names
from dflashkit.decoding import speculative_generate
from dflashkit.lookup import ContextLookup
from dflashkit.policy import AdaptiveBlockSize
from tests.conftest import EOS
from tests.test_decoding import cached_target, hf_greedy
from tests.test_policy import curve


def brute_force(tokens, limit, min_n, max_n):
    """The continuation of the latest earlier occurrence of the longest matching suffix."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + limit]
    return []


def test_latest_occurrence_of_the_longest_ngram_wins():
    lookup = ContextLookup(min_ngram=2, max_ngram=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]
    # (6, 7) last occurred at 4-5 (-> 2), but (5, 6, 7) occurred at 0-2 (-> 1): longest wins
    assert lookup.propose(seq, 3) == [1, 6, 7]
    assert lookup.propose(seq + [9], 3) == []            # (7, 9) and (6, 7, 9) never occurred
    lookup.reset()
    assert lookup.propose([4, 4], 5) == []                 # the suffix itself is no occurrence
    assert lookup.propose([4, 4, 4], 5) == [4]             # (4, 4) at 0-1 -> what followed it
    assert lookup.propose([4, 4, 4, 4], 0) == []           # no room to copy


def test_a_sequence_that_is_not_a_continuation_starts_over():
    lookup = ContextLookup(min_ngram=2, max_ngram=2)
    assert lookup.propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert lookup.propose([8, 9, 8, 9], 4) == [8, 9]       # nothing of [1, 2, ...] leaks in
    assert lookup.propose([1, 2, 8], 4) == []


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup(min_ngram=0)
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup(min_ngram=3, max_ngram=2)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
       cuts=st.lists(st.integers(1, 60), max_size=6),
       limit=st.integers(0, 6), bounds=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 3)]))
def test_incremental_index_equals_a_brute_force_scan(tokens, cuts, limit, bounds):
    lookup = ContextLookup(*bounds)
    for end in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        assert lookup.propose(tokens[:end], limit) == brute_force(tokens[:end], limit, *bounds)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, 12), min_size=4, max_size=20),
       block_size=st.sampled_from([2, 4, 8]), max_new=st.integers(1, 40))
@pytest.mark.parametrize("family_name", ["qwen2", "llama"])
def test_copying_is_lossless_with_and_without_a_drafter(family_name, prompt, block_size, max_new):
    """Prompts from a few ids repeat n-grams, so copies are proposed (and some accepted)."""
    target, drafter = cached_target(family_name)
    ref = hf_greedy(target, prompt, max_new)
    for proposer in (drafter, None):
        res = speculative_generate(target, proposer, prompt, max_new_tokens=max_new, block_size=block_size,
                                   stop_token_ids=[EOS], lookup=True)
        assert res.tokens == ref
        st_ = res.stats
        assert sum(st_.acceptance_lengths) + 1 == len(res.tokens)
        assert st_.lookup_accepted <= sum(a - 1 for a in st_.acceptance_lengths)
        if proposer is None:   # no drafter: every accepted draft was a copy
            assert st_.lookup_accepted == sum(a - 1 for a in st_.acceptance_lengths)
            assert sum(st_.slot_drafted) == 0


def test_copies_are_proposed_accepted_and_kept_out_of_the_drafter_statistics():
    target, drafter = cached_target("qwen2")
    prompt = [5, 6, 7, 8] * 6      # a looping prompt: the target tends to continue the loop
    ref = hf_greedy(target, prompt, 40, eos=None)
    plain = speculative_generate(target, drafter, prompt, max_new_tokens=40, block_size=8, stop_token_ids=[])
    copied = speculative_generate(target, drafter, prompt, max_new_tokens=40, block_size=8,
                                  stop_token_ids=[], lookup=True)
    assert plain.tokens == copied.tokens == ref
    st_ = copied.stats
    assert st_.lookup_steps > 0
    drafted_steps = sum(v > 1 for v in st_.verify_sizes) - st_.lookup_steps
    assert st_.slot_drafted[0] == drafted_steps        # slot statistics count drafter blocks only
    assert st_.lookup_accepted > 0
    assert st_.to_dict()["lookup_steps"] == st_.lookup_steps


def test_copying_with_the_adaptive_block_size_is_lossless():
    target, drafter = cached_target("llama")
    policy = AdaptiveBlockSize(curve({q: 10.0 + q for q in range(1, 17)}, draft=1.0), max_drafts=7,
                               learn_costs=False)
    for prompt in ([9, 10, 11] * 5, [3, 4, 5, 6, 7, 3, 4]):
        res = speculative_generate(target, drafter, prompt, max_new_tokens=30, block_size=policy,
                                   stop_token_ids=[], lookup=True)
        assert res.tokens == hf_greedy(target, prompt, 30, eos=None)


def test_lookup_alone_needs_a_block_above_one_token_and_method_names_are_checked():
    target, _ = cached_target("qwen2")
    res = speculative_generate(target, None, [4, 5, 4, 5], max_new_tokens=6, block_size=4, lookup=True)
    assert res.tokens == hf_greedy(target, [4, 5, 4, 5], 6)
    with pytest.raises(ValueError, match="lookup=True"):
        speculative_generate(target, None, [4, 5], max_new_tokens=3, block_size=4)
    check_method_names(["ar", "lookup", "lookup:4", "dflash+lookup", "dflash+lookup:3", "dflash+lookup:auto"])
    with pytest.raises(ValueError, match="integer >= 2"):
        check_method_names(["ar", "lookup:1"])
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        check_method_names(["ar", "dflash+lookup:x"])


@pytest.mark.parametrize("acceptance", ["match", "rejection"])
def test_sampling_with_copies_matches_the_target_distribution(acceptance):
    """A deterministic copy under either acceptance rule: the samples follow the target's own
    distribution (chi-square as in test_sampling.py). The prompt holds most ids, so a 1-gram
    lookup finds something to copy in many runs."""
    from dflashkit.drafter import config_for_target, init_drafter
    from dflashkit.sampling import SamplingConfig
    from tests.conftest import MASK, tiny_target
    from tests.test_sampling import ALPHA, chi_square_pvalue, exact_distribution
    target = tiny_target("qwen2", seed=1, temperature_scale=0.6)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    prompt, length = list(range(3, 60)) + [9, 14, 27], 3
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    dist = exact_distribution(target, prompt, length, sampling)
    samples, copies = [], 0
    for seed in range(1000):
        res = speculative_generate(target, drafter, prompt, max_new_tokens=length, block_size=4,
                                   sampling=SamplingConfig(1.0, 1.0, 3, seed=seed), stop_token_ids=[],
                                   acceptance=acceptance, lookup=ContextLookup(min_ngram=1))
        samples.append(tuple(res.tokens))
        copies += res.stats.lookup_steps
    assert copies > 250     # (measured: 334 steps of the 1000 runs verified a copy)
    p = chi_square_pvalue(samples, dist)
    assert p > ALPHA, f"samples with copies deviate from the target's distribution (p={p:.2e})"
