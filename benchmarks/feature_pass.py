"""Training's target-feature pass: a full forward (every layer, one position's logits) against
``Target.features``, which stops after the deepest captured layer, on the same sequences.

    .venv/bin/python benchmarks/feature_pass.py --dtype float32 --lengths 256,512,1024 --repeats 5

Both passes run interleaved per repeat on random token ids; prints the median seconds of each,
their ratio, and checks that the captured features are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflashkit.checkpoint import load_drafter
from dflashkit.cli import shipped_drafter
from dflashkit.target import load_target


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="256,512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    target = load_target(args.target, dtype=args.dtype, progress=False)
    layer_ids = load_drafter(shipped_drafter(args.target)).target_layer_ids
    print(f"{args.target} ({target.num_layers} layers, {args.dtype}, fast path {target.fast_path}); "
          f"captured layers {layer_ids}; {torch.get_num_threads()} threads")
    print(f"{'tokens':>6} | {'full pass s':>11} | {'early stop s':>12} | {'ratio':>5} | identical")
    gen = torch.Generator().manual_seed(0)
    for L in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, len(target.tokenizer), (1, L), generator=gen)
        full_s, early_s, same = [], [], True
        for _ in range(args.repeats + 1):   # the first round warms up and is dropped
            t0 = time.perf_counter()
            full = target.forward(ids, 0, None, capture=layer_ids, last_only=True).features
            t1 = time.perf_counter()
            early = target.features(ids, layer_ids)
            t2 = time.perf_counter()
            full_s.append(t1 - t0)
            early_s.append(t2 - t1)
            same &= torch.equal(full, early)
        f, e = statistics.median(full_s[1:]), statistics.median(early_s[1:])
        print(f"{L:>6} | {f:>11.3f} | {e:>12.3f} | {e / f:>5.2f} | {same}")


if __name__ == "__main__":
    main()
