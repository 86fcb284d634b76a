"""``dflashkit serve``: an OpenAI-compatible HTTP server around the speculative decoding loop.

Users of speculative decoding talk to it through the OpenAI API and watch acceptance, so
the server speaks that wire format (chat and text completions, SSE streaming, ``usage``)
and adds one extension field, ``dflash``, with the request's acceptance lengths and tau
(SGLang reports the same as ``spec_accept_length``) and, per streamed chunk, which tokens
came from the drafter. A worker thread takes requests from a bounded FIFO queue: a full
queue answers 429 at once, a request past its deadline or whose client went away is
dropped at its next commit. With ``--max-batch N`` up to N requests are decoded together
and a new one joins the running batch at the next step (continuous batching, batch.py),
each streaming and ending on its own; with 1 they run one at a time.
"""


import argparse
import asyncio
import hmac
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("dflashkit.serve")

DEFAULT_HOST = "127.0.0.1"


# --- configuration and errors ------------------------------------------------------------------

@dataclass(frozen=True)
class ServerConfig:
    """What ``dflashkit serve`` was asked for; everything has a safe default but the target."""

    target: str
    drafter: str | None = None
    host: str = DEFAULT_HOST
    port: int = 8000
    api_key: str | None = None
    block_size: int | str | None = None    # "auto", or default: the drafter's (1 without one)
    tree: int | None = None                # drafted tokens per draft tree (tree.py); None: chains
    fast_path: bool = True                 # prepacked CPU kernels where available (fastpath.py)
    dtype: str = "float32"                 # or bfloat16 (AMX CPUs; README "bf16")
    device: str = "cpu"                    # or cuda / cuda:N: where the target and drafter run
    max_queue: int = 16                    # waiting requests; one more gets 429
    max_batch: int = 8                     # requests decoded together (1 = one at a time); 8 won
                                           # the load test (benchmarks/loadtest/, README)
    timeout_s: float = 300.0               # per request, queue wait included
    default_max_tokens: int = 512          # when a request gives none (capped by the context)
    model_name: str | None = None          # id served by /v1/models (default: the target name)


class APIError(Exception):
    """An error answered in the OpenAI shape ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class GenerationAborted(Exception):
    """Raised from ``on_commit`` to leave the decoding loop (cancel, timeout, stop string)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --- metrics (Prometheus text format, no extra dependency) --------------------------------------

