"""The ``dflashkit`` command line: models, drafter, generate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def shipped_drafter(target_name: str) -> Path | None:
    """The drafter committed under checkpoints/ for a registry target, if there is one (a
    target given as a local folder has none)."""
    from .models import REGISTRY
    if target_name not in REGISTRY:
        return None
    path = REPO_ROOT / "checkpoints" / target_name
    return path if (path / "config.json").exists() and (path / "model.safetensors").exists() else None


def _warn_if_inexact(target, speculative: bool) -> None:
    from .target import inexact_output_warning
    message = inexact_output_warning(target) if speculative else None
    if message:
        print(message, file=sys.stderr)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _block_size(text: str) -> int | str:
    """A positive integer, or ``auto`` (chosen per step from measured costs, policy.py)."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r}") from None


# --- models ---------------------------------------------------------------------------------

def cmd_models_prepare(args) -> int:
    from .models import prepare_model
    for name in args.names:
        print(prepare_model(name, progress=not args.quiet))
    return 0


def cmd_models_list(args) -> int:
    from .models import list_models
    for entry in list_models():
        state = "prepared" if entry.prepared else "not prepared"
        print(f"{entry.spec.name:32s} {state:13s} {entry.path or ''}")
    return 0


# --- drafter --------------------------------------------------------------------------------

def cmd_drafter_init(args) -> int:
    from .checkpoint import save_drafter
    from .drafter import config_for_target, init_drafter
    from .target import load_target
    target = load_target(args.target)
    ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    cfg = config_for_target(target, num_layers=args.layers, block_size=args.block_size,
                            target_layer_ids=ids, mask_token_id=args.mask_token_id,
                            intermediate_size=args.intermediate_size)
    out = save_drafter(init_drafter(cfg, seed=args.seed), args.out)
    print(f"wrote an UNTRAINED drafter to {out}: {cfg.num_hidden_layers} layer(s), block size "
          f"{cfg.block_size}, target layers {cfg.target_layer_ids}, mask id {cfg.mask_token_id}")
    return 0


def cmd_drafter_info(args) -> int:
    from .checkpoint import load_drafter
    model = load_drafter(args.path)
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"path": str(args.path), "parameters": n, "hidden_size": cfg.hidden_size,
                      "num_hidden_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
                      "num_target_layers": cfg.num_target_layers,
                      "target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id},
                     indent=2))
    return 0


# --- generate -------------------------------------------------------------------------------

class _TerminalStream:
    """Prints text as tokens are committed; drafted tokens in green on a terminal."""

    def __init__(self, target, color: bool):
        self.target, self.color, self.ids, self.shown = target, color, [], ""

    def __call__(self, new_ids: list[int], from_draft: int) -> None:
        self.ids += new_ids
        text = self.target.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        delta, self.shown = text[len(self.shown):], text
        if self.color and from_draft:
            delta = f"\033[32m{delta}\033[0m"
        sys.stdout.write(delta)
        sys.stdout.flush()


