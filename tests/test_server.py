"""``dflashkit serve`` against a live uvicorn server on loopback, through the real openai client.

Most tests use a tiny random Llama with the SmolLM2 tokenizer (real text, a chat template)
and a random drafter, both saved to a tmp folder and loaded the way ``serve`` loads them.
"""

import json
import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
import uvicorn
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from dflashkit.checkpoint import save_drafter
from dflashkit.decoding import speculative_generate
from dflashkit.drafter import config_for_target, init_drafter
from dflashkit.sampling import SamplingConfig
from dflashkit.server import Engine, ServerConfig, TextAssembler, create_app

SMOL = "smollm2-135m-instruct"
KEY = "test-key-123"
CONTEXT = 256


def _smol_folder() -> Path:
    from dflashkit.models import list_models
    entry = next(m for m in list_models() if m.spec.name == SMOL)
    if not entry.prepared:
        pytest.skip(f"{SMOL} is not prepared (dflashkit models prepare {SMOL})")
    return entry.path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny random Llama (vocab 49152) with SmolLM2's tokenizer, and a random drafter."""
    root = tmp_path_factory.mktemp("serve")
    tok = AutoTokenizer.from_pretrained(_smol_folder())
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)   # peaked logits: seeded samples differ by seed, not by noise
    target_dir, drafter_dir = root / "target", root / "drafter"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id).save_pretrained(target_dir)
    from dflashkit.target import load_target
    target = load_target(target_dir, progress=False)
    save_drafter(init_drafter(config_for_target(target, num_layers=1, block_size=4)), drafter_dir)
    return target_dir, drafter_dir


@contextmanager
def live_server(engine: Engine, api_key: str | None):
    """uvicorn on 127.0.0.1, a free port chosen by the OS, in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module", params=[8, 1], ids=["batched", "one-at-a-time"])
def server(tiny_dirs, request):
    """The same tests against both workers: continuous batching (the default) and one
    request at a time."""
    target_dir, drafter_dir = tiny_dirs
    engine = Engine.from_config(ServerConfig(target=str(target_dir), drafter=str(drafter_dir),
                                             model_name="tiny", max_queue=1, timeout_s=30,
                                             max_batch=request.param))
    with live_server(engine, KEY) as url:
        yield engine, url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _healthy(url):
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def _reference(engine, ids, n, **kw):
    """The target's own output (plain decoding), run while the server is idle."""
    return speculative_generate(engine.target, None, ids, max_new_tokens=n, block_size=1, **kw)


HI = [{"role": "user", "content": "Say hello."}]


# --- the API ----------------------------------------------------------------------------------

def test_models_health_and_playground(server, client):
    engine, url = server
    _healthy(url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '"tiny"' in page.text and "http" not in page.text.replace("http-equiv", "")  # no remote assets


def test_chat_greedy_equals_the_target(server, client):
    engine, _ = server
    resp = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    ids = engine.target.encode_prompt(HI)
    ref = _reference(engine, ids, 12)
    assert resp.choices[0].message.content == engine.target.decode(ref.tokens)
    assert resp.choices[0].finish_reason == ("stop" if ref.stop_reason == "stop_token" else "length")
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(ref.tokens)
    assert resp.usage.total_tokens == len(ids) + len(ref.tokens)
    d = resp.model_extra["dflash"]
    assert d["block_size"] == 4 and d["verify_steps"] == len(d["acceptance_lengths"])
    assert sum(d["acceptance_lengths"]) + 1 == len(ref.tokens)
    assert d["tau"] == pytest.approx(sum(d["acceptance_lengths"]) / len(d["acceptance_lengths"]), abs=1e-3)
    assert d["spec_accept_length"] == d["tau"]


def test_completion_and_token_prompt(server, client):
    engine, _ = server
    resp = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    ids = engine.target.encode_prompt("The capital of France is", chat=False)
    ref = _reference(engine, ids, 8)
    assert resp.choices[0].text == engine.target.decode(ref.tokens)
    assert resp.usage.prompt_tokens == len(ids)
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == resp.choices[0].text


def test_streaming_matches_non_streaming(server, client):
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    pieces = [p for c in chunks if c.choices and c.model_extra.get("dflash")
              for p in c.model_extra["dflash"].get("pieces", [])]
    assert "".join(p[0] for p in pieces) == text and all(p[1] in (0, 1) for p in pieces)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert finals[0].model_extra["dflash"]["acceptance_lengths"] == plain.model_extra["dflash"]["acceptance_lengths"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    stream = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6,
                                            temperature=0, stream=True))
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in stream) == done.choices[0].text