class Histogram:
    """Cumulative-bucket histogram as Prometheus expects it."""

    def __init__(self, name: str, help_: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help_, sorted(buckets)
        self.counts = [0] * len(self.buckets)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for b, c in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{le="{_num(b)}"}} {c}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}',
                  f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class Metrics:
    """Server counters; every update takes one lock (requests are few, updates are cheap)."""

    def __init__(self, block_size: int):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.finished: dict[str, int] = {}
        self.prompt_tokens = self.generation_tokens = self.draft_tokens = self.verify_steps = 0
        self.ttft = Histogram("dflashkit_time_to_first_token_seconds",
                              "Arrival to first token, queue wait included.",
                              [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60])
        self.decode_tps = Histogram("dflashkit_decode_tokens_per_second",
                                    "Per request: tokens after the first per second of decoding.",
                                    [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000])
        self.batch = Histogram("dflashkit_batch_size", "Requests decoded together, per decoding step.",
                               [1, 2, 4, 8, 16, 32])
        self.accept = Histogram("dflashkit_acceptance_length",
                                "Tokens committed per verify step (bonus token included).",
                                list(range(1, max(block_size, 1) + 1)))

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def count_finished(self, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def record_generation(self, s: "RunStats", prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += s.tokens
            self.draft_tokens += s.from_draft
            self.verify_steps += len(s.acceptance_lengths)
            if s.ttft_s is not None:
                self.ttft.observe(s.ttft_s)
            if s.tokens > 1:
                self.decode_tps.observe(s.decode_tokens_per_s)
            for a in s.acceptance_lengths:
                self.accept.observe(a)

    def render(self, queue_depth: int, running: int, capacity: int) -> str:
        with self.lock:
            out = ["# HELP dflashkit_requests_total HTTP requests by endpoint and status.",
                   "# TYPE dflashkit_requests_total counter"]
            out += [f'dflashkit_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())]
            out += ["# HELP dflashkit_generations_total Generations by how they ended.",
                    "# TYPE dflashkit_generations_total counter"]
            out += [f'dflashkit_generations_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            for name, help_, value in (
                    ("prompt_tokens", "Prompt tokens of generations run.", self.prompt_tokens),
                    ("generation_tokens", "Tokens generated.", self.generation_tokens),
                    ("draft_accepted_tokens", "Generated tokens that were the drafter's proposals.",
                     self.draft_tokens),
                    ("verify_steps", "Target verify passes after the first token.", self.verify_steps)):
                out += [f"# HELP dflashkit_{name}_total {help_}", f"# TYPE dflashkit_{name}_total counter",
                        f"dflashkit_{name}_total {value}"]
            for name, help_, value in (("queue_depth", "Requests waiting.", queue_depth),
                                       ("queue_capacity", "Waiting requests allowed.", capacity),
                                       ("running_requests", "Generations running now.", running)):
                out += [f"# HELP dflashkit_{name} {help_}", f"# TYPE dflashkit_{name} gauge",
                        f"dflashkit_{name} {value}"]
            for h in (self.ttft, self.decode_tps, self.accept, self.batch):
                out += h.render()
        return "\n".join(out) + "\n"


# --- text: incremental decoding, stop strings, per-token provenance -----------------------------

@dataclass
class Piece:
    text: str
    draft: bool      # True: the drafter proposed this token and the target accepted it


class TextAssembler:
    """Turns committed ids into text pieces, cutting at the first stop string.

    Text that could still grow into a stop string is held back, so a streamed answer never
    shows a stop string that the final answer omits; an incomplete UTF-8 sequence waits for
    the token that completes it.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""               # decoded text so far (cut at a stop string once found)
        self.pending: list[Piece] = []   # text[emitted:] not yet handed out
        self.emitted = 0
        self.consumed = 0            # tokens that contributed to the answer
        self.stopped = False

    def add(self, new_ids: list[int], from_draft: int) -> list[Piece]:
        for i, tok in enumerate(new_ids):
            self.ids.append(int(tok))
            self.consumed += 1
            full = self.decode(self.ids)
            if full.endswith("\ufffd"):
                continue
            before = len(self.text)
            if len(full) > before:
                self.pending.append(Piece(full[before:], i < from_draft))
                self.text = full
            if self._cut_at_stop(max(0, before - self.hold)):
                break
        return self._release(final=self.stopped)

    def finish(self) -> list[Piece]:
        """Everything left, including a trailing incomplete character."""
        if not self.stopped:
            full = self.decode(self.ids)
            if len(full) > len(self.text):
                self.pending.append(Piece(full[len(self.text):], False))
                self.text = full
                self._cut_at_stop(0)
        return self._release(final=True)

    def _cut_at_stop(self, start: int) -> bool:
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        self.stopped = True
        return True

    def _release(self, final: bool) -> list[Piece]:
        limit = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out: list[Piece] = []
        while self.pending and self.emitted < limit:
            p = self.pending[0]
            take = min(len(p.text), limit - self.emitted)
            out.append(Piece(p.text[:take], p.draft))
            self.emitted += take
            if take == len(p.text):
                self.pending.pop(0)
            else:
                self.pending[0] = Piece(p.text[take:], p.draft)
        if final:
            self.pending.clear()
        return out


# --- jobs and the worker ------------------------------------------------------------------------

@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class RunStats:
    """Measured from the commits themselves, so it is complete even when a run is aborted."""

    tokens: int = 0
    from_draft: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"acceptance_lengths": self.acceptance_lengths, "tau": round(self.tau, 4),
                "spec_accept_length": round(self.tau, 4), "accepted_from_draft": self.from_draft,
                "verify_steps": len(self.acceptance_lengths),
                "time_to_first_token_s": _round(self.ttft_s), "prefill_s": _round(self.prefill_s),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class Job:
    """One request's generation: its events flow from the worker thread to the event loop."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout_s
        self.stats = RunStats()

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:   # the loop is closed: the server is shutting down
            self.cancel.set()


class JobQueue:
    """Bounded FIFO whose waiting jobs can be withdrawn at once (a client went away)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self.closed = False

    def put(self, job: Job) -> None:
        with self._cond:
            if len(self._jobs) >= self.capacity:
                raise APIError(429, f"the server is busy: {len(self._jobs)} requests are already waiting "
                                    f"(queue capacity {self.capacity}); retry later",
                               "rate_limit_error", None, "queue_full")
            self._jobs.append(job)
            self._cond.notify()

    def get(self) -> Job | None:
        with self._cond:
            while not self._jobs and not self.closed:
                self._cond.wait()
            return self._jobs.popleft() if self._jobs else None

    def take(self, n: int) -> list[Job]:
        """Up to ``n`` more waiting jobs, without waiting (they join the running batch)."""
        with self._cond:
            return [self._jobs.popleft() for _ in range(min(n, len(self._jobs)))]

    def withdraw(self, job: Job) -> None:
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._jobs)


class Engine:
    """Target + drafter + one worker thread that runs queued generations in order."""

    def __init__(self, target, drafter=None, block_size: int | None = None, name: str | None = None,
                 max_queue: int = 16, timeout_s: float = 300.0, default_max_tokens: int = 512,
                 generate_fn: Callable | None = None, drafter_path: str | None = None,
                 max_batch: int = 1, tree: int | None = None):
        from .decoding import DFlashProposer, speculative_generate
        from .drafter import DFlashDrafter
        if isinstance(drafter, DFlashDrafter):
            drafter = DFlashProposer(drafter, target)   # checks compatibility before serving
        self.policy = None     # an adaptive block size, shared by every request (it keeps learning)
        if tree is not None:
            from .tree import check_tree_size
            check_tree_size(tree)
            if not isinstance(drafter, DFlashProposer):
                raise ValueError("--tree needs a DFlash drafter (--drafter DIR)")
            if max_batch > 1:
                raise ValueError("draft trees decode one request at a time: use --max-batch 1 with --tree")
            if block_size == "auto":   # the tree sizes itself; its depth is the drafter's block - 1
                block_size = None
        self.tree = tree
        if block_size == "auto":
            if not isinstance(drafter, DFlashProposer):
                raise ValueError("--block-size auto needs a drafter (--drafter DIR)")
            from .costs import cost_curve
            from .policy import AdaptiveBlockSize
            trained = drafter.drafter.block_size
            self.policy = AdaptiveBlockSize(cost_curve(target, drafter, max_q=trained, progress=True),
                                            max_drafts=trained - 1)
            block_size = trained
        if block_size is None:
            block_size = drafter.drafter.block_size if isinstance(drafter, DFlashProposer) else 1
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer or 'auto', got {block_size!r}")
        if block_size > 1 and drafter is None:
            raise ValueError("block_size > 1 needs a drafter (--drafter DIR), or use --block-size 1")
        if max_queue < 1 or timeout_s <= 0 or max_batch < 1:
            raise ValueError("max_queue and max_batch must be >= 1 and timeout must be > 0")
        self.max_batch = max_batch
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.name = name or target.name
        self.drafter_path = drafter_path
        self.timeout_s, self.default_max_tokens = timeout_s, default_max_tokens
        self.generate_fn = generate_fn or speculative_generate
        self.queue = JobQueue(max_queue)
        self.metrics = Metrics(block_size)
        self.running: list[Job] = []
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> "Engine":
        """Load the drafter first (a bad folder fails in a second), then the target."""
        from .checkpoint import load_drafter
        from .target import inexact_output_warning, load_target
        drafter = load_drafter(cfg.drafter) if cfg.drafter else None
        target = load_target(cfg.target, dtype=cfg.dtype, fast_path=None if cfg.fast_path else False,
                             device=cfg.device)
        if drafter is not None and inexact_output_warning(target):
            log.warning("%s", inexact_output_warning(target))
        if drafter is not None and drafter.is_untrained:
            log.warning("%s is an UNTRAINED drafter: expect almost no accepted tokens", cfg.drafter)
        return cls(target, drafter, cfg.block_size, cfg.model_name or cfg.target, cfg.max_queue,
                   cfg.timeout_s, cfg.default_max_tokens, drafter_path=cfg.drafter,
                   max_batch=cfg.max_batch, tree=cfg.tree)

    def decoding_mode(self) -> dict:
        """How requests are decoded, as responses report it."""
        return {"block_size": self.block_size, "tree": self.tree}

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="dflashkit-worker", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.queue.close()
        for job in self.running:
            job.cancel.set()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def withdraw(self, job: Job) -> None:
        job.cancel.set()
        self.queue.withdraw(job)

    # --- the worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        if self.max_batch > 1:
            return self._work_batched()
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancel.is_set():
                continue
            self.running = [job]
            with self.metrics.lock:
                self.metrics.batch.observe(1)
            try:
                self._run(job)
            except Exception as e:   # never let one request kill the worker
                log.exception("generation failed")
                job.emit(("error", APIError(500, f"generation failed: {e}", "server_error")))
                self.metrics.count_finished("error")
            finally:
                self.running = []

    def _work_batched(self) -> None:
        """Continuous batching: waiting requests join the running batch at every step."""
        from .batch import BatchDecoder
        decoder = None
        while True:
            if decoder is None or not decoder.active:
                self.running = []
                job = self.queue.get()
                if job is None:
                    return
                jobs = [job, *self.queue.take(self.max_batch - 1)]
                decoder = BatchDecoder(self.target, self.drafter, self.policy or self.block_size)
            else:
                jobs = self.queue.take(self.max_batch - decoder.active)
            jobs = [j for j in jobs if not j.cancel.is_set()]
            try:
                if jobs:
                    self._admit(decoder, jobs)
                with self.metrics.lock:
                    self.metrics.batch.observe(decoder.active)
                decoder.step()
            except Exception as e:   # never let one request kill the worker
                log.exception("generation failed")
                for j in self.running:
                    j.emit(("error", APIError(500, f"generation failed: {e}", "server_error")))
                    self.metrics.count_finished("error")
                decoder = None

    def _admit(self, decoder, jobs: list[Job]) -> None:
        """Add requests to the running batch; a request the target cannot take gets its 400."""
        from .batch import BatchRequest, _validate
        from .target import TargetError
        requests = []
        for job in jobs:
            self.running = self.running + [job]
            sampling, text, on_commit, stops = self._start(job)
            request = BatchRequest(job.request.prompt_ids, job.request.max_tokens, sampling, stops)
            try:
                _validate(self.target, request)
            except (TargetError, ValueError) as e:
                self.running = [j for j in self.running if j is not job]
                job.emit(("error", APIError(400, str(e))))
                self.metrics.count_finished("error")
                continue
            reason: dict[str, str] = {}

            def commit(new_ids, from_draft, on_commit=on_commit, reason=reason):
                try:
                    on_commit(new_ids, from_draft)
                except GenerationAborted as e:
                    reason["why"] = e.reason
                    return False
                return True

            def finish(result, job=job, text=text, reason=reason):
                self.running = [j for j in self.running if j is not job]
                why = reason.get("why") or ("stop" if result.stop_reason == "stop_token" else "length")
                self._finish(job, text, why)
            request.on_commit, request.on_finish = commit, finish
            requests.append(request)
        decoder.add(requests)

    def _start(self, job: Job):
        """Per-request state: sampling, text assembly, and the commit callback, which raises
        ``GenerationAborted`` when the request must end (stop string, timeout, client gone)."""
        from .sampling import SamplingConfig
        req = job.request
        sampling = SamplingConfig(req.temperature, req.top_p, req.top_k, req.seed)
        text = TextAssembler(self.target.decode, req.stop)
        stats = job.stats
        start = time.monotonic()
        last = [start]

        def on_commit(new_ids: list[int], from_draft: int) -> None:
            now = time.monotonic()
            if stats.ttft_s is None:
                stats.ttft_s, stats.prefill_s = now - job.arrived, now - start
            else:
                stats.acceptance_lengths.append(len(new_ids))
                stats.decode_s += now - last[0]
            last[0] = now
            pieces = text.add(new_ids, from_draft)
            stats.tokens = text.consumed
            stats.from_draft += min(from_draft, len(new_ids))
            job.emit(("delta", pieces, len(new_ids)))
            if text.stopped:
                raise GenerationAborted("stop")
            if now > job.deadline:     # before the cancel flag: a timed-out request is withdrawn too
                raise GenerationAborted("timeout")
            if job.cancel.is_set():
                raise GenerationAborted("cancelled")

        stops = self.target.stop_token_ids() + list(req.stop_token_ids)
        return sampling, text, on_commit, stops

    def _run(self, job: Job) -> None:
        from .target import TargetError
        req = job.request
        sampling, text, on_commit, stops = self._start(job)
        try:
            extra = {"tree": self.tree} if self.tree is not None else {}
            result = self.generate_fn(self.target, self.drafter, req.prompt_ids,
                                      max_new_tokens=req.max_tokens, sampling=sampling,
                                      stop_token_ids=stops, block_size=self.policy or self.block_size,
                                      on_commit=on_commit, **extra)
            reason = "stop" if result.stop_reason == "stop_token" else "length"
        except GenerationAborted as e:
            reason = e.reason
        except (TargetError, ValueError) as e:
            job.emit(("error", APIError(400, str(e))))
            self.metrics.count_finished("error")
            return
        self._finish(job, text, reason)

    def _finish(self, job: Job, text: "TextAssembler", reason: str) -> None:
        stats = job.stats
        tail = text.finish()
        if tail:
            job.emit(("delta", tail, 0))
        self.metrics.record_generation(stats, len(job.request.prompt_ids))
        self.metrics.count_finished(reason)
        if reason in ("cancelled", "timeout"):
            job.emit(("error", _timeout_error(self.timeout_s) if reason == "timeout" else
                      APIError(499, "the client closed the request", code="cancelled")))
            return
        job.emit(("done", {"finish_reason": reason, "text": text.text, "completion_tokens": stats.tokens}))


def _timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"the request exceeded the server's timeout of {timeout_s:g} s",
                    "timeout_error", None, "timeout")


# --- request schemas -------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)                     # extension (vLLM/SGLang): -1 or 0 = off
    seed: int | None = Field(None, ge=0, le=2 ** 63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None          # extension (vLLM/SGLang)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return APIError(400, f"invalid value for {param or 'the request'}: {err['msg']}", param=param,
                    code="invalid_value" if err["type"] != "missing" else "missing_required_parameter")


async def _read_json(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


# --- the application ----------------------------------------------------------------------------

def create_app(engine: Engine, api_key: str | None = None):
    """The FastAPI app; the engine's worker starts and stops with the app's lifespan."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="dflashkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(_req, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        return error_response(APIError(400, str(e.errors()[:1])))

    @app.exception_handler(Exception)
    async def _unexpected(_req, e: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.middleware("http")
    async def count_and_authorize(request: Request, call_next):
        path = request.url.path
        protected = path.startswith("/v1/") or path == "/metrics"
        if api_key and protected and not _authorized(request.headers.get("authorization"), api_key):
            response = error_response(APIError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "authentication_error", None, "invalid_api_key"))
        else:
            response = await call_next(request)
        known = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/"}
        engine.metrics.count_request(path if path in known else "other", response.status_code)
        return response

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unhealthy", "reason": "the worker thread is not running"},
                                status_code=503)
        return {"status": "ok", "queue_depth": len(engine.queue), "running": len(engine.running)}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(len(engine.queue), len(engine.running),
                                     engine.queue.capacity)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(engine, created)]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(PLAYGROUND_HTML.replace("__MODEL__", json.dumps(engine.name).replace("<", "\\u003c")))

    async def _validated(request: Request, model_cls):
        """Parse and validate a JSON body; check the model name."""
        body = await _read_json(request)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        _check_model(engine, req.model)
        return req

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _validated(request, ChatRequest)
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
        ids = _encode(engine, messages, chat=True)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = _generation_request(engine, req, ids, limit)
        return await _respond(engine, request, gen, req, "chat.completion")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _validated(request, CompletionRequest)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        ids = _encode(engine, prompt, chat=False) if isinstance(prompt, str) else list(prompt)
        gen = _generation_request(engine, req, ids, req.max_tokens)
        return await _respond(engine, request, gen, req, "text_completion")

    async def _respond(engine: Engine, request: Request, gen: GenerationRequest, req: _Sampling, kind: str):
        job = Job(gen, asyncio.get_running_loop(), engine.timeout_s)
        engine.submit(job)     # 429 here, before any byte is sent
        meta = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(engine, job, meta, kind, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(engine, request, job, meta, kind)

    return app


def _authorized(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), key.encode())


def _model_card(engine: Engine, created: int) -> dict:
    return {"id": engine.name, "object": "model", "created": created, "owned_by": "dflashkit",
            "max_model_len": engine.target.max_positions,
            "dflash": {"drafter": engine.drafter_path, **engine.decoding_mode()}}


def _check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {engine.name!r}",
                       param="model", code="model_not_found")


def _content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _encode(engine: Engine, prompt, chat: bool) -> list[int]:
    from .target import TargetError
    try:
        return engine.target.encode_prompt(prompt, chat=chat)
    except TargetError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None


def _generation_request(engine: Engine, req: _Sampling, ids: list[int], max_tokens: int | None) -> GenerationRequest:
    """Check the prompt and the limits against the target; fill the defaults."""
    context = engine.target.max_positions
    vocab = engine.target.num_embeddings
    param = "messages" if isinstance(req, ChatRequest) else "prompt"
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    if any(not 0 <= i < vocab for i in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=param)
    room = context - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                       param=param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(engine.default_max_tokens, room)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({len(ids)} tokens) exceeds this "
                            f"model's context of {context} tokens", param="max_tokens",
                       code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise APIError(400, "stop: at most 16 non-empty strings", param="stop")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= i < vocab for i in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    return GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, temperature=float(req.temperature),
                             top_p=float(req.top_p), top_k=max(req.top_k, 0), seed=req.seed,
                             stop=stop, stop_token_ids=stop_ids)


