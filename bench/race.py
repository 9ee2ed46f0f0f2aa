"""The CPU race: fastmt, the Hugging Face baseline and eole at one small size (``SIZE``), one thread each, on
the same rows, to a fixed step count, scored by one function (``score``). ``python -m bench.race`` (=
``fastmt bench peers --cpu``).

The split is built once and exported (data.export_split: the files every system reads, hashed in the report);
per seed and system one training process keeps its weights every ``--eval-every`` steps; outside every
training clock each kept weight set translates the whole validation split (greedy, each system's own decoder),
the last one the test split too. Reported over seeds: BLEU at equal steps, the training seconds to each step
(the system's own loop: startup, model build and evaluation excluded), and the first step at which validation
BLEU reached ``--threshold``. The recipes: fastmt's ``tiny`` preset at ``SIZE``; hf:
``bench.peers.PeerRecipe``, sentences a batch chosen for fastmt's real tokens a step; eole:
bench/eole_peer.py, its WMT17 recipe at this size."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.race_report import averages_table, frontier_rows, markdown, summarize, time_to, write_report  # noqa: F401 - the report's names, as the race's

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("fastmt", "hf", "eole")
STAND_IN = str(REPO.parent / "shared" / "data" / "opus_mt_testsets" / "en-it" / "train.jsonl")  # a dev checkout's
# the small size every system trains at (fastmt override syntax)
SIZE = {"model.d_model": "128", "model.n_heads": "4", "model.d_ff": "512", "model.enc_layers": "2",
        "model.dec_layers": "2", "data.vocab_size": "8000", "data.max_len": "64", "data.max_tokens": "4096"}
MAX_LEN_A, MAX_LEN_B = 1.5, 10  # decoding length limit a * len(src) + b (eole: one max_length, below)


def score(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """sacreBLEU corpus BLEU and chrF with signatures: ``train.evaluation.scores.corpus_scores``, as fastmt's own
    validation."""
    from train.evaluation.scores import corpus_scores

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} translations for {len(refs)} references")
    return corpus_scores(list(hyps), [list(refs)])


class RaceSetupError(ValueError):
    """The race cannot run as asked on this data (said in one line before anything trains)."""


@dataclass
class RaceConfig:
    data_files: tuple[str, ...]
    work: Path
    steps: int = 600  # optimizer steps per run (an idle 2-core machine: about 20 min a seed for the three)
    eval_every: int = 200  # weights kept (and scored afterwards) every N steps
    seeds: tuple[int, ...] = (0, 1, 2)
    systems: tuple[str, ...] = SYSTEMS
    threshold: float = 0.5  # valid BLEU of the time-to-threshold column
    threads: int = 1
    jobs: int = 1  # runs trained (and scored) at once: on 2 cores, 2 one-thread runs
    timeout_s: float = 3600.0  # per training process
    hf_lr: float = 2e-3  # the HF baseline's peak lr: the best of the CPU lr check (bench/results/peers-cpu.md)
    eole_peak_lr: float = 2e-3  # eole's noam peak
    fastmt_overrides: tuple[str, ...] = ()  # more --x.y V for fastmt (e.g. --optim.ema_decay 0.999)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.steps < 1 or self.eval_every < 1 or self.steps % self.eval_every:
            raise ValueError(f"--steps {self.steps} must be a positive multiple of --eval-every {self.eval_every}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"--systems: unknown {unknown or list(self.systems)}; choose from {','.join(SYSTEMS)}")
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")
        if self.jobs < 1 or self.threads < 1:
            raise ValueError(f"--jobs {self.jobs} and --threads {self.threads} must be at least 1")


def fastmt_config(rc: RaceConfig, cache: Path):
    """fastmt's Config of the race (the tiny preset at ``SIZE``) for ``rc``'s data."""
    from train.config import apply_overrides, get_config

    return apply_overrides(get_config("tiny"), {**SIZE, "data.data_files": ",".join(rc.data_files),
                                                "data.cache_dir": str(cache)})


def _run(cmd: list[str], log_path: Path, rc: RaceConfig, log: Callable[[str], None]) -> float:
    """Run ``cmd`` in its own process group (killed whole at ``rc.timeout_s``); returns its wall seconds."""
    log(f"[race] {' '.join(cmd)}")
    t0 = time.perf_counter()
    H.run_in_group(cmd, log_path, timeout_s=rc.timeout_s, cwd=REPO, env=H.child_env(
        rc.threads, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1"))
    return time.perf_counter() - t0


def _new(path: Path) -> Path:
    if path.exists():
        raise FileExistsError(f"{path} exists: give a new --work folder (nothing is overwritten)")
    return path


def train_fastmt(rc: RaceConfig, seed: int, work: Path, cache: Path, log) -> dict[str, Any]:
    """``python -m train`` for ``rc.steps`` (epochs of ``eval_every`` batches, a checkpoint each; evaluation only
    after the last, which the race does not count). Returns checkpoints and training seconds by step."""
    n = rc.steps // rc.eval_every
    name = f"fastmt-s{seed}"
    flags = [x for k, v in SIZE.items() for x in (f"--{k}", v)]
    cmd = [sys.executable, "-m", "train", "--preset", "tiny", "--data-files", *rc.data_files, *flags,
           "--data.cache_dir", str(cache), "--run.seed", str(seed), "--data.seed", str(seed),
           "--run.epochs", str(n), "--run.max_batches_per_epoch", str(rc.eval_every), "--run.keep_last", str(n),
           "--run.cpu_threads", str(rc.threads), "--eval.every", str(n), "--eval.max_sentences", "1",
           "--eval.test_at_end", "false", "--run.out_dir", str(work), "--run.name", name,
           "--run.tensorboard", "false", "--run.progress", "false", "--run.plot", "false", *rc.fastmt_overrides]
    run_dir = _new(work / name)
    wall = _run(cmd, work / f"{name}.log", rc, log)
    from train.runs.metrics import read_metrics

    seconds, t = {}, 0.0
    for r in (r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"):
        t += float(r["epoch_seconds"])
        seconds[int(r["step"])] = t
    ckpts = {int(p.stem.split("-")[1]): p for p in (run_dir / "checkpoints").glob("step-*.pt")}
    want = set(range(rc.eval_every, rc.steps + 1, rc.eval_every))
    if set(ckpts) != want:
        raise RuntimeError(f"fastmt kept weights at steps {sorted(ckpts)}, not {sorted(want)}")
    return {"checkpoints": ckpts, "seconds": seconds, "process_seconds": wall, "command": cmd}


def train_hf(rc: RaceConfig, seed: int, work: Path, cache: Path, log) -> dict[str, Any]:
    """The HF baseline's worker process (``python -m bench.race _hf``): weights and seconds by step."""
    out = _new(work / f"hf-s{seed}")
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.race", "_hf", "--out", str(out), "--cache", str(cache), "--seed", str(seed),
           "--steps", str(rc.steps), "--eval-every", str(rc.eval_every), "--lr", str(rc.hf_lr),
           "--threads", str(rc.threads), "--data-files", *rc.data_files]
    wall = _run(cmd, work / f"hf-s{seed}.log", rc, log)
    rec = json.loads((out / "hf.json").read_text())
    return {"checkpoints": {int(k): out / v for k, v in rec["checkpoints"].items()},
            "seconds": {int(k): v for k, v in rec["seconds"].items()}, "process_seconds": wall, "command": cmd,
            "batch_sentences": rec["batch_sentences"]}


