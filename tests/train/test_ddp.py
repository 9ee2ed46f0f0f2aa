"""DDP with the gloo backend on CPU: 2 processes train a few steps and keep identical replicas."""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cache: str, out: str):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from pathlib import Path

    import torch.distributed as dist

    from tests.utils import tiny_config
    from train.loop import Trainer

    # different seeds: DDP syncs init; one run folder for both ranks, the data from the warm toy cache
    cfg = tiny_config(Path(out), data={"cache_dir": cache}, max_steps=3, seed=100 + rank)
    trainer = Trainer(cfg, log=lambda *a: None)
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    init = float(torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()]).sum())
    seen = []
    step = trainer.train_step

    def recording(batches):
        seen.extend(int(i) for b in batches for i in b.index)
        return step(batches)

    trainer.train_step = recording
    summary = trainer.fit()
    flat = torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()])
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "init": init, "checksum": float(flat.sum()), "abs": float(flat.abs().sum()), "first": flat[:8].tolist(),
        "steps": summary["steps"], "seen": seen,
        "ckpts": sorted(p.name for p in (trainer.run_dir / "checkpoints").glob("*.pt")),
    }))
    dist.destroy_process_group()


def test_ddp_gloo_replicas_stay_identical(toy_bundle, tmp_path):
    # `toy_bundle` warmed the tokenizer/encoding cache the workers read (same data config)
    mp.spawn(_worker, args=(2, _free_port(), toy_bundle.cfg.cache_dir, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["steps"] == r1["steps"] == 3
    assert r0["checksum"] == r1["checksum"] and r0["abs"] == r1["abs"] and r0["first"] == r1["first"]
    assert set(r0["seen"]).isdisjoint(r1["seen"])  # the batch sampler shards by rank
    assert r0["ckpts"] == ["step-00000003.pt"]  # only rank 0 saves (one shared run folder)
    assert r0["init"] == r1["init"]  # DDP broadcast rank 0's weights over rank 1's (other seed)
    assert r0["checksum"] != r0["init"]  # and training moved them
