"""Benchmark arithmetic on constructed records, the losslessness check, and a smoke run."""

import json

import pytest
import torch

from dflashkit.bench import make_methods, run_bench
from dflashkit.report import (Record, attach_checks, first_difference, lossless_verdict, markdown_table, mismatch_kind,
                              drafting_methods, paired_comparison, paired_tables, report_from_folder,
                              summarize)
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.sampling import SamplingConfig
from dflashkit.suites import BenchPrompt
from tests.conftest import MASK, tiny_target


def rec(method, pid, n, decode_s, acc=None, suite="s", ident=None):
    slots = None
    if acc:
        slots = ([sum(1 for a in acc if a > k + 1) for k in range(3)], [len(acc)] * 3)
    return Record(suite, pid, 0, method, n, 0.1, decode_s, [1] * n, acc,
                  slots[0] if slots else None, slots[1] if slots else None, ident)


def test_pooled_speedup_tau_and_histogram():
    records = [rec("ar", "a", 11, 1.0), rec("ar", "b", 21, 4.0),
               rec("dflash", "a", 11, 0.5, acc=[2, 4, 4]), rec("dflash", "b", 21, 1.0, acc=[1, 1, 2, 4])]
    s = summarize(records)["s"]
    # ar: 30 decode tokens in 5.0 s; dflash: 30 in 1.5 s -> pooled 3.33x (not the mean of 2x and 4x).
    assert s["dflash"]["speedup_vs_ar"] == pytest.approx((5.0 / 30) / (1.5 / 30))
    assert s["dflash"]["speedup_per_prompt"]["median"] == pytest.approx(3.0)
    assert s["dflash"]["tau"] == pytest.approx(((2 + 4 + 4) / 3 + (1 + 1 + 2 + 4) / 4) / 2)
    assert s["dflash"]["acceptance_histogram"] == {"1": 2, "2": 2, "3": 0, "4": 3}
    assert s["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert s["dflash"]["slot_acceptance"][0] == pytest.approx(5 / 7)
    assert s["dflash"]["speedup_vs_ar_loop"] is None      # no ar-loop records in this run
    loop = [rec("ar-loop", "a", 11, 0.8), rec("ar-loop", "b", 21, 2.2)]
    s = summarize(records + loop)["s"]
    assert s["dflash"]["speedup_vs_ar_loop"] == pytest.approx((3.0 / 30) / (1.5 / 30))


def test_paired_comparison_of_two_drafting_methods():
    # speeds (decode tokens / s): auto 10, 20, 30 and 12 on suite t; fixed 10, 25, 20 and 12
    records = [rec("auto", "a", 11, 1.0), rec("auto", "b", 21, 1.0), rec("auto", "c", 31, 1.0),
               rec("fixed", "a", 11, 1.0), rec("fixed", "b", 21, 0.8), rec("fixed", "c", 31, 1.5),
               rec("auto", "d", 13, 1.0, suite="t"), rec("fixed", "d", 13, 1.0, suite="t"),
               rec("auto", "e", 9, 1.0)]                      # no partner: not paired
    comp = paired_comparison(records, "auto", "fixed")
    s = comp["s"]
    assert s["pairs"] == 3 and s["wins"] == 1                 # only c is faster under auto
    assert s["median"] == pytest.approx(1.0)                  # ratios 1.0, 0.8, 1.5
    assert s["pooled"] == pytest.approx((3.3 / 60) / (3.0 / 60))
    assert s["ci95"][0] <= s["median"] <= s["ci95"][1]
    assert 0.8 <= s["ci95"][0] and s["ci95"][1] <= 1.5         # medians of resamples stay in range
    assert comp["all"]["pairs"] == 4 and comp["t"]["median"] == pytest.approx(1.0)
    assert paired_comparison(records, "auto", "fixed") == comp  # seeded: the same every time
    entries, md = paired_tables(records, ["ar", "dflash", "dflash:4"])
    assert entries == {} and md == ""                          # no dflash records to pair
    renamed = [Record(**{**r.__dict__, "method": {"auto": "dflash", "fixed": "dflash:4"}[r.method]})
               for r in records]
    entries, md = paired_tables(renamed, ["ar", "dflash", "dflash:4"])
    assert "dflash vs dflash:4" in entries and "| s | 3 | 1.000x" in md and "1 of 3" in md


def test_lossless_check_flags_an_injected_mismatch():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    records = [rec("ar", "a", 5, 1.0), rec("dflash", "a", 5, 0.5, acc=[2, 2], ident=False)]
    s = summarize(records)
    assert s["s"]["dflash"]["mismatches"] == 1
    assert "1 MISMATCH" in markdown_table(s, ["ar", "dflash"])
    records[1].identical_to_ar_loop = False
    assert summarize(records)["s"]["dflash"]["mismatches_vs_ar_loop"] == 1
    ok, text = lossless_verdict(records, SamplingConfig())
    assert not ok and "LOSSLESS CHECK FAILED" in text and "s/a" in text


def test_checks_are_attached_whatever_order_the_methods_ran_in():
    # rotated order: the dflash run and ar-loop came before ar on this turn
    loop = Record("s", "a", 0, "ar-loop", 3, 0.1, 1.0, [1, 2, 3])
    spec = Record("s", "a", 0, "dflash", 3, 0.1, 0.5, [1, 2, 4], [2, 1], [1], [2])
    other = Record("s", "b", 0, "dflash", 3, 0.1, 0.5, [9, 9, 9], [3], [1], [1])   # no references
    attach_checks([spec, loop, other])
    assert spec.identical_to_ar_loop is False and spec.identical_to_ar is None
    ar = Record("s", "a", 0, "ar", 3, 0.1, 2.0, [1, 2, 3])
    attach_checks([spec, loop, ar, other])
    assert (spec.first_diff, spec.identical_to_ar, loop.identical_to_ar) == (2, False, True)
    assert other.identical_to_ar is None and other.identical_to_ar_loop is None
    assert mismatch_kind(spec, bf16=True) == "failure"
    sampled = Record("s", "a", 0, "dflash", 3, 0.1, 0.5, [7, 7, 7])
    attach_checks([sampled, loop, ar], greedy=False)        # sampled outputs: never compared
    assert sampled.identical_to_ar is None and sampled.identical_to_ar_loop is None


def test_bf16_kernel_differences_are_told_apart_from_speculation_failures():
    """In bf16 our plain loop may differ from HF generate (one-row kernel rounding): a dflash
    output equal to ar-loop is then not a failure; one that differs from ar-loop always is, and
    in fp32 any difference from ar is."""
    def loop_run(ident_ar):
        return rec("ar-loop", "a", 5, 0.8, ident=ident_ar)

    def dflash(ident_ar, ident_loop):
        r = rec("dflash", "a", 5, 0.5, acc=[2, 2], ident=ident_ar)
        r.identical_to_ar_loop = ident_loop
        r.first_diff = None if ident_ar else 3
        return r

    same_as_loop = dflash(False, True)
    assert mismatch_kind(same_as_loop, bf16=True) == "kernel"
    assert mismatch_kind(same_as_loop, bf16=False) == "failure"
    assert mismatch_kind(dflash(False, False), bf16=True) == "failure"
    assert mismatch_kind(dflash(True, False), bf16=True) == "failure"   # equal to ar by luck only
    assert mismatch_kind(loop_run(False), bf16=True) == "kernel"
    assert mismatch_kind(loop_run(False), bf16=False) == "failure"
    lookup = rec("prompt-lookup", "a", 5, 0.5, ident=False)   # HF's multi-row default kernels
    assert mismatch_kind(lookup, bf16=True) == "kernel"
    assert mismatch_kind(lookup, bf16=False) == "failure"
    assert mismatch_kind(dflash(True, True), bf16=True) is None

    records = [rec("ar", "a", 5, 1.0), loop_run(False), same_as_loop]
    s = summarize(records, bf16=True)["s"]
    assert s["dflash"]["mismatches"] == 0 and s["dflash"]["kernel_differences"] == 1
    assert "MISMATCH" not in markdown_table({"s": s}, ["ar", "ar-loop", "dflash"])
    ok, text = lossless_verdict(records, SamplingConfig(), bf16=True)
    assert ok and "Speculation lossless" in text and "2 outputs of our loop" in text
    lookup.first_diff = 4
    ok, text = lossless_verdict(records + [lookup], SamplingConfig(), bf16=True)
    assert ok and "1 outputs of Hugging Face's own" in text and "`prompt-lookup` on s/a turn 0 at position 4" in text
    ok, text = lossless_verdict(records, SamplingConfig(), bf16=False)
    assert not ok and "LOSSLESS CHECK FAILED" in text
    records[2] = dflash(False, False)
    ok, text = lossless_verdict(records, SamplingConfig(), bf16=True)
    assert not ok and "LOSSLESS CHECK FAILED" in text and "add `ar-loop`" not in text
    ok, text = lossless_verdict([records[0], dflash(False, None)], SamplingConfig(), bf16=True)
    assert not ok and "add `ar-loop`" in text        # no plain loop ran: cannot tell them apart


def test_smoke_every_method_on_a_tiny_model(tmp_path, monkeypatch):
    target = tiny_target("llama", seed=5, temperature_scale=2.0)
    assistant = tiny_target("llama", seed=6, layers=2).model
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))

    class Tok:   # a stand-in tokenizer: characters -> ids, so suites' text prompts work
        chat_template = "x"

    target.tokenizer = Tok()
    monkeypatch.setattr(type(target), "encode_prompt",
                        lambda self, msgs, chat=True: [3 + (ord(c) % 80) for m in msgs for c in m["content"][:20]])
    monkeypatch.setattr(type(target), "decode", lambda self, ids: "".join(chr(97 + i % 26) for i in ids))
    prompts = {"humaneval": [BenchPrompt("humaneval", "h1", ["def f(x): return x"])],
               "mtbench": [BenchPrompt("mtbench", "m1", ["Hello there", "And again"])]}
    monkeypatch.setattr("dflashkit.bench.load_suite", lambda s, n, seed: prompts[s])
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))   # dflash:auto's cost curve
    methods = make_methods(["ar", "ar-loop", "dflash", "dflash:2", "dflash:auto", "prompt-lookup",
                            "assisted:tiny"], target, drafter,
                           block_size=4, load_assistant=lambda name: assistant)
    report = run_bench(target, methods, ["humaneval", "mtbench"], 1, 12, SamplingConfig(), 0, tmp_path,
                       {"target": "tiny"}, progress=False)
    assert report["lossless"], "a method differs from ar at temperature 0"
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 7 * 3                      # 7 methods x (1 + 2 turns)
    assert {json.loads(x)["method"] for x in lines} == set(methods)
    for name in ("summary.json", "report.md", "speedup.png", "acceptance.png"):
        assert (tmp_path / name).exists(), name
    assert "tau" in report["summary"]["mtbench"]["dflash"]
    assert drafting_methods(report["summary"], list(methods))[0] == "dflash"   # the acceptance plot's
    assert "tau" in report["summary"]["mtbench"]["dflash:auto"]
    checked = [json.loads(x) for x in lines if json.loads(x)["method"] not in ("ar", "ar-loop")]
    assert all(r["identical_to_ar_loop"] is True for r in checked)
    md = (tmp_path / "report.md").read_text()
    assert "15 of 15 outputs identical" in md
    assert "### mtbench" in md and "| dflash:auto | 2 |" in md and "TTFT" in md   # both turns counted
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        make_methods(["ar", "dflash:zero"], target, drafter)


