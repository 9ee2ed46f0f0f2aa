"""``fastmt bench inference`` / ``python -m bench.inference``: one model, one test set, every engine: fastmt's own
decoding (eager; on CUDA also its CUDA-graph path), CTranslate2 float32 and int8 (``fastmt export --to ct2``) and
Hugging Face ``generate`` (``fastmt export --to hf``), same beam, GNMT alpha and length limit
(``floor(a * source tokens + b)``). Per engine: sentences/s, generated tokens/s, peak memory, BLEU/chrF.

Each engine runs in its own child process (so each peak memory is its own: the process's max RSS on the CPU; on
CUDA also torch's peak allocation, which CTranslate2's allocator does not report), warms up on 16 sentences, then
translates the whole set once. With no ``--ckpt`` it first trains a small model itself (``tiny`` shape,
``model.ffn_norm false`` so that CTranslate2 can take it) on ``--data-files`` (default: the toy corpus), for
``--train-steps`` steps, and scores its test split; with ``--ckpt`` the test set is the first ``--sentences`` pairs of
``--data-files`` (or of the checkpoint's own test split when its data can be rebuilt). Writes
``<out>/inference-<device>.md`` (``--out``, default bench/results) and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from data.files import read_json, read_text

ENGINES = ("fastmt", "fastmt-cuda-graph", "ct2-float32", "ct2-int8", "hf-generate")
COLUMNS = ("engine", "sentences_per_s", "tokens_per_s", "seconds", "peak_rss_mb", "peak_cuda_mb", "bleu", "chrf",
           "same_as_fastmt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--ckpt", help="a trained checkpoint (ffn_norm false); none: train a small model first")
    p.add_argument("--data-files", nargs="+", metavar="F", help="pairs files (jsonl/parquet/tsv); none: the toy corpus")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the markdown result")
    p.add_argument("--sentences", type=int, default=500, help="test sentences translated by each engine")
    p.add_argument("--beam", type=int, default=4, help="beam size (1: greedy)")
    p.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (every engine)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per engine (0: every core)")
    p.add_argument("--train-steps", type=int, default=600, help="steps of the model trained without --ckpt")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one engine from a job file
    return p


# -- the model and the test set ----------------------------------------------------------------------------
def train_small(work: Path, data_files: list[str], steps: int, device: str,
                threads: int) -> tuple[Path, list[str], list[str]]:
    """A tiny-shape model trained ``steps`` steps (ffn_norm off) and its test split (sources, references)."""
    import dataclasses

    from data.config import toy
    from train.config import tiny
    from train.loop import Trainer
    from train.runs.report import translation_checkpoint

    cfg = tiny()
    data = toy(cache_dir=str(work / "cache"), toy_rows=6000) if not data_files else dataclasses.replace(
        cfg.data, data_files=tuple(data_files), cache_dir=str(work / "cache"), num_workers=0)
    cfg = dataclasses.replace(
        cfg, data=data, model=dataclasses.replace(cfg.model, ffn_norm=False),
        run=dataclasses.replace(cfg.run, name="inference", out_dir=str(work / "runs"), epochs=1000, max_steps=steps,
                                max_batches_per_epoch=None, progress=False, tensorboard=False, plot=False,
                                device=device, cpu_threads=threads or None),
        eval=dataclasses.replace(cfg.eval, every=10**6, test_at_end=False, num_samples=0))
    trainer = Trainer(cfg, log=lambda *a: None)
    trainer.fit()
    test = trainer.data.splits["test"]
    return translation_checkpoint(work / "runs" / "inference"), list(test.src_text), list(test.tgt_text)


def test_pairs(ckpt: Path, data_files: list[str] | None) -> tuple[list[str], list[str]]:
    from train.cli.evaluate import read_pairs
    from train.cli.export import load_source

    data = load_source(ckpt).config.get("data") or {}
    if data_files:
        return read_pairs(data_files[0], data.get("src_lang", "en"), data.get("tgt_lang", "it"))
    raise SystemExit("bench.inference: --ckpt needs --data-files (the test pairs)")


# -- one engine, in a child process -------------------------------------------------------------------------
def run_child(job_file: str) -> None:
    job = read_json(job_file, "benchmark job")
    engine, device, d = job["engine"], job["device"], job["decoding"]
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    from train import flush_denormals

    flush_denormals()
    src = job["src"]
    if engine.startswith("fastmt"):
        from train.cli.export import load_source
        from train.evaluation.decode import translate

        s = load_source(job["ckpt"])
        model = s.model.to(device)
        graphs = engine == "fastmt-cuda-graph"

        def fn(x):
            return translate(model, s.tok, x, torch.device(device), beam_size=d["beam"], batch_size=d["batch"],
                             max_len_ratio=d["a"], max_len_extra=d["b"], length_penalty=d["alpha"],
                             fixed_shapes=graphs, cuda_graph=graphs)
        tok = s.tok.sp
    elif engine.startswith("ct2"):
        from train.export.ct2 import CT2Translator

        tr = CT2Translator(job["dirs"][engine], device=device, threads=job["threads"])

        def fn(x):
            return tr.translate(x, beam_size=d["beam"], length_penalty=d["alpha"], max_len_a=d["a"],
                                max_len_b=d["b"], batch_size=d["batch"])
        tok = tr.tok.sp
    else:
        from train.export.hf import HFTranslator

        tr = HFTranslator(job["dirs"]["hf"], device=device)

        def fn(x):
            return tr.translate(x, beam_size=d["beam"], length_penalty=d["alpha"], max_len_a=d["a"],
                                max_len_b=d["b"], batch_size=d["batch"])
        tok = tr.sp
    fn(src[:16])  # warm-up: lazy initialisation, kernels, graph captures of the small shapes
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    hyps = fn(src)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) + 1 for ids in tok.encode(hyps))  # generated tokens, EOS included
    Path(job["result"]).write_text(json.dumps({
        "hyps": hyps, "seconds": seconds, "tokens": tokens,
        "peak_rss_mb": peak_rss_mb(),
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" and
        not engine.startswith("ct2") else None}))


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: its own, unlike ru_maxrss, which Linux carries over from the
    parent across fork and exec)."""
    for line in read_text("/proc/self/status", "process status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_name() -> str:
    try:
        for line in read_text("/proc/cpuinfo", "CPU description", limit=64 * 2**20).splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, ValueError):
        pass
    return "unknown CPU"