def cmd_generate(args) -> int:
    from .baselines import hf_generate
    from .checkpoint import load_drafter
    from .decoding import speculative_generate
    from .sampling import SamplingConfig
    from .target import load_target

    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    drafter_path = args.drafter or shipped_drafter(args.target)
    if args.block_size != 1 and drafter_path is None:
        raise ValueError(f"no drafter for {args.target}: pass --drafter DIR (make one with "
                         f"`dflashkit drafter init --target {args.target} --out DIR`) or use "
                         f"--block-size 1 for plain decoding")
    drafter = load_drafter(drafter_path) if args.block_size != 1 else None   # fail fast on a bad folder
    target = load_target(args.target, dtype=args.dtype, progress=not args.json,
                         fast_path=False if args.no_fast_path else None, device=args.device)
    _warn_if_inexact(target, speculative=drafter is not None)
    if drafter is not None and drafter.is_untrained:
        print(f"note: {drafter_path} is an UNTRAINED (freshly initialised) drafter: its proposals are "
              "almost never accepted, so expect a slowdown; the output is still the target's own.",
              file=sys.stderr)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = target.encode_prompt(prompt, chat=not args.raw)
    stops = target.stop_token_ids() + list(args.stop_id or [])
    stream = None if args.json else _TerminalStream(target, sys.stdout.isatty())
    block_size = args.block_size
    if args.tree is not None and block_size == "auto":   # the CLI default: the tree sizes itself
        block_size = None
    result = speculative_generate(target, drafter, ids, max_new_tokens=args.max_new_tokens,
                                  sampling=sampling, stop_token_ids=stops, block_size=block_size,
                                  acceptance=args.acceptance, on_commit=stream, lookup=args.lookup,
                                  tree=args.tree)
    st = result.stats
    report = {
        "target": args.target, "drafter": str(drafter_path) if drafter is not None else None,
        "prompt_tokens": len(ids), "tokens": result.tokens, "text": target.decode(result.tokens),
        "stop_reason": result.stop_reason, **st.to_dict(),
        "decode_tokens_per_s": result.decode_tokens_per_s,
    }
    if args.compare:
        plain = speculative_generate(target, None, ids, max_new_tokens=args.max_new_tokens,
                                     sampling=sampling, stop_token_ids=stops, block_size=1)
        hf = hf_generate(target, ids, args.max_new_tokens, sampling, stops)
        report["compare"] = {
            "hf_generate": {"tokens_per_s": hf.decode_tokens_per_s, "prefill_s": hf.prefill_s,
                            "identical": hf.tokens == result.tokens, "num_tokens": len(hf.tokens)},
            "ar_loop": {"tokens_per_s": plain.decode_tokens_per_s, "prefill_s": plain.stats.prefill_s,
                        "identical": plain.tokens == result.tokens, "num_tokens": len(plain.tokens)},
            "speedup_vs_hf_generate": _ratio(result.decode_tokens_per_s, hf.decode_tokens_per_s),
            "speedup_vs_ar_loop": _ratio(result.decode_tokens_per_s, plain.decode_tokens_per_s),
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print("\n")
    print(f"tokens: {len(result.tokens)} ({result.stop_reason})   tau: {st.tau:.2f}   "
          f"decode: {result.decode_tokens_per_s:.2f} tok/s   prefill: {st.prefill_s:.2f}s   "
          f"draft: {st.draft_s:.2f}s   verify: {st.verify_s:.2f}s" +
          (f"   copied: {st.lookup_accepted} tokens in {st.lookup_steps} steps" if args.lookup else ""))
    if args.compare:
        c = report["compare"]
        greedy = sampling.greedy
        for name, key in (("HF generate", "hf_generate"), ("plain loop (B=1)", "ar_loop")):
            same = ("identical tokens" if c[key]["identical"] else "DIFFERENT TOKENS") if greedy else \
                "sampling: tokens differ by design (distributions are tested instead)"
            print(f"{name:17s} {c[key]['tokens_per_s']:.2f} tok/s -> speedup "
                  f"{c['speedup_vs_' + key]:.2f}x   {same}")
        if greedy and not (c["hf_generate"]["identical"] and c["ar_loop"]["identical"]):
            print("error: speculative output differs from the target's own greedy output", file=sys.stderr)
            return 3
    return 0


def cmd_bench(args) -> int:
    from .bench import check_method_names, make_methods, run_bench
    from .report import report_from_folder
    from .checkpoint import drafter_digest, load_drafter
    from .sampling import SamplingConfig
    from .suites import STAND_INS, load_suite
    from .target import load_target
    if args.report_only:
        report = report_from_folder(args.out)
        print((args.out / "report.md").read_text())
        return 3 if report["lossless"] is False else 0
    if not args.target:
        raise ValueError("bench needs --target NAME (or --report-only to redraw the report in --out)")
    # every input checked before a model loads (a minute or more)
    suites = [x.strip() for x in args.suites.split(",") if x.strip()]
    if not suites:
        raise ValueError(f"--suites is empty; choose from {', '.join(STAND_INS)}")
    bad = [x for x in suites if x not in STAND_INS]
    if bad:
        raise ValueError(f"--suites: unknown {bad}; choose from {', '.join(STAND_INS)}")
    if len(set(suites)) < len(suites):
        raise ValueError(f"--suites lists a suite more than once: {args.suites}")
    for suite in suites:
        load_suite(suite, args.num_prompts, args.seed)   # its package is installed, its data reads
    names = [x.strip() for x in args.methods.split(",") if x.strip()]
    check_method_names(names)
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    drafter_path = args.drafter or shipped_drafter(args.target)
    wants_drafter = any(n.partition(":")[0] in ("dflash", "dflash-tree", "dflash+lookup") for n in names)
    if wants_drafter and drafter_path is None:
        raise ValueError(f"method dflash needs a drafter: pass --drafter DIR (no shipped drafter "
                         f"for {args.target})")
    target = load_target(args.target, dtype=args.dtype, fast_path=False if args.no_fast_path else None,
                         device=args.device)
    _warn_if_inexact(target, speculative=wants_drafter)
    drafter = load_drafter(drafter_path) if wants_drafter else None
    methods = make_methods(names, target, drafter, args.block_size,
                           load_assistant=lambda name: load_target(name, dtype=target.dtype,
                                                                   fast_path=False, device=target.device))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    config["drafter"] = str(drafter_path) if drafter is not None else None
    config["drafter_sha256"] = drafter_digest(drafter_path) if drafter is not None else None
    report = run_bench(target, methods, suites, args.num_prompts, args.max_new_tokens, sampling,
                       args.seed, args.out, config, max_turns=args.max_turns, fresh=args.fresh)
    print((args.out / "report.md").read_text())
    return 3 if report["lossless"] is False else 0


def cmd_bench_combine(args) -> int:
    from .bench_combine import combine
    report = combine(args.runs, args.out)
    print((args.out / "report.md").read_text())
    return 3 if report["lossless"] is False else 0


def cmd_bench_cost(args) -> int:
    from .checkpoint import load_drafter
    from .costbench import cost_table, run_cost_bench
    from .target import load_target
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = sorted(set(backends) - {"fast", "default"})
    if bad or not backends:
        raise ValueError(f"--backends: unknown {bad}; choose from fast, default")
    kvs = [_positive_int(k) for k in args.kv.split(",") if k.strip()]
    drafter_path = args.drafter or shipped_drafter(args.target)
    drafter = load_drafter(drafter_path) if drafter_path is not None else None
    target = load_target(args.target, dtype=args.dtype,
                         fast_path=False if backends == ["default"] else None, device=args.device)
    result = run_cost_bench(target, drafter, kvs, args.max_q, backends, args.repeats, args.out)
    print(cost_table(result))
    print(f"wrote {args.out}/costs.md, costs.json, costs.png")
    return 0


STAGES = "data,teacher,train,export"


def cmd_train(args) -> int:
    from .pipeline import load_config, run_stages
    cfg = load_config(args.config)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - {"data", "teacher", "train", "export"})
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {unknown}; choose from data, teacher, train, export")
    run_stages(cfg, stages, force_teacher=args.stages != STAGES)
    return 0


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


