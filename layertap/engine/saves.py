"""The connector's scheduler side: which requests to save in which step, and the metadata it hands to the
workers (see ``connector``'s docstring for the whole protocol). Runs in the engine-core process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from layertap.engine import compat
from layertap.records import LAYER_SEMANTICS

PARAMS_KEY = "layertap"  # kv_transfer_params[PARAMS_KEY] marks a request for capture


class SlotCheckError(RuntimeError):
    """The slots vLLM wrote this step do not include the slots computed for a request."""


NOTHING_SHARED: dict[str, Any] = {}
"""A SaveJob's ``shared`` where its maker gives none: one dict, so the writer encodes it once. Never changed."""


@dataclass
class SaveJob:
    req_id: str
    key: str
    block_ids: list[int]
    token_ids: list[int] | np.ndarray
    """The record's token ids as the scheduler has them (a list): the record's writer converts them once and
    hashes them (``records.ids_and_digest``), off the scheduler's step (on CUDA in the record process)."""
    num_rows: int
    meta: dict[str, Any]  # the record's own manifest fields
    release: bool = True  # report the blocks free once read (False: a prompt saved before its request ends)
    shared: dict[str, Any] = field(default_factory=lambda: NOTHING_SHARED)
    """Manifest fields every record of this engine carries (one dict, never changed once made): the writer
    encodes them once (``records.MetaTemplate``); the record's manifest is ``{**shared, **meta}``."""


@dataclass
class SlotCheck:
    req_id: str
    block_ids: list[int]
    start: int
    stop: int


@dataclass
class LayertapMetadata(KVConnectorMetadata):
    saves: list[SaveJob] = field(default_factory=list)
    checks: list[SlotCheck] = field(default_factory=list)
    num_tokens: int = 0
    """Tokens scheduled this step: how much of the runner's slot-mapping buffer a late check reads."""