# -- the parent ---------------------------------------------------------------------------------------------
def measure(args, ckpt: Path, src: list[str], ref: list[str], work: Path, device: str) -> list[dict]:
    from train.cli.export import main as export
    from train.evaluation.scores import corpus_scores

    dirs = {"ct2-float32": work / "ct2", "ct2-int8": work / "ct2-int8", "hf": work / "hf"}
    engines = [e for e in args.engines.split(",") if e in ENGINES and (device == "cuda" or e != "fastmt-cuda-graph")]
    for prefix, module in (("ct2", "ctranslate2"), ("hf", "transformers")):
        if any(e.startswith(prefix) for e in engines) and importlib.util.find_spec(module) is None:
            print(f"bench.inference: {module} is not installed here (pip install -e '.[export]'): the {prefix} "
                  f"engines are skipped", flush=True)
            engines = [e for e in engines if not e.startswith(prefix)]
    for name, extra in (("ct2-float32", ["--to", "ct2"]), ("ct2-int8", ["--to", "ct2", "--quantization", "int8"]),
                        ("hf", ["--to", "hf"])):
        if any(e.startswith(name.split("-")[0]) for e in engines) and export(
                ["--ckpt", str(ckpt), *extra, "--force", str(dirs[name])]) != 0:
            raise SystemExit(f"bench.inference: fastmt export {' '.join(extra)} failed")
    rows, first = [], None
    for engine in engines:
        job = work / f"{engine}.job.json"
        result = work / f"{engine}.result.json"
        job.write_text(json.dumps({"engine": engine, "device": device, "ckpt": str(ckpt), "src": src,
                                   "threads": args.threads, "dirs": {k: str(v) for k, v in dirs.items()},
                                   "result": str(result), "decoding": {
                                       "beam": args.beam, "alpha": args.length_penalty, "a": 1.5, "b": 10,
                                       "batch": args.batch_size}}))
        subprocess.run([sys.executable, "-m", "bench.inference", "--child", str(job)], check=True)
        r = read_json(result, "benchmark result", limit=4 * 2**30)
        first = first if first is not None else r["hyps"]
        scores = corpus_scores(r["hyps"], [ref])
        rows.append({"engine": engine, "sentences_per_s": len(src) / r["seconds"],
                     "tokens_per_s": r["tokens"] / r["seconds"], "seconds": r["seconds"],
                     "peak_rss_mb": r["peak_rss_mb"], "peak_cuda_mb": r["peak_cuda_mb"], "bleu": scores["bleu"],
                     "chrf": scores["chrf"], "same_as_fastmt": sum(a == b for a, b in zip(r["hyps"], first)),
                     "signature": scores["bleu_signature"]})
        print(f"{engine}: {rows[-1]['sentences_per_s']:.1f} sentences/s, BLEU {scores['bleu']:.2f}", flush=True)
    return rows