DTYPE_HELP = ("float32 (default): greedy output identical to HF generate. bfloat16: on CPUs with "
              "AMX, about 1.3x faster plain decoding and verify passes as cheap as one token; "
              "identical to our own plain loop, but HF generate's one-token bf16 kernel rounds "
              "differently and can pick another token at near-ties (README, 'bf16')")


DEVICE_HELP = ("where the target (and the drafter with it) runs: cpu (default), cuda or cuda:N; "
               "on a GPU greedy output equals plain decoding's except where two logits tie to "
               "within rounding (different kernels for one token and for a block)")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device`` for every command that loads a target (generate, bench,
    bench-cost, serve)."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help=DTYPE_HELP)
    parser.add_argument("--device", default="cpu", help=DEVICE_HELP)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflashkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="real target models, offline").add_subparsers(
        dest="models_command", required=True)
    prep = models.add_parser("prepare", help="install, assemble, verify and convert a model")
    prep.add_argument("names", nargs="+", metavar="NAME")
    prep.add_argument("--quiet", action="store_true")
    prep.set_defaults(func=cmd_models_prepare)
    models.add_parser("list", help="known models and whether they are prepared").set_defaults(
        func=cmd_models_list)

    drafter = sub.add_parser("drafter", help="create or inspect drafters").add_subparsers(
        dest="drafter_command", required=True)
    init = drafter.add_parser("init", help="write a freshly initialised (untrained) drafter")
    init.add_argument("--target", required=True, help="model name or local Hugging Face folder")
    init.add_argument("--out", required=True, type=Path)
    init.add_argument("--layers", type=_positive_int, default=1, help="drafter layers (default 1)")
    init.add_argument("--block-size", type=_positive_int, default=16)
    init.add_argument("--target-layer-ids", help="comma-separated target layer ids (default: paper spread)")
    init.add_argument("--mask-token-id", type=int, help="default: first unused embedding row")
    init.add_argument("--intermediate-size", type=_positive_int, help="default: the target's")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=cmd_drafter_init)
    info = drafter.add_parser("info", help="validate a drafter folder and print its shape")
    info.add_argument("path", type=Path)
    info.set_defaults(func=cmd_drafter_info)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("--target", required=True, help="model name or local Hugging Face folder")
    gen.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped one)")
    gen.add_argument("--prompt", required=True, help="prompt text, or - to read stdin")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--block-size", type=_block_size, default="auto",
                     help="tokens per verify (1 = plain decoding), or auto (default): chosen at "
                          "each step from this machine's measured costs and the running acceptance")
    add_target_arguments(gen)
    gen.add_argument("--no-fast-path", action="store_true",
                     help="use PyTorch's default CPU kernels instead of prepacked weights")
    gen.add_argument("--acceptance", choices=["match", "rejection"], default="match",
                     help="sampling acceptance rule (both lossless)")
    gen.add_argument("--lookup", action="store_true",
                     help="where the context's last n-gram occurred before, verify what followed it "
                          "instead of a drafter block (copies prompt text; lossless)")
    gen.add_argument("--tree", type=_positive_int, metavar="N",
                     help="verify a draft tree of N drafted tokens per step (the best-scoring "
                          "continuations of the drafter's block, up to --block-size - 1 deep) "
                          "instead of a chain; N = block size - 1 verifies as many tokens as the chain")
    gen.add_argument("--stop-id", type=int, action="append", help="extra stop token id (repeatable)")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding (HF generate and our loop with B=1)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="acceptance and speedup on standard suites, all methods")
    bench.add_argument("--target", help="model name or local Hugging Face folder (required)")
    bench.add_argument("--drafter", type=Path, help="default: the shipped drafter of the target")
    bench.add_argument("--suites", default="humaneval,mtbench,gsm,math,chat,zh",
                       help="comma-separated (default: all six)")
    bench.add_argument("--methods", default="ar,ar-loop,dflash,prompt-lookup",
                       help="comma-separated: ar, ar-loop, dflash, dflash:B, dflash:auto, "
                            "dflash+lookup[:B|:auto] (the drafter, copying from the context where "
                            "it can), lookup:B (context copies alone, on our loop), prompt-lookup "
                            "(HF's), assisted:MODEL; at least one baseline, ar or ar-loop "
                            "(default: ar,ar-loop,dflash,prompt-lookup)")
    bench.add_argument("--num-prompts", type=_positive_int, default=20,
                       help="per suite; a fixed subset for a given --seed (default 20)")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=256, help="default 256")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--top-p", type=float, default=1.0, help="default 1.0")
    bench.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    bench.add_argument("--seed", type=int, default=0, help="prompt subset and sampling seed (default 0)")
    bench.add_argument("--block-size", type=_block_size, default="auto",
                       help="dflash tokens per verify, or auto (default; see generate)")
    add_target_arguments(bench)
    bench.add_argument("--no-fast-path", action="store_true",
                       help="run our loops on PyTorch's default CPU kernels")
    bench.add_argument("--max-turns", type=_positive_int, help="only the first N turns (MT-Bench has 2)")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="report folder; a run there with the same configuration resumes "
                            "(default bench-out)")
    bench.add_argument("--fresh", action="store_true",
                       help="start over instead of resuming the run already in --out")
    bench.add_argument("--report-only", action="store_true",
                       help="run nothing: redraw report.md, summary.json and the plots from the "
                            "records in --out (a run in progress or interrupted is marked partial)")
    bench.set_defaults(func=cmd_bench)
    combine = sub.add_parser("bench-combine",
                             help="one report from several bench runs, each covering its own suites")
    combine.add_argument("runs", type=Path, nargs="+", help="--out folders of `dflashkit bench` runs")
    combine.add_argument("--out", type=Path, required=True, help="folder for the combined report")
    combine.set_defaults(func=cmd_bench_combine)

    from .export import add_export_parsers
    from .server import add_serve_parsers
    add_serve_parsers(sub)
    add_export_parsers(sub)

    cost = sub.add_parser("bench-cost", help="cost of verify and draft passes vs this machine's floors")
    cost.add_argument("--target", required=True)
    cost.add_argument("--drafter", type=Path, help="default: the shipped drafter of the target, if any")
    cost.add_argument("--kv", default="256,2048", help="comma-separated KV lengths")
    cost.add_argument("--max-q", type=_positive_int, default=16)
    cost.add_argument("--backends", default="fast,default", help="fast, default or both")
    add_target_arguments(cost)
    cost.add_argument("--repeats", type=_positive_int, default=5)
    cost.add_argument("--out", type=Path, default=Path("bench-cost-out"))
    cost.set_defaults(func=cmd_bench_cost)

    train = sub.add_parser("train", help="run the training pipeline of a YAML config")
    train.add_argument("--config", required=True, type=Path)
    train.add_argument("--stages", default=STAGES,
                       help="comma-separated subset (teacher: the target's distributions for "
                            "distillation; by default it runs only when train.distill > 0)")
    train.set_defaults(func=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError
    from .pipeline import ConfigError
    from .target import TargetError
    known: tuple[type[BaseException], ...] = (CheckpointError, ConfigError, TargetError, ValueError,
                                               OSError)
    try:
        from .models import ModelPrepareError
        known += (ModelPrepareError,)
    except ImportError:
        pass
    try:
        return args.func(args)
    except known as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
