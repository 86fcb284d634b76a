"""Training throughput of a DFlash drafter at a real target's shapes, on the CPU or on GPUs.

The target's weights need not be there (they cannot travel to a rented GPU machine): a model
with the same config.json and random weights regenerates sequences of the training data's
length (prompt + 320 response tokens, features stored, on the CPU as the data stage does),
then the trainer runs the shipped drafter's recipe on them exactly as ``dflashkit train``
would (2 layers, block 8, 64 anchors, 8 sequences per step), once per arithmetic asked for.
Random weights change the numbers the loss sees, not the work a step does. Prints one row per
arithmetic: median step time and tokens/s over the steps after the first two.

    python benchmarks/train_throughput.py --target-config ~/.cache/dflashkit/qwen2.5-coder-0.5b-instruct/hf/config.json \\
        --device cuda --autocast float32,bfloat16
"""

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflashkit.regenerate import DataConfig, regenerate
from dflashkit.target import Target
from dflashkit.trainer import DrafterSpec, TrainConfig, Trainer


def make_data(config_path: Path, root: Path, sequences: int, prompt_tokens: int,
              new_tokens: int, layers: list[int]) -> tuple[Path, Path]:
    config = AutoConfig.from_pretrained(config_path.parent)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = -1     # random weights: never stop early
    target_dir = root / "target"
    model.save_pretrained(target_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [{"id": f"p{i}", "source": "random", "kind": "code",
                "input_ids": torch.randint(1000, 30000, (prompt_tokens,), generator=g).tolist()}
               for i in range(sequences)]
    cfg = DataConfig(out_dir=str(root / "data"), max_new_tokens=new_tokens, batch_size=sequences,
                     feature_layers=layers)
    t = time.perf_counter()
    regenerate(Target(model, None, name="random-weights"), prompts, cfg, progress=False)
    print(f"data: {sequences} sequences of {prompt_tokens} + {new_tokens} tokens in "
          f"{time.perf_counter() - t:.0f} s (CPU, {torch.get_num_threads()} threads)")
    return target_dir, root / "data"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-config", type=Path, required=True,
                    help="the target's config.json (only its shapes are used)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--autocast", default="float32,bfloat16")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=320)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mask-token-id", type=int, default=151665)
    args = ap.parse_args()
    if not args.target_config.is_file():
        raise SystemExit(f"--target-config {args.target_config}: no such file (a target's config.json)")
    layers = [1, 6, 11, 16, 21]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, data_dir = make_data(args.target_config, Path(tmp), args.sequences,
                                         args.prompt_tokens, args.new_tokens, layers)
        for arith in args.autocast.split(","):
            spec = DrafterSpec(num_layers=2, block_size=8, intermediate_size=4480,
                               mask_token_id=args.mask_token_id)
            cfg = TrainConfig(epochs=1000, global_batch=8, lr=3e-4, num_anchors=64, heldout=0,
                              eval_every=10**9, save_every=10**9, device=args.device,
                              attention=args.attention, autocast=arith, max_steps=args.steps)
            out = Path(tmp) / f"train-{arith}"
            trainer = Trainer(str(target_dir), data_dir, out, spec, cfg, progress=False)
            trainer.fit()
            with (out / "log.csv").open() as f:
                log = list(csv.DictReader(f))
            elapsed = [0.0] + [float(r["elapsed_s"]) for r in log]
            step_s = [b - a for a, b in zip(elapsed, elapsed[1:])][2:]
            tok_s = [float(r["tokens_per_s"]) for r in log][2:]
            rows.append((trainer._hardware(), arith, trainer.attention, statistics.median(step_s),
                         statistics.median(tok_s), float(log[-1]["loss"])))
    print(f"\n{args.steps} steps of 8 sequences, the first two not counted\n")
    print("| hardware | arithmetic | attention | step, median s | tokens/s, median | last loss |")
    print("|---|---|---|---|---|---|")
    for hw, arith, attn, t, tok, loss in rows:
        print(f"| {hw} | {arith} | {attn} | {t:.3f} | {tok:.0f} | {loss:.3f} |")


if __name__ == "__main__":
    main()
