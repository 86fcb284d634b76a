"""The adaptive block size against fixed sizes, in one process, interleaved prompt by prompt
(bf16 fast path, the shipped drafter, 8 HumanEval prompts of the bench's seed-1 subset, 256
new tokens, greedy). Variants: fixed blocks 4 and 5; auto as shipped (learned costs,
one draft fewer tried every 8th step); auto without that exploration; auto on the start-up cost
curve alone. Each policy object is reused across prompts, as in the bench and the server.

    .venv/bin/python benchmarks/auto_vs_fixed.py

Prints tokens/s per prompt, the mean, the median ratio to fixed block 4, and the acceptance
each policy learned. No HF generate here: this isolates the policy from the bench's method
order.
"""
import statistics as st

from dflashkit.target import load_target
from dflashkit.checkpoint import load_drafter
from dflashkit.decoding import speculative_generate, DFlashProposer
from dflashkit.suites import load_suite
from dflashkit.costs import cost_curve
from dflashkit.policy import AdaptiveBlockSize
t = load_target("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
p = DFlashProposer(load_drafter("checkpoints/qwen2.5-coder-0.5b-instruct"), t)
curve = cost_curve(t, p, max_q=8)
methods = {"fixed4": 4, "auto_e8": AdaptiveBlockSize(curve, 7), "fixed5": 5,
           "auto_e0": AdaptiveBlockSize(curve, 7, explore_costs_every=0),
           "auto_nolearn": AdaptiveBlockSize(curve, 7, learn_costs=False)}
prompts = load_suite("humaneval", 8, seed=1)
rate = {m: [] for m in methods}
for q in prompts:
    ids = t.encode_prompt([{"role": "user", "content": q.turns[0]}])
    for m, bs in methods.items():
        r = speculative_generate(t, p, ids, max_new_tokens=256, block_size=bs)
        rate[m].append((len(r.tokens) - 1) / r.stats.decode_s)
    print(q.id, {m: round(v[-1], 2) for m, v in rate.items()}, flush=True)
for m, v in rate.items():
    rel = [a / b for a, b in zip(v, rate["fixed4"])]
    print(m, "mean tok/s", round(st.mean(v), 2), "median vs fixed4", round(st.median(rel), 3))
for m in ("auto_e8", "auto_e0", "auto_nolearn"):
    pol = methods[m]
    print(m, "prefix rates", [round(x, 3) for x in pol.prefix_rates()][:5])
