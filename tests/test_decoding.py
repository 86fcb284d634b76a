"""The decoding loop is lossless: greedy tokens equal Hugging Face generate(do_sample=False)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashkit.decoding import GenerationResult, speculative_generate
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.sampling import SamplingConfig
from tests.conftest import EOS, MASK, VOCAB, tiny_target


def hf_greedy(target, prompt, max_new_tokens, eos=EOS):
    """The target's own greedy output, from transformers with its default kernels (the
    reference must not run on the path under test)."""
    ids = torch.tensor([prompt], device=target.device)
    gen_cfg = target.model.generation_config
    gen_cfg.eos_token_id = eos
    with target.default_path():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, pad_token_id=0,
                                    generation_config=gen_cfg)
    return out[0, len(prompt):].tolist()


class OracleProposer:
    """Proposes the target's true continuation: every proposal is accepted."""

    feature_layers = [0]

    def __init__(self, continuation, prompt_len):
        self.continuation, self.prompt_len = continuation, prompt_len
        self.calls = 0

    def begin(self):
        self.calls = 0

    def propose(self, committed, new_features, num_slots, sampling, generator):
        self.calls += 1
        done = committed.shape[-1] - self.prompt_len
        nxt = self.continuation[done:done + num_slots]
        nxt = nxt + [3] * (num_slots - len(nxt))
        return torch.tensor(nxt), None


_TARGETS = {}


def cached_target(family, seed=0):
    key = (family, seed)
    if key not in _TARGETS:
        t = tiny_target(family, seed=seed, temperature_scale=3.0)
        d = init_drafter(config_for_target(t, num_layers=2, block_size=16, mask_token_id=MASK), seed=seed)
        _TARGETS[key] = (t, d)
    return _TARGETS[key]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, VOCAB - 2), min_size=1, max_size=24),
       block_size=st.sampled_from([1, 2, 3, 4, 7, 16]),
       max_new=st.integers(1, 40))
@pytest.mark.parametrize("family_name", ["qwen2", "qwen3", "llama"])
def test_greedy_random_drafter_equals_hf_generate(family_name, prompt, block_size, max_new):
    target, drafter = cached_target(family_name)
    ref = hf_greedy(target, prompt, max_new)
    res = speculative_generate(target, drafter, prompt, max_new_tokens=max_new,
                               block_size=block_size, stop_token_ids=[EOS])
    assert res.tokens == ref
    assert sum(res.stats.acceptance_lengths) + 1 == len(res.tokens)
    assert all(1 <= a <= block_size for a in res.stats.acceptance_lengths)


def _long_reference(target, prompt, n):
    """A continuation without stop tokens, so oracle blocks are never cut short."""
    return hf_greedy(target, prompt, n, eos=None)


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_oracle_whole_blocks_accepted(family, block_size):
    target, _ = cached_target(family)
    prompt = [7, 11, 13, 17, 19]
    steps = 3
    n = 1 + steps * block_size
    ref = _long_reference(target, prompt, n)
    oracle = OracleProposer(ref, len(prompt))
    res = speculative_generate(target, oracle, prompt, max_new_tokens=n, block_size=block_size,
                               stop_token_ids=[])
    assert res.tokens == ref
    assert res.stats.acceptance_lengths == [block_size] * steps  # B-1 drafts + the bonus
    assert res.stats.slot_acceptance_rates() == [1.0] * (block_size - 1)
    assert res.stop_reason == "max_new_tokens"


def test_oracle_max_new_tokens_inside_a_block(family):
    target, _ = cached_target(family)
    prompt, b = [5, 9, 33, 60], 8
    ref = _long_reference(target, prompt, 40)
    for max_new in (1, 2, 8, 9, 10, 12, 1 + 2 * b + 3):
        res = speculative_generate(target, OracleProposer(ref, len(prompt)), prompt,
                                   max_new_tokens=max_new, block_size=b, stop_token_ids=[])
        assert res.tokens == ref[:max_new], max_new
        assert len(res.tokens) == max_new


def test_oracle_stop_token_inside_an_accepted_block(family):
    target, _ = cached_target(family)
    prompt, b = [21, 22, 23], 8
    ref = _long_reference(target, prompt, 40)
    # A stop id whose first occurrence falls strictly inside the second block.
    for k in range(b + 2, 2 * b):
        if ref[k] not in ref[:k]:
            break
    else:
        pytest.skip("no fresh token inside the block")
    res = speculative_generate(target, OracleProposer(ref, len(prompt)), prompt,
                               max_new_tokens=40, block_size=b, stop_token_ids=[ref[k]])
    assert res.tokens == ref[:k + 1]
    assert res.stop_reason == "stop_token"
    assert res.stats.acceptance_lengths[-1] == k + 1 - 1 - b


def test_first_token_stop_and_streaming(family):
    target, drafter = cached_target(family)
    prompt = [30, 31, 32]
    ref = hf_greedy(target, prompt, 30)
    res = speculative_generate(target, drafter, prompt, max_new_tokens=30, block_size=4,
                               stop_token_ids=[ref[0]])
    assert res.tokens == ref[:1] and res.stop_reason == "stop_token"
    streamed = []
    res = speculative_generate(target, drafter, prompt, max_new_tokens=30, block_size=4,
                               stop_token_ids=[EOS], on_commit=lambda ids, _a: streamed.extend(ids))
    assert streamed == res.tokens == ref


