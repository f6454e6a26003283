"""What queuing one step's gather costs the engine's step thread, three ways, in one process on the GPU.

The record process path (``record_writer._gather_group_offload``) spends part of its ~0.5 ms a step on the
GPU hosts in torch calls that only *queue* work: the index upload, a slice and a view of the staging ring, and
``index_select(out=)``. This compares, on a view shaped like the benchmark's capture layer
(``[blocks, 16, planes, hidden]``), the host time of queuing the same gather:

  torch   what the engine does today: ``IndexUpload`` + ring slice + view + ``torch.index_select(out=)``
  batch   one ``cudaMemcpyBatchAsync`` call (CUDA >= 12.8) of every block, device to device, on a side stream
          fenced by two raw events (the batch API refuses the legacy default stream vLLM runs on)
  loop    one raw ``cudaMemcpyAsync`` per block on the current stream

Each result is checked against the view (the ring holds the gathered blocks, in order). With ``--busy-ms`` a
matmul of about that length runs first, so the calls are made against a busy GPU, as in the engine.

    python benchmarks/gather_launch_cost.py --records 1,2,8 --iters 200 --busy-ms 0,5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layertap.engine.gpu_gather import BatchCopies, IndexUpload, RawCopies, block_copies  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default="1,2,8", help="records per step (comma-separated)")
    ap.add_argument("--rows", type=int, default=1024, help="rows per record")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--busy-ms", default="0,5", help="a matmul of about this length before each step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gather_launch_cost needs a CUDA device")
    dev = torch.device("cuda")
    rc = RawCopies.load()
    if rc is None:
        raise SystemExit("no libcudart mapped in this process")
    n_blocks = 4096
    view = torch.randn(n_blocks, args.block, args.planes, args.hidden, device=dev).to(torch.bfloat16)
    block_elems = args.block * args.planes * args.hidden
    block_bytes = block_elems * view.element_size()
    ring_blocks = 8 * (args.rows // args.block) + 8
    ring = torch.empty(ring_blocks * block_elems, dtype=view.dtype, device=dev)
    upload = IndexUpload(dev, rc)
    batch = BatchCopies.load(rc)
    if batch is None:
        raise SystemExit("this CUDA runtime has no cudaMemcpyBatchAsync (before 12.8)")
    side = torch.cuda.Stream()
    ev_a, ev_b = rc.event(), rc.event()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    print(f"CUDA runtime {batch.version}; view {tuple(view.shape)} {view.dtype}; block {block_bytes >> 10} KiB; "
          f"{torch.cuda.get_device_name()}")

    def busy(ms: float) -> None:
        for _ in range(int(ms / 0.12)):  # ~0.12 ms a 4096^3 bf16 matmul on an H100
            a @ a

    rng = np.random.default_rng(0)

    def torch_way(lists: list[list[int]]) -> None:
        fwd = torch.cuda.current_stream().cuda_stream
        index = upload(lists, fwd)
        n = index.shape[0]
        out = ring[0:n * block_elems].view(n, *view.shape[1:])
        torch.index_select(view, 0, index, out=out)

    base, ring_ptr = view.data_ptr(), ring.data_ptr()
    bstride = view.stride(0) * view.element_size()

    def batch_way(lists: list[list[int]]) -> None:
        fwd = torch.cuda.current_stream().cuda_stream
        dsts, srcs, sizes = block_copies(lists, base, bstride, n_blocks, ring_ptr, block_bytes)  # as the engine does
        ev_a.record(fwd)
        rc.wait_event(side.cuda_stream, ev_a)
        batch(dsts, srcs, sizes, side.cuda_stream)
        ev_b.record(side.cuda_stream)
        rc.wait_event(fwd, ev_b)

    def loop_way(lists: list[list[int]]) -> None:
        fwd = torch.cuda.current_stream().cuda_stream
        i = 0
        for blocks in lists:
            for b in blocks:
                rc.copy(ring_ptr + i * block_bytes, base + b * bstride, block_bytes, 3, fwd)  # 3: device to device
                i += 1

    ways = {"torch": torch_way, "batch": batch_way, "loop": loop_way}
    per = args.rows // args.block
    for busy_ms in [float(x) for x in args.busy_ms.split(",")]:
        for k in [int(x) for x in args.records.split(",")]:
            times = {w: [] for w in ways}
            for it in range(args.iters):
                lists = [rng.choice(n_blocks, per, replace=False).tolist() for _ in range(k)]
                order = list(ways) if it % 2 == 0 else list(reversed(ways))
                for w in order:
                    torch.cuda.synchronize()
                    busy(busy_ms)
                    t0 = time.perf_counter()
                    ways[w](lists)
                    times[w].append(time.perf_counter() - t0)
                    if it < 3:  # the first steps check the ring against the view
                        torch.cuda.synchronize()
                        got = ring[: k * per * block_elems].view(k * per, *view.shape[1:])
                        want = view[torch.tensor([b for blocks in lists for b in blocks], device=dev)]
                        if not torch.equal(got, want):
                            raise SystemExit(f"{w}: the ring does not hold the gathered blocks")
                        ring.zero_()
            med = {w: statistics.median(t) * 1e6 for w, t in times.items()}
            print(f"busy {busy_ms:g} ms, {k} records ({k * per} blocks): host us a step " +
                  "  ".join(f"{w} {med[w]:.1f}" for w in ways) +
                  f"   batch/torch {med['batch'] / med['torch']:.2f}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
