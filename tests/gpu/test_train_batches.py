"""The trainer's batches built on the GPU (records' bf16 rows copied, padded and widened there) equal the
batches built in host memory and copied, value for value; the record's memory may be overwritten as soon as
``collate`` returns (a transport slot is reused) without changing the batch. No vLLM needed."""

import torch

from layertap.records import Record
from layertap.train.data import collate


def records(n: int = 5, hidden: int = 512) -> list[Record]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        k = 40 + 17 * i
        out.append(Record(index=i, token_ids=torch.randint(0, 100, (k,), generator=g),
                          hidden_states=torch.randn(k, 4, hidden, generator=g).to(torch.bfloat16),
                          layer_ids=[2, 5, 7, 9], num_prompt_tokens=k // 3, loss_mask=None, meta={}))
    return out


def test_device_batch_equals_host_batch_and_owns_its_rows():
    recs = records()
    id5 = [r.hidden_states[:, 1].float() for r in recs]
    host = collate(recs, [2, 7], 9, 96)  # a gather (planes 0 and 2 of 4) on the host, then copied
    dev = collate(recs, [2, 7], 9, 96, device="cuda")
    whole = collate(recs, [2, 5, 7], 9, 96, device="cuda")  # every plane used: each record copied whole
    for r in recs:
        r.hidden_states.fill_(7.0)  # the slot is reused once collate returned
    torch.cuda.synchronize()
    assert dev.aux.is_cuda and dev.last.is_cuda and dev.aux.dtype == torch.float32
    for name in ("ids", "aux", "last", "mask"):
        torch.testing.assert_close(getattr(dev, name).cpu(), getattr(host, name), rtol=0, atol=0)
    w = whole.aux.cpu()
    torch.testing.assert_close(w[:, :, :512], host.aux[:, :, :512], rtol=0, atol=0)
    torch.testing.assert_close(w[:, :, 1024:], host.aux[:, :, 512:], rtol=0, atol=0)
    torch.testing.assert_close(whole.last.cpu(), host.last, rtol=0, atol=0)
    for i, x in enumerate(id5):
        n = min(96, x.shape[0])
        torch.testing.assert_close(w[i, :n, 512:1024], x[:n], rtol=0, atol=0)
        assert float(w[i, n:].abs().sum()) == 0.0