def test_an_interrupted_bench_resumes_without_rerunning_or_duplicating(tmp_path):
    target = tiny_target("qwen2", seed=3)
    calls = {"n": 0, "limit": 5}
    order = []

    def counted(method, name):
        def run(ids, n, s, stops):
            calls["n"] += 1
            order.append(name)
            if calls["n"] > calls["limit"]:
                raise KeyboardInterrupt
            return method(ids, n, s, stops)
        return run

    prompts = [BenchPrompt("humaneval", f"h{i}", [f"task {i}"]) for i in range(4)]

    class Tok:
        chat_template = "x"

    target.tokenizer = Tok()
    base = make_methods(["ar", "ar-loop"], target)
    methods = {k: counted(v, k) for k, v in base.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(target), "encode_prompt",
                   lambda self, msgs, chat=True: [3 + (ord(c) % 80) for m in msgs for c in m["content"]])
        mp.setattr(type(target), "decode", lambda self, ids: "x" * len(ids))
        mp.setattr("dflashkit.bench.load_suite", lambda s, n, seed: prompts)
        mp.setattr("dflashkit.report.load_suite", lambda s, n, seed: prompts)
        config = {"target": "tiny", "drafter": "/checkout/a/drafter", "drafter_sha256": "s1"}
        args = (target, methods, ["humaneval"], 4, 6, SamplingConfig(), 0, tmp_path, config)
        with pytest.raises(KeyboardInterrupt):
            run_bench(*args, progress=False)
        assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 5
        assert order[:5] == ["ar", "ar-loop", "ar-loop", "ar", "ar"]    # rotated per prompt
        with open(tmp_path / "records.jsonl", "a") as f:
            f.write('{"suite": "humaneval", "prom')           # a torn line from the kill
        partial = report_from_folder(tmp_path)                 # the report of the run so far
        assert (partial["records"], partial["expected_records"]) == (5, 8)
        assert partial["summary"]["humaneval"]["ar"]["prompts"] == 3
        assert "Partial run: 5 of 8 method runs" in (tmp_path / "report.md").read_text()
        calls.update(n=0, limit=100)
        report = run_bench(*args, progress=False)
        assert calls["n"] == 3                                  # only the 3 missing runs
        lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
        assert len(lines) == 8 and len({(x["prompt_id"], x["method"]) for x in lines}) == 8
        assert report["lossless"] and report["summary"]["humaneval"]["ar"]["prompts"] == 4
        assert "Partial" not in (tmp_path / "report.md").read_text()
        calls.update(n=0)                  # the same drafter bytes from another checkout: resumes
        run_bench(target, methods, ["humaneval"], 4, 6, SamplingConfig(), 0, tmp_path,
                  {**config, "drafter": "/checkout/b/drafter"}, progress=False)
        assert calls["n"] == 0
        with pytest.raises(ValueError, match="different configuration"):
            run_bench(target, methods, ["humaneval"], 4, 7, SamplingConfig(), 0, tmp_path,
                      config, progress=False)
        with pytest.raises(ValueError, match="different configuration"):   # drafter retrained in place
            run_bench(target, methods, ["humaneval"], 4, 6, SamplingConfig(), 0, tmp_path,
                      {**config, "drafter_sha256": "another"}, progress=False)
        env = json.loads((tmp_path / "environment.json").read_text())
        assert report["environment"] == env          # the machine of the first start, kept
        (tmp_path / "environment.json").write_text(json.dumps({**env, "torch_threads": 99}))
        with pytest.raises(ValueError, match="99 torch threads"):   # timings would not compare
            run_bench(*args, progress=False)
        calls.update(n=0)
        run_bench(*args, progress=False, fresh=True)
        assert calls["n"] == 8


