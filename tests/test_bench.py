"""Benchmark arithmetic on constructed records, the losslessness check, and a smoke run."""

import json

import pytest
import torch

from dflashkit.bench import make_methods, run_bench
from dflashkit.report import (Record, attach_checks, details_tables, first_difference, lossless_verdict,
                              markdown_table, mismatch_kind, drafting_methods, paired_comparison,
                              paired_tables, report_from_folder, summarize)
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
    # pooled over every verify step, like the histogram: 18 tokens in 7 steps
    assert s["dflash"]["tau"] == pytest.approx((2 + 4 + 4 + 1 + 1 + 2 + 4) / 7)
    assert s["dflash"]["acceptance_histogram"] == {"1": 2, "2": 2, "3": 0, "4": 3}
    assert s["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert s["dflash"]["slot_acceptance"][0] == pytest.approx(5 / 7)
    assert s["dflash"]["speedup_vs_ar_loop"] is None      # no ar-loop records in this run
    loop = [rec("ar-loop", "a", 11, 0.8), rec("ar-loop", "b", 21, 2.2)]
    s = summarize(records + loop)["s"]
    assert s["dflash"]["speedup_vs_ar_loop"] == pytest.approx((3.0 / 30) / (1.5 / 30))
    assert s["dflash"]["speedup_per_prompt"]["vs"] == "ar"     # ar present: still the reference
    # no ar in the run: the spread is per prompt over ar-loop (1.6x and 2.2x), not missing
    s = summarize(records[2:] + loop)["s"]
    spread = s["dflash"]["speedup_per_prompt"]
    assert spread["vs"] == "ar-loop" and spread["median"] == pytest.approx((1.6 + 2.2) / 2)
    assert "1.90x (1.66-2.14) vs ar-loop" in details_tables({"s": s}, ["dflash"])


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
    # three prompts: with the order rotated per prompt, some methods run before ar and ar-loop
    prompts = {"humaneval": [BenchPrompt("humaneval", "h1", ["def f(x): return x"]),
                             BenchPrompt("humaneval", "h2", ["def g(y): return 2 * y"])],
               "mtbench": [BenchPrompt("mtbench", "m1", ["Hello there", "And again"])]}
    monkeypatch.setattr("dflashkit.bench.load_suite", lambda s, n, seed: prompts[s])
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))   # dflash:auto's cost curve
    methods = make_methods(["ar", "ar-loop", "dflash", "dflash:2", "dflash:auto", "prompt-lookup",
                            "assisted:tiny", "dflash+lookup", "lookup:3", "dflash-tree",
                            "dflash-tree:9"], target, drafter,
                           block_size=4, load_assistant=lambda name: assistant)
    report = run_bench(target, methods, ["humaneval", "mtbench"], 1, 12, SamplingConfig(), 0, tmp_path,
                       {"target": "tiny"}, progress=False)
    assert report["lossless"], "a method differs from ar at temperature 0"
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == 11 * 4                     # 11 methods x (1 + 1 + 2 turns)
    assert {json.loads(x)["method"] for x in lines} == set(methods)
    rows = [json.loads(x) for x in lines]
    for row in rows:                                # every line checked and with its metrics
        if row["method"] != "ar":
            assert row["identical_to_ar"] is True and row["first_diff"] is None, row["method"]
        assert row["first_tokens"] >= 1 and row["metrics"]["decode_tokens_per_s"] > 0
        assert row["metrics"]["speedup_vs_ar"] > 0 and row["metrics"]["ttft_s"] == row["prefill_s"]
        assert (row["metrics"]["tau"] is None) == (row["acceptance_lengths"] is None)
    for name in ("summary.json", "report.md", "speedup.png", "acceptance.png"):
        assert (tmp_path / name).exists(), name
    assert "tau" in report["summary"]["mtbench"]["dflash"]
    assert drafting_methods(report["summary"], list(methods))[0] == "dflash"   # the acceptance plot's
    assert "tau" in report["summary"]["mtbench"]["dflash:auto"]
    checked = [json.loads(x) for x in lines if json.loads(x)["method"] not in ("ar", "ar-loop")]
    assert all(r["identical_to_ar_loop"] is True for r in checked)
    md = (tmp_path / "report.md").read_text()
    assert "36 of 36 outputs identical" in md
    assert "tau" in report["summary"]["humaneval"]["dflash-tree:9"]
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
            run_bench(*args, progress=False, warmup=False)
        assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 5
        assert order[:5] == ["ar", "ar-loop", "ar-loop", "ar", "ar"]    # rotated per prompt
        with open(tmp_path / "records.jsonl", "a") as f:
            f.write('{"suite": "humaneval", "prom')           # a torn line from the kill
        partial = report_from_folder(tmp_path)                 # the report of the run so far
        assert (partial["records"], partial["expected_records"]) == (5, 8)
        assert partial["summary"]["humaneval"]["ar"]["prompts"] == 3
        assert "Partial run: 5 of 8 method runs" in (tmp_path / "report.md").read_text()
        calls.update(n=0, limit=100)
        report = run_bench(*args, progress=False, warmup=False)
        assert calls["n"] == 3                                  # only the 3 missing runs
        lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
        assert len(lines) == 8 and len({(x["prompt_id"], x["method"]) for x in lines}) == 8
        assert report["lossless"] and report["summary"]["humaneval"]["ar"]["prompts"] == 4
        assert "Partial" not in (tmp_path / "report.md").read_text()
        calls.update(n=0)                  # the same drafter bytes from another checkout: resumes
        run_bench(target, methods, ["humaneval"], 4, 6, SamplingConfig(), 0, tmp_path,
                  {**config, "drafter": "/checkout/b/drafter"}, progress=False)
        assert calls["n"] == 0                  # nothing left to run: no warm-up either
        assert len(report_env(tmp_path)["resumed_at"]) == 2
        assert "Resumed 2 time(s)" in (tmp_path / "report.md").read_text()
        with pytest.raises(ValueError, match="max_new_tokens: 6 there, 7 now"):
            run_bench(target, methods, ["humaneval"], 4, 7, SamplingConfig(), 0, tmp_path,
                      config, progress=False)
        with pytest.raises(ValueError, match="different configuration"):   # drafter retrained in place
            run_bench(target, methods, ["humaneval"], 4, 6, SamplingConfig(), 0, tmp_path,
                      {**config, "drafter_sha256": "another"}, progress=False)
        env = report_env(tmp_path)
        assert report["environment"]["time"] == env["time"]    # the machine of the first start, kept
        (tmp_path / "environment.json").write_text(json.dumps({**env, "torch_threads": 99}))
        with pytest.raises(ValueError, match="torch_threads 99.*OMP_NUM_THREADS=99"):
            run_bench(*args, progress=False)                   # timings would not compare
        (tmp_path / "environment.json").write_text(json.dumps({**env, "transformers": "0.0.1"}))
        with pytest.raises(ValueError, match="transformers '0.0.1'"):
            run_bench(*args, progress=False)
        (tmp_path / "environment.json").write_text(json.dumps({**env, "dflashkit_commit": "0123abc"}))
        with pytest.raises(ValueError, match="dflashkit_commit '0123abc'.*from a checkout of 0123abc"):
            run_bench(*args, progress=False)                   # other code: other timings
        (tmp_path / "environment.json").write_text(json.dumps(env))
        lines = (tmp_path / "records.jsonl").read_text().splitlines()
        (tmp_path / "records.jsonl").write_text("\n".join(lines[:3] + ['{"suite": 1'] + lines[3:]) + "\n")
        with pytest.raises(ValueError, match="line 4: not a bench record"):   # never a silent loss
            run_bench(*args, progress=False)
        assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 9   # left as it was
        calls.update(n=0)
        run_bench(*args, progress=False, fresh=True, warmup=False)
        assert calls["n"] == 8