def eole_batch_tokens(bundle) -> int:
    """eole's ``batch_size`` (tokens as eole counts them: about the longer side of each pair) giving fastmt's real
    src + tgt tokens a batch: those times mean(max(src, tgt)) / mean(src + tgt), a multiple of 8."""
    import numpy as np

    sp = bundle.splits["train"]
    s, t = sp.src_lengths.astype("float64"), sp.tgt_lengths.astype("float64")
    ratio = float(np.maximum(s, t).mean() / (s + t).mean())
    return max(8, int(round(hf_tokens_per_batch(bundle) * ratio / 8)) * 8)


def train_eole(rc: RaceConfig, seed: int, work: Path, split_dir: Path, vocab_size: int, batch_tokens: int,
               log) -> dict[str, Any]:
    from bench import eole_peer as E

    r = E.EoleRecipe(steps=rc.steps, save_every=rc.eval_every, seed=seed, peak_lr=rc.eole_peak_lr,
                     tokens_per_step=batch_tokens)
    t0 = time.perf_counter()
    got = E.train(split_dir, work / f"eole-s{seed}", r, vocab_size, timeout_s=rc.timeout_s, log=log)
    secs = got["step_seconds"]
    return {"checkpoints": got["checkpoints"], "seconds": {s: secs.get(s) for s in got["checkpoints"]},
            "process_seconds": time.perf_counter() - t0, "command": ["eole", "train", "--config", got["config"]],
            "learning_rate": got["learning_rate"], "warmup_steps": got["warmup_steps"], "batch_tokens": batch_tokens}