def test_stop_strings_cut_the_text_and_the_generation(server, client):
    full = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 12, text
    stop = text[6:9]
    expected = text[:text.find(stop)]
    cut = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=0, stop=[stop, "\x00zz"])
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_stop_token_ids_extension(server, client):
    engine, _ = server
    ids = engine.target.encode_prompt(HI)
    ref = _reference(engine, ids, 10, stop_token_ids=[])
    third = ref.tokens[2]
    resp = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, temperature=0,
                                          extra_body={"stop_token_ids": [third]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == ref.tokens.index(third) + 1


def test_sampling_with_a_seed_is_reproducible(server, client):
    def run(seed):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=1.0,
                                              top_p=0.9, seed=seed, extra_body={"top_k": 50}
                                              ).choices[0].message.content
    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c


def test_api_key(server):
    _, url = server
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": HI})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 401
    _healthy(url)


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MALFORMED = [
    (CHAT, b"{not json", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, b"\xff\xfe", 400),
    (CHAT, {"model": "tiny"}, 400),
    (CHAT, {"model": "tiny", "messages": []}, 400),
    (CHAT, {"model": "tiny", "messages": "hello"}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "temperature": "hot"}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "temperature": -1}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "top_p": 0}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "top_k": 1.5}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "max_tokens": -5}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "max_tokens": 0}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "max_tokens": "10"}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "max_tokens": 10 ** 12}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "max_tokens": CONTEXT}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "stop": 5}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "stop": [""]}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "stop_token_ids": [10 ** 9]}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "n": 3}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "stream": "yes"}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "seed": "abc"}, 400),
    (CHAT, {"model": "tiny", "messages": HI, "seed": 2 ** 80}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "word " * 400}]}, 400),
    (CHAT, {"model": "gpt-5", "messages": HI}, 404),
    (COMP, {"model": "tiny"}, 400),
    (COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400),
    (COMP, {"model": "tiny", "prompt": [-1, 3]}, 400),
    (COMP, {"model": "tiny", "prompt": ""}, 400),
    (COMP, {"model": "tiny", "prompt": "hi", "echo": True}, 400),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path,body,status", MALFORMED)
def test_malformed_requests_get_openai_errors(server, path, body, status):
    _, url = server
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url + path, headers={**AUTH, "Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    _healthy(url)


def test_wrong_method_and_the_client_view_of_errors(server, client):
    _, url = server
    r = httpx.get(url + CHAT, headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=10 ** 9)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=HI)


# --- concurrency --------------------------------------------------------------------------------

@contextmanager
def slowed(engine, gate: threading.Event | None = None, delay: float = 0.0):
    """Make generations wait for ``gate`` before starting and sleep ``delay`` per commit
    (one-at-a-time and batched workers alike: both start every request with ``_start``)."""
    real = engine._start

    def start(job):
        if gate is not None:
            assert gate.wait(20)
        sampling, text, on_commit, stops = real(job)

        def commit(ids, n):
            time.sleep(delay)
            on_commit(ids, n)
        return sampling, text, commit, stops

    engine._start = start
    try:
        yield
    finally:
        engine._start = real


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_queue_full_gets_429_and_order_is_kept(server):
    engine, url = server
    gate, results = threading.Event(), {}
    body = {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 0}

    def call(name):
        results[name] = httpx.post(url + CHAT, headers=AUTH, json=body, timeout=30)

    with slowed(engine, gate):
        a = threading.Thread(target=call, args=("a",))
        a.start()
        _wait(lambda: bool(engine.running))
        b = threading.Thread(target=call, args=("b",))
        b.start()
        _wait(lambda: len(engine.queue) == 1)
        t = time.monotonic()
        r = httpx.post(url + CHAT, headers=AUTH, json=body, timeout=30)
        assert r.status_code == 429 and time.monotonic() - t < 5
        assert r.json()["error"]["code"] == "queue_full" and "busy" in r.json()["error"]["message"]
        gate.set()
        a.join(30)
        b.join(30)
    assert results["a"].status_code == results["b"].status_code == 200
    assert results["a"].json()["choices"][0]["message"]["content"] == \
        results["b"].json()["choices"][0]["message"]["content"]
    _healthy(url)


