"""``Tap``: a vLLM engine with hidden-state capture, and the request loop that proves each record.

    tap = Tap(model=PATH, layers=[1, 2, 4], **vllm_engine_kwargs)
    for rec in tap.capture(inputs):          # prompt mode: teacher forcing over whole conversations
        ...
    for rec in tap.capture(inputs, mode="generate", sampling_params=SamplingParams(max_tokens=32)):
        ...

Each submitted request carries ``kv_transfer_params={"layertap": {...}}``; the connector in the engine
writes its record through the transport; the Tap matches records to requests by key and checks the
token-id digest against the tokens it submitted (plus the tokens vLLM returned), so a record read from
another request's rows can not pass. Records are complete when ``capture`` returns.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layertap import analysis
from layertap.data import InputItem, iter_inputs
from layertap.engine import compat, launch, watchdog
from layertap.engine.connector import PARAMS_KEY
from layertap.errors import CaptureError, LayerZeroMismatch, MissingRecords
from layertap.errors import RequestTooLong  # noqa: F401  (re-exported, as are the three above)
from layertap.records import LAYER_SEMANTICS, Record, token_digest
from layertap.transport.base import TransportFull, get_transport
from layertap.targetinfo import TargetInfo
from layertap.verify import row_cosine

log = logging.getLogger("layertap")

CPU_DEFAULT_KV_BYTES = 1 << 30  # the CPU backend reads gpu_memory_utilization as a share of RAM
DEFAULT_START_TIMEOUT = 900.0
"""Seconds an engine may take to start (a compiled 8B model starts in 1-2 min on the H200; weights read
from a slow disk take longer): past it, ``EngineStartTimeout`` with a report, instead of a silent hang."""
DEFAULT_STEP_TIMEOUT = 300.0
"""Seconds one engine step may take (steps take milliseconds to seconds)."""


def owner_info() -> dict[str, int]:
    """This process, as the engine processes' connector watches it (``connector.watch_owner``)."""
    from layertap.transport.shm_pool import proc_start_time

    return {"pid": os.getpid(), "start": proc_start_time(os.getpid()) or 0}


@dataclass
class Rejected:
    index: int
    reason: str


def _loss_spans(mask: list[int] | None) -> list[list[int]] | None:
    if mask is None:
        return None
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def _engine_died(expect: dict, by_req: dict, queue: list) -> MissingRecords:
    lost = sorted([it.index for it, *_ in expect.values()] + [it.index for it in by_req.values()]
                  + [it.index for it in queue])
    return MissingRecords(f"the vLLM engine died; {len(lost)} inputs have no record: indices "
                          f"{lost[:20]}{' ...' if len(lost) > 20 else ''}")


