"""``fastmt bench inference`` / ``python -m bench.inference``: one model, one test set, every engine: fastmt's
own decoding (eager; on CUDA also its CUDA-graph path), CTranslate2 float32 and int8 (``fastmt export --to
ct2``) and Hugging Face ``generate`` (``fastmt export --to hf``), same beam, GNMT alpha and length limit
(``floor(a * source tokens + b)``). Per engine: sentences/s, generated tokens/s, peak memory, BLEU/chrF.

Each engine runs in its own child process (its own peak memory) pinned to ``--threads`` CPU threads (default
1: on a busy machine more threads wait for each other), warms up on 16 sentences, then translates the whole
set; ``--repeats`` rounds, the engines taking turns, the median time reported with its spread and the load
around it. Exactly ``--sentences`` sentences (fewer available is an error): with no ``--ckpt`` it first trains
a ``tiny`` model on ``--data-files`` (default: the toy corpus) for ``--train-steps`` steps with a test split
of that size; with ``--ckpt`` the first pairs of ``--data-files``, else the checkpoint's own test split (its
run's data rebuilt with its tokenizer). Writes ``<out>/inference-<device>.md`` (default ``runs/bench``,
outside the tracked results: ``--out bench/results`` updates those) and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import child_env, run_in_group, tail
from data.files import read_json, read_text

ENGINES = ("fastmt", "fastmt-cuda-graph", "ct2-float32", "ct2-int8", "hf-generate")
COLUMNS = ("engine", "sentences_per_s", "tokens_per_s", "seconds", "spread_s", "sentences_per_cpu_s", "load",
           "peak_rss_mb", "peak_cuda_mb", "bleu", "chrf", "same_as_fastmt")
DEFAULT_OUT = Path("runs/bench")  # git-ignored: a run never rewrites the tracked bench/results unless asked


def positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--ckpt", help="a trained checkpoint (ffn_norm false); none: train a small model first")
    p.add_argument("--data-files", nargs="+", metavar="F", help="pairs files (jsonl/parquet/tsv); none: the toy corpus")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder of the markdown result (default {DEFAULT_OUT}; bench/results holds the tracked ones)")
    p.add_argument("--sentences", type=positive, default=500, help="test sentences translated by each engine")
    p.add_argument("--beam", type=positive, default=4, help="beam size (1: greedy)")
    p.add_argument("--length-penalty", type=float, default=0.6, help="GNMT alpha")
    p.add_argument("--batch-size", type=positive, default=32, help="sentences per batch (every engine)")
    p.add_argument("--threads", type=positive, default=1, help="CPU threads of each engine (default 1)")
    p.add_argument("--repeats", type=positive, default=3, help="timed passes per engine, in turns (median reported)")
    p.add_argument("--train-steps", type=int, default=600, help="steps of the model trained without --ckpt")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each engine's pass (its process "
                                                                   "group is killed past it)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one engine from a job file
    return p


# -- the model and the test set ----------------------------------------------------------------------------
def train_small(work: Path, data_files: list[str], steps: int, device: str,
                sentences: int) -> tuple[Path, list[str], list[str]]:
    """A tiny model trained ``steps`` steps and its test split of ``sentences`` pairs (sources, refs)."""
    import dataclasses

    from data.config import toy
    from train.config import tiny
    from train.loop import Trainer
    from train.runs.report import translation_checkpoint

    cfg = tiny()
    data = toy(cache_dir=str(work / "cache"), toy_rows=max(6000, 3 * sentences), test_size=sentences) \
        if not data_files else dataclasses.replace(cfg.data, data_files=tuple(data_files), cache_dir=str(work / "cache"),
                                                   num_workers=0, test_size=sentences)
    cfg = dataclasses.replace(
        cfg, data=data,
        run=dataclasses.replace(cfg.run, name="inference", out_dir=str(work / "runs"), epochs=1000, max_steps=steps,
                                max_batches_per_epoch=None, progress=False, tensorboard=False, plot=False,
                                device=device),
        eval=dataclasses.replace(cfg.eval, every=10**6, test_at_end=False, num_samples=0))
    trainer = Trainer(cfg, log=lambda *a: None)
    trainer.fit()
    test = trainer.data.splits["test"]
    return translation_checkpoint(work / "runs" / "inference"), list(test.src_text), list(test.tgt_text)


def test_pairs(ckpt: Path, data_files: list[str] | None) -> tuple[list[str], list[str], str, str]:
    """(sources, references, what they are, the model in a few words): the pairs of ``--data-files``, else the
    checkpoint's own test split."""
    from bench.cli import corpus_label
    from train.cli.evaluate import read_pairs
    from train.runs.checkpoint import load_checkpoint

    saved = load_checkpoint(ckpt)
    m, run = saved.get("config", {}).get("model") or {}, saved.get("config", {}).get("run") or {}
    note = (f"{ckpt.name} (given): {m.get('enc_layers')}+{m.get('dec_layers')} layers, d_model "
            f"{m.get('d_model')}, d_ff {m.get('d_ff')}, vocabulary {m.get('vocab_size')}, ffn_norm "
            f"{m.get('ffn_norm')}; run {run.get('name')!r}, step {(saved.get('position') or {}).get('step')}")
    data = saved.get("config", {}).get("data") or {}
    if data_files:
        src, ref = read_pairs(data_files[0], data.get("src_lang", "en"), data.get("tgt_lang", "it"))
        return src, ref, f"the first pairs of {corpus_label(data_files)}", note
    from data import build_data
    from train.config import Config
    from train.preflight import tokenizer_of

    try:
        cfg = Config.from_dict(saved["config"], where=str(ckpt))
        bundle = build_data(cfg.data, log=lambda *a: None, tokenizer=tokenizer_of(saved, ckpt))
    except Exception as e:  # noqa: BLE001 - its data is not here: say so, and how to give test pairs instead
        raise SystemExit(f"bench.inference: the test split of {ckpt} cannot be rebuilt here ({type(e).__name__}: "
                         f"{e}); give test pairs with --data-files") from None
    test = bundle.splits["test"]
    where = corpus_label(cfg.data.data_files) if cfg.data.data_files else str(cfg.data.dataset)
    what = f"the test split of {where} (the checkpoint's run's own)"
    return list(test.src_text), list(test.tgt_text), what, note


