"""Load test for `dflashkit serve`: a bounded number of concurrent clients on loopback.

Against a running server:

    .venv/bin/dflashkit serve --target qwen2.5-coder-0.5b-instruct --drafter DIR --port 8000 &
    .venv/bin/python benchmarks/loadtest.py --url http://127.0.0.1:8000 --concurrency 1,2,4 \
        --requests 8 --max-tokens 64

Or comparing scheduling policies, each on a server this script starts and stops itself:

    .venv/bin/python benchmarks/loadtest.py --serve qwen2.5-coder-0.5b-instruct \
        --drafter checkpoints/qwen2.5-coder-0.5b-instruct --max-batch 1,8 --out benchmarks/loadtest

First every prompt runs once alone (greedy) to get its reference output; then, for each
concurrency level, that many clients send the prompts concurrently. Reports requests/s,
p50/p99 latency, time to first token, errors, and whether every greedy output equals its
one-at-a-time output. Only loopback URLs are accepted; loops are bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
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
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    first = None
    text = []
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "latency": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if delta:
                    first = first or time.perf_counter() - t0
                    text.append(delta)
    except httpx.HTTPError as e:
        return {"ok": False, "status": str(e), "latency": time.perf_counter() - t0}
    return {"ok": True, "latency": time.perf_counter() - t0, "ttft": first, "text": "".join(text),
            "tokens": tokens}


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
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "ttft_p50_s": statistics.median([r["ttft"] for r in ok if r["ttft"]]) if ok else None,
            "identical_to_alone": same, "results": results}


def run_levels(url, levels, n, max_tokens, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    alone = asyncio.run(level(url, 1, len(PROMPTS), max_tokens, key, None, model))
    reference = {r["prompt"]: r["text"] for r in alone["results"] if r["ok"]}
    return [asyncio.run(level(url, c, n, max_tokens, key, reference, model)) for c in levels]


def table(rows, label=""):
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    out = ["| policy | concurrency | requests | errors | req/s | tokens/s | p50 latency s | p99 latency s "
           "| TTFT p50 s | identical to alone |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {label} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
                   f"{r['requests_per_s']:.3f} | {r['tokens_per_s']:.2f} | {f(r['p50_s'])} | "
                   f"{f(r['p99_s'])} | {f(r['ttft_p50_s'])} | "
                   f"{r['identical_to_alone']}/{r['requests'] - r['errors']} |")
    return out


@contextlib.contextmanager
def spawned_server(target, drafter, max_batch, extra):
    """``dflashkit serve`` on a free loopback port; stopped on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "dflashkit.cli", "serve", "--target", target, "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", "64", *extra]
    if drafter:
        cmd += ["--drafter", drafter]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 600 s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--serve", metavar="TARGET", help="start servers for TARGET instead of using --url")
    ap.add_argument("--drafter", help="with --serve: the drafter folder")
    ap.add_argument("--max-batch", default="1", help="with --serve: comma-separated policies to compare")
    ap.add_argument("--serve-args", default="", help="with --serve: extra `dflashkit serve` flags")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per level (<= 256)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key")
    ap.add_argument("--out", help="folder for results.json and results.md")
    args = ap.parse_args()
    host = urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("loadtest only targets loopback servers (127.0.0.1, localhost, ::1)")
    n = min(args.requests, 256)
    levels = [int(x) for x in args.concurrency.split(",")]
    runs = {}
    if args.serve:
        for mb in [int(x) for x in args.max_batch.split(",")]:
            with spawned_server(args.serve, args.drafter, mb, args.serve_args.split()) as url:
                runs[f"max-batch {mb}"] = run_levels(url, levels, n, args.max_tokens, None)
                print("\n".join(table(runs[f"max-batch {mb}"], f"max-batch {mb}")), flush=True)
    else:
        runs["server"] = run_levels(args.url, levels, n, args.max_tokens, args.api_key)
    lines = []
    for label, rows in runs.items():
        lines += table(rows, label)[(0 if not lines else 2):]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"max_tokens": args.max_tokens, "requests_per_level": n, "serve": args.serve,
                "drafter": args.drafter, "serve_args": args.serve_args}
        (out / "results.json").write_text(json.dumps({**meta, "runs": {
            k: [{kk: vv for kk, vv in r.items() if kk != "results"} for r in rows]
            for k, rows in runs.items()}}, indent=2))
        (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