class SchedulerSide:
    """Per step: the saves of finished (or prompt-complete) requests and the first steps' slot checks."""

    def __init__(self, c: Any):
        self.c = c
        self.blocks: dict[str, list[int]] = {}  # hidden-group block ids per live request
        self.params: dict[str, dict] = {}
        self.pending: list[SaveJob] = []
        # Prompt-mode requests on the hook path are saved in the step whose forward completes their prompt
        # (the rows are final then), not after they finish: no blocks held, no engine step spent waiting.
        self.eager = self.c._extra.get("capture_path") == "hook"  # as compat.capture_layer_ids decides
        self.prompts: dict[str, list[int]] = {}  # prompt ids of live prompt-mode requests to save eagerly
        self.saved_early: dict[str, dict] = {}  # req_id -> what request_finished reports for it
        self.steps = 0
        self.decode_steps = 0
        # Generate-mode requests alive (by their params; ``default_generate``: every request counts, as under
        # ``layertap serve``): only they keep decode rows, so only while one lives can a decode-step slot check
        # come. Without one, the steady state below needs no block tracking even before any decode check ran.
        self.gen_live: set[str] = set()
        self.default_generate = self.c._extra.get("default_mode", "prompt") == "generate"
        self.shared = {"layer_ids": list(self.c._layer_ids), "layer_semantics": LAYER_SEMANTICS,
                       "cache_group": self.c._group_desc}  # every SaveJob's ``shared``: the same dict

    def build_meta(self, out) -> LayertapMetadata:
        new = compat.new_requests(out)
        decode_checks_done = self.decode_steps >= self.c._check_steps or not (self.default_generate or self.gen_live)
        if not new and not self.prompts and self.steps >= self.c._check_steps and decode_checks_done:
            # Steady state (once the first steps' checks are done, and the first decode steps' where a
            # generate-mode request runs): no slot check can come any more and no prompt waits for an early
            # save, so the block ids need no tracking (a generate-mode save takes them from request_finished);
            # only the saves queued by request_finished go out. This runs on the engine's one thread every
            # step; the full pass below cost ~0.5 us per request in flight (31 us a step at 64, measured on the
            # 2-core CPU machine), and a prompt-only run (no decode check ever) took it on every step: ~45 us a
            # step at 1 in flight there (benchmarks/step_profile.py, 2026-12-06).
            self.steps += 1
            saves, self.pending = self.pending, []
            return LayertapMetadata(saves=saves)
        return self._build_meta(out, new)

    def _build_meta(self, out, new: list) -> LayertapMetadata:
        g = self.c._group
        sched = compat.num_scheduled(out)
        checks = []
        want_checks = self.steps < self.c._check_steps
        computed_now: dict[str, int] = {}
        for rid, blocks, computed, params, prompt in new:
            self.blocks[rid] = list(blocks[g]) if len(blocks) > g else []
            computed_now[rid] = computed
            if params and PARAMS_KEY in params:
                self.params[rid] = params[PARAMS_KEY]
                mode = self.params[rid].get("mode", self.c._extra.get("default_mode", "prompt"))
                if self.eager and mode == "prompt" and prompt:
                    self.prompts[rid] = prompt
                elif mode == "generate":
                    self.gen_live.add(rid)
            if want_checks and rid in sched:
                checks.append(SlotCheck(rid, list(self.blocks[rid]), computed, computed + sched[rid]))
        cached = compat.cached_requests(out)
        # Decode steps (a token + the dummy draft) are checked too: their positions are where scheduler and
        # worker can disagree (async scheduling), and the first steps of a run are often all prefill. Only
        # requests that keep decode rows (generate mode) are checked there: a prompt-mode request's rows
        # end with its prompt, whatever a late decode step writes after it.
        def keeps_decode_rows(rid: str) -> bool:
            params = self.params.get(rid)
            mode = params.get("mode") if params is not None else None
            return (mode or self.c._extra.get("default_mode", "prompt")) == "generate"

        decoding = {rid for rid, _, _, _, n_out in cached if n_out > 0 and rid in sched}
        want_decode_checks = any(map(keeps_decode_rows, decoding)) and self.decode_steps < self.c._check_steps
        for rid, new_blocks, resumed, computed, _ in cached:
            computed_now[rid] = computed
            if new_blocks is not None and len(new_blocks) > g:
                self.blocks[rid] = list(new_blocks[g]) if resumed else self.blocks.get(rid, []) + list(new_blocks[g])
            if rid in decoding and not keeps_decode_rows(rid):
                continue
            if (want_checks or want_decode_checks) and rid in sched:
                checks.append(SlotCheck(rid, list(self.blocks.get(rid, [])), computed, computed + sched[rid]))
        self.steps += 1
        self.decode_steps += want_decode_checks
        saves = self.pending
        for rid in [r for r in self.prompts if r in sched and computed_now.get(r, -1) + sched[r] >= len(self.prompts[r])]:
            saves.append(self._early_save(rid, self.prompts.pop(rid)))
        meta = LayertapMetadata(saves=saves, checks=checks, num_tokens=sum(sched.values()))
        self.pending = []
        return meta

    def _early_save(self, rid: str, prompt: list[int]) -> SaveJob:
        """This step's forward completes the prompt of a prompt-mode request: its rows are final after it."""
        params = self.params.get(rid, {})
        n = len(prompt)
        job = self._job(rid, params, "prompt", prompt, n, None, list(self.blocks.get(rid, [])))
        job.release = False  # the request runs on; its blocks are the scheduler's to free
        self.saved_early[rid] = {"status": "saving", "key": job.key, "num_rows": n}
        return job

    def _job(self, rid: str, params: dict, mode: str, token_ids: list[int], n_prompt: int,
             next_token: int | None, block_ids: list[int]) -> SaveJob:
        n_rows = len(token_ids)
        # No conversion or hash of the tokens here: the record's writer makes both (``records.ids_and_digest``;
        # on CUDA the record process, off the engine's thread, where they cost ~70 us a 1k-token record on
        # the H100 hosts' step thread, benchmarks/step_profile.py 2026-12-06). The Tap hashes the tokens it
        # submitted and compares them with the record's digest, which the transport checks against its ids.
        key = f"{params.get('run', 'run')}:{rid}"
        meta = {
            "key": key, "request_id": rid, "index": int(params.get("index", -1)), "mode": mode,
            "num_tokens": n_rows, "num_prompt_tokens": min(n_prompt, n_rows),
            "next_token_id": next_token,
            **{k: v for k, v in params.items() if k in ("sample", "run", "loss_spans")},
        }
        return SaveJob(rid, key, block_ids, token_ids, n_rows, meta, shared=self.shared)

    def finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self.blocks.pop(rid, None)
        self.gen_live.discard(rid)
        self.prompts.pop(rid, None)
        params = self.params.pop(rid, None)
        early = self.saved_early.pop(rid, None)
        if early is not None:  # saved when its prompt completed; nothing left to hold
            # the status alone: finished_request_state copies the request's token list (~1k ids a prompt)
            return False, {PARAMS_KEY: {"status": "aborted"} if compat.request_aborted(request) else early}
        if params is None:
            tp = request.kv_transfer_params or {}
            params = tp.get(PARAMS_KEY) if isinstance(tp, dict) else None
        if params is None and self.c._extra.get("capture_all"):
            params = {}  # `layertap serve --capture-all`: every request is captured (pipeline/serve.py)
        if params is None:
            return False, None  # not a capture request
        all_ids, n_prompt, n_computed, aborted, _ = compat.finished_request_state(request)
        if aborted or n_computed == 0:
            return False, {PARAMS_KEY: {"status": "aborted"}}
        # `layertap serve` sets default_mode "generate" (prompt + answer rows); the Tap always sends a mode.
        mode = params.get("mode", self.c._extra.get("default_mode", "prompt"))
        # Rows exist for tokens that ran through the model. The last sampled token never did; after a
        # preemption vLLM may count the dummy draft slot as computed, so clip to the tokens that ran.
        n_rows = min(n_computed, n_prompt if mode == "prompt" else len(all_ids) - 1)
        job = self._job(rid, params, mode, all_ids[:n_rows], n_prompt,
                        all_ids[n_rows] if n_rows < len(all_ids) else None, block_ids)
        self.pending.append(job)
        return True, {PARAMS_KEY: {"status": "saving", "key": job.key, "num_rows": n_rows}}