@pytest.mark.real_model
def test_assisted_with_a_draft_model_of_another_tokenizer_is_lossless():
    """assisted:MODEL with a different vocabulary (SmolLM2's drafting for Qwen's) goes through
    transformers' universal assisted generation and still gives the target's greedy output."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from dflashkit.models import prepare_model
    from dflashkit.target import Target
    tokenizers = {n: AutoTokenizer.from_pretrained(prepare_model(n, progress=False))
                  for n in ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")}
    torch.manual_seed(0)
    qwen_tok, smol_tok = tokenizers["qwen2.5-coder-0.5b-instruct"], tokenizers["smollm2-135m-instruct"]
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    target = Target(Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, **small)), qwen_tok, "tiny-qwen")
    assistant = Target(LlamaForCausalLM(LlamaConfig(vocab_size=49152, **small)), smol_tok, "tiny-smol")
    methods = make_methods(["ar", "assisted:smol"], target, load_assistant=lambda name: assistant)
    ids = qwen_tok("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", add_special_tokens=False)["input_ids"]
    ar = methods["ar"](ids, 16, SamplingConfig(), [])
    assisted = methods["assisted:smol"](ids, 16, SamplingConfig(), [])
    assert len(ar.tokens) == 16 and assisted.tokens == ar.tokens
