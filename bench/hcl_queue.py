#!/usr/bin/env python
"""HCL's MoCo branch on its key queue: PML's ``NTXentLoss`` against the pairwise cross-entropy on the
cosine that ``recipes/hcl.py`` uses (the same loss and gradients when every query has one positive).

    python -m bench hcl_queue                                   # CPU: batch 64, queues 4096 and 65536
    python -m bench hcl_queue --device cuda --batch 256 --queues 4096,16384,65536   # the paper's batch

Each case runs in a fresh process: a ``KeyQueue`` (PML ``CrossBatchMemory``) is filled to capacity with
random unit keys, then one warm-up and ``--repeats`` timed steps of what ``HCLTrainer`` does for this
branch (normalise queries and keys, the queue's loss with the keys enqueued, backward to the queries).
Time: the median step (CUDA: between two synchronisations). Memory: CUDA ``max_memory_allocated`` over
one step minus what was allocated before it; CPU: the growth of the peak resident set over one step
(``VmHWM``, reset through /proc/self/clear_refs). A case that runs out of memory prints "out of memory".
The last column is the ratio NTXent / pairwise CE of the same batch and queue, measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOSSES = ("ntxent", "pairwise_ce")
LABELS = {"ntxent": "PML NTXentLoss", "pairwise_ce": "PairwiseCrossEntropyLoss(CosineSimilarity)"}


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(loss_name: str, batch: int, queue: int, dim: int, device: str, repeats: int, threads: int) -> dict:
    """One case, in this process: {"ms": median step time, "mib": peak memory of a step} or {"error": ...}."""
    import statistics
    import time

    import torch
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.losses import NTXentLoss

    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss
    from pml_hyperbolic.training.hcl_trainer import KeyQueue

    torch.set_num_threads(threads)
    dev = torch.device(device)
    loss = NTXentLoss(temperature=0.2) if loss_name == "ntxent" else PairwiseCrossEntropyLoss(
        temperature=0.2, distance=CosineSimilarity())
    memory = KeyQueue(loss, dim, memory_size=queue).to(dev)
    with torch.no_grad():  # a full queue, as after the first queue-length of steps
        memory.embedding_memory.copy_(torch.nn.functional.normalize(torch.randn(queue, dim, device=dev), dim=1))
        memory.label_memory.copy_(torch.arange(queue, device=dev) + 10 * batch)
        memory.has_been_filled, memory.queue_idx = True, 0
    gen = torch.Generator(device=dev).manual_seed(0)
    mask = torch.cat([torch.zeros(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool)]).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step(i):
        q = torch.randn(batch, dim, device=dev, generator=gen, requires_grad=True)
        k = torch.randn(batch, dim, device=dev, generator=gen)
        ids = torch.arange(batch, device=dev) + i * batch
        value = memory(torch.nn.functional.normalize(torch.cat([q, k]), dim=1), torch.cat([ids, ids]),
                       enqueue_mask=mask)
        value.backward()
        return float(value.detach())

    try:
        step(0)
        sync()
        if dev.type == "cuda":
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step(1)
            sync()
            peak = torch.cuda.max_memory_allocated(dev) - before
        else:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # the high-water mark restarts from the current resident size
            before = _rss("VmRSS")
            step(1)
            # pages the allocator returns while the step runs can leave the mark a little below the
            # starting size: the step then added nothing measurable
            peak = max(0, _rss("VmHWM") - before)
        times = []
        for i in range(repeats):
            sync()
            t0 = time.perf_counter()
            step(2 + i)
            sync()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    except RuntimeError as err:  # CPU allocators raise a plain RuntimeError
        if "memory" in str(err).lower() or "alloc" in str(err).lower():
            return {"error": "out of memory"}
        raise
    return {"ms": 1e3 * statistics.median(times), "mib": peak / 2 ** 20}


def run_case(loss_name, batch, queue, dim, device, repeats, threads) -> dict:
    """``measure`` in a fresh interpreter (so one case's peak and allocator state do not reach another)."""
    code = (f"import json; from bench import hcl_queue; "
            f"print(json.dumps(hcl_queue.measure({loss_name!r}, {batch}, {queue}, {dim}, {device!r}, {repeats}, "
            f"{threads})))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors go back to the OS: honest peaks
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": "killed (out of memory?)" if out.returncode < 0 else f"failed: {tail}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def positive_ints(text: str, flag: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated positive integers, got {text!r}")
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="64", help="queries per step (comma-separated for several)")
    p.add_argument("--queues", default="4096,65536", help="queue lengths (comma-separated)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    batches, queues = positive_ints(a.batch, "--batch"), positive_ints(a.queues, "--queues")
    if a.repeats < 1 or a.dim < 1 or a.threads < 1:
        raise SystemExit("--repeats, --dim and --threads must be at least 1")
    print(f"# python -m bench hcl_queue {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# device {a.device}, dim {a.dim}, {a.threads} thread(s), median of {a.repeats} steps after one warm-up")
    print("| batch | queue | loss | step ms | peak MiB | NTXent / pairwise CE (time, memory) |")
    print("|---:|---:|---|---:|---:|---|")
    rows = []
    for batch in batches:
        for queue in queues:
            got = {name: run_case(name, batch, queue, a.dim, a.device, a.repeats, a.threads) for name in LOSSES}
            for name in LOSSES:
                r = got[name]
                ratio = ""
                if name == "ntxent":
                    ours = got["pairwise_ce"]
                    ratio = ("—" if "error" in r or "error" in ours else
                             f"{r['ms'] / ours['ms']:.1f}×, {r['mib'] / max(ours['mib'], 1e-3):.0f}×")
                cells = ([r["error"], "—"] if "error" in r else [f"{r['ms']:.1f}", f"{r['mib']:.0f}"])
                print(f"| {batch} | {queue} | {LABELS[name]} | {cells[0]} | {cells[1]} | {ratio} |", flush=True)
                rows.append({"batch": batch, "queue": queue, "loss": name, **r})
    return rows


if __name__ == "__main__":
    main()
