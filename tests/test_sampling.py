"""Sampling is lossless: speculative samples follow the target's own distribution exactly.

Goodness of fit: continuations of length L under top-k have at most k**L outcomes; their exact
probabilities come from the target's processed distributions, enumerated. A chi-square test
at significance 1e-3 (false-alarm rate 0.1% per test; seeds are fixed, so the run is
deterministic) compares them with N speculative samples.
"""


import copy

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from dflashkit.decoding import speculative_generate
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.sampling import SamplingConfig, target_probs
from tests.conftest import MASK, tiny_target
from dflashkit.policy import AdaptiveBlockSize
from tests.test_decoding import OracleProposer, hf_greedy
from tests.test_policy import curve

ALPHA = 1e-3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 7, 0.6)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    got = target_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(got, expected)


def exact_distribution(target, prompt, length, sampling):
    """P(continuation) for every continuation of ``length`` tokens, by enumeration."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in dist.items():
            ids = torch.tensor([prompt + list(seq)], device=target.device)
            logits = target.model(input_ids=ids).logits[0, -1]
            probs = target_probs(logits, sampling)
            for tok in torch.nonzero(probs > 0).flatten().tolist():
                nxt[seq + (tok,)] = p * float(probs[tok])
        dist = nxt
    return dist


def chi_square_pvalue(samples, dist):
    outcomes = sorted(dist)
    counts = {o: 0 for o in outcomes}
    for s in samples:
        assert s in counts, f"sampled continuation {s} has probability 0 under the target"
        counts[s] += 1
    n = len(samples)
    observed = [counts[o] for o in outcomes]
    expected = [dist[o] * n for o in outcomes]
    total = sum(expected)
    expected = [e * n / total for e in expected]
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("acceptance,proposer_kind,sampling,adaptive", [
    ("match", "oracle", SamplingConfig(temperature=1.0, top_k=3), False),
    ("match", "random", SamplingConfig(temperature=0.8, top_k=4), False),
    ("match", "oracle", SamplingConfig(temperature=1.2, top_p=0.7, top_k=6), False),
    ("rejection", "random", SamplingConfig(temperature=1.0, top_k=3), False),
    ("rejection", "drafter_equals_target", SamplingConfig(temperature=1.0, top_k=3), False),
    # the adaptive block size: the number of verified drafts changes from step to step
    ("match", "oracle", SamplingConfig(temperature=1.0, top_k=3), True),
    ("rejection", "drafter_equals_target", SamplingConfig(temperature=1.0, top_k=3), True),
])
def test_speculative_sampling_matches_target_distribution(acceptance, proposer_kind, sampling, adaptive):
    target = tiny_target("qwen2", seed=1, temperature_scale=0.6)
    prompt, length, n = [9, 14, 27, 3], 3, 1000
    dist = exact_distribution(target, prompt, length, sampling)
    if proposer_kind == "random":
        proposer = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    elif proposer_kind == "oracle":
        proposer = OracleProposer(hf_greedy(target, prompt, length, eos=None), len(prompt))
    else:
        proposer = _TargetAsDrafter(target, len(prompt))
    block = 4
    if adaptive:   # the policy in the loop (fixed costs: the choice must not depend on timing)
        block = AdaptiveBlockSize(curve({1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5}, draft=1.0),
                                  max_drafts=3, explore_every=2, learn_costs=False)
    samples, drafted = [], [0, 0, 0]
    for seed in range(n):
        s = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, seed=seed)
        res = speculative_generate(target, proposer, prompt, max_new_tokens=length, sampling=s,
                                   block_size=block, stop_token_ids=[], acceptance=acceptance)
        drafted = [d + x for d, x in zip(drafted, res.stats.slot_drafted)]
        samples.append(tuple(res.tokens))
    p = chi_square_pvalue(samples, dist)
    assert p > ALPHA, f"speculative samples deviate from the target's distribution (p={p:.2e})"
    if adaptive:   # the policy drafted (3 new tokens, the first from the prefill: 0 or 1 per step)
        assert drafted[0] > 0, drafted


def test_goodness_of_fit_detects_a_biased_sampler():
    """The test above can fail: greedy-biased samples are rejected."""
    target = tiny_target("qwen2", seed=1, temperature_scale=0.6)
    prompt, length = [9, 14, 27, 3], 3
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    dist = exact_distribution(target, prompt, length, sampling)
    greedy = tuple(hf_greedy(target, prompt, length, eos=None))
    samples = []
    for seed in range(1000):
        res = speculative_generate(target, None, prompt, max_new_tokens=length, stop_token_ids=[],
                                   sampling=SamplingConfig(1.0, 1.0, 3, seed=seed))
        samples.append(greedy if seed % 4 == 0 else tuple(res.tokens))  # 25% extra greedy mass
    assert chi_square_pvalue(samples, dist) < ALPHA


class _TargetAsDrafter:
    """Proposes by sampling the target itself (q == p): rejection sampling accepts everything."""

    feature_layers = [0]

    def __init__(self, target, prompt_len):
        self.target = target

    def begin(self):
        pass

    def propose(self, committed, new_features, num_slots, sampling, generator):
        seq = committed.tolist()
        toks, probs = [], []
        for _ in range(num_slots):
            logits = self.target.model(input_ids=torch.tensor([seq])).logits[0, -1]
            p = target_probs(logits, sampling)
            t = int(torch.multinomial(p, 1, generator=generator))
            toks.append(t), probs.append(p), seq.append(t)
        return torch.tensor(toks), torch.stack(probs)


def test_seeded_sampling_is_reproducible():
    target = tiny_target("llama", seed=2)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    s = SamplingConfig(temperature=1.0, top_p=0.9, seed=123)
    a = speculative_generate(target, drafter, [5, 6, 7], max_new_tokens=20, sampling=s)
    b = speculative_generate(target, drafter, [5, 6, 7], max_new_tokens=20, sampling=s)
    assert a.tokens == b.tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
@pytest.mark.parametrize("acceptance", ["match", "rejection"])
def test_sampling_on_a_gpu_matches_the_targets_distribution_and_the_cpus_draws(acceptance):
    """On a GPU, speculative samples follow the target's exact distribution (enumerated on the
    same GPU), and a seed draws the same tokens as on the CPU (fp64: the probabilities agree)."""
    from dflashkit.target import Target
    cpu = tiny_target("qwen2", seed=1, dtype=torch.float64, temperature_scale=0.6)
    cpu.set_fast_path(False)
    cpu_drafter = init_drafter(config_for_target(cpu, num_layers=1, block_size=4, mask_token_id=MASK))
    gpu = Target(copy.deepcopy(cpu.model).to("cuda"), None, name="tiny-qwen2-cuda")
    gpu_drafter = copy.deepcopy(cpu_drafter).to("cuda")
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    prompt, length, n = [9, 14, 27, 3], 3, 1000
    dist = exact_distribution(gpu, prompt, length, sampling)
    samples = []
    for seed in range(n):
        s = SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, seed=seed)
        res = speculative_generate(gpu, gpu_drafter, prompt, max_new_tokens=length, sampling=s,
                                   block_size=4, stop_token_ids=[], acceptance=acceptance)
        samples.append(tuple(res.tokens))
        if seed < 20:
            there = speculative_generate(cpu, cpu_drafter, prompt, max_new_tokens=length,
                                         sampling=s, block_size=4, stop_token_ids=[],
                                         acceptance=acceptance)
            assert there.tokens == res.tokens
    p = chi_square_pvalue(samples, dist)
    assert p > ALPHA, f"speculative samples on the GPU deviate from the target's distribution (p={p:.2e})"