def report_env(folder):
    return json.loads((folder / "environment.json").read_text())


def _tiny_bench(monkeypatch, prompts):
    """A tiny target whose 'tokenizer' maps characters to ids, serving ``prompts``."""
    target = tiny_target("qwen2", seed=3)

    class Tok:
        chat_template = "x"

    target.tokenizer = Tok()
    monkeypatch.setattr(type(target), "encode_prompt",
                        lambda self, msgs, chat=True: [3 + (ord(c) % 80) for m in msgs for c in m["content"]])
    monkeypatch.setattr(type(target), "decode", lambda self, ids: "x" * len(ids))
    monkeypatch.setattr("dflashkit.bench.load_suite", lambda s, n, seed: prompts)
    monkeypatch.setattr("dflashkit.report.load_suite", lambda s, n, seed: prompts)
    return target


def test_an_injected_mismatch_fails_the_run_loudly(tmp_path, monkeypatch, capsys):
    """A speculative method whose output changes one token is reported as a failure with the
    prompt and the position, in the report, in stderr and in the records."""
    prompts = [BenchPrompt("humaneval", f"h{i}", [f"task number {i}"]) for i in range(3)]
    target = _tiny_bench(monkeypatch, prompts)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    methods = make_methods(["ar", "ar-loop", "dflash"], target, drafter, block_size=4)
    honest = methods["dflash"]

    def corrupted(ids, n, s, stops):
        r = honest(ids, n, s, stops)
        if ids[-1] == 3 + ord("2") % 80:                         # only on prompt h2, token 5
            r.tokens = r.tokens[:5] + [(r.tokens[5] + 1) % 100] + r.tokens[6:]
        return r

    methods["dflash"] = corrupted
    report = run_bench(target, methods, ["humaneval"], 3, 10, SamplingConfig(), 0, tmp_path,
                       {"target": "tiny"}, progress=False)
    assert report["lossless"] is False and report["identical_to_ar"] is False
    assert report["summary"]["humaneval"]["dflash"]["mismatches"] == 1
    err = capsys.readouterr().err
    assert "LOSSLESS CHECK FAILED" in err and "humaneval/h2 turn 0 at generated position 5" in err
    md = (tmp_path / "report.md").read_text()
    assert "**LOSSLESS CHECK FAILED**: `dflash` differs from `ar-loop` on humaneval/h2 turn 0 at generated position 5" in md
    bad = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()
           if '"identical_to_ar_loop": false' in x]
    assert [(r["prompt_id"], r["first_diff_ar_loop"], r["first_diff"]) for r in bad] == [("h2", 5, 5)]