def test_float64_long_generation_bitwise_stable():
    """A longer run in float64, where block and single-token passes cannot tie-break apart."""
    target = tiny_target("qwen3", seed=3, dtype=torch.float64, temperature_scale=3.0)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=16, mask_token_id=MASK))
    prompt = list(range(10, 40))
    ref = hf_greedy(target, prompt, 200, eos=None)
    oracle = OracleProposer(ref, len(prompt))
    for proposer in (drafter, oracle):
        res = speculative_generate(target, proposer, prompt, max_new_tokens=200, stop_token_ids=[])
        assert res.tokens == ref


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(block_size=0),
    dict(acceptance="bogus"), dict(prompt=[]), dict(prompt=[VOCAB + 5]),
    dict(max_new_tokens=5000),
])
def test_bad_arguments_raise_clear_errors(bad):
    target, drafter = cached_target("qwen2")
    prompt = bad.pop("prompt", [4, 5, 6])
    with pytest.raises(ValueError) as err:
        speculative_generate(target, drafter, prompt, **{"max_new_tokens": 5, **bad})
    assert str(err.value)


def test_block_size_above_one_needs_a_drafter():
    target, _ = cached_target("qwen2")
    with pytest.raises(ValueError, match="needs a drafter"):
        speculative_generate(target, None, [4, 5], max_new_tokens=3, block_size=4)
    res = speculative_generate(target, None, [4, 5], max_new_tokens=3)
    assert isinstance(res, GenerationResult) and res.stats.acceptance_lengths == [1, 1]


def test_sampling_config_validation():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(top_k=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_a_bad_device_is_refused_before_a_model_loads(capsys):
    """--device / load_target(device=...): a clear error, not a traceback from deep in torch,
    and before the minute a model takes to load."""
    from dflashkit.cli import main
    from dflashkit.target import TargetError, resolve_device
    assert resolve_device(None) == torch.device("cpu") == resolve_device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(TargetError, match="is not a device: use cpu, cuda, cuda:N or auto"):
        resolve_device("gpu0")
    with pytest.raises(TargetError, match="cpu or cuda only"):
        resolve_device("meta")
    if torch.cuda.is_available():
        with pytest.raises(TargetError, match=r"only \d+ CUDA GPU\(s\) here"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(TargetError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    code = main(["generate", "--target", "/nonexistent/target", "--block-size", "1",
                 "--prompt", "x", "--device", "cuda:x"])
    assert code == 2 and "--device 'cuda:x' is not a device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
def test_a_target_loaded_onto_a_gpu_takes_the_drafter_with_it(tmp_path):
    """load_target(device="cuda") (what --device cuda does in generate, bench and serve):
    the weights go straight to the GPU (the CPU's packed fast-path weights could not move),
    a drafter made on the CPU follows the target there, greedy output is transformers' own on
    that GPU, and the adaptive policy's cost curve times GPU passes (synchronised)."""
    from dflashkit.costs import cost_curve
    from dflashkit.decoding import DFlashProposer
    from dflashkit.target import load_target
    tiny_target("qwen2", seed=6, temperature_scale=3.0).model.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target", progress=False, device="cuda")
    assert target.device.type == "cuda" and not target.fast_path
    drafter = init_drafter(config_for_target(target, num_layers=2, block_size=8, mask_token_id=MASK),
                           seed=6)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        prompt = torch.randint(3, VOCAB - 2, (int(torch.randint(1, 24, (1,), generator=g)),),
                               generator=g).tolist()
        res = speculative_generate(target, drafter, prompt, max_new_tokens=40, block_size=8,
                                   stop_token_ids=[])
        assert res.tokens == hf_greedy(target, prompt, 40, eos=None)
    assert next(drafter.parameters()).is_cuda
    curve = cost_curve(target, DFlashProposer(drafter, target), max_q=4, kv_length=64, rounds=3,
                       use_cache=False)
    assert all(ms > 0 for ms in curve.verify_ms.values()) and curve.draft_ms > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch.cuda)")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_on_a_gpu_equals_hf_generate_there(dtype):
    """The loop keeps every tensor on the target's device: on a GPU, speculative greedy output
    (a random drafter, block 8, and the oracle that accepts whole blocks) is the target's own
    greedy output from transformers on the same GPU."""
    from dflashkit.target import Target
    base = tiny_target("qwen2", seed=5, dtype=dtype, temperature_scale=3.0)
    base.set_fast_path(False)   # the CPU's prepacked (oneDNN) weights cannot move to a GPU
    target = Target(base.model.to("cuda"), None, name="tiny-qwen2-cuda")
    assert target.device.type == "cuda"
    drafter = init_drafter(config_for_target(target, num_layers=2, block_size=8,
                                             mask_token_id=MASK), seed=5).to("cuda")
    g = torch.Generator().manual_seed(5)
    for n in range(6):
        prompt = torch.randint(3, VOCAB - 2, (int(torch.randint(1, 24, (1,), generator=g)),),
                               generator=g).tolist()
        ref = hf_greedy(target, prompt, 48, eos=None)
        res = speculative_generate(target, drafter, prompt, max_new_tokens=48, block_size=8,
                                   stop_token_ids=[])
        assert res.tokens == ref
        oracle = OracleProposer(ref, len(prompt))
        whole = speculative_generate(target, oracle, prompt, max_new_tokens=48, block_size=8,
                                     stop_token_ids=[])
        assert whole.tokens == ref
        assert max(whole.stats.acceptance_lengths) == 8
