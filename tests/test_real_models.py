"""Real models prepared from PyPI packages: the promise holds on Qwen2.5-Coder and SmolLM2."""

import json

import pytest
import torch

from dflashkit.cli import main as cli_main
from dflashkit.decoding import speculative_generate
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.fastpath import bf16_fast
from dflashkit.models import prepare_model
from dflashkit.target import load_target
from tests.test_decoding import OracleProposer

pytestmark = pytest.mark.real_model
QWEN = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"
PROMPT = "Write a Python function that checks whether a string is a palindrome."


@pytest.fixture(scope="module")
def qwen():
    prepare_model(QWEN, progress=False)
    return load_target(QWEN, progress=False)


def test_cli_generate_with_fresh_drafter_equals_target_greedy(tmp_path, capsys):
    drafter_dir = tmp_path / "drafter"
    assert cli_main(["drafter", "init", "--target", QWEN, "--out", str(drafter_dir),
                     "--block-size", "4"]) == 0
    capsys.readouterr()
    rc = cli_main(["generate", "--target", QWEN, "--drafter", str(drafter_dir), "--prompt", PROMPT,
                   "--max-new-tokens", "24", "--compare", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert len(report["tokens"]) == 24
    assert report["compare"]["hf_generate"]["identical"], "differs from HF generate greedy"
    assert report["compare"]["ar_loop"]["identical"]
    assert "palindrome" in report["text"].lower() or "def " in report["text"]


def test_draft_trees_with_the_shipped_drafter_are_lossless(qwen, capsys):
    """`dflashkit generate --tree N`: the output is the target's own (HF generate and the plain
    loop), through the CLI and with a wider tree from Python."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    rc = cli_main(["generate", "--target", QWEN, "--prompt", PROMPT, "--max-new-tokens", "48",
                   "--tree", "7", "--compare", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(report["tokens"]) == 48
    assert report["compare"]["hf_generate"]["identical"] and report["compare"]["ar_loop"]["identical"]
    assert max(report["verify_sizes"]) == 8 and max(report["acceptance_lengths"]) > 1
    ids = qwen.encode_prompt("Write a Python function that merges two sorted lists.")
    plain = speculative_generate(qwen, None, ids, max_new_tokens=64, block_size=1)
    wide = speculative_generate(qwen, load_drafter(shipped_drafter(QWEN)), ids, max_new_tokens=64, tree=24)
    assert wide.tokens == plain.tokens and max(wide.stats.verify_sizes) == 25


def test_mask_id_and_stop_ids_of_the_real_tokenizer(qwen):
    cfg = config_for_target(qwen, num_layers=1)
    assert cfg.mask_token_id == 151665          # first row after the real vocabulary
    assert set(qwen.stop_token_ids()) == {151645, 151643}
    assert cfg.target_layer_ids == [12] and cfg.num_target_layers == 24
    assert config_for_target(qwen, num_layers=5).target_layer_ids == [1, 6, 11, 16, 21]


def test_whole_accepted_blocks_on_the_real_model(qwen):
    """With the true continuation proposed, 8-token verify passes keep greedy output exact."""
    ids = qwen.encode_prompt(PROMPT)
    plain = speculative_generate(qwen, None, ids, max_new_tokens=33, block_size=1, stop_token_ids=[])
    oracle = OracleProposer(plain.tokens, len(ids))
    res = speculative_generate(qwen, oracle, ids, max_new_tokens=33, block_size=8, stop_token_ids=[])
    assert res.tokens == plain.tokens
    assert res.stats.acceptance_lengths == [8, 8, 8, 8]


def test_llama_target_smollm2(tmp_path):
    target = load_target(SMOL, progress=False)
    cfg = config_for_target(target, num_layers=1, block_size=4)
    assert cfg.mask_token_id not in target.stop_token_ids() + [target.pad_token_id()]
    ids = target.encode_prompt("What is 2 + 2?")
    ref = target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    res = speculative_generate(target, init_drafter(cfg), ids, max_new_tokens=16)
    stops = target.stop_token_ids()
    cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
    assert res.tokens == ref[:cut]


def test_fast_path_equals_default_path_on_the_real_model(qwen):
    """Prepacked kernels + in-place cache give the same greedy tokens as PyTorch's defaults,
    with the shipped drafter at a fixed and at the adaptive block size."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    drafter = load_drafter(shipped_drafter(QWEN))
    ids = qwen.encode_prompt(PROMPT)
    runs = {}
    for fast in (False, True):
        qwen.set_fast_path(fast)
        runs[fast, 1] = speculative_generate(qwen, None, ids, max_new_tokens=48, block_size=1).tokens
        runs[fast, 4] = speculative_generate(qwen, drafter, ids, max_new_tokens=48, block_size=4).tokens
    runs["auto"] = speculative_generate(qwen, drafter, ids, max_new_tokens=48, block_size="auto").tokens
    qwen.set_fast_path(True)
    assert len(set(map(tuple, runs.values()))) == 1, runs


def test_copying_from_the_context_is_lossless_on_the_real_model(qwen):
    """The shipped drafter with context copies (and copies alone) give the target's own greedy
    tokens; a coding answer repeats the prompt's names, so copies are verified and accepted."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    drafter = load_drafter(shipped_drafter(QWEN))
    ids = qwen.encode_prompt(PROMPT)
    plain = speculative_generate(qwen, None, ids, max_new_tokens=64, block_size=1)
    hybrid = speculative_generate(qwen, drafter, ids, max_new_tokens=64, block_size=8, lookup=True)
    alone = speculative_generate(qwen, None, ids, max_new_tokens=64, block_size=8, lookup=True)
    assert hybrid.tokens == plain.tokens and alone.tokens == plain.tokens
    assert hybrid.stats.lookup_accepted > 0 and hybrid.stats.lookup_steps < len(hybrid.stats.acceptance_lengths)


@pytest.mark.skipif(not bf16_fast(), reason="this CPU has no bf16 matrix arithmetic (AMX)")
def test_bf16_fast_path_equals_its_plain_loop_on_the_real_model():
    """bf16 (opt-in): speculative output, alone and in a batch with holes, is exactly the
    bf16 plain loop's; block sizes 8 and auto with the shipped drafter."""
    from dflashkit.batch import BatchRequest, batch_generate
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    target = load_target(QWEN, dtype="bfloat16", progress=False)
    assert target.fast_path and target.dtype == torch.bfloat16
    drafter = load_drafter(shipped_drafter(QWEN))
    prompts = [PROMPT, "What is 17 * 23? Explain briefly."]
    ids = [target.encode_prompt(p) for p in prompts]
    plain = [speculative_generate(target, None, i, max_new_tokens=40, block_size=1).tokens for i in ids]
    for bs in (8, "auto"):
        assert [speculative_generate(target, drafter, i, max_new_tokens=40, block_size=bs).tokens
                for i in ids] == plain, bs
    assert [speculative_generate(target, drafter, i, max_new_tokens=40, tree=7).tokens for i in ids] == plain
    batched = batch_generate(target, drafter, [BatchRequest(i, 40) for i in ids], block_size=4)
    assert [r.tokens for r in batched] == plain


def test_warm_start_from_the_real_target_reads_its_layers_by_name(qwen):
    """drafter.init: target on Qwen2.5 (attention biases dropped): the drafter's context is
    what target layer 22 normalises its input to, read straight from the safetensors files."""
    from dflashkit.drafter import warm_start_from_target
    from dflashkit.target import read_target_tensors
    cfg = config_for_target(qwen, num_layers=1, block_size=8, target_layer_ids=[1, 6, 11, 16, 21])
    drafter = init_drafter(cfg)
    assert warm_start_from_target(drafter, lambda names: read_target_tensors(QWEN, names)) == [22]
    ids = torch.tensor([qwen.encode_prompt(PROMPT)])
    with qwen.default_path(), torch.no_grad():
        hidden = qwen.model(ids, output_hidden_states=True).hidden_states
        expected = qwen.model.model.layers[22].input_layernorm(hidden[22])
        context = drafter.project_context(torch.cat([hidden[j + 1] for j in cfg.target_layer_ids], -1))
    torch.testing.assert_close(context, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no tensor named"):
        read_target_tensors(QWEN, ["model.layers.99.mlp.up_proj.weight"])


def test_teacher_forced_walk_reproduces_decodings_acceptance_on_the_real_model(qwen):
    """tfeval: one target forward over the greedy answer and one training-path drafter pass
    give, walked the way decoding walks, the acceptance lengths decoding reports."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    from dflashkit.tfeval import acceptance_profile, greedy_walk, leading_accepted, proposal_head
    drafter = load_drafter(shipped_drafter(QWEN))
    ids = qwen.encode_prompt(PROMPT)
    res = speculative_generate(qwen, drafter, ids, max_new_tokens=64, block_size=8, stop_token_ids=[])
    seq = torch.tensor(ids + res.tokens)
    feats = qwen.forward(seq[None], 0, None, capture=drafter.target_layer_ids, last_only=True).features
    assert torch.equal(qwen.features(seq[None], drafter.target_layer_ids), feats)   # training's early-stopped pass
    head, index = proposal_head(drafter, qwen)
    anchors, leading, _, _ = leading_accepted(drafter, qwen.embed, head, seq, len(ids), feats, 8, index)
    walk = [n + 1 for n in greedy_walk(anchors, leading)]
    lengths = res.stats.acceptance_lengths
    assert sum(lengths) == 63 and max(lengths) > 1   # the prefill commits the first token
    # decoding's last step is cut at max_new_tokens; every step before it agrees exactly
    assert walk[:len(lengths) - 1] == lengths[:-1]
    profile = acceptance_profile(drafter, qwen, [(seq, len(ids))], [feats])
    assert profile.walk_steps >= len(lengths) - 1 and profile.tau_every_position >= 1.0


def test_teacher_forced_tree_walk_reproduces_tree_decoding_on_the_real_model(qwen):
    """tfeval for draft trees: the tree built from the training-path drafter pass at each anchor,
    walked along the answer, accepts what tree decoding accepted at every step."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.cli import shipped_drafter
    from dflashkit.tfeval import greedy_walk, slot_top_tokens, tree_accepted
    from dflashkit.tree import build_tree
    drafter = load_drafter(shipped_drafter(QWEN))
    ids = qwen.encode_prompt(PROMPT)
    res = speculative_generate(qwen, drafter, ids, max_new_tokens=64, tree=10, stop_token_ids=[])
    seq = torch.tensor(ids + res.tokens)
    feats = qwen.forward(seq[None], 0, None, capture=drafter.target_layer_ids, last_only=True).features
    anchors, top_ids, top_lp = slot_top_tokens(drafter, qwen, seq, len(ids), feats, 10)
    answer = seq.tolist()
    counts = [tree_accepted(build_tree(answer[a], i, lp, 10), answer, a)
              for a, i, lp in zip(anchors.tolist(), top_ids, top_lp)]
    walk = [n + 1 for n in greedy_walk(anchors, torch.tensor(counts))]
    lengths = res.stats.acceptance_lengths
    assert sum(lengths) == 63 and max(lengths) > 2
    assert walk[:len(lengths) - 1] == lengths[:-1]
