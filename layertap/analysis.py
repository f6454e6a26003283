"""Analysis API: vLLM's ``generate`` plus each sample's hidden states, from the pass that generated it.

    tap = Tap(model=PATH, layers=[0, 8, 16], post_norm_last=True)      # any vLLM engine kwargs too
    outs = tap.generate(prompts, SamplingParams(max_tokens=64, temperature=0.7, n=2), logits_at="generated")
    c = outs[0].outputs[1]                 # a vLLM CompletionOutput, exactly as vLLM returned it, plus:
    c.hidden_states                        # torch.Tensor [P + G - 1, len(layers), hidden], engine dtype
    c.layer_ids                            # plane j of hidden_states is layer id layer_ids[j] (ascending)
    c.logits, c.logits_positions           # fp32 [len(positions), vocab] and the rows they belong to

Row alignment (the contract; ``P`` = ``len(out.prompt_token_ids)``, ``G`` = ``len(c.token_ids)``):
    the sequence that ran through the model is ``prompt_token_ids + token_ids[:-1]``: the last sampled
    token was never fed back, so it has no row. Row ``t`` is the state computed *for* input token ``t``
    and predicts token ``t + 1``: rows ``0 .. P-2`` predict prompt tokens, row ``P - 1 + k`` predicted
    generated token ``token_ids[k]`` (``k = 0 .. G-1``). ``hidden_states.shape[0] == P + G - 1``.
Layer semantics (``layertap.records``): id ``i`` is the residual stream entering decoder layer ``i``
    (id 0 = embeddings); id ``N = num_hidden_layers`` is the last layer's output *before* the final norm,
    unless ``post_norm_last``: then plane ``N`` has the model's final RMSNorm applied (HF's last
    ``output_hidden_states`` entry). ``post_norm_last`` and ``logits_at`` require ``N`` in ``layers``.
Logits: the model's ``lm_head`` applied (fp32) to the post-norm plane ``N`` at the rows ``logits_at``
    names: ``"generated"`` (rows ``P-1 ..``: ``logits[k]`` is the distribution ``token_ids[k]`` was
    sampled from, before temperature), ``"last"``, ``"all"``, or a list of row indices (negative from end).

Which pass: the rows are the engine's own, written by vLLM's ``extract_hidden_states`` drafter into
KV-cache blocks during generation and read once per sample when it finishes (engine/connector.py):
nothing is copied to this process per step; a record crosses the transport once, is copied into
``hidden_states`` here and its transport buffer released. ``n > 1``: vLLM fans a request out into
children with internal ids ``f"{j}_{parent_internal_id}"``; each child finishes and is captured on its
own, and its record is attached to ``outputs[j]`` (``CompletionOutput.index == j``) and proven by the
token-id digest of ``prompt + that sample's tokens``.

Not supported: stop *strings* (vLLM's detokenizer ends those requests by abort, which discards the
capture; use ``stop_token_ids``), streaming output kinds (results are final-only, as ``LLM.generate``).
Do not run ``capture`` and ``generate`` on one Tap at the same time (they share the record source).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union

import torch

from layertap.engine.connector import PARAMS_KEY
from layertap.errors import CaptureError, MissingRecords
from layertap.records import Record, token_digest
from layertap.targetinfo import TargetInfo

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

log = logging.getLogger("layertap")

LogitsAt = Union[None, str, Sequence[int]]
# Final norms of the form ``w * x / rms(x)``; Gemma-style ``(1 + w)`` norms would need their own branch.
_PLAIN_RMSNORM_TYPES = {"qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "qwen2_moe", "mixtral"}


class AnalysisError(CaptureError):
    """A ``generate`` request is invalid for capture, or its hidden states could not be proven."""


class TapLike(Protocol):
    """What ``generate`` uses of a ``layertap.tap.Tap``: its started engine, record source and settings.
    (``Tap.generate`` calls in here; this module does not import the Tap.)"""

    target: TargetInfo
    layers: list[int]
    post_norm_last: bool
    run: str
    max_model_len: int
    max_inflight: int | None
    record_timeout: float
    llm: Any
    source: Any

    @property
    def tokenizer(self) -> Any: ...

    def check_generate_allowed(self) -> None: ...

    def step(self) -> list: ...


# ------------------------------------------------------------------------------------------ numerics
@dataclass
class FinalNorm:
    """The target's final RMSNorm, read from the checkpoint (no model load)."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def from_target(cls, target: TargetInfo) -> "FinalNorm":
        mt = target.config.get("model_type")
        if mt not in _PLAIN_RMSNORM_TYPES:
            raise AnalysisError(f"post-norm / logits: model_type {mt!r} is not one whose final norm is known to "
                                f"be w * x / rms(x) (supported: {sorted(_PLAIN_RMSNORM_TYPES)})")
        w = target.tensor("model.norm.weight", "model.language_model.norm.weight")
        return cls(w.float(), float(target.config.get("rms_norm_eps", 1e-6)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalize in fp32, cast back to the input dtype, then scale (weight * x.to(dtype)).
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(x.dtype) * y.to(x.dtype))


def lm_head_weight(target: TargetInfo) -> torch.Tensor:
    """``lm_head.weight``, or the embedding table when the model ties them; fp32 ``[vocab, hidden]``."""
    if target.config.get("tie_word_embeddings"):
        return target.embedding.float()
    return target.tensor("lm_head.weight", "model.language_model.lm_head.weight").float()


_NAMED_ROWS = ("generated", "last", "all")


def logit_rows(spec: LogitsAt, n_rows: int, n_prompt: int) -> list[int] | None:
    """Row indices for ``logits_at`` (see the module docstring) in a sample of ``n_rows`` rows."""
    if spec is None:
        return None
    if isinstance(spec, str):
        named = {"generated": range(n_prompt - 1, n_rows), "last": range(n_rows - 1, n_rows), "all": range(n_rows)}
        if spec not in named:
            raise AnalysisError(f"logits_at={spec!r}: use one of {_NAMED_ROWS} or a list of row indices")
        return list(named[spec])
    rows = [int(i) + n_rows if int(i) < 0 else int(i) for i in spec]
    bad = [i for i, r in zip(spec, rows) if not 0 <= r < n_rows]
    if bad:
        raise AnalysisError(f"logits_at rows {bad} are outside this sample's {n_rows} rows")
    return rows


def sample_keys(run: str, internal_id: str, n: int) -> list[str]:
    """Record keys of a request's samples, in sample order. vLLM (``v1/engine/parallel_sampling.py``,
    ``ParentRequest.get_child_info``) names child ``j`` of an ``n > 1`` request ``f"{j}_{internal_id}"``;
    with ``n == 1`` the request runs under its internal id. The connector keys records ``f"{run}:{id}"``."""
    ids = [internal_id] if n == 1 else [f"{j}_{internal_id}" for j in range(n)]
    return [f"{run}:{i}" for i in ids]


# ------------------------------------------------------------------------------------------ requests
@dataclass
class _Settings:
    layers: list[int]
    num_layers: int
    post_norm: bool
    logits_at: LogitsAt
    norm: FinalNorm | None = None
    head: torch.Tensor | None = None

    @property
    def last_plane(self) -> int:
        return self.layers.index(self.num_layers)


def check_settings(layers: list[int], num_layers: int, post_norm: bool, logits_at: LogitsAt) -> None:
    """Raise unless the plane that post-norm / logits need (layer id ``num_layers``) is captured."""
    if isinstance(logits_at, str) and logits_at not in _NAMED_ROWS:
        raise AnalysisError(f"logits_at={logits_at!r}: use one of {_NAMED_ROWS} or a list of row indices")
    if (post_norm or logits_at is not None) and num_layers not in layers:
        what = "post_norm_last" if post_norm else f"logits_at={logits_at!r}"
        raise AnalysisError(f"{what} needs the last layer's output, layer id {num_layers} (this model has "
                            f"{num_layers} layers), among the captured layers; got layers={layers}")


def _settings(tap: TapLike, post_norm: bool, logits_at: LogitsAt) -> _Settings:
    n = tap.target.num_layers
    check_settings(tap.layers, n, post_norm, logits_at)
    s = _Settings(tap.layers, n, post_norm, logits_at)
    if post_norm or logits_at is not None:
        s.norm = FinalNorm.from_target(tap.target)
    if logits_at is not None:
        s.head = lm_head_weight(tap.target)
    return s


def _prompt_len(tap: TapLike, prompt: Any) -> int:
    """Prompt length for the up-front max_model_len check (vLLM's own ids are proven later)."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return len(prompt["prompt_token_ids"])
    text = prompt["prompt"] if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise AnalysisError(f"prompt of type {type(prompt).__name__}: pass a string, {{'prompt': str}} or "
                            "{'prompt_token_ids': [...]}")
    return len(tap.tokenizer(text)["input_ids"])


def _request_params(tap: TapLike, sp: "SamplingParams", index: int, n_prompt: int) -> "SamplingParams":
    """A clone of ``sp`` with the capture marker; refuses what capture cannot serve."""
    from vllm.sampling_params import RequestOutputKind

    if sp.stop:
        raise AnalysisError(f"prompt {index}: stop strings {sp.stop!r} end requests by abort in vLLM's detokenizer, "
                            "which discards the capture; use stop_token_ids instead")
    p = sp.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    room = tap.max_model_len - n_prompt - 1  # the capture's dummy draft token needs one slot
    if p.max_tokens is None:
        p.max_tokens = room
    if p.max_tokens > room:
        raise AnalysisError(f"prompt {index}: {n_prompt} prompt tokens + max_tokens {p.max_tokens} + 1 capture slot "
                            f"> max_model_len {tap.max_model_len} (vLLM would skip the capture for the whole batch)")
    params = {"index": index, "mode": "generate", "run": tap.run, "loss_spans": None}
    p.extra_args = {**(p.extra_args or {}), "kv_transfer_params": {PARAMS_KEY: params}}
    return p


@dataclass
class _Sample:
    """A record turned into owned tensors (its transport buffer is released on arrival)."""

    token_ids: list[int]
    hidden: torch.Tensor
    logits: torch.Tensor | None
    positions: list[int] | None
    error: str | None = None
    """A per-sample problem (e.g. a ``logits_at`` row past its end), raised after the call drains."""


def _convert(rec: Record, s: _Settings) -> _Sample:
    hs = rec.hidden_states.clone()  # own it: the record may view a shm slot that goes back to the pool
    n_rows, n_prompt = int(hs.shape[0]), int(rec.num_prompt_tokens)
    logits, rows = None, None
    if s.norm is not None:
        last = s.norm(hs[:, s.last_plane])
        if s.head is not None:
            try:
                rows = logit_rows(s.logits_at, n_rows, n_prompt)
            except AnalysisError as e:  # keep draining the engine; raised in _attach
                return _Sample(rec.token_ids.tolist(), hs, None, None, f"record {rec.key}: {e}")
            logits = last[rows].float() @ s.head.T
        if s.post_norm:
            hs[:, s.last_plane] = last
    return _Sample(rec.token_ids.tolist(), hs, logits, rows)


@dataclass
class _Job:
    index: int
    prompt: Any
    params: "SamplingParams"
    keys: list[str] = field(default_factory=list)
    output: Any = None


# ------------------------------------------------------------------------------------------ the loop
def generate(tap: TapLike, prompts: Any, sampling_params: "SamplingParams | Sequence[SamplingParams] | None" = None,
             *, logits_at: LogitsAt = None, post_norm_last: bool | None = None, lora_request: Any = None,
             priority: int = 0) -> list["RequestOutput"]:
    """``LLM.generate`` semantics (prompts in, ``RequestOutput`` per prompt in order), plus
    ``hidden_states`` / ``layer_ids`` (and ``logits`` / ``logits_positions`` when ``logits_at`` is
    given) on every ``CompletionOutput``. ``post_norm_last`` defaults to the Tap's setting."""
    post = tap.post_norm_last if post_norm_last is None else post_norm_last
    settings = _settings(tap, post, logits_at)
    jobs = _jobs(tap, prompts, sampling_params)
    samples = _drive(tap, jobs, settings, lora_request, priority)
    for job in jobs:
        _attach(job, samples, settings)
    return [job.output for job in jobs]


def _jobs(tap: TapLike, prompts: Any, sampling_params: Any) -> list[_Job]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    tap.check_generate_allowed()
    if sampling_params is None:
        sampling_params = tap.llm.get_default_sampling_params()
    sps = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
    if len(sps) != len(prompts):
        raise AnalysisError(f"{len(sps)} sampling params for {len(prompts)} prompts")
    return [_Job(i, p, _request_params(tap, sp, i, _prompt_len(tap, p))) for i, (p, sp) in enumerate(zip(prompts, sps))]


def _drive(tap: TapLike, jobs: list[_Job], s: _Settings, lora_request: Any, priority: int) -> dict[str, _Sample]:
    """Run every job to completion; returns converted samples by record key (each proven later)."""
    by_rid: dict[str, _Job] = {}  # external request id -> job, while the request runs
    try:
        return _loop(tap, jobs, s, lora_request, priority, by_rid)
    finally:
        if by_rid:  # an error: do not leave this call's requests running in the shared engine
            tap.llm.llm_engine.abort_request(list(by_rid))


def _loop(tap: TapLike, jobs: list[_Job], s: _Settings, lora_request: Any, priority: int,
          by_rid: dict[str, _Job]) -> dict[str, _Sample]:
    engine = tap.llm.llm_engine
    queue = list(reversed(jobs))
    owner: dict[str, _Job] = {}  # record key -> job, registered before the request can finish
    samples: dict[str, _Sample] = {}
    batch = uuid.uuid4().hex[:6]
    last_progress = time.monotonic()
    while queue or by_rid or len(samples) < len(owner):
        while queue and (not by_rid or _can_admit(tap, len(owner) - len(samples) + queue[-1].params.n)):
            job = queue.pop()
            ext = f"{tap.run}-g{batch}-{job.index}"  # RequestOutput.request_id; the engine adds a suffix
            rid = engine.add_request(ext, job.prompt, job.params, lora_request=lora_request, priority=priority)
            job.keys = sample_keys(tap.run, rid, job.params.n)
            owner.update({k: job for k in job.keys})
            by_rid[ext] = job
        if by_rid:
            for out in tap.step():
                if out.finished:
                    by_rid.pop(out.request_id).output = out
                    last_progress = time.monotonic()
        for rec in tap.source.poll(timeout=0.0 if by_rid or queue else 0.05):
            _receive(rec, tap.run, owner, samples, s)
            last_progress = time.monotonic()
        if not by_rid and not queue and time.monotonic() - last_progress > tap.record_timeout:
            missing = [k for k in owner if k not in samples]
            raise MissingRecords(f"{len(missing)} sample records never arrived within {tap.record_timeout:.0f}s: "
                                 + ", ".join(f"prompt {owner[k].index} ({k})" for k in missing[:10]))
    return samples


def _can_admit(tap: TapLike, samples_in_flight: int) -> bool:
    """At most ``tap.max_inflight`` samples running, and no more than the transport can hold (records are
    consumed as they arrive, so the worker never blocks on a full shm pool because of this call)."""
    if tap.max_inflight is not None and samples_in_flight > tap.max_inflight:
        return False
    free = tap.source.free_capacity()
    return free is None or samples_in_flight <= free


def _receive(rec: Record, run: str, owner: dict[str, _Job], samples: dict[str, _Sample], s: _Settings) -> None:
    try:
        if rec.meta.get("run") != run:
            raise AnalysisError(f"record {rec.key} (index {rec.index}) belongs to another run")
        if rec.key not in owner:
            raise AnalysisError(f"record {rec.key} (index {rec.index}) matches no sample of this generate call "
                                "(did vLLM change how it names n > 1 child requests?)")
        if rec.layer_ids != s.layers:
            raise AnalysisError(f"record {rec.key}: layer ids {rec.layer_ids} != configured {s.layers}")
        samples[rec.key] = _convert(rec, s)
    finally:
        rec.release()


def _attach(job: _Job, samples: dict[str, _Sample], s: _Settings) -> None:
    """Prove each sample's record against this prompt + that sample's tokens, then attach it."""
    out = job.output
    if len(out.outputs) != len(job.keys):
        raise AnalysisError(f"prompt {job.index}: {len(out.outputs)} outputs for n={len(job.keys)}")
    prompt = list(out.prompt_token_ids)
    for comp in out.outputs:
        key = job.keys[comp.index]
        smp = samples[key]
        if smp.error:
            raise AnalysisError(f"prompt {job.index} sample {comp.index}: {smp.error}")
        want = prompt + list(comp.token_ids)[:-1]  # the last sampled token never ran through the model
        if len(smp.token_ids) != len(want) or token_digest(smp.token_ids) != token_digest(want):
            raise AnalysisError(
                f"prompt {job.index} sample {comp.index} ({key}): record has {len(smp.token_ids)} rows, expected "
                f"{len(prompt)} prompt + {len(comp.token_ids)} generated - 1 = {len(want)} with matching token ids")
        if not torch.isfinite(smp.hidden).all():
            raise AnalysisError(f"prompt {job.index} sample {comp.index} ({key}): non-finite hidden states")
        comp.hidden_states = smp.hidden
        comp.layer_ids = list(s.layers)
        comp.logits = smp.logits
        comp.logits_positions = smp.positions