def markdown(rows: list[dict], args, n: int, corpus: str, device: str, ckpt_note: str) -> str:
    from bench.harness import markdown_table, provenance, provenance_markdown

    prov = provenance(device)
    base = next((r for r in rows if r["engine"] == "fastmt"), rows[0])
    lines = [f"# Inference speed, side by side ({'GPU' if device == 'cuda' else 'CPU'})", "",
             f"`python -m bench.inference {' '.join(sys.argv[1:])}`", "",
             provenance_markdown(prov, None), f"- machine: {cpu_name()}, {os.cpu_count()} cores visible (shared: load "
             f"average {os.getloadavg()[0]:.1f} at the end); threads per engine: {args.threads or 'all'}", f"- model: {ckpt_note}", f"- test set: {n} sentences of {corpus}",
             f"- decoding (every engine): beam {args.beam}, GNMT alpha {args.length_penalty:g} (CTranslate2 and HF: "
             f"n-best rescored with GNMT), max length 1.5 x source + 10 per sentence, batch {args.batch_size}",
             f"- BLEU signature: {rows[0]['signature']}", "",
             markdown_table([{k: r.get(k) for k in COLUMNS} for r in rows], COLUMNS), "",
             "`same_as_fastmt`: sentences whose translation equals fastmt's (eager) word for word. Peak RSS: the "
             "engine's whole process (Python, torch and the library included).", ""]
    for r in rows:
        if r is not base:
            lines.append(f"- {r['engine']}: {r['sentences_per_s'] / base['sentences_per_s']:.2f}x fastmt's "
                         f"sentences/s")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        run_child(args.child)
        return 0
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="fastmt-inference-") as tmp:
        work = Path(tmp)
        files = list(args.data_files or [])
        if args.ckpt:
            ckpt, note = Path(args.ckpt), f"{args.ckpt}"
            src, ref = test_pairs(ckpt, files)
        else:
            ckpt, src, ref = train_small(work, files, args.train_steps, device, args.threads)
            note = f"`tiny` shape with model.ffn_norm false, trained here for {args.train_steps} steps"
        src, ref = src[: args.sentences], ref[: args.sentences]
        rows = measure(args, ckpt, src, ref, work, device)
    from bench.cli import corpus_label

    corpus = corpus_label(files) if files else "the toy corpus (generated)"
    text = markdown(rows, args, len(src), corpus, device, note)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"inference-{'cpu' if device == 'cpu' else 'gpu'}.md"
    path.write_text(text)
    print(text)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