class Tap:
    """A vLLM ``LLM`` with capture of the given layer ids; see the module docstring."""

    def __init__(self, model: str | os.PathLike, layers: list[int], *, transport: str | None = None,
                 transport_config: dict[str, Any] | None = None, out: str | os.PathLike | None = None,
                 max_inflight: int | None = None, check_first: int = 8, record_timeout: float = 120.0,
                 post_norm_last: bool = False, zero_copy: bool = False, capture_path: str = "hook",
                 start_timeout: float = DEFAULT_START_TIMEOUT, step_timeout: float = DEFAULT_STEP_TIMEOUT,
                 **engine_kwargs: Any):
        """``transport``: "file" (a dataset at ``out``), "shm" (default without ``out``: a shared-memory pool)
        or "mooncake". ``zero_copy``: stream records that view the transport's memory (call
        ``rec.release()`` when done); by default streamed records are private copies. ``capture_path``:
        "hook" (default; the model runner's forward writes the rows, no speculative decoding) or
        "extract" (vLLM's ``extract_hidden_states`` speculative method); see ``engine/launch.py``.
        ``start_timeout`` / ``step_timeout``: seconds the engine may take to start / to return from one step
        before ``EngineStartTimeout`` / ``EngineStepTimeout`` (the message says where its processes stand;
        they are killed). Whatever fails in here leaves nothing behind (no shared memory, no process)."""
        launch.check_capture_path(capture_path)
        self.capture_path = capture_path
        self.version = compat.check_version()
        self.target = TargetInfo.load(model)
        self.layers = self.target.check_layer_ids(layers)
        compat.check_model_tappable(self.target.config.get("architectures"), self.target.config.get("model_type"))
        self.check_first = check_first
        self.post_norm_last = post_norm_last
        """Analysis API: apply the model's final norm to layer id N in ``generate`` results."""
        self.record_timeout = record_timeout
        self.stall_timeout = 10.0
        """Seconds the transport may stay full with nothing in flight before ``TransportFull`` is raised."""
        self.max_inflight = max_inflight
        """At most this many requests run in the engine at once; the Tap keeps that many in it. The engine's own
        ``max_num_seqs`` is the caller's (vLLM's default unless given); where it is at most ``max_inflight``, see
        ``lookahead``."""
        self.lookahead = True
        """Where the engine's ``max_num_seqs`` is at most ``max_inflight``, admit up to ``max_inflight`` more
        requests than that: they wait in the engine's own queue, so the engine replaces a finished request
        without waiting for its output to reach this process and the next admission to come back. False: at most
        ``max_inflight`` requests are in the engine (running or waiting), as where the engine has more seats
        (a benchmark aid for ``capture_overhead.py``, whose plain engine is driven the same way)."""
        self._engine_seqs: int | None = None
        self.defer_records = True
        """While the engine's next output already waits, take it before proving more records (at least one a
        round). False (a benchmark aid, ``capture_overhead.py`` capture-eager): every committed record first."""
        self.prebuild = False
        """Build the next requests (vLLM's input processing) while the engine runs, so that admitting one after
        a finished request is only its send (``compat.request_builder``; ignored where that vLLM has no such
        seam). Off by default until a GPU pair shows it pays: on the CPU box it cuts the admission of a
        1,024-token request to ~0.3 of its time (``benchmarks/admission_cost.py``), with no measurable change in
        throughput (RESULTS 2026-12-06, eleventh session); ``capture_overhead.py`` capture-prebuild measures that."""
        self.deferrals = 0
        """Rounds in which records waited for an engine output (``defer_records``), over the Tap's life."""
        self.run = uuid.uuid4().hex[:8]
        on_cuda = torch.cuda.is_available()
        if os.environ.get("LAYERTAP_ALLOW_KNOWN_BUGS") != "1":
            compat.check_known_bugs(self.version, self.layers, bool(engine_kwargs.get("enforce_eager")), on_cuda)
        self._tmp = None
        self.llm = None
        self.source = None
        self._watch = None
        self._wd = watchdog.Watchdog(start_timeout, step_timeout, watchdog.new_diag_dir())
        try:
            self._open(transport, transport_config, out, zero_copy, engine_kwargs, on_cuda)
        except BaseException:
            self.close()  # a failed or interrupted start-up: free the transport, stop what started
            raise

    def _open(self, transport: str | None, transport_config: dict[str, Any] | None, out: Any, zero_copy: bool,
              engine_kwargs: dict[str, Any], on_cuda: bool) -> None:
        cfg = dict(transport_config or {})
        transport = transport or ("file" if out is not None else "shm")
        if transport == "file":
            if out is None:
                self._tmp = tempfile.mkdtemp(prefix="layertap-")
                out = self._tmp
            cfg["path"] = str(out)
        self.transport_name = transport
        self.transport_cls = get_transport(transport)
        self.transport_cfg = {**self.transport_cls.prepare(cfg), "backend": transport}
        self.run_meta = {
            "model": str(self.target.path), "config_hash": self.target.config_hash, "vllm_version": self.version,
            "layer_semantics": LAYER_SEMANTICS, "num_hidden_layers": self.target.num_layers,
            "hidden_size": self.target.hidden_size, "format_version": 1,
        }
        if transport == "file":
            self._write_dataset_manifest(Path(self.transport_cfg["path"]))
        if transport == "file":
            self.source = self.transport_cls.make_source(self.transport_cfg)
        else:
            self.source = self.transport_cls.make_source(self.transport_cfg, copy=not zero_copy)
        self.llm = self._start_engine(engine_kwargs, on_cuda)
        self._engine_seqs = compat.max_num_seqs(self.llm)
        self._output_waiting = compat.output_waiting_check(self.llm)  # for defer_records (None: not here)
        self._watch = compat.watch_engine_death(self.llm)
        llm = self.llm
        self._wd.on_timeout = lambda err: compat.fail_blocked_step(llm, err)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.rejected: list[Rejected] = []
        self._stale_requests: set[str] = set()
        self._stale_keys: set[str] = set()
        self._abandoned_ids: set[str] = set()
        self._checked = 0
        self._n_req = 0  # requests sent to the engine
        self._n_rid = 0  # request ids made (a request is built before it is sent: Tap.prebuild)

    # ------------------------------------------------------------------ set-up
    def _write_dataset_manifest(self, root: Path) -> None:
        man = root / "dataset.json"
        meta = {**self.run_meta, "layer_ids": self.layers}
        if man.exists():
            old = json.loads(man.read_text())
            for k in ("config_hash", "layer_ids"):
                if old.get(k) != meta.get(k):
                    raise CaptureError(f"{root} already holds a dataset with {k}={old.get(k)!r}, not {meta.get(k)!r}; "
                                       "use a new --out directory")
            return
        tmp = man.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, man)

    def _start_engine(self, kw: dict[str, Any], on_cuda: bool):
        from vllm import LLM

        kw = {**compat.engine_defaults(self.version, on_cuda, kw, self.capture_path), **kw}
        capture_kw = launch.engine_capture_kwargs(self.capture_path, self.layers, kw)
        for k in ("speculative_config", "worker_cls"):
            kw.pop(k, None)  # only None or "auto" get here (engine_capture_kwargs refuses the rest)
        if not on_cuda and "kv_cache_memory_bytes" not in kw and "gpu_memory_utilization" not in kw:
            kw["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_BYTES
        extra = {"transport": self.transport_cfg, "run_meta": self.run_meta,
                 "slot_check_steps": kw.pop("slot_check_steps", 4), "owner": owner_info(),
                 "capture_path": self.capture_path, "layer_ids": list(self.layers)}
        # Connector switches (e.g. {"direct": False}: stage rows through pinned buffers instead of writing
        # them into transport memory in place); unknown keys are refused so a typo is not silently ignored.
        extra.update(launch.check_connector_options(kw.pop("connector_options", None)))
        env = {**launch.engine_env(on_cuda, kw), watchdog.DIAG_ENV: str(self._wd.diag)}
        with launch.engine_env_set(env), self._wd.starting():
            return LLM(
                model=str(self.target.path),
                **capture_kw,
                kv_transfer_config=launch.kv_transfer_config(extra),
                **kw,
            )

    def check_generate_allowed(self) -> None:
        compat.check_generate_allowed(self.version, torch.cuda.is_available(), compat.async_scheduling(self.llm),
                                      self.capture_path)

    def step(self) -> list:
        """One ``LLMEngine.step()`` under the step limit (``EngineStepTimeout``)."""
        with self._wd.stepping():
            return self.llm.llm_engine.step()

    @property
    def tokenizer(self):
        return self.target.tokenizer

    # ------------------------------------------------------------------ capture
    def capture(self, inputs: str | os.PathLike | Iterable[Any], *, mode: str = "prompt", sampling_params=None,
                skip_indices: set[int] | None = None) -> Iterator[Record]:
        """Submit every input, yield one checked ``Record`` per request as it commits.

        ``mode="prompt"``: one forward pass over the whole input (teacher forcing); rows = input tokens.
        ``mode="generate"``: rows = input tokens + generated tokens except the last sampled one.
        Inputs that would overrun ``max_model_len`` are rejected by name (``self.rejected``); the rest run.
        A bad input (``InputError``) stops the call before any record is handed out. Writing a dataset
        (``file``), every input is checked before any request; streaming, the first before its admission and the
        others while it runs, each before its own admission.
        """
        from vllm import SamplingParams

        if mode not in ("prompt", "generate"):
            raise ValueError(f"mode must be 'prompt' or 'generate', got {mode!r}")
        if mode == "generate":
            self.check_generate_allowed()
        items = iter_inputs(inputs, self.tokenizer)
        if mode == "prompt":
            # the one sampled token is never read: no detokenizing (a measurable share of the driver's
            # per-request work)
            sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        else:
            sp = sampling_params or SamplingParams(max_tokens=32, temperature=0.0)

        def take(n: int | None) -> list[InputItem]:
            """The next ``n`` inputs (``None``: all the rest), checked; the too long ones rejected by name."""
            todo: list[InputItem] = []
            for it in items if n is None else itertools.islice(items, n):
                if skip_indices and it.index in skip_indices:
                    continue
                need = len(it.token_ids) + (sp.max_tokens or 0) + 1
                if need > self.max_model_len:
                    reason = (f"input {it.index}: {len(it.token_ids)} prompt tokens + max_tokens {sp.max_tokens} + 1 "
                              f"capture slot = {need} > max_model_len {self.max_model_len}")
                    log.error("rejected %s", reason)
                    self.rejected.append(Rejected(it.index, reason))
                else:
                    todo.append(it)
            return todo

        # Writing a dataset (file): records land on disk as their requests finish, so every input is checked
        # before any request goes to the engine and a call with a bad input leaves no record there. Streamed
        # records (shm, mooncake): each input is checked just before it is admitted, the first alone before the
        # first admission, and every other one before the first engine step is read, so before any record is
        # handed out (a bad one raises InputError and the admitted requests are aborted). Checking them all first
        # kept the engine idle ~50 us per 1,024-token input at the start of every call (13 ms for 256 inputs on
        # the H100 host of 2026-12-06); checking the first round's 16 first, ~0.9 ms a call at 16 in flight (H100,
        # 2026-12-07: `head` in capture_overhead.py --stats).
        if self.transport_name == "file":
            yield from self._run(take(None), sp, mode)
        else:
            first = min(self.max_inflight or self.HEAD_INPUTS, self.HEAD_INPUTS)
            yield from self._run(take(1), sp, mode, rest=(lambda: take(first - 1), lambda: take(None)))

    _UNREAD = object()
    # The first admission round takes at most this many inputs (fewer where max_inflight is lower), checked and
    # admitted one after the first: enough for the engine's first steps (16 inputs of 1,024 tokens are two steps at
    # 8,192 tokens a step), while the rest are checked and admitted as those run
    HEAD_INPUTS = 16

    def _admit_bound(self) -> int | None:
        """The most requests this Tap keeps in the engine, running or waiting there (None: no bound but the
        transport's). ``max_inflight``, plus as many more where the engine itself runs at most that many
        (``lookahead``)."""
        n = self.max_inflight
        if n is not None and self.lookahead and self._engine_seqs is not None and self._engine_seqs <= n:
            return 2 * n
        return n

    def _can_admit(self, running: int, pending_records: int, free: Any = _UNREAD) -> bool:
        """Engine bound: ``_admit_bound()`` requests in the engine. Transport bound: every request in the engine
        and every record not yet consumed must fit the transport's free capacity, so the worker never blocks on
        a full pool because of us (the producer slows by admitting fewer requests, nothing is dropped).
        ``free``: the capacity as read at the start of this admission round (default: read it now)."""
        bound = self._admit_bound()
        if bound is not None and running >= bound:
            return False
        if free is Tap._UNREAD:
            free = self.source.free_capacity()
        return free is None or running + pending_records < free

    def _run(self, todo: list[InputItem], sp, mode: str,
             rest: Sequence[Callable[[], list[InputItem]]] = ()) -> Iterator[Record]:
        by_req: dict[str, InputItem] = {}
        expect: dict[str, tuple[InputItem, list[int], str]] = {}  # record key -> (item, its token ids, their digest)
        try:
            yield from self._loop(todo, sp, mode, by_req, expect, rest)
        finally:
            # Left early (the caller stopped iterating, or an error): abort what still runs and remember
            # what belongs to this iteration, so a later capture on this Tap is not confused by it.
            if by_req and self.llm is not None and not compat.engine_dead(self.llm):
                self.llm.llm_engine.abort_request(list(by_req))
            self._stale_requests.update(by_req)
            self._abandoned_ids.update(by_req)
            self._stale_keys.update(expect)

    def _abandoned(self, rec: Record) -> bool:
        # vLLM appends "-<8 hex>" to request ids; a record of a request that finished in the engine before
        # the abort carries the internal id.
        rid = str(rec.meta.get("request_id", ""))
        return rid.rsplit("-", 1)[0] in self._abandoned_ids

    def _loop(self, todo: list[InputItem], sp, mode: str, by_req: dict, expect: dict,
              rest: Sequence[Callable[[], list[InputItem]]] = ()) -> Iterator[Record]:
        """``rest``: the inputs after ``todo``, in stages (each checks its inputs when called), all taken and
        admitted as far as the bounds allow before the first engine step is read, so a bad input stops the call
        before any record is handed out."""
        from vllm import TokensPrompt

        engine = self.llm.llm_engine
        queue = list(reversed(todo))
        early: dict[str, Record] = {}  # records can commit before their RequestOutput is processed
        running = 0
        stall_since: float | None = None
        last_progress = time.monotonic()

        # One template for this call: vLLM copies the params it is given (compat.engine_copies_params), so
        # each request only replaces the template's extra_args, and no deep copy of our own sits between
        # a finished request and its successor's admission (at 1-16 in flight a late admission can miss
        # the engine's next scheduling step).
        template = sp.clone()
        shared = compat.engine_copies_params(self.version)
        extra = dict(template.extra_args or {})

        # Requests built ahead (vLLM's input processing, ~3/4 of add_request: compat.request_builder) while the
        # engine runs, in queue order; admitting one is then only its send. None: built at admission.
        build = compat.request_builder(engine, self.version) if self.prebuild else None
        ready: collections.deque = collections.deque()  # (input, request id, params, request or prompt)
        ahead = min(self.max_inflight or self.HEAD_INPUTS, self.HEAD_INPUTS)

        def make(it: InputItem) -> tuple:
            self._n_rid += 1
            rid = f"{self.run}-{it.index}-{self._n_rid}"
            p = template if shared else template.clone()
            params = {"index": it.index, "mode": mode, "run": self.run, "loss_spans": _loss_spans(it.loss_mask)}
            p.extra_args = {**extra, "kv_transfer_params": {PARAMS_KEY: params}}  # a new dict each time
            prompt = TokensPrompt(prompt_token_ids=it.token_ids)
            return it, rid, p, (prompt if build is None else build(rid, prompt, p))

        def admit(finishing: int = 0) -> int:
            n = 0
            bound = self._admit_bound()
            if not (ready or queue) or (bound is not None and running >= bound):
                return 0
            free = self.source.free_capacity()  # read once per round: a scan of the pool's slot table
            while (ready or queue) and self._can_admit(running + n, len(expect) + finishing, free):
                it, rid, p, req = ready.popleft() if ready else make(queue.pop())
                self._n_req += 1
                if build is None:
                    engine.add_request(rid, req, p)
                else:
                    compat.send_built(engine, req, p)
                by_req[rid] = it
                n += 1
            return n

        def prepare() -> None:
            """Build the next requests while the engine runs; an engine output that already waits goes first."""
            while build is not None and queue and len(ready) < ahead:
                if output_waiting is not None and output_waiting():
                    return
                ready.append(make(queue.pop()))

        inproc = compat.engine_core_in_process(self.llm)
        # Records come second to the engine's output: while the engine core's next output already waits in
        # this process, the driver takes it (and refills from it) before proving and handing out more records;
        # at least one record goes per round, so records never starve (None: no queue to look at).
        output_waiting = self._output_waiting if self.defer_records else None

        stages = list(rest)
        while not queue and stages:  # the inputs so far were all skipped or rejected
            queue = list(reversed(stages.pop(0)()))
        while queue or ready or running or expect:  # pending stages imply a non-empty queue (above)
            running += admit()
            while stages:  # the remaining inputs, checked while the first requests run
                queue[:0] = reversed(stages.pop(0)())
                running += admit()
            if running:
                prepare()
                try:
                    outs = self.step()
                except watchdog.EngineTimeout:
                    raise
                except Exception as e:
                    if compat.engine_dead(self.llm):
                        raise _engine_died(expect, by_req, [*queue, *(r[0] for r in ready)]) from e
                    raise
                finished = []
                for out in outs:
                    if out.request_id in self._stale_requests:  # from an abandoned earlier iteration
                        if out.finished:
                            self._stale_requests.discard(out.request_id)
                        continue
                    if not out.finished:
                        continue
                    running -= 1
                    finished.append((out, by_req.pop(out.request_id)))
                # Refill before anything else (the finished requests' proofs, handing records out): the
                # engine works on the next requests meanwhile (at 1 in flight it would otherwise sit idle).
                # Their records count against the transport's room as if already expected.
                running += admit(len(finished))
                for out, it in finished:
                    expect.update(self._expected(out, it, mode))
                    last_progress = time.monotonic()
            elif expect and inproc:
                # An in-process engine core steps only when called: the step that passes the last finished
                # requests to the connector's save (generate mode) would otherwise never run.
                self.step()
            # Wait for records only when there is nothing else to do: no request running, none to admit
            # (else a record in flight would hold up the next request's admission) and no record in hand
            # to hand out. A record can land before its request's finished output reaches this process (on
            # CUDA a prompt's record is copied out in its own forward step): waiting for more first cost
            # the full wait, 50 ms, at the end of every call (H100, 2026-12-05).
            in_hand = any(k in expect for k in early)  # a record due whose request has finished
            idle = not running and not in_hand and not ((queue or ready) and self._can_admit(running, len(expect)))
            hurry = output_waiting if running else None
            deferred = hurry is not None and in_hand and hurry()
            # Records are taken off the pool only where one can be due: a finished request awaits its record,
            # or nothing runs. One that lands while its request still runs (on CUDA a prompt's record is copied
            # out in its own forward step, before its finished output reaches this process) stays in the pool
            # until its request finished: taking it earlier is driver work in the way of the engine's next
            # output (H100, 2026-12-06: that output waited 0.20 ms a request in this process at 1 in flight).
            if not deferred and (expect or not running):
                for rec in self.source.poll(timeout=0.05 if idle else 0.0):
                    if rec.meta.get("run") != self.run:
                        raise CaptureError(f"record {rec.key} (index {rec.index}) belongs to another run")
                    if rec.key in self._stale_keys or self._abandoned(rec):  # from an iteration the caller left
                        self._stale_keys.discard(rec.key)
                        rec.release()
                        continue
                    early[rec.key] = rec
            handed = 0
            for key in [k for k in early if k in expect]:
                if handed and hurry is not None and hurry():
                    deferred = True
                    break
                rec = early.pop(key)
                self._prove(rec, *expect.pop(key))
                last_progress = time.monotonic()
                handed += 1
                yield rec
            self.deferrals += deferred
            if compat.engine_dead(self.llm):
                raise _engine_died(expect, by_req, [*queue, *(r[0] for r in ready)])
            stalled = (queue or ready) and not running and not expect and not early and not self._can_admit(0, 0)
            if not stalled:
                stall_since = None
            elif stall_since is None:
                stall_since = time.monotonic()
                time.sleep(0.01)
            elif time.monotonic() - stall_since < self.stall_timeout:
                time.sleep(0.01)  # another thread may still release records
            else:
                raise TransportFull(
                    f"the {self.transport_name} transport has no free capacity and nothing is in flight: records "
                    "already yielded still hold it. Call rec.release() when done with a zero-copy record "
                    f"(or use zero_copy=False); {len(queue) + len(ready)} inputs are waiting")
            if not running and expect and time.monotonic() - last_progress > self.record_timeout:
                for it, want, digest in expect.values():  # a request whose tokens the engine changed says so
                    self._check_engine_tokens(it, want, digest)
                raise MissingRecords(f"{len(expect)} records never arrived within {self.record_timeout:.0f}s: "
                                     + ", ".join(f"index {it.index} ({k})" for k, (it, *_) in list(expect.items())[:10]))
        if early:
            raise CaptureError("records matching no request of this run: "
                               + ", ".join(f"{k} (index {r.index})" for k, r in list(early.items())[:10]))

    def _expected(self, out, it: InputItem, mode: str) -> dict[str, tuple[InputItem, list[int], str | None]]:
        """The record this finished request must deliver: its key -> (input, the token ids it must carry, the
        engine's digest of them where the engine sent one: this connector leaves hashing to the record's
        writer, off the engine's thread). The digests are compared when the record is proven (``_prove``),
        work that waits while an engine output does; what is checked here needs no hashing."""
        params = (out.kv_transfer_params or {}).get(PARAMS_KEY) if out.kv_transfer_params else None
        if params is None or params.get("status") != "saving":
            raise CaptureError(f"input {it.index} (request {out.request_id}) finished without a capture "
                               f"(kv_transfer_params={out.kv_transfer_params}); was it aborted?")
        if mode == "prompt":
            want = it.token_ids
        else:
            comp = out.outputs[0]
            want = (list(it.token_ids) + list(comp.token_ids))[: params["num_rows"]]
        return {params["key"]: (it, want, params.get("token_digest"))}

    @staticmethod
    def _check_engine_tokens(it: InputItem, want: list[int], digest: str | None) -> str:
        """The digest of the tokens submitted (and, generating, those the engine returned); the engine's own,
        where it sent one, must equal it."""
        expected = token_digest(want)
        if digest is not None and expected != digest:
            raise CaptureError(f"input {it.index}: the engine's token ids for its request differ from the tokens "
                               "submitted")
        return expected

    def _prove(self, rec: Record, it: InputItem, want: list[int], digest: str | None) -> None:
        """The record must carry exactly this request's tokens: the sha256 of its token ids (checked against
        its manifest by the transport on delivery) against that of the tokens submitted and, generating,
        returned by the engine for this request; the first records get deeper checks."""
        expected = self._check_engine_tokens(it, want, digest)
        if rec.checked_digest() != expected:  # hashed once, by the transport's check on delivery
            raise CaptureError(f"record {rec.key}: token ids differ from input {it.index}'s")
        if rec.index != it.index:
            raise CaptureError(f"record {rec.key}: index {rec.index} != input index {it.index}")
        if rec.layer_ids != self.layers:
            raise CaptureError(f"record {rec.key}: layer ids {rec.layer_ids} != configured {self.layers}")
        if self._checked < self.check_first:
            self._checked += 1
            if not torch.isfinite(rec.hidden_states.float()).all():
                raise CaptureError(f"record {rec.key}: non-finite hidden states")
            if 0 in self.layers:
                self._check_layer_zero(rec)

    def _check_layer_zero(self, rec: Record) -> None:
        emb = self.target.embedding_rows(rec.token_ids)
        got = rec.hidden_states[:, self.layers.index(0)].float()
        cos = row_cosine(got, emb.float())
        if cos.min() < 0.99:
            raise LayerZeroMismatch(
                f"record {rec.key}: layer id 0 is not the token embedding (min cosine {cos.min():.4f}); vLLM "
                f"{self.version} returned another tensor for layer 0 (known in eager mode on 0.25)"
            )

    # ------------------------------------------------------------------ analysis
    def generate(self, prompts, sampling_params=None, **kwargs):
        """vLLM's ``generate`` plus per-sample hidden states; see ``layertap.analysis``."""
        return analysis.generate(self, prompts, sampling_params, **kwargs)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the engine and free the transport (idempotent; also after a failed start-up)."""
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "_watch", None) is not None:
            self._watch.set()
        try:
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                finally:
                    del llm
        finally:
            src = getattr(self, "source", None)
            self.source = None
            try:
                if src is not None:
                    src.close()
            finally:
                if getattr(self, "transport_cfg", None) is not None:
                    self.transport_cls.cleanup(self.transport_cfg)
                wd = getattr(self, "_wd", None)
                if wd is not None:
                    wd.close()
                    shutil.rmtree(wd.diag, ignore_errors=True)
                if self._tmp:
                    shutil.rmtree(self._tmp, ignore_errors=True)
                    self._tmp = None

    def __enter__(self) -> "Tap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
