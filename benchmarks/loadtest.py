"""Load test for `dflashkit serve`: a bounded number of concurrent clients on loopback.

    .venv/bin/dflashkit serve --target qwen2.5-coder-0.5b-instruct --drafter DIR --port 8000 &
    .venv/bin/python benchmarks/loadtest.py --url http://127.0.0.1:8000 --concurrency 1,2,4 \
        --requests 8 --max-tokens 64

First every prompt runs once alone (greedy) to get its reference output; then, for each
concurrency level, that many clients send the prompts concurrently. Reports requests/s,
p50/p99 latency, time to first token, errors, and whether every greedy output equals its
one-at-a-time output. Only loopback URLs are accepted; loops are bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from urllib.parse import urlparse

import httpx2 as httpx

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "What is 17 * 23? Show your steps.",
    "Write a bash one-liner that counts lines in all .py files.",
    "Summarise what a hash map is in two sentences.",
    "Write a Python generator that yields prime numbers.",
    "Give three tips for writing readable code.",
]


async def one_request(client, url, prompt, max_tokens, key, model):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    first = None
    text = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "latency": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if delta:
                    first = first or time.perf_counter() - t0
                    text.append(delta)
    except httpx.HTTPError as e:
        return {"ok": False, "status": str(e), "latency": time.perf_counter() - t0}
    return {"ok": True, "latency": time.perf_counter() - t0, "ttft": first, "text": "".join(text)}


async def level(url, concurrency, n, max_tokens, key, reference, model):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def task(i):
            async with sem:
                p = PROMPTS[i % len(PROMPTS)]
                r = await one_request(client, url, p, max_tokens, key, model)
                r["prompt"] = p
                return r
        t0 = time.perf_counter()
        results = await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency"] for r in ok)
    same = sum(1 for r in ok if reference is None or r["text"] == reference.get(r["prompt"]))
    return {"concurrency": concurrency, "requests": n, "errors": n - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall,
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "ttft_p50_s": statistics.median([r["ttft"] for r in ok if r["ttft"]]) if ok else None,
            "identical_to_alone": same, "results": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per level (<= 256)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("loadtest only targets loopback servers (127.0.0.1, localhost, ::1)")
    n = min(args.requests, 256)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    alone = asyncio.run(level(args.url, 1, len(PROMPTS), args.max_tokens, args.api_key, None, model))
    reference = {r["prompt"]: r["text"] for r in alone["results"] if r["ok"]}
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        rows.append(asyncio.run(level(args.url, c, n, args.max_tokens, args.api_key, reference, model)))
    print("| concurrency | requests | errors | req/s | p50 latency s | p99 latency s | TTFT p50 s | identical to alone |")
    print("|---|---|---|---|---|---|---|---|")
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['requests_per_s']:.3f} | "
              f"{f(r['p50_s'])} | {f(r['p99_s'])} | {f(r['ttft_p50_s'])} | "
              f"{r['identical_to_alone']}/{r['requests'] - r['errors']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "levels": [{k: v for k, v in r.items() if k != "results"}
                                                                  for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