def hf_tokens_per_batch(bundle, n_batches: int = 200) -> float:
    """Mean real (src + tgt) tokens of fastmt's training batches (its first epoch's plan)."""
    sp = bundle.splits["train"]
    lens = sp.src_lengths + sp.tgt_lengths
    plan = bundle.plan("train", epoch=0)[:n_batches]
    return float(sum(int(lens[b].sum()) for b in plan) / max(len(plan), 1))


def hf_worker(argv: Sequence[str]) -> int:
    import numpy as np
    import torch

    from bench import peers as P
    from data import build_data
    from train import flush_denormals

    p = argparse.ArgumentParser(prog="python -m bench.race _hf")
    for flag, kind in (("--out", Path), ("--cache", Path), ("--seed", int), ("--steps", int), ("--eval-every", int),
                       ("--lr", float), ("--threads", int)):
        p.add_argument(flag, type=kind, required=True)
    p.add_argument("--data-files", nargs="+", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    flush_denormals()
    rc = RaceConfig(data_files=tuple(a.data_files), work=a.out, steps=a.steps, eval_every=a.eval_every)
    cfg = fastmt_config(rc, a.cache)
    bundle = build_data(cfg.data, log=lambda m: None)
    tok, device = bundle.tokenizer, torch.device("cpu")
    src, tgt = P.encode_split(bundle.splits["train"], tok.eos_id, cfg.model.max_positions)
    pair_tokens = float(np.mean([len(s) + len(t) for s, t in zip(src, tgt)]))
    sentences = max(1, round(hf_tokens_per_batch(bundle) / pair_tokens))
    recipe = P.PeerRecipe(batch_size=sentences, lr=a.lr, seed=a.seed, max_steps=a.steps, epochs=10 ** 6)
    torch.manual_seed(a.seed)
    model = P.marian_model(cfg.model, tok, device, scale_embedding=recipe.scale_embedding)
    opt = P._optimizer(model, recipe, device)
    sched = P.PlannedSchedule(a.steps, recipe.warmup_ratio)
    step, t_train, ckpts, seconds, epoch, losses, window = 0, 0.0, {}, {}, 0, {}, []
    model.train()
    while step < a.steps:
        for batch in P.train_loader(src, tgt, recipe, tok.pad_id, epoch):
            t0 = time.perf_counter()
            window.append(P.train_step(model, opt, batch, tok, recipe, recipe.lr * sched.factor(step)))
            step, t_train = step + 1, t_train + time.perf_counter() - t0
            if step % a.eval_every == 0:
                mean, window = float(torch.stack(window).mean()), []  # the smoothed loss since the last point
                if not math.isfinite(mean):
                    raise FloatingPointError(f"HF baseline: loss {mean} at step {step}")
                name = f"step-{step}.pt"
                torch.save(model.state_dict(), a.out / name)
                ckpts[step], seconds[step], losses[step] = name, t_train, mean
                print(f"[hf] step {step} train loss {mean:.3f} {t_train:.1f} s", flush=True)
            if step >= a.steps:
                break
        epoch += 1
    (a.out / "hf.json").write_text(json.dumps({"checkpoints": ckpts, "seconds": seconds, "train_loss": losses,
                                               "batch_sentences": sentences, "recipe": asdict(recipe)}))
    return 0


def translate_fastmt(ckpt: Path, sentences: list[str]) -> list[str]:
    import torch

    from train.evaluation.decode import translate
    from train.evaluation.load import load_for_inference

    model, tok, _ = load_for_inference(ckpt, "cpu")
    return translate(model, tok, sentences, torch.device("cpu"), beam_size=1, decode="greedy", batch_size=64,
                     max_len_ratio=MAX_LEN_A, max_len_extra=MAX_LEN_B)


def translate_hf(weights: Path, cfg, bundle, sentences: list[str]) -> list[str]:
    import torch

    from bench import peers as P
    from train.evaluation.decode import encode_sources

    tok = bundle.tokenizer
    model = P.marian_model(cfg.model, tok, torch.device("cpu"))
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return P.translate(model, tok, encode_sources(tok, sentences, cfg.model.max_positions), torch.device("cpu"),
                       beam_size=1, batch_size=64, max_len_ratio=MAX_LEN_A, max_len_extra=MAX_LEN_B)


def translate_eole(ckpt: Path, src_file: Path, out_file: Path) -> list[str]:
    from bench import eole_peer as E

    return E.predict(ckpt, src_file, out_file, timeout_s=1800, beam_size=1,
                     max_length=int(MAX_LEN_A * 64 + MAX_LEN_B))


def load_sample() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def versions() -> dict[str, str]:
    import torch

    from bench import eole_peer as E

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": "missing"}
    with contextlib.suppress(ImportError):
        import transformers

        out["transformers"] = transformers.__version__
    try:
        out["eole (its venv: eole, torch)"] = E.eole_version(E.eole_binary())
    except Exception as e:  # noqa: BLE001 - a missing eole is reported, not fatal
        out["eole (its venv: eole, torch)"] = f"missing ({type(e).__name__})"
    return out


def run_race(rc: RaceConfig, log: Callable[[str], None] = print,
             on_update: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Build and export the split, train every (seed, system), score every kept weight set; returns the record."""
    import torch

    from data import build_data
    from data.export_split import export_split, read_pairs

    torch.set_num_threads(rc.threads)
    work = Path(rc.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    cfg = fastmt_config(rc, cache)
    bundle = build_data(cfg.data, log=lambda m: None)
    shortest = min(len(bundle.plan("train", epoch=e)) for e in range(rc.steps // rc.eval_every))
    if rc.eval_every > shortest:  # fastmt keeps its weights at epoch ends: an "epoch" must hold eval_every batches
        raise RaceSetupError(f"--eval-every {rc.eval_every} is more than the {shortest} batches of a fastmt epoch on "
                         f"this data: give --eval-every <= {shortest} (and --steps a multiple of it)")
    split_dir = work / "split"
    split = export_split(bundle, cfg.data, split_dir)
    valid_src, valid_ref = read_pairs(split_dir, "valid")
    test_src, test_ref = read_pairs(split_dir, "test")
    record: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(rc).items()},
                              "split": split, "versions": versions(), "runs": [], "load": [load_sample()],
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "tokens_per_batch_fastmt": hf_tokens_per_batch(bundle)}
    eole_tokens = record["eole_batch_tokens"] = eole_batch_tokens(bundle)
    lock = threading.Lock()

    def translate(system: str, seed: int, step: int, ckpt: Path, name: str, src: list[str]) -> list[str]:
        if system == "fastmt":
            return translate_fastmt(ckpt, src)
        if system == "hf":
            return translate_hf(ckpt, cfg, bundle, src)
        return translate_eole(ckpt, split_dir / f"{name}.src", work / f"eole-s{seed}" / f"{name}-{step}.hyp")

    def one(seed: int, system: str) -> None:
        run: dict[str, Any] = {"system": system, "seed": seed, "load_before": load_sample()}
        try:
            got = (train_fastmt(rc, seed, work, cache, log) if system == "fastmt" else
                   train_hf(rc, seed, work, cache, log) if system == "hf" else
                   train_eole(rc, seed, work, split_dir, bundle.tokenizer.vocab_size, eole_tokens, log))
            run.update({k: v for k, v in got.items() if k != "checkpoints"})
            run["command"] = " ".join(str(x) for x in got["command"])
            run["points"] = []
            last = max(got["checkpoints"])
            for step, ckpt in sorted(got["checkpoints"].items()):
                t0 = time.perf_counter()
                sets = [("valid", valid_src, valid_ref)] + ([("test", test_src, test_ref)] if step == last else [])
                point: dict[str, Any] = {"step": step, "train_seconds": got["seconds"].get(step)}
                for name, src, ref in sets:
                    hyps = translate(system, seed, step, ckpt, name, src)
                    s = score(hyps, ref)
                    point[f"{name}_bleu"], point[f"{name}_chrf"] = s["bleu"], s["chrf"]
                    point["bleu_signature"] = s["bleu_signature"]
                    point[f"{name}_sentences"] = len(hyps)
                point["decode_seconds"] = time.perf_counter() - t0
                run["points"].append(point)
                log(f"[race] {system} seed {seed} step {step}: valid BLEU {point['valid_bleu']:.2f}"
                    + (f", test BLEU {point['test_bleu']:.2f}" if "test_bleu" in point else "")
                    + f" ({point['train_seconds'] or float('nan'):.0f} s of training)")
            run["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - one system's failure is a row, the race goes on
            run["status"] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:400]}"
            log(f"[race] {system} seed {seed}: {run['status']}")
        run["load_after"] = load_sample()
        with lock:
            record["runs"].append(run)
            record["load"].append(run["load_after"])
            if on_update is not None:
                on_update(record)

    jobs = [(seed, system) for seed in rc.seeds for system in rc.systems]
    if rc.jobs == 1:
        for job in jobs:
            one(*job)
    else:  # each job is a child process plus in-process scoring at one thread: a thread pool drives them
        with ThreadPoolExecutor(max_workers=rc.jobs) as pool:
            for f in [pool.submit(one, *job) for job in jobs]:
                f.result()
        record["runs"].sort(key=lambda r: (rc.seeds.index(r["seed"]), rc.systems.index(r["system"])))
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return record


def score_averages(record: dict, k: int, log: Callable[[str], None] = print) -> None:
    """fastmt's checkpoint averaging (``eval.average_last``) measured on the race's own kept weights: the mean of each
    fastmt run's last ``k`` checkpoints, scored like every point (``run["averaged"][k]``); trains nothing."""
    import torch

    from data.export_split import read_pairs
    from train.runs.checkpoint import average_checkpoints

    work = Path(record["config"]["work"])
    sets = {name: read_pairs(work / "split", name) for name in ("valid", "test")}
    for run in record["runs"]:
        if run["system"] != "fastmt" or run.get("status") != "ok":
            continue
        run_dir = work / f"fastmt-s{run['seed']}"
        paths = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-k:]
        if len(paths) < k:
            raise RaceSetupError(f"--average-last {k}: {run_dir / 'checkpoints'} keeps {len(paths)} step checkpoints")
        out = run_dir / f"average-last-{k}.pt"
        torch.save(average_checkpoints(paths), out)
        got: dict[str, Any] = {"checkpoints": [p.name for p in paths]}
        for name, (src, ref) in sets.items():
            s = score(translate_fastmt(out, src), ref)
            got[f"{name}_bleu"], got[f"{name}_chrf"] = s["bleu"], s["chrf"]
        run.setdefault("averaged", {})[str(k)] = got
        log(f"[race] fastmt seed {run['seed']}: the average of the last {k} kept weights: valid BLEU "
            f"{got['valid_bleu']:.2f}, test BLEU {got['test_bleu']:.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.race", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-files", nargs="+", metavar="F", default=[STAND_IN],
                   help=f"jsonl/parquet/tsv files (default the stand-in corpus {STAND_IN})")
    p.add_argument("--work", type=Path, help="folder for the split, runs and logs (default runs/race-<time>)")
    p.add_argument("--steps", type=int, default=RaceConfig.steps)
    p.add_argument("--eval-every", type=int, default=RaceConfig.eval_every)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--threshold", type=float, default=RaceConfig.threshold, help="valid BLEU of time-to-threshold")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=RaceConfig.jobs, help="runs at once (each --threads threads)")
    p.add_argument("--timeout-s", type=float, default=RaceConfig.timeout_s, help="per training process")
    p.add_argument("--hf-lr", type=float, default=RaceConfig.hf_lr)
    p.add_argument("--eole-peak-lr", type=float, default=RaceConfig.eole_peak_lr)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "peers-cpu.md",
                   help="the report (a .json record and a .png frontier beside it)")
    p.add_argument("--average-last", type=int, metavar="K", help="also score the mean of each fastmt run's last K "
                   "kept weights (checkpoint averaging; with --report-from: on that race's work folder)")
    p.add_argument("--report-from", type=Path, metavar="JSON",
                   help="write the report (--out) again from a race's .json record (with --threshold if given); "
                        "trains nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_hf"]:
        return hf_worker(argv[1:])
    p = build_parser()
    a, fastmt_extra = p.parse_known_args(argv)
    if a.average_last is not None and a.average_last < 2:
        p.error(f"--average-last {a.average_last}: give 2 or more kept weights to average")
    if a.report_from is not None:
        from data.files import read_json

        try:
            record = read_json(a.report_from, "race record")
        except (OSError, ValueError) as e:
            p.error(f"--report-from {a.report_from}: {e}")
        if "--threshold" in argv:
            record["config"]["threshold"] = a.threshold
        if a.average_last:
            try:
                score_averages(record, a.average_last)
            except (RaceSetupError, OSError) as e:
                p.error(str(e))
        write_report(record, record.get("command", "python -m bench.race"), a.out)
        print(f"[race] report: {a.out}")
        return 0
    if fastmt_extra and not all(x.startswith("--") or i % 2 for i, x in enumerate(fastmt_extra)):
        p.error(f"unrecognised arguments {fastmt_extra} (extra --section.field VALUE pairs go to fastmt)")
    missing = [f for f in a.data_files if not Path(f).is_file()]
    if missing:
        p.error(f"--data-files: no such file(s) {missing}; give existing jsonl/parquet/tsv files")
    try:
        seeds = tuple(int(s) for s in a.seeds.split(",") if s.strip())
        rc = RaceConfig(data_files=tuple(str(Path(f).resolve()) for f in a.data_files),
                        work=a.work or REPO / "runs" / time.strftime("race-%Y%m%d-%H%M%S"), steps=a.steps,
                        eval_every=a.eval_every, seeds=seeds,
                        systems=tuple(s.strip() for s in a.systems.split(",") if s.strip()),
                        threshold=a.threshold, threads=a.threads, jobs=a.jobs, timeout_s=a.timeout_s, hf_lr=a.hf_lr,
                        eole_peak_lr=a.eole_peak_lr, fastmt_overrides=tuple(fastmt_extra))
    except ValueError as e:
        p.error(str(e))
    if rc.work.exists() and any(rc.work.iterdir()):
        p.error(f"--work {rc.work} is not empty: give a new folder (nothing is overwritten)")
    command = "python -m bench.race " + " ".join(argv)

    def write(record, plot=False):
        record["command"] = command
        write_report(record, command, a.out, plot=plot)

    try:
        record = run_race(rc, on_update=write)
        if a.average_last:
            score_averages(record, a.average_last)
    except RaceSetupError as e:
        p.error(str(e))
    write(record, plot=True)
    for row in summarize(record):
        print(json.dumps(row))
    print(f"[race] report: {a.out}")
    return 0 if all(r.get("status") == "ok" for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