async def _next_event(engine: Engine, job: Job, request=None) -> tuple:
    """Wait for the worker, watching the deadline and (non-streaming) the client."""
    while True:
        left = job.deadline - time.monotonic()
        if left <= 0:
            engine.withdraw(job)
            return ("error", _timeout_error(engine.timeout_s))
        try:
            return await asyncio.wait_for(job.events.get(), timeout=min(left, 0.25))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                engine.withdraw(job)
                return ("error", APIError(499, "the client closed the request", code="cancelled"))


def _usage(job: Job, completion_tokens: int) -> dict:
    p = len(job.request.prompt_ids)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}


async def _complete(engine: Engine, request, job: Job, meta: dict, kind: str):
    from fastapi.responses import JSONResponse
    while True:
        event = await _next_event(engine, job, request)
        if event[0] == "error":
            return JSONResponse(event[1].body(), status_code=event[1].status)
        if event[0] == "done":
            break
    done = event[1]
    if kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]},
                  "logprobs": None, "finish_reason": done["finish_reason"]}
    else:
        choice = {"index": 0, "text": done["text"], "logprobs": None, "finish_reason": done["finish_reason"]}
    return {**meta, "object": kind, "choices": [choice], "usage": _usage(job, done["completion_tokens"]),
            "dflash": {**job.stats.to_dict(), **engine.decoding_mode()}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(engine: Engine, job: Job, meta: dict, kind: str, include_usage: bool):
    """SSE chunks; ``dflash.pieces`` says per text piece whether the drafter produced it."""
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, extra: dict) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**meta, "object": obj, "choices": [choice], **extra}

    finished = False
    try:
        if chat:
            first = chunk(None, None, {})
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        while True:
            event = await _next_event(engine, job)
            if event[0] == "error":
                finished = True
                yield _sse(event[1].body())
                break
            if event[0] == "delta":
                _, pieces, accepted = event
                if not pieces:
                    continue
                s = job.stats
                live = {"pieces": [[p.text, int(p.draft)] for p in pieces], "accept_length": accepted,
                        "tau": round(s.tau, 4), "tokens": s.tokens,
                        "decode_tokens_per_s": round(s.decode_tokens_per_s, 3)}
                yield _sse(chunk("".join(p.text for p in pieces), None, {"dflash": live}))
                continue
            finished, done = True, event[1]
            usage = _usage(job, done["completion_tokens"])
            final = {"usage": usage, "dflash": {**job.stats.to_dict(), **engine.decoding_mode()}}
            yield _sse(chunk(None if chat else "", done["finish_reason"], final))
            if include_usage:
                yield _sse({**meta, "object": obj, "choices": [], "usage": usage})
            break
        yield _sse("[DONE]")
    finally:
        # Runs on normal end, on a write error and on cancellation by a disconnect: a client
        # that went away frees the worker at the next commit and its queue slot at once.
        if not finished:
            engine.withdraw(job)