def test_a_bench_without_hf_generate_uses_ar_loop_as_its_reference(tmp_path, monkeypatch, capsys):
    """Where HF generate is slow, ``ar-loop`` alone is the baseline: ratios over it, every
    output (ours and Hugging Face's) checked against it, a changed token still a failure."""
    prompts = [BenchPrompt("humaneval", f"h{i}", [f"task number {i}"]) for i in range(3)]
    target = _tiny_bench(monkeypatch, prompts)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    methods = make_methods(["ar-loop", "dflash", "prompt-lookup"], target, drafter, block_size=4)
    report = run_bench(target, methods, ["humaneval"], 3, 10, SamplingConfig(), 0, tmp_path / "ok",
                       {"target": "tiny"}, progress=False)
    assert report["lossless"] is True and report["identical_to_ar"] is None
    assert report["identical_to_ar_loop"] is True
    e = report["summary"]["humaneval"]["dflash"]
    assert e["speedup_vs_ar"] is None and e["speedup_vs_ar_loop"] > 0 and e["mismatches"] == 0
    md = (tmp_path / "ok" / "report.md").read_text()
    assert "every greedy output identical to `ar-loop`" in md and "No `ar`" in md
    assert f"{e['speedup_vs_ar_loop']:.2f}x vs ar-loop |" in md    # no empty bracket, no "-" first
    assert (tmp_path / "ok" / "speedup.png").exists()
    honest = methods["prompt-lookup"]

    def corrupted(ids, n, s, stops):      # a Hugging Face method that changes token 3 of h1
        r = honest(ids, n, s, stops)
        if ids[-1] == 3 + ord("1") % 80:
            r.tokens = r.tokens[:3] + [(r.tokens[3] + 1) % 100] + r.tokens[4:]
        return r

    methods["prompt-lookup"] = corrupted
    capsys.readouterr()
    report = run_bench(target, methods, ["humaneval"], 3, 10, SamplingConfig(), 0, tmp_path / "bad",
                       {"target": "tiny"}, progress=False)
    assert report["lossless"] is False and report["summary"]["humaneval"]["prompt-lookup"]["mismatches"] == 1
    assert "prompt-lookup differs from ar-loop on humaneval/h1 turn 0 at generated position 3" in \
        capsys.readouterr().err
    md = (tmp_path / "bad" / "report.md").read_text()
    assert "`prompt-lookup` differs from `ar-loop` on humaneval/h1 turn 0 at generated position 3" in md


