"""Records -> padded training batches, plus the two data helpers drafter training needs:

- ``regenerate``: replace assistant turns by the target's own greedy output (on-policy data, the way
  speculators / SpecForge prepare it), keeping the generated token ids exactly (no re-tokenisation).
- ``records_from_hf``: a reference capture from an HF forward pass (ids ``i < N`` are
  ``output_hidden_states[i]``; id ``N`` is the *input* of the final norm, taken with a forward hook,
  because HF's last hidden state is post-norm). Used by unit tests and for debugging capture.

The trainer consumes ``Iterable[Record]`` only, so a file dataset and a live stream share one path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from layertap.data import InputItem, load_inputs
from layertap.records import LAYER_SEMANTICS, Record, token_digest


@dataclass
class Batch:
    ids: torch.Tensor
    """[B, T] token ids (0 past each row's length)."""
    aux: torch.Tensor
    """[B, T, n_aux * H] concatenated auxiliary states, in config order."""
    last: torch.Tensor | None
    """[B, T, H] pre-norm last state (EAGLE-3 labels), or None when not requested."""
    mask: torch.Tensor
    """[B, T] float 0/1: token t is trained (assistant); 0 on padding."""
    lengths: torch.Tensor
    """[B] valid tokens per row."""

    def to(self, device: str | torch.device) -> "Batch":
        return Batch(self.ids.to(device), self.aux.to(device),
                     None if self.last is None else self.last.to(device), self.mask.to(device),
                     self.lengths.to(device))


def check_full_rows(rec: Record) -> None:
    """Drafters attend over every earlier row, so records that kept only some rows cannot train them."""
    if getattr(rec, "positions", None) is not None:
        raise ValueError(f"record {rec.key}: holds only selected rows (captured with --only-loss-masked); "
                         "drafter training needs every row: capture without it")


def plane_index(rec: Record, layer_id: int) -> int:
    """Plane of ``layer_id`` in ``rec``; raises naming the record and the ids it does hold."""
    if layer_id not in rec.layer_ids:
        raise ValueError(f"record {rec.key}: layer id {layer_id} not captured (has {rec.layer_ids}); "
                         "ids are vLLM aux ids: id i = input of decoder layer i")
    return rec.layer_ids.index(layer_id)


def trained_mask(rec: Record) -> torch.Tensor:
    """Assistant mask of a record; without one, every generated (non-prompt) token is trained."""
    n = int(rec.token_ids.shape[0])
    if rec.loss_mask is not None:
        return rec.loss_mask.to(torch.float32)[:n]
    m = torch.zeros(n)
    m[rec.num_prompt_tokens :] = 1.0
    return m


def collate(recs: Sequence[Record], aux_ids: Sequence[int], last_id: int | None, max_len: int,
            device: str | torch.device | None = None) -> Batch:
    """Right-pad records into one batch. Padding sits after every real token, and all attention in both
    drafters looks only backwards into the context, so padding never changes a real position's output.

    With ``device`` (the trainer's) the batch is built there: each record's rows travel in their stored
    dtype (bf16 from a bf16 engine, half the bytes of float32) and are padded and widened to float32 on the
    device. Without it the batch is built in host memory: a fresh float32 buffer each step (page faults), the
    bf16 -> float32 pass on the CPU, then twice the bytes to copy. The values are the same either way."""
    n = [min(int(r.token_ids.shape[0]), max_len) for r in recs]
    t, b = max(n), len(recs)
    h = int(recs[0].hidden_states.shape[-1])
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t)
    aux = torch.zeros(b, t, len(aux_ids) * h, device=dev)
    last = torch.zeros(b, t, h, device=dev) if last_id is not None else None
    for i, (r, k) in enumerate(zip(recs, n)):
        check_full_rows(r)
        ids[i, :k] = r.token_ids[:k]
        planes = [plane_index(r, a) for a in aux_ids]
        lp = plane_index(r, last_id) if last is not None else None
        # The planes this batch uses, in the stored dtype, one copy per record (blocking: the record's
        # memory, a transport slot, may be reused once it returns); widened to float32 where they land.
        keep = planes + ([lp] if lp is not None else [])
        whole = keep == list(range(int(r.hidden_states.shape[1])))  # no host-side gather needed
        rows = (r.hidden_states[:k] if whole else r.hidden_states[:k, keep]).to(dev)
        aux[i, :k] = rows[:, : len(planes)].reshape(k, -1)
        if last is not None:
            last[i, :k] = rows[:, -1]
        mask[i, :k] = trained_mask(r)[:k]
    return Batch(ids.to(dev), aux, last, mask.to(dev), torch.tensor(n))


