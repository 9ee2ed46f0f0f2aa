"""eole (the OpenNMT-py successor) as a peer: trained and decoded by its own command line on fastmt's split.

eole lives in its own virtual environment (bench/requirements-peers.txt; ``.venv-peers/bin/eole`` or
``$FASTMT_EOLE``): it pins its own torch and pydantic. This module writes eole's config, runs ``eole
build_vocab`` / ``train`` / ``predict`` as subprocesses (each in its own process group, killed whole at its
deadline) and reads eole's log for the seconds at each step. ``EoleRecipe`` is eole's WMT17 transformer recipe
(recipes/wmt17/wmt17_ende_spm.yaml) at fastmt's size, with fastmt's SentencePiece model and a warm-up scaled
to the run (``warmup_for``), noam's factor chosen so the peak is ``peak_lr``."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EOLE = REPO / ".venv-peers" / "bin" / "eole"
STEP_LINE = re.compile(r"Step\s+(\d+)(?:/\s*\d+)?;.*?;\s*([\d.]+)\s+sec;")


class EoleMissing(RuntimeError):
    """eole is not installed where fastmt looks for it."""


def eole_binary() -> Path:
    """``$FASTMT_EOLE`` or ``.venv-peers/bin/eole``; a missing one raises ``EoleMissing`` with the install line."""
    path = Path(os.environ.get("FASTMT_EOLE") or DEFAULT_EOLE)
    if not path.is_file():
        raise EoleMissing(f"eole not found at {path}: python3.11 -m venv .venv-peers && .venv-peers/bin/pip install "
                          f"-r bench/requirements-peers.txt (or set FASTMT_EOLE to an eole executable)")
    return path


def eole_version(eole: Path) -> str:
    code = "import eole, torch; print(eole.__version__, torch.__version__)"
    try:
        return subprocess.run([str(eole.parent / "python"), "-c", code], capture_output=True, text=True,
                              timeout=120).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


@dataclass
class EoleRecipe:
    """eole's WMT17 recipe at fastmt's size (module docstring); the fields a run changes."""

    d_model: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 512
    dropout: float = 0.1
    tokens_per_step: int = 4096  # batch_size with batch_type tokens
    max_len: int = 64  # filtertoolong, in subwords
    steps: int = 1000
    save_every: int = 500  # checkpoints (and eval points) every N steps
    warmup: int | None = None  # None: warmup_for(steps)
    peak_lr: float = 3e-3  # noam's peak, at step == warmup
    seed: int = 0
    average_decay: float = 0.0  # eole's weight EMA (0: off)

    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else warmup_for(self.steps)

    def noam_factor(self) -> float:
        """eole's ``learning_rate`` under ``decay_method: noam``: lr(step) = factor * d^-0.5 * min(step^-0.5,
        step * warmup^-1.5), whose peak (at ``warmup``) is factor / sqrt(d * warmup)."""
        return self.peak_lr * math.sqrt(self.d_model * self.warmup_steps())


def warmup_for(steps: int) -> int:
    """The recipe's warm-up (4,000 of 50,000 steps: 8 %) for a run of ``steps``, at least a fifth of a short run
    (a noam warm-up of a few dozen steps diverges at this size), at most the recipe's 4,000."""
    return max(1, min(4000, max(round(0.08 * steps), steps // 5)))


def eole_config(split_dir: Path, work: Path, r: EoleRecipe, vocab_size: int) -> dict:
    """eole's config (a dict; JSON is YAML) for training on ``split_dir`` (data.export_split's files)."""
    split_dir, work = Path(split_dir).resolve(), Path(work).resolve()
    spm = str(split_dir / "spm.model")
    return {
        "save_data": str(work / "data"), "overwrite": True, "seed": r.seed, "report_every": max(1, r.save_every // 5),
        "src_vocab": str(work / "vocab.shared"), "tgt_vocab": str(work / "vocab.shared"),
        "src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, "vocab_size_multiple": 8,
        "share_vocab": True, "n_sample": 0,  # build_vocab reads the whole corpus (--n_sample -1)
        "data": {"corpus_1": {"path_src": str(split_dir / "train.src"), "path_tgt": str(split_dir / "train.tgt")},
                 "valid": {"path_src": str(split_dir / "valid.src"), "path_tgt": str(split_dir / "valid.tgt")}},
        "transforms": ["sentencepiece", "filtertoolong"],
        "transforms_configs": {"sentencepiece": {"src_subword_model": spm, "tgt_subword_model": spm},
                               "filtertoolong": {"src_seq_length": r.max_len, "tgt_seq_length": r.max_len}},
        "training": {
            "model_path": str(work / "model"), "keep_checkpoint": -1, "save_checkpoint_steps": r.save_every,
            "average_decay": r.average_decay, "train_steps": r.steps, "valid_steps": 10 ** 9,  # scored outside
            "world_size": 1, "gpu_ranks": [], "batch_type": "tokens", "batch_size": r.tokens_per_step,
            "valid_batch_size": r.tokens_per_step, "batch_size_multiple": 8, "accum_count": [1], "accum_steps": [0],
            "num_workers": 0, "bucket_size": 32768, "optim": "adamw", "learning_rate": r.noam_factor(),
            "warmup_steps": r.warmup_steps(), "decay_method": "noam", "adam_beta2": 0.998,
            "dropout_steps": [0], "dropout": [r.dropout], "attention_dropout": [r.dropout], "max_grad_norm": 0,
            "label_smoothing": 0.1, "param_init_method": "xavier_uniform", "normalization": "tokens",
        },
        "model": {"architecture": "transformer", "hidden_size": r.d_model, "share_decoder_embeddings": True,
                  "share_embeddings": True, "layers": r.layers, "heads": r.heads, "transformer_ff": r.ffn,
                  "embeddings": {"word_vec_size": r.d_model, "position_encoding_type": "SinusoidalInterleaved"}},
    }


def run_logged(cmd: list[str], log_path: Path, *, timeout_s: float, log: Callable[[str], None] = print) -> int:
    """``harness.run_in_group`` (one thread, output appended to ``log_path``, eole's own python path)."""
    from bench.harness import child_env, run_in_group

    log(f"[eole] {' '.join(cmd)}")
    return run_in_group(cmd, log_path, timeout_s=timeout_s, append=True, tail_lines=4,
                        env=child_env(1, PYTHONUNBUFFERED="1", PYTHONPATH="", CUDA_VISIBLE_DEVICES=""))


def step_seconds(log_text: str) -> dict[int, float]:
    """step -> eole's own elapsed seconds at that report (its ``Step N/M; ...; S sec;`` lines)."""
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(log_text)}


def checkpoints(work: Path) -> dict[int, Path]:
    """eole's kept checkpoints (``model/step_N``) by step."""
    got = {int(p.name.split("_")[1]): p for p in (work / "model").glob("step_*") if p.name.split("_")[1].isdigit()}
    return dict(sorted(got.items()))


def train(split_dir: Path, work: Path, r: EoleRecipe, vocab_size: int, *, timeout_s: float,
          log: Callable[[str], None] = print) -> dict:
    """build_vocab + train; returns {config, log, checkpoints: {step: path}, train_seconds (process wall of
    ``eole train``), step_seconds (eole's log)}."""
    eole, work = eole_binary(), Path(work)
    if work.exists():
        shutil.rmtree(work / "model", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "config.yaml"
    cfg_path.write_text(json.dumps(eole_config(split_dir, work, r, vocab_size), indent=1))
    log_path = work / "eole.log"
    log_path.write_text("")
    started = time.monotonic()  # one deadline for both commands
    run_logged([str(eole), "build_vocab", "--config", str(cfg_path), "--n_sample", "-1"], log_path,
               timeout_s=timeout_s, log=log)
    t0 = time.monotonic()
    run_logged([str(eole), "train", "--config", str(cfg_path)], log_path,
               timeout_s=max(1.0, started + timeout_s - t0), log=log)
    return {"config": str(cfg_path), "log": str(log_path), "checkpoints": checkpoints(work),
            "train_seconds": time.monotonic() - t0, "vocab_seconds": t0 - started,
            "step_seconds": step_seconds(log_path.read_text(errors="replace")), "recipe": asdict(r),
            "learning_rate": r.noam_factor(), "warmup_steps": r.warmup_steps()}


def predict(ckpt: Path, src_file: Path, out_file: Path, *, timeout_s: float, beam_size: int = 1,
            max_length: int = 106, log_path: Path | None = None, log: Callable[[str], None] = print) -> list[str]:
    """``eole predict`` of ``src_file`` (raw text; eole's sentencepiece transform from the checkpoint's config)
    into ``out_file``; returns the detokenised lines."""
    eole = eole_binary()
    cmd = [str(eole), "predict", "--model_path", str(ckpt), "--src", str(src_file), "--output", str(out_file),
           "--beam_size", str(beam_size), "--batch_size", "64", "--batch_type", "sents", "--max_length",
           str(max_length), "--world_size", "1"]
    run_logged(cmd, log_path or Path(out_file).with_suffix(".log"), timeout_s=timeout_s, log=log)
    return Path(out_file).read_text(encoding="utf-8").split("\n")[:-1]


# -- ``fastmt bench peers --peer eole`` ------------------------------------------------------------------------
def recipe_for(model_cfg, *, steps: int, save_every: int, seed: int, tokens_per_step: int, max_len: int,
               peak_lr: float = EoleRecipe.peak_lr, warmup: int | None = None) -> EoleRecipe:
    """The recipe at a fastmt model's size; eole's transformer has one ``layers`` for both stacks."""
    if model_cfg.enc_layers != model_cfg.dec_layers:
        raise ValueError(f"eole's transformer recipe has one layer count; model.enc_layers={model_cfg.enc_layers} "
                         f"!= model.dec_layers={model_cfg.dec_layers}")
    return EoleRecipe(d_model=model_cfg.d_model, layers=model_cfg.enc_layers, heads=model_cfg.n_heads,
                      ffn=model_cfg.d_ff, dropout=model_cfg.dropout, tokens_per_step=tokens_per_step,
                      max_len=max_len, steps=steps, save_every=save_every, seed=seed, peak_lr=peak_lr, warmup=warmup)


def run_peer(cfg, *, run_dir: Path, steps: int | None, wall_s: float | None, save_every: int, seed: int,
             peak_lr: float, test: bool, clock: Callable[[], float], log: Callable[[str], None] = print) -> dict:
    """eole on ``cfg``'s data (fastmt's split exported into the run folder) for ``steps`` or until ``wall_s``
    seconds since process start (then its process group is killed and the kept checkpoints scored); every kept
    checkpoint's whole-validation BLEU (greedy) and the last one's test BLEU, by ``bench.race.score``, logged as
    fastmt-format rows in ``run_dir/metrics.jsonl`` (``wall_seconds``: since this process started)."""
    from bench.peers import claimed_folder
    from bench.race import eole_batch_tokens, score
    from data import build_data
    from data.export_split import export_split, read_pairs
    from train.runs.folder import done_record
    from train.runs.metrics import MetricsLogger

    eole = eole_binary()  # before anything is built
    with claimed_folder(run_dir, log) as run_dir:
        bundle = build_data(cfg.data, log=lambda m: log(str(m)))
        split_dir = run_dir / "split"
        split = export_split(bundle, cfg.data, split_dir)
        r = recipe_for(cfg.model, steps=steps if steps is not None else 10 ** 7,  # a wall budget alone: until killed
                       save_every=save_every, seed=seed, tokens_per_step=eole_batch_tokens(bundle),
                       max_len=cfg.data.max_len, peak_lr=peak_lr, warmup=None if steps is not None else 4000)
        metrics = MetricsLogger(run_dir, tensorboard=False)
        metrics.log({"kind": "start", "system": "eole", "eole": eole_version(eole), "recipe": asdict(r),
                     "noam_learning_rate": r.noam_factor(), "split": split, "wall_seconds": clock()})
        t_start = clock()  # eole's step seconds count from its training start: after build_vocab and its imports
        stop = "done"
        try:
            got = train(split_dir, run_dir / "eole", r, bundle.tokenizer.vocab_size, log=log,
                        timeout_s=10 ** 7 if wall_s is None else max(1.0, wall_s - t_start))
        except TimeoutError:
            stop = "max_wall_seconds"
            got = {"checkpoints": checkpoints(run_dir / "eole"), "vocab_seconds": 0.0,
                   "step_seconds": step_seconds((run_dir / "eole" / "eole.log").read_text(errors="replace"))}
        best, points, valid_ref = None, list(got["checkpoints"].items()), read_pairs(split_dir, "valid")[1]
        for i, (step, ckpt) in enumerate(points):
            hyps = predict(ckpt, split_dir / "valid.src", run_dir / f"valid-{step}.hyp", timeout_s=3600)
            sc = score(hyps, valid_ref)
            elapsed = got["step_seconds"].get(step)
            metrics.log({"kind": "epoch", "epoch": i + 1, "step": step, "bleu": sc["bleu"], "chrf": sc["chrf"],
                         "bleu_signature": sc["bleu_signature"], "eval_sentences": len(hyps),
                         "wall_seconds": None if elapsed is None else t_start + got["vocab_seconds"] + elapsed,
                         "train_seconds": elapsed})
            log(f"[eole] step {step}: valid BLEU {sc['bleu']:.2f}")
            best = sc["bleu"] if best is None else max(best, sc["bleu"])
        summary = {"best_bleu": best, "steps": points[-1][0] if points else 0, "stop_reason": stop,
                   "run_dir": str(run_dir)}
        if test and points:
            hyps = predict(points[-1][1], split_dir / "test.src", run_dir / "test.hyp", timeout_s=3600)
            sc = score(hyps, read_pairs(split_dir, "test")[1])
            metrics.log({"kind": "test", "weights": "last", "test_bleu": sc["bleu"], "test_chrf": sc["chrf"],
                         "bleu_signature": sc["bleu_signature"], "test_sentences": len(hyps),
                         "wall_seconds": clock()})
            summary["test_bleu"] = sc["bleu"]
        metrics.log(done_record(epoch=len(points), step=summary["steps"], stop_reason=stop, best_bleu=best,
                                wall_seconds=clock()))
        metrics.close()
    return summary