# --- serving from the command line ---------------------------------------------------------------

def serve(cfg: ServerConfig) -> None:
    """Load the models and run uvicorn until interrupted."""
    import uvicorn
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", cfg.host)
    engine = Engine.from_config(cfg)
    app = create_app(engine, cfg.api_key)
    mode = f"adaptive, up to {engine.block_size}" if engine.policy else str(engine.block_size)
    if engine.tree is not None:
        mode += f", draft trees of {engine.tree} tokens"
    print(f"dflashkit serve: {engine.name} (block size {mode}) on http://{cfg.host}:{cfg.port}/",
          file=sys.stderr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")


def cmd_serve(args) -> int:
    serve(ServerConfig(target=args.target, drafter=args.drafter, host=args.host, port=args.port,
                       api_key=args.api_key, max_queue=args.max_queue, fast_path=not args.no_fast_path,
                       dtype=args.dtype, device=args.device,
                       max_batch=args.max_batch, tree=args.tree,
                       block_size=args.block_size if args.block_size is not None else (
                           "auto" if args.drafter else None),
                       timeout_s=args.timeout, default_max_tokens=args.default_max_tokens,
                       model_name=args.model_name))
    return 0


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_serve_parsers(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on a subparsers object (``set_defaults(func=cmd_serve)``)."""
    from .cli import _block_size, _positive_int, add_target_arguments
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with speculative decoding",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="registry name or local Hugging Face folder")
    p.add_argument("--drafter", default=None, help="drafter folder (omit for plain decoding)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    p.add_argument("--block-size", type=_block_size, default=None,
                   help="tokens per verify pass (1 = plain decoding), or auto (the default with a "
                        "drafter): chosen per step from this machine's measured costs")
    p.add_argument("--tree", type=_positive_int, metavar="N",
                   help="verify a draft tree of N drafted tokens per step instead of a chain "
                        "(one request at a time: needs --max-batch 1)")
    p.add_argument("--no-fast-path", action="store_true", help="PyTorch's default CPU kernels")
    add_target_arguments(p)
    p.add_argument("--max-batch", type=_positive_int, default=ServerConfig.max_batch,
                   help="requests waiting together are decoded together, up to this many "
                        "(1 = one at a time)")
    p.add_argument("--max-queue", type=_positive_int, default=16, help="waiting requests before 429")
    p.add_argument("--timeout", type=_positive_float, default=300.0, help="seconds per request")
    p.add_argument("--default-max-tokens", type=_positive_int, default=512)
    p.add_argument("--model-name", default=None, help="model id to serve (default: the target name)")
    p.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m dflashkit.server``: the serve command on its own."""
    parser = argparse.ArgumentParser(prog="python -m dflashkit.server")
    add_serve_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO)
    return args.func(args)


PLAYGROUND_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dflashkit playground</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:15px/1.5 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
 header{display:flex;gap:1.5em;align-items:baseline;padding:.8em 1.2em;background:#1d2330;color:#fff}
 header b{font-size:1.1em} .stat{font-variant-numeric:tabular-nums} .stat span{font-weight:600}
 main{max-width:900px;margin:0 auto;padding:1em}
 #log{display:flex;flex-direction:column;gap:.8em;margin-bottom:1em}
 .msg{padding:.7em 1em;border-radius:8px;white-space:pre-wrap;word-wrap:break-word}
 .user{background:#dde6f7;align-self:flex-end;max-width:80%} .assistant{background:#fff;border:1px solid #dde}
 .error{background:#fde2e2;color:#8a1414}
 .d{background:#c9f0cf;border-radius:3px} .t{background:transparent}
 form{display:flex;flex-direction:column;gap:.5em} textarea{font:inherit;padding:.5em;min-height:4em}
 .row{display:flex;gap:1em;align-items:center;flex-wrap:wrap} input{font:inherit;width:6em}
 .legend span{padding:0 .4em;margin-right:.5em} button{font:inherit;padding:.4em 1.2em}
</style></head><body>
<header><b>dflashkit</b><span id="model"></span>
 <span class="stat">tau <span id="tau">-</span></span>
 <span class="stat">tokens/s <span id="tps">-</span></span>
 <span class="stat">tokens <span id="ntok">0</span></span>
 <span class="stat">from drafter <span id="ndraft">0</span></span></header>
<main>
 <p class="legend"><span class="d">accepted from the drafter</span><span class="t">the target's own token</span></p>
 <div id="log"></div>
 <form id="form">
  <textarea id="prompt" placeholder="Ask something; Ctrl+Enter sends"></textarea>
  <div class="row">
   <label>temperature <input id="temperature" type="number" value="0" min="0" max="2" step="0.1"></label>
   <label>max tokens <input id="max_tokens" type="number" value="256" min="1"></label>
   <label>API key <input id="key" type="password" style="width:10em"></label>
   <button id="send" type="submit">Send</button><button id="reset" type="button">New chat</button>
  </div>
 </form>
</main>
<script>
const MODEL = __MODEL__;
const $ = id => document.getElementById(id);
$("model").textContent = MODEL;
let history = [];
function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls; if (text) div.textContent = text;
  $("log").appendChild(div); return div;
}
function stats(d) {
  if (d.tau !== undefined) $("tau").textContent = Number(d.tau).toFixed(2);
  if (d.decode_tokens_per_s !== undefined) $("tps").textContent = Number(d.decode_tokens_per_s).toFixed(1);
}
async function send(prompt) {
  history.push({role: "user", content: prompt});
  bubble("user", prompt);
  const out = bubble("assistant", ""); out.id = "answer-" + history.length;
  let text = "", ntok = 0, ndraft = 0;
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers["Authorization"] = "Bearer " + $("key").value;
  $("send").disabled = true;
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify({
      model: MODEL, messages: history, stream: true,
      temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value)})});
    if (!resp.ok) { const e = await resp.json(); throw new Error(e.error ? e.error.message : resp.statusText); }
    const reader = resp.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, cut).trim(); buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(msg.error.message);
        const d = msg.dflash || {};
        for (const [piece, fromDraft] of (d.pieces || [])) {
          const span = document.createElement("span");
          span.className = fromDraft ? "d" : "t"; span.textContent = piece;
          out.appendChild(span); text += piece;
          if (fromDraft) ndraft++;
        }
        if (d.tokens !== undefined) ntok = d.tokens;
        if (d.accepted_from_draft !== undefined) ndraft = d.accepted_from_draft;
        $("ntok").textContent = ntok; $("ndraft").textContent = ndraft;
        stats(d);
        if (msg.choices && msg.choices[0] && msg.choices[0].finish_reason) out.dataset.finish = msg.choices[0].finish_reason;
      }
    }
    history.push({role: "assistant", content: text});
  } catch (e) {
    history.pop(); out.remove(); bubble("error", String(e.message || e));
  } finally { $("send").disabled = false; }
}
$("form").addEventListener("submit", ev => {
  ev.preventDefault();
  const p = $("prompt").value.trim(); if (!p) return;
  $("prompt").value = ""; send(p);
});
$("prompt").addEventListener("keydown", ev => { if (ev.key === "Enter" && ev.ctrlKey) $("form").requestSubmit(); });
$("reset").addEventListener("click", () => { history = []; $("log").innerHTML = ""; });
</script></body></html>
"""


if __name__ == "__main__":
    sys.exit(main())