def check_out(out: Path) -> None:
    """``--out`` can hold the result: a folder, or a path under a writable folder (created at the end)."""
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"bench.inference: --out {out}: {parent} is {'not writable' if parent.is_dir() else 'a file'}; "
                         f"give a folder")


# -- one engine, in a child process -------------------------------------------------------------------------
def run_child(job_file: str) -> None:
    job = read_json(job_file, "benchmark job")
    engine, device, d = job["engine"], job["device"], job["decoding"]
    torch.set_num_threads(job["threads"])
    from train import flush_denormals

    flush_denormals()
    src = job["src"]
    if engine.startswith("fastmt"):
        from train.cli.export import load_source
        from train.evaluation.decode import translate

        s = load_source(job["ckpt"])
        model, graphs, tok = s.model.to(device), engine == "fastmt-cuda-graph", s.tok.sp

        def fn(x):
            return translate(model, s.tok, x, torch.device(device), beam_size=d["beam"], batch_size=d["batch"],
                             max_len_ratio=d["a"], max_len_extra=d["b"], length_penalty=d["alpha"],
                             fixed_shapes=graphs, cuda_graph=graphs)
    else:
        if engine.startswith("ct2"):
            from train.export.ct2 import CT2Translator

            tr = CT2Translator(job["dirs"][engine], device=device, threads=job["threads"])
            tok = tr.tok.sp
        else:
            from train.export.hf import HFTranslator

            tr = HFTranslator(job["dirs"]["hf"], device=device)
            tok = tr.sp

        def fn(x):
            return tr.translate(x, beam_size=d["beam"], length_penalty=d["alpha"], max_len_a=d["a"],
                                max_len_b=d["b"], batch_size=d["batch"])
    fn(src[:16])  # warm-up: lazy initialisation, kernels, graph captures of the small shapes
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    hyps = fn(src)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(ids) + 1 for ids in tok.encode(hyps))  # generated tokens, EOS included
    Path(job["result"]).write_text(json.dumps({
        "hyps": hyps, "seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens,
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
        if any(e == name or (name == "hf" and e.startswith("hf")) for e in engines) and export(
                ["--ckpt", str(ckpt), *extra, "--force", str(dirs[name])]) != 0:
            raise SystemExit(f"bench.inference: fastmt export {' '.join(extra)} failed")
    passes: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repeats):  # the engines take turns: a change of load hits every engine alike
        for engine in engines:
            job = work / f"{engine}.job.json"
            result = work / f"{engine}.result.json"
            decoding = {"beam": args.beam, "alpha": args.length_penalty, "a": 1.5, "b": 10,
                        "batch": args.batch_size}
            job.write_text(json.dumps({"engine": engine, "device": device, "ckpt": str(ckpt), "src": src,
                                       "threads": args.threads, "dirs": {k: str(v) for k, v in dirs.items()},
                                       "result": str(result), "decoding": decoding}))
            load_before = os.getloadavg()[0]
            try:  # its own process group under a deadline; a failure: the log's last lines
                run_in_group([sys.executable, "-m", "bench.inference", "--child", str(job)], work / f"{engine}.log",
                             timeout_s=args.timeout_s, env=child_env(args.threads), tail_lines=5)
            except (RuntimeError, TimeoutError) as e:  # the log goes with the temporary folder: its end is said
                raise SystemExit(f"bench.inference: the {engine} engine failed: {e}"
                                 + (f"; it ended: {tail(work / f'{engine}.log')}" if isinstance(e, TimeoutError)
                                    else "")) from None
            passes[engine].append({**read_json(result, "benchmark result", limit=4 * 2**30), "load": (load_before, os.getloadavg()[0])})
    rows, first = [], None
    for engine in engines:
        runs = passes[engine]
        r = runs[0]
        seconds = sorted(p["seconds"] for p in runs)
        median = statistics.median(seconds)
        first = first if first is not None else r["hyps"]
        scores = corpus_scores(r["hyps"], [ref])
        loads = [x for p in runs for x in p["load"]]
        cpu = statistics.median(p["cpu_seconds"] for p in runs)
        rows.append({"engine": engine, "sentences_per_s": len(src) / median, "tokens_per_s": r["tokens"] / median,
                     "sentences_per_cpu_s": len(src) / cpu,
                     "seconds": median, "spread_s": f"{seconds[0]:.3g}-{seconds[-1]:.3g}",
                     "load": f"{min(loads):.1f}-{max(loads):.1f}", "peak_rss_mb": max(p["peak_rss_mb"] for p in runs),
                     "peak_cuda_mb": r["peak_cuda_mb"], "bleu": scores["bleu"], "chrf": scores["chrf"],
                     "same_as_fastmt": sum(a == b for a, b in zip(r["hyps"], first)),
                     "same_every_pass": all(p["hyps"] == r["hyps"] for p in runs),
                     "signature": scores["bleu_signature"]})
        print(f"{engine}: {rows[-1]['sentences_per_s']:.1f} sentences/s, BLEU {scores['bleu']:.2f}", flush=True)
    return rows


def markdown(rows: list[dict], args, n: int, corpus: str, device: str, ckpt_note: str, loads: tuple) -> str:
    from bench.harness import cpu_name, markdown_table, provenance, provenance_markdown

    prov = provenance(device)
    base = next((r for r in rows if r["engine"] == "fastmt"), rows[0])
    lines = [f"# Inference speed, side by side ({'GPU' if device == 'cuda' else 'CPU'})", "",
             f"`python -m bench.inference {' '.join(sys.argv[1:])}`", "",
             provenance_markdown(prov, None),
             f"- machine: {cpu_name()}, {os.cpu_count()} cores visible, shared: load average (1 min) {loads[0]:.1f} "
             f"at the start, {loads[1]:.1f} at the end; {args.threads} thread{'s' if args.threads > 1 else ''} per "
             f"engine (OMP/MKL pinned too)",
             f"- model: {ckpt_note}", f"- test set: {n} sentences, {corpus}",
             f"- decoding (every engine): beam {args.beam}, GNMT alpha {args.length_penalty:g} (CTranslate2 and HF: "
             f"n-best rescored with GNMT), max length 1.5 x source + 10 per sentence, batch {args.batch_size}",
             f"- timing: {args.repeats} pass{'es' if args.repeats > 1 else ''} per engine after a 16-sentence warm-up, "
             f"the engines taking turns; `seconds` is the median pass (wall clock), `spread_s` the fastest-slowest, "
             f"`sentences_per_cpu_s` the sentences per second of the process's own CPU time (median pass: what "
             f"waiting for a busy core does not inflate), `load` the load average range around the engine's passes",
             f"- BLEU signature: {rows[0]['signature']}", "",
             markdown_table([{k: r.get(k) for k in COLUMNS} for r in rows], COLUMNS), "",
             "`same_as_fastmt`: sentences whose translation equals fastmt's (eager) word for word. Peak RSS: the "
             "engine's whole process (Python, torch and the library included).", ""]
    for r in rows:
        if r is not base:
            lines.append(f"- fastmt / {r['engine']}: {base['sentences_per_s'] / r['sentences_per_s']:.2f}x the "
                         f"sentences/s ({base['sentences_per_cpu_s'] / r['sentences_per_cpu_s']:.2f}x per CPU second)")
    changed = [r["engine"] for r in rows if not r["same_every_pass"]]
    if changed:
        lines.append(f"- translations differed between passes: {', '.join(changed)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        run_child(args.child)
        return 0
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from bench.cli import corpus_label

    check_out(args.out)  # before minutes of work, and before writing anything
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fastmt-inference-") as tmp:
        work = Path(tmp)
        files = list(args.data_files or [])
        if args.ckpt:
            ckpt = Path(args.ckpt)
            src, ref, corpus, note = test_pairs(ckpt, files)
        else:
            from data.clean import DataInputError

            try:
                ckpt, src, ref = train_small(work, files, args.train_steps, device, args.sentences)
            except DataInputError as e:  # e.g. a test split of --sentences that leaves no training rows
                raise SystemExit(f"bench.inference: {e}") from None
            note = f"`tiny` shape (default model.ffn_norm: off), trained here for {args.train_steps} steps"
            corpus = f"the test split of {corpus_label(files) if files else 'the toy corpus (generated)'}"
        if len(src) < args.sentences:
            raise SystemExit(f"bench.inference: --sentences {args.sentences}, but the test set has {len(src)} pairs "
                             f"({'the first pairs of --data-files' if args.ckpt else 'its test split'}): give more "
                             f"pairs or fewer --sentences")
        src, ref = src[: args.sentences], ref[: args.sentences]
        rows = measure(args, ckpt, src, ref, work, device)
    text = markdown(rows, args, len(src), corpus, device, note, (start_load, os.getloadavg()[0]))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"inference-{'cpu' if device == 'cpu' else 'gpu'}.md"
    from data.files import atomic_write

    atomic_write(path, text, what="bench result")
    print(text)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