def test_a_sampling_run_does_not_claim_identical_outputs(tmp_path, monkeypatch):
    prompts = [BenchPrompt("chat", f"c{i}", [f"say something {i}"]) for i in range(2)]
    target = _tiny_bench(monkeypatch, prompts)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))
    methods = make_methods(["ar", "ar-loop", "dflash"], target, drafter, block_size=4)
    report = run_bench(target, methods, ["chat"], 2, 8, SamplingConfig(temperature=1.0, seed=1), 0,
                       tmp_path, {"target": "tiny"}, progress=False)
    assert report["lossless"] is None and report["identical_to_ar"] is None
    assert report["records_checked"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "Sampling run (temperature 1.0): outputs are not compared" in md and "Lossless" not in md
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert all(r["identical_to_ar"] is None and r["identical_to_ar_loop"] is None for r in rows)


def test_hugging_face_first_delivery_is_counted_out_of_decode_tokens():
    """Assisted and prompt-lookup generation hand over several tokens with the first one; the
    decode rate counts only what came after it."""
    from dflashkit.baselines import _FirstTokenClock
    clock = _FirstTokenClock()
    clock.put(torch.zeros(1, 30))            # the prompt
    clock.put(torch.zeros(1, 4))             # prefill + 3 accepted drafts
    clock.put(torch.zeros(1, 2))
    assert clock.first_tokens == 4 and clock.first_token_at is not None
    r = Record("s", "a", 0, "prompt-lookup", 24, 0.5, 2.0, [1] * 24, first_tokens=4)
    assert r.decode_tokens == 20
    assert Record("s", "a", 0, "ar", 24, 0.5, 2.0, [1] * 24).decode_tokens == 23


def test_bad_bench_input_is_refused_before_any_model_loads(capsys, monkeypatch):
    from dflashkit import cli
    monkeypatch.setattr("dflashkit.target.load_target",
                        lambda *a, **k: pytest.fail("a model was loaded before the input was checked"))
    cases = [(["--suites", "humaneval,nope"], "unknown ['nope']"),
             (["--suites", " , "], "--suites is empty"),
             (["--methods", "ar,dflash,turbo"], "unknown method 'turbo'"),
             (["--methods", "ar,assisted:"], "names no draft model"),
             (["--methods", "ar,dflash:0"], "positive integer or 'auto'"),
             (["--methods", "ar,dflash-tree:x"], "must be a positive integer"),
             (["--methods", "dflash,lookup:3"], "must include a baseline"),
             (["--methods", "ar,ar"], "more than once")]
    for extra, message in cases:
        code = cli.main(["bench", "--target", "qwen2.5-coder-0.5b-instruct", "--suites", "humaneval",
                         "--num-prompts", "2", *extra])
        assert code == 2, extra
        assert message in capsys.readouterr().err, extra
    assert cli.shipped_drafter("/some/local/hf_folder") is None      # a folder target ships none
    assert cli.shipped_drafter("qwen2.5-coder-0.5b-instruct") is not None
    code = cli.main(["bench", "--target", "/some/local/hf_folder", "--suites", "humaneval",
                     "--methods", "ar,dflash"])
    assert code == 2 and "needs a drafter" in capsys.readouterr().err


def test_suites_give_a_fixed_subset_per_seed():
    from dflashkit.suites import load_suite
    a, b, c = (load_suite("humaneval", 5, seed) for seed in (0, 0, 1))
    assert [p.id for p in a] == [p.id for p in b] and [p.id for p in a] != [p.id for p in c]
    assert len(a) == 5 and len({p.id for p in a}) == 5 and all(p.turns[0] for p in a)
    assert len(load_suite("humaneval", 1000)) == 164
    gsm = load_suite("gsm", 3)
    assert [p.id for p in gsm] == [p.id for p in load_suite("gsm", 3)] and len(gsm) == 3
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        load_suite("nope", 3)


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


def test_runs_of_separate_suites_combine_into_one_report_and_mismatched_ones_are_refused(tmp_path, monkeypatch):
    """bench-combine: parts measured per suite (one run each, perhaps on another machine)
    side by side, read only; parts of another configuration or sharing a suite refused."""
    from dflashkit.bench_combine import CombineError, combine
    target = _tiny_bench(monkeypatch, [])
    suite_prompts = lambda s, n, seed: [BenchPrompt(s, f"{s}{i}", [f"{s} task {i}"]) for i in range(2)]
    monkeypatch.setattr("dflashkit.bench.load_suite", suite_prompts)
    monkeypatch.setattr("dflashkit.report.load_suite", suite_prompts)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4, mask_token_id=MASK))

    def part(name, suite, names, tokens=8):
        methods = make_methods(names, target, drafter, block_size=4)
        run_bench(target, methods, [suite], 2, tokens, SamplingConfig(), 0, tmp_path / name,
                  {"target": "tiny", "block_size": 4}, progress=False, warmup=False)
        return tmp_path / name

    a = part("he", "humaneval", ["ar", "ar-loop", "dflash"])
    b = part("gsm", "gsm", ["ar", "ar-loop", "dflash", "dflash:2"])
    env = json.loads((b / "environment.json").read_text())
    (b / "environment.json").write_text(json.dumps({**env, "cpu": "Another CPU"}))
    before = (a / "records.jsonl").read_bytes()
    report = combine([a, b], tmp_path / "all")
    assert (a / "records.jsonl").read_bytes() == before                     # parts only read
    assert list(report["summary"]) == ["humaneval", "gsm"] and report["lossless"] is True
    assert report["records"] == report["expected_records"] == 2 * 3 + 2 * 4
    assert "dflash:2" not in report["summary"]["humaneval"] and "dflash:2" in report["summary"]["gsm"]
    md = (tmp_path / "all" / "report.md").read_text()
    assert "| suite | ar | ar-loop | dflash | dflash:2 |" in md
    assert md.count("| humaneval |") == 1 and "| humaneval | " in md and " | - |" in md
    assert "**The parts ran on different machines** (cpu differ)" in md and "Another CPU" in md
    with pytest.raises(CombineError, match="holds a bench run"):
        combine([a, b], b)                                               # a part's own report
    assert "Lossless: every greedy output identical to `ar`." in md
    assert (tmp_path / "all" / "speedup.png").exists() and "Partial" not in md

    c = part("he2", "humaneval", ["ar", "ar-loop", "dflash"])
    with pytest.raises(CombineError, match="suite 'humaneval' is in both"):
        combine([a, c], tmp_path / "bad")
    d = part("chat", "chat", ["ar", "ar-loop", "dflash"], tokens=6)
    with pytest.raises(CombineError, match="differs from .* in max_new_tokens: 6 vs 8"):
        combine([a, d], tmp_path / "bad")
    with pytest.raises(CombineError, match="holds no bench run"):
        combine([a, tmp_path], tmp_path / "bad")