def batches(records: Iterable[Record], batch_size: int, aux_ids: Sequence[int], last_id: int | None,
            max_len: int, device: str | torch.device | None = None) -> Iterator[tuple[Batch, int]]:
    """Group a record stream into batches (built on ``device``: see ``collate``); yields (batch, records
    consumed so far). Records with fewer than 3 tokens carry no training pair and are skipped (but
    counted, so resume stays aligned)."""
    buf: list[Record] = []
    seen = 0
    for rec in records:
        seen += 1
        if int(rec.token_ids.shape[0]) >= 3:
            buf.append(rec)
        if len(buf) == batch_size:
            yield collate(buf, aux_ids, last_id, max_len, device), seen
            buf = []
    if buf:
        yield collate(buf, aux_ids, last_id, max_len, device), seen


@dataclass
class Shard:
    """One rank's part of a global batch (``shard_batches``)."""

    batch: Batch | None
    """This rank's rows, collated; None when the (final, partial) global batch has none for this rank."""
    mask: torch.Tensor
    """[G, T] trained-token mask of the whole global batch (same on every rank; for shared sampling)."""
    lengths: torch.Tensor
    """[G] lengths of the whole global batch."""
    seen: int
    """Records of the global stream consumed so far (skipped short records included)."""

    @property
    def global_size(self) -> int:
        return int(self.lengths.shape[0])