def _generations(url, reason):
    text = httpx.get(url + "/metrics", headers=AUTH).text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'dflashkit_generations_total{{reason="{reason}"}}')), None)
    return int(line.split()[-1]) if line else 0


def test_disconnect_mid_stream_frees_the_worker(server):
    engine, url = server
    before = _generations(url, "cancelled")
    body = {"model": "tiny", "messages": HI, "max_tokens": 200, "temperature": 0, "stream": True,
            "stop_token_ids": []}
    with slowed(engine, delay=0.05):
        with httpx.stream("POST", url + CHAT, headers=AUTH, json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while '"pieces"' not in next(lines):
                pass
        # 200 tokens at 50 ms each would take 10 s; the closed stream stops it at once.
        _wait(lambda: not engine.running, timeout=3)
    assert _generations(url, "cancelled") == before + 1
    _healthy(url)


def test_per_request_timeout(server):
    engine, url = server
    body = {"model": "tiny", "messages": HI, "max_tokens": 100, "temperature": 0, "stop_token_ids": []}
    old = engine.timeout_s
    engine.timeout_s = 0.5
    try:
        with slowed(engine, delay=0.05):
            r = httpx.post(url + CHAT, headers=AUTH, json=body, timeout=30)
            _wait(lambda: not engine.running, timeout=3)
    finally:
        engine.timeout_s = old
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    _healthy(url)


def test_metrics(server, client):
    _, url = server
    client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0)
    text = httpx.get(url + "/metrics", headers=AUTH).text
    for name in ("dflashkit_requests_total", "dflashkit_generation_tokens_total",
                 "dflashkit_time_to_first_token_seconds_bucket", "dflashkit_decode_tokens_per_second_count",
                 "dflashkit_acceptance_length_bucket{le=\"4\"}", "dflashkit_queue_depth"):
        assert name in text, name
    assert 'dflashkit_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert 'status="400"' in text or 'status="401"' in text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert values["dflashkit_generation_tokens_total"] > 0
    assert values['dflashkit_acceptance_length_bucket{le="+Inf"}'] == values["dflashkit_acceptance_length_count"]


def test_drafted_tokens_are_marked_in_the_stream(server):
    """With a proposer that knows the answer, chunks say which text came from the drafter."""
    from tests.test_decoding import OracleProposer
    engine, _ = server
    ids = engine.target.encode_prompt(HI)
    ref = _reference(engine, ids, 13, stop_token_ids=[])
    oracle = Engine(engine.target, OracleProposer(ref.tokens, len(ids)), block_size=4, name="oracle")
    with live_server(oracle, None) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(model="oracle", messages=HI, max_tokens=13, temperature=0,
                                                     stream=True, extra_body={"stop_token_ids": []}))
    pieces = [p for c in chunks if c.choices and c.model_extra.get("dflash")
              for p in c.model_extra["dflash"].get("pieces", [])]
    assert "".join(p[0] for p in pieces) == engine.target.decode(ref.tokens)
    assert {p[1] for p in pieces} == {0, 1}
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason).model_extra["dflash"]
    assert final["acceptance_lengths"] == [4, 4, 4] and final["tau"] == 4.0
    assert final["accepted_from_draft"] == 9


# --- the playground in headless Chromium --------------------------------------------------------

def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


def test_playground_streams_in_headless_chromium(server):
    """The page loads, a prompt streams an answer, coloured pieces and tau appear."""
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    from tests.test_decoding import OracleProposer
    engine, _ = server
    ids = engine.target.encode_prompt(HI)
    ref = _reference(engine, ids, 9, stop_token_ids=[])
    oracle = Engine(engine.target, OracleProposer(ref.tokens, len(ids)), block_size=4, name="oracle",
                    default_max_tokens=9)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]
    with live_server(oracle, KEY) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=args, headless=True)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.fill("#key", KEY)
            page.fill("#max_tokens", "9")
            page.fill("#prompt", HI[0]["content"])
            page.click("#send")
            page.wait_for_selector(".assistant[data-finish]", timeout=20000)
            answer = page.text_content(".assistant")
            drafted = page.locator(".assistant span.d").count()
            own = page.locator(".assistant span.t").count()
            tau = page.inner_text("#tau")
            colour = page.eval_on_selector(".assistant span.d", "e => getComputedStyle(e).backgroundColor")
        finally:
            browser.close()
    assert answer == engine.target.decode(ref.tokens)
    assert drafted > 0 and own > 0 and colour not in ("rgba(0, 0, 0, 0)", "transparent")
    assert float(tau) == pytest.approx(4.0)