def shard_batches(records: Iterable[Record], batch_size: int, rank: int, world_size: int,
                  aux_ids: Sequence[int], last_id: int | None, max_len: int,
                  device: str | torch.device | None = None) -> Iterator[Shard]:
    """``batches`` split over ranks: every rank reads the same global stream and groups it exactly like
    ``batches(records, batch_size, ...)``; of each global batch, row i goes to rank ``i % world_size``.
    So the union of the ranks' shards at step s is the single-process batch at step s, and ``seen`` is
    the same global count on every rank. Only this rank's rows are collated (hidden states copied)."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"shard_batches: rank {rank} outside world size {world_size}")
    buf: list[Record] = []
    seen = 0

    def shard() -> Shard:
        n = [min(int(r.token_ids.shape[0]), max_len) for r in buf]
        mask = torch.zeros(len(buf), max(n))
        for i, (r, k) in enumerate(zip(buf, n)):
            check_full_rows(r)
            mask[i, :k] = trained_mask(r)[:k]
        mine = buf[rank::world_size]
        return Shard(collate(mine, aux_ids, last_id, max_len, device) if mine else None, mask, torch.tensor(n),
                     seen)

    for rec in records:
        seen += 1
        if int(rec.token_ids.shape[0]) >= 3:
            buf.append(rec)
        if len(buf) == batch_size:
            yield shard()
            buf = []
    if buf:
        yield shard()


def _hf_model(model_path: str | Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return model.eval()


def records_from_hf(model_path: str | Path, items: Iterable[InputItem | Sequence[int]],
                    layer_ids: Sequence[int], *, model: Any = None,
                    extra_meta: dict[str, Any] | None = None) -> list[Record]:
    """Reference records from an HF forward pass: row t = state computed for input token t."""
    model = model or _hf_model(model_path)
    n_layers = int(model.config.num_hidden_layers)
    if any(i < 0 or i > n_layers for i in layer_ids):
        raise ValueError(f"layer_ids {list(layer_ids)} must lie in [0, {n_layers}]")
    grabbed: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(lambda m, inp, out: grabbed.__setitem__("pre", inp[0]))
    out = []
    try:
        for k, item in enumerate(items):
            it = item if isinstance(item, InputItem) else InputItem(k, list(item))
            ids = torch.tensor([it.token_ids])
            with torch.no_grad():
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            planes = [grabbed["pre"][0] if i == n_layers else hs[i][0] for i in layer_ids]
            mask = None if it.loss_mask is None else torch.tensor(it.loss_mask, dtype=torch.uint8)
            first_trained = it.loss_mask.index(1) if it.loss_mask and 1 in it.loss_mask else len(it.token_ids)
            out.append(Record(
                index=it.index, token_ids=ids[0], hidden_states=torch.stack(planes, dim=1).contiguous(),
                layer_ids=list(layer_ids), num_prompt_tokens=first_trained, loss_mask=mask,
                meta={"index": it.index, "model": str(model_path), "layer_ids": list(layer_ids),
                      "num_prompt_tokens": first_trained,
                      "layer_semantics": LAYER_SEMANTICS, "mode": "hf-reference",
                      "token_digest": token_digest(ids[0]), "num_tokens": len(it.token_ids),
                      **(extra_meta or {})},
            ))
    finally:
        hook.remove()
    return out


def prompt_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages up to (excluding) the last assistant turn: what the target is asked to answer."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages[:last]


def regenerate(model_path: str | Path, conversations: str | Path | Sequence[Any], *, max_tokens: int = 128,
               llm: Any = None, **engine_kwargs: Any) -> list[InputItem]:
    """On-policy items: each conversation's prompt + the target's greedy answer, as generated token ids.

    The answer is kept as the sampled ids (re-tokenising decoded text can split differently), with the
    loss mask on exactly those ids. ``llm`` reuses an existing ``vllm.LLM``; else one is built with
    ``engine_kwargs``. Call from under ``if __name__ == "__main__":`` (vLLM spawns workers).
    """
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(model_path))
    items = load_inputs(conversations, tok)
    prompts = []
    for it in items:
        if it.messages is None:
            raise ValueError(f"input {it.index}: regenerate needs conversations (messages), got plain tokens")
        ids = tok.apply_chat_template(prompt_of(it.messages), tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    llm = llm or LLM(model=str(model_path), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for it, p, o in zip(items, prompts, outs):
        gen = list(o.outputs[0].token_ids)
        result.append(InputItem(it.index, p + gen, [0] * len(p) + [1] * len(gen), it.messages))
    return result


def epoch_stream(dataset: Sequence[Record], epochs: int, seed: int) -> Iterator[Record]:
    """Records of a random-access dataset, reshuffled each epoch (deterministic in ``seed``), so a
    resumed run that skips the consumed prefix sees exactly the records the uninterrupted run saw."""
    if epochs <= 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for i in torch.randperm(len(dataset), generator=gen).tolist():
            yield dataset[i]


def token_counts(records: Iterable[Record], vocab_size: int) -> torch.Tensor:
    """Counts of trained (assistant) tokens, for choosing the EAGLE-3 draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        keep = trained_mask(r) > 0
        counts += torch.bincount(r.token_ids[keep].to(torch.long), minlength=vocab_size)[:vocab_size]
    return counts


def write_dataset(records: Iterable[Record], out_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Store records as a ``file`` transport dataset (what ``load_records`` reads)."""
    import json

    from layertap.records import record_tensors
    from layertap.transport.file import FileSink

    out = Path(out_dir)
    sink = FileSink(out, "hf", fsync=False)
    try:
        for r in records:
            sink.put(str(r.index), record_tensors(r), r.meta)
    finally:
        sink.close()
    (out / "dataset.json").write_text(json.dumps(manifest, indent=1))
    return out


def records_from_source(source: Any, *, poll_timeout: float = 1.0, idle_timeout: float = 30.0) -> Iterator[Record]:
    """Adapt a transport ``Source`` (``poll() -> list[Record]``) into the record iterator the trainer
    takes: online training runs the same ``Trainer.fit`` as offline. Ends after ``idle_timeout`` seconds
    without a new record (the producer finished or died; ``Source`` raises ``PeerGone`` for the latter)."""
    import time

    last = time.monotonic()
    while True:
        got = source.poll(poll_timeout)
        if got:
            last = time.monotonic()
            yield from got
        elif time.monotonic() - last > idle_timeout:
            return