# --- the command line ----------------------------------------------------------------------------

def test_serve_parser_defaults_to_loopback():
    import argparse
    from dflashkit.server import add_serve_parsers, cmd_serve
    parser = argparse.ArgumentParser()
    add_serve_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--target", "t", "--drafter", "d"])
    assert (args.host, args.port, args.api_key, args.func) == ("127.0.0.1", 8000, None, cmd_serve)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--target", "t", "--max-queue", "0"])


def test_serve_process_end_to_end(tiny_dirs):
    """``python -m dflashkit.server`` loads the folders, binds loopback and answers."""
    import subprocess
    import sys
    target_dir, drafter_dir = tiny_dirs
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "dflashkit.server", "--target", str(target_dir),
                             "--drafter", str(drafter_dir), "--port", str(port), "--api-key", KEY,
                             "--model-name", "tiny"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "DFLASHKIT_CACHE": str(target_dir.parent / "cache")})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        resp = client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0)
        # no --block-size with a drafter: adaptive, up to the drafter's block of 4
        assert resp.usage.completion_tokens == 5 and resp.model_extra["dflash"]["block_size"] == 4
        assert list((target_dir.parent / "cache" / "costs").glob("*.json"))
    finally:
        proc.terminate()
        proc.wait(10)


def test_engine_refuses_speculation_without_a_drafter(server):
    engine, _ = server
    with pytest.raises(ValueError):
        Engine(engine.target, None, block_size=4)


# --- units ---------------------------------------------------------------------------------------

def test_text_assembler_holds_back_a_possible_stop_and_keeps_provenance():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    asm = TextAssembler(decode, ["cde"])
    out = asm.add([ord("a"), ord("b"), ord("c")], from_draft=2)
    assert [(p.text, p.draft) for p in out] == [("a", True)]        # "bc" could start "cde"
    out = asm.add([ord("d"), ord("e"), ord("f")], from_draft=0)
    assert asm.stopped and asm.text == "ab" and asm.consumed == 5
    assert [(p.text, p.draft) for p in out] == [("b", True)]
    plain = TextAssembler(decode, [])
    assert [p.text for p in plain.add([104, 105], 1)] == ["h", "i"]
    assert plain.finish() == []


# --- the real model ------------------------------------------------------------------------------

@pytest.mark.real_model
def test_real_smollm2_through_the_server_equals_plain_decoding(tmp_path):
    from dflashkit.target import load_target
    _smol_folder()
    target = load_target(SMOL, progress=False)
    drafter = init_drafter(config_for_target(target, num_layers=1, block_size=4))
    engine = Engine(target, drafter, name=SMOL)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with live_server(engine, None) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=16, temperature=0)
        ids = target.encode_prompt(messages)
        ref = speculative_generate(target, None, ids, max_new_tokens=16, block_size=1,
                                   sampling=SamplingConfig())
    assert resp.choices[0].message.content == target.decode(ref.tokens)
    assert resp.usage.completion_tokens == len(ref.tokens)


def test_requests_waiting_together_are_decoded_together(tiny_dirs):
    """With --max-batch 4, requests that arrive while one runs join its batch; each gets
    exactly what it gets alone (greedy), including a stop string and a streamed answer."""
    target_dir, drafter_dir = tiny_dirs
    engine = Engine.from_config(ServerConfig(target=str(target_dir), drafter=str(drafter_dir),
                                             model_name="tiny", max_queue=8, max_batch=4, block_size=4))
    bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"Count to {i}."}],
               "max_tokens": 12 + 5 * i, "temperature": 0, "stop_token_ids": []} for i in range(4)]
    bodies[2]["stop"] = ["\n"]
    results = {}
    with live_server(engine, KEY) as url, slowed(engine, gate := threading.Event()):
        def call(i):
            if i == 3:   # streamed
                with httpx.stream("POST", url + CHAT, headers=AUTH, json={**bodies[i], "stream": True},
                                  timeout=60) as r:
                    results[i] = "".join(
                        json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                        for ln in r.iter_lines() if ln.startswith("data: {") and '"choices"' in ln)
            else:
                r = httpx.post(url + CHAT, headers=AUTH, json=bodies[i], timeout=60)
                results[i] = r.json()["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=call, args=(0,))]
        threads[0].start()
        _wait(lambda: bool(engine.running))          # request 0 runs alone, held at the gate
        for i in (1, 2, 3):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
        try:
            _wait(lambda: len(engine.queue) == 3)
        finally:
            gate.set()
        for t in threads:
            t.join(60)
        metrics = httpx.get(url + "/metrics", headers=AUTH).text
    def bucket(le):
        return int(next(ln for ln in metrics.splitlines()
                        if ln.startswith(f'dflashkit_batch_size_bucket{{le="{le}"}}')).split()[-1])
    assert bucket(1) >= 1            # request 0 ran alone for a while ...
    assert bucket(2) < bucket(4)     # ... then 1, 2 and 3 joined it (steps with 3-4 rows)
    for i, body in enumerate(bodies):
        ids = engine.target.encode_prompt(body["messages"])
        ref = engine.target.decode(_reference(engine, ids, body["max_tokens"], stop_token_ids=[]).tokens)
        if "stop" in body:
            ref = ref.split("\n")[0]
        assert results[i] == ref, i


def test_loadtest_script_compares_policies_on_live_servers(tiny_dirs, tmp_path):
    """benchmarks/loadtest.py starts a server per policy, runs concurrent clients, and finds
    every greedy answer identical to the one-at-a-time answer, with no errors."""
    import subprocess
    import sys
    target_dir, drafter_dir = tiny_dirs
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "loadtest.py"
    proc = subprocess.run([sys.executable, str(script), "--serve", str(target_dir), "--drafter",
                           str(drafter_dir), "--max-batch", "1,4", "--concurrency", "1,4",
                           "--requests", "4", "--max-tokens", "8", "--serve-args", "--block-size 3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DFLASHKIT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert set(runs) == {"max-batch 1", "max-batch 4"}
    for rows in runs.values():
        assert [r["concurrency"] for r in rows] == [1, 4]
        assert all(r["errors"] == 0 and r["identical_to_alone"] == 4 and r["tokens_per_s"] > 0
                   for r in rows)
    assert "| max-batch 4 | 4 |" in (tmp_path / "results.md").read_text()


def test_draft_trees_through_the_server_equal_plain_decoding(tiny_dirs):
    """--tree N: each request decodes through draft trees, greedy output is the target's own,
    and a batched server refuses trees with a clear error."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.target import load_target
    target_dir, drafter_dir = tiny_dirs
    with pytest.raises(ValueError, match="--max-batch 1"):
        Engine.from_config(ServerConfig(target=str(target_dir), drafter=str(drafter_dir), tree=5, max_batch=8))
    runs = []

    def recorded(*args, **kwargs):
        result = speculative_generate(*args, **kwargs)
        runs.append((kwargs.get("tree"), result.stats.verify_sizes))
        return result

    target = load_target(target_dir, progress=False)
    engine = Engine(target, load_drafter(drafter_dir), block_size="auto", name="tiny", tree=5,
                    generate_fn=recorded)
    assert engine.tree == 5 and engine.policy is None and engine.block_size == 4
    body = {"model": "tiny", "messages": HI, "max_tokens": 20, "temperature": 0, "stop_token_ids": []}
    with live_server(engine, None) as url:
        r = httpx.post(url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = _reference(engine, engine.target.encode_prompt(HI), 20, stop_token_ids=[])
    assert r.json()["choices"][0]["message"]["content"] == engine.target.decode(ref.tokens)
    assert r.json()["dflash"]["tree"] == 5
    assert len(runs) == 1 and runs[0][0] == 5 and max(runs[0][1]) == 6   # 5 drafted tokens + the root
