"""``python -m bench.data_scale``: cold and warm start of the data layer on corpora of 0.02-5 M pairs.

For each size it writes a corpus (never committed: under ``--work``), then runs ``build_data`` twice in a
fresh child process each, on an empty cache (cold) and on the cache the first run left (warm), and
measures: wall of ``build_data``; wall of the whole child (interpreter and imports included); the peak
memory of the child's process tree while it builds (RSS summed over the tree every 20 ms from
/proc/PID/statm, PSS every 200 ms from smaps_rollup, and ``resource.getrusage`` of the child and of its
largest child); pairs/s per core
(cold: pairs / wall / cores used); the CPU seconds of the build (user + system, the child and its build
workers: what the build costs whatever the machine's load; on a shared machine wall / CPU says how much of the
cores it got); the seconds of each build phase (cold: read, clean, hash, scratch files,
group = the leakage-free split, tokenizer = its sample + training, encode, write; from the entry's meta.json,
`data.build`); and the first-batch latency (``next(iter(bundle.loader("train")))`` after the build, torch
imported beforehand). ``--code DIR`` measures another checkout (e.g. the tree
before a change): the child imports ``data`` from there. Rows are appended to
``bench/results/data-scale-cpu.csv``; the table (``.md``) and the plot (``.png``) are rewritten from
all rows, labelled with the machine, the load average and the code's git sha.

Corpora: ``--from FILE`` repeats a real corpus with a numeric suffix per copy (what issue 24 measured);
without it, a synthetic en-it corpus is generated (Zipf-distributed words, seeded).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SIZES_M = (0.02, 0.2, 1.0, 5.0)
BUILD_PHASES = ("read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write")  # data.build.PHASES
COLUMNS = ("date", "code", "tag", "corpus", "pairs", "phase", "build_s", "process_s", "first_batch_s",
           "pairs_per_s_core", "cores", "rss_tree_mb", "pss_tree_mb", "maxrss_self_mb", "maxrss_child_mb",
           "load_before", "load_after", "machine") + tuple(f"{k}_s" for k in BUILD_PHASES) + ("cpu_s",)

# The child: imports, build_data (timed), a marker so the parent stops sampling memory, then torch and the
# first training batch (timed). Prints one JSON line.
CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
from data import DataConfig, build_data
cfg = DataConfig(data_files=(sys.argv[1],), cache_dir=sys.argv[2], num_workers=int(sys.argv[4]))
def cpu():  # user + system seconds of this process and of its children that ended (the build's workers)
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
t1, c1 = time.perf_counter(), cpu()
logs = []
bundle = build_data(cfg, log=lambda m: logs.append(m) if m.startswith("[data] built ") else None)
t2, c2 = time.perf_counter(), cpu()
ru_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ru_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
pss_end = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:")) / 1024
open(sys.argv[3], "w").close()
import torch
t3 = time.perf_counter()
batch = next(iter(bundle.loader("train")))
t4 = time.perf_counter()
pairs = sum(len(s) for s in bundle.splits.values())
meta = json.load(open(os.path.join(bundle.split_record["cache"], "meta.json")))
phases = (meta.get("build") or {}).get("phases", {}) if "built " in " ".join(logs) else {}
print(json.dumps({"phases": phases, "import_s": t1 - t0, "build_s": t2 - t1, "cpu_s": c2 - c1, "first_batch_s": t4 - t3, "pairs": pairs,
                  "rows": bundle.report.rows, "maxrss_self_mb": ru_self / 1024,
                  "maxrss_child_mb": ru_child / 1024, "pss_end_mb": pss_end}))
"""


# ----------------------------------------------------------------------------------------------
# Corpora
# ----------------------------------------------------------------------------------------------
def replicate(source: Path, out: Path, pairs: int) -> None:
    """``pairs`` rows: ``source``'s rows repeated, copy k >= 1 with " k" appended to both sides."""
    rows = [json.loads(line)["translation"] for line in source.open(encoding="utf-8") if line.strip()]
    langs = list(rows[0])
    with out.open("w", encoding="utf-8") as f:
        n = 0
        for k in range(pairs // len(rows) + 1):
            tail = f" {k}" if k else ""
            buf = []
            for r in rows[: pairs - n]:
                buf.append(json.dumps({"id": str(n), "translation": {g: r[g] + tail for g in langs}},
                                      ensure_ascii=False))
                n += 1
            f.write("\n".join(buf) + "\n" if buf else "")


def _words(n: int, rng: np.random.Generator) -> list[str]:
    consonants, vowels = list("bcdfglmnprstvz"), list("aeiou")
    out = set()
    while len(out) < n:
        k = int(rng.integers(1, 4))
        out.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(k)))
    return sorted(out)


def synthetic(out: Path, pairs: int, seed: int = 0, vocab: int = 20_000, chunk: int = 50_000) -> None:
    """A seeded en-it-like corpus: Zipf word draws (1.1), 3-30 words a sentence, the target a per-word
    mapping with a few words dropped or added."""
    rng = np.random.default_rng(seed)
    en, it = np.array(_words(vocab, rng)), np.array([w[::-1] + "o" for w in _words(vocab, rng)])
    with out.open("w", encoding="utf-8") as f:
        for start in range(0, pairs, chunk):
            m = min(chunk, pairs - start)
            lens = rng.integers(3, 31, m)
            ids = np.minimum(rng.zipf(1.1, int(lens.sum())), vocab) - 1
            cut = np.cumsum(lens)[:-1]
            lines = []
            for i, w in enumerate(np.split(ids, cut)):
                src = " ".join(en[w]).capitalize() + "."
                tw = w[rng.random(len(w)) > 0.1]
                tgt = " ".join(it[tw]).capitalize() + "."
                lines.append(json.dumps({"id": str(start + i), "translation": {"en": src, "it": tgt}}))
            f.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------------------------
# Measuring a child process tree
# ----------------------------------------------------------------------------------------------
def _children_of() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def tree_memory(pid: int, pss: bool = True) -> tuple[float, float]:
    """(RSS, PSS) in MB summed over ``pid`` and its descendants. RSS comes from /proc/PID/statm (cheap); PSS
    from smaps_rollup, which walks the page tables under the process's mmap lock, so it is read only when
    ``pss`` (every 10th sample: reading it every 20 ms slowed a 2 GB build measurably)."""
    kids, todo, rss, pss_kb = _children_of(), [pid], 0.0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * page / 2**20
            if pss:
                with open(f"/proc/{p}/smaps_rollup") as f:
                    pss_kb += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except (OSError, StopIteration, ValueError):
            pass
    return rss, pss_kb / 1024


def run_child(code: Path, corpus: Path, cache: Path, workers: int) -> dict:
    marker = cache.parent / f".built-{os.getpid()}"
    marker.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    t0 = time.perf_counter()
    # output to files, not pipes: this loop does not read while it samples, and a child that wrote more than a
    # pipe holds would block until the parent read
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(corpus), str(cache), str(marker), str(workers)],
                                env=env, cwd=str(code), stdout=fout, stderr=ferr, text=True)
        peak_rss = peak_pss = 0.0
        n = 0
        while proc.poll() is None and not marker.exists():
            rss, pss = tree_memory(proc.pid, pss=n % 10 == 0)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            n += 1
            time.sleep(0.02)
        proc.wait()
        fout.seek(0), ferr.seek(0)
        out, err = fout.read(), ferr.read()
    wall = time.perf_counter() - t0
    marker.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-3000:]}")
    rec = json.loads(out.strip().splitlines()[-1])
    rec.update(process_s=wall, rss_tree_mb=max(peak_rss, rec["maxrss_self_mb"]),
               pss_tree_mb=max(peak_pss, rec["pss_end_mb"]))  # short (warm) builds end before a PSS sample
    return rec


# ----------------------------------------------------------------------------------------------
# Labels, table, plot
# ----------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"


def git_sha(code: Path) -> str:
    try:
        sha = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--", "data"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_rows(path: Path) -> list[dict]:
    """The CSV's rows, every one with every column of `COLUMNS` (rows written before a column existed: "")."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: r.get(k) or "" for k in COLUMNS} for r in csv.DictReader(f)]


def append_row(path: Path, row: dict) -> None:
    """Append ``row``; a CSV whose header lacks columns added since is rewritten with them first (old rows: "")."""
    header = []
    if path.is_file():
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
    if header != list(COLUMNS):
        rows = load_rows(path)
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    with path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=COLUMNS).writerow(row)


def write_table(rows: list[dict], md: Path) -> None:
    def f(v, fmt):
        return "—" if v in ("", None) else format(float(v), fmt)

    lines = ["# Data layer at scale: cold and warm start (CPU)", "",
             "`python -m bench.data_scale` (module docstring: what is measured and how). build = `build_data` wall; "
             "process = the whole child (interpreter, imports, build, torch import, first batch); memory = peak over "
             "the build, summed over the process tree (RSS counts shared pages once per process, PSS shares them); "
             "getrusage = max RSS of the child / of its largest child. The machine is shared: the load average "
             "before/after each run is given.", ""]
    lines += ["## Summary: medians over the rows below, per corpus, size, code and phase", "",
              "CPU s: user + system seconds of the build's processes (a cost the machine's load does not change "
              "much; recorded since issue 37); pairs/CPU-s: pairs per such second.", "",
              "| corpus | pairs | phase | code (tag) | build s | CPU s | peak RSS tree MB | peak PSS tree MB | pairs/s/core "
              "| pairs/CPU-s | runs | load |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["corpus"], int(r["pairs"]), r["phase"], f"{r['code']} ({r['tag']})"), []).append(r)
    for (corpus, pairs, phase, code), rs in sorted(groups.items()):
        def med(k, rs=rs):
            v = [float(r[k]) for r in rs if r[k] not in ("", None)]
            return float(np.median(v)) if v else None

        loads = [float(r["load_before"]) for r in rs] + [float(r["load_after"]) for r in rs]
        pps, cpu = med("pairs_per_s_core"), med("cpu_s")
        per_cpu = pairs / cpu if cpu and phase == "cold" else None
        lines.append(f"| {corpus} | {pairs:,} | {phase} | {code} | {med('build_s'):.3f} "
                     f"| {'—' if cpu is None else f'{cpu:.1f}'} | {med('rss_tree_mb'):.0f} "
                     f"| {med('pss_tree_mb'):.0f} | {'' if pps is None else f'{pps:,.0f}'} "
                     f"| {'' if per_cpu is None else f'{per_cpu:,.0f}'} | {len(rs)} | {min(loads):.1f}–{max(loads):.1f} |")
    lines.append("")
    timed = [r for r in rows if r["phase"] == "cold" and any(r.get(f"{k}_s") for k in BUILD_PHASES)]
    if timed:
        lines += ["## Where a cold build's time goes (seconds per phase, `data.build`)", "",
                  "read/clean/hash/scratch: pass A (parse, clean, normalise + hash, scratch files), split from its "
                  "wall time by the workers' seconds in each step; group: the leakage-free split (streaming passes "
                  "over the hashes); tokenizer: its sample + SentencePiece training; encode: pass B; write: the "
                  "arrays and meta.json. Load = the 1-minute load average before → after (2 cores).", "",
                  "| date | code | corpus | pairs | build s | CPU s | " + " | ".join(BUILD_PHASES)
                  + " | slowest | RSS tree MB | load |", "|---|---|---|---:|---:|---:|" + "---:|" * len(BUILD_PHASES)
                  + "---|---:|---|"]
        for r in timed:
            sec = {k: float(r[f"{k}_s"] or 0) for k in BUILD_PHASES}
            lines.append(f"| {r['date']} | {r['code']} | {r['corpus']} | {int(r['pairs']):,} | {float(r['build_s']):.1f} "
                         f"| {f(r['cpu_s'], '.1f')} | " + " | ".join(f"{sec[k]:.1f}" for k in BUILD_PHASES)
                         + f" | {max(sec, key=sec.get)} | {float(r['rss_tree_mb']):.0f} "
                         f"| {r['load_before']} → {r['load_after']} |")
        lines.append("")
    for mach in sorted({r["machine"] for r in rows}):
        lines += [f"## {mach}", "",
                  "| date | code | tag | corpus | pairs | phase | build s | process s | first batch s | pairs/s/core "
                  "| RSS tree MB | PSS tree MB | getrusage self / child MB | load |",
                  "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            if r["machine"] != mach:
                continue
            lines.append(
                f"| {r['date']} | {r['code']} | {r['tag']} | {r['corpus']} | {int(r['pairs']):,} | {r['phase']} "
                f"| {f(r['build_s'], '.2f')} | {f(r['process_s'], '.2f')} | {f(r['first_batch_s'], '.3f')} "
                f"| {f(r['pairs_per_s_core'], ',.0f')} | {f(r['rss_tree_mb'], '.0f')} | {f(r['pss_tree_mb'], '.0f')} "
                f"| {f(r['maxrss_self_mb'], '.0f')} / {f(r['maxrss_child_mb'], '.0f')} "
                f"| {r['load_before']} → {r['load_after']} |")
        lines.append("")
    md.write_text("\n".join(lines))


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["tag"], r["code"], r["phase"], r["corpus"]), []).append(r)
    for (tag, code, phase, corpus), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: int(r["pairs"]))
        x = [int(r["pairs"]) for r in rs]
        style = "-o" if phase == "cold" else "--s"
        label = f"{tag} ({code}) {phase}, {corpus}"
        axes[0].plot(x, [float(r["build_s"]) for r in rs], style, label=label)
        axes[1].plot(x, [float(r["pss_tree_mb"]) for r in rs], style, label=label)
    for ax, title in zip(axes, ("build_data wall (s)", "peak PSS of the process tree (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("pairs")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"bench.data_scale — {rows[-1]['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def spm_sample_rows(source: Path, sizes: list[int], work: Path, vocab: int = 8000) -> list[dict]:
    """What a sampled tokenizer changes on one corpus: per ``spm_sample_pairs`` (0 = every train pair), the
    vocabulary, subwords per sentence (valid and train), byte-fallback share on valid, the pieces shared with
    the model trained on everything, and the SentencePiece training time."""
    from data import DataConfig, build_data

    rows, full = [], None
    for k in sizes:
        logs: list[str] = []
        cfg = DataConfig(data_files=(str(source),), cache_dir=str(work / "cache-spm-sample"), spm_sample_pairs=k,
                         vocab_size=vocab, num_workers=0)
        b = build_data(cfg, log=logs.append)
        tok, va, tr = b.tokenizer, b.splits["valid"], b.splits["train"]
        pieces = {tok.sp.id_to_piece(i) for i in range(tok.vocab_size)}
        full = pieces if full is None else full
        ids = np.concatenate([np.asarray(va.src_ids), np.asarray(va.tgt_ids)])
        is_byte = np.array([tok.sp.is_byte(i) for i in range(tok.vocab_size)])
        trained = next((line for line in logs if "trained SentencePiece" in line), "")
        rows.append({
            "sample_pairs": k, "of_train": b.split_record["rows_before_length_filter"]["train"],
            "vocab": tok.vocab_size, "asked": vocab,
            "valid_src_per_sent": float(np.diff(va.src_offsets).mean()),
            "valid_tgt_per_sent": float(np.diff(va.tgt_offsets).mean()),
            "train_src_per_sent": float(np.diff(tr.src_offsets).mean()),
            "train_tgt_per_sent": float(np.diff(tr.tgt_offsets).mean()),
            "valid_byte_share": float(is_byte[ids].mean()), "shared_pieces": len(pieces & full) / len(full),
            "log": trained,
        })
    return rows


def write_spm_table(rows: list[dict], md: Path, source: Path) -> None:
    lines = ["# SentencePiece on a seeded sample of the train split (stand-in corpus, CPU)", "",
             f"`python -m bench.data_scale --spm-sample K,... --vocab V,... --from {source}` "
             f"({date.today().isoformat()}, {machine()}). Stand-in corpus: real human translations in "
             "the OPUS Books row format, not OPUS Books. Split as `build_data` does (1000 valid, 1000 test, seed 0); "
             "BPE; subwords per sentence exclude EOS/BOS.", "",
             "| sample pairs | of train | vocab | valid src / tgt subwords per sentence | train src / tgt | "
             "valid byte-fallback share | pieces shared with the all-pairs model |",
             "|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        k = min(r["sample_pairs"] or r["of_train"], r["of_train"])
        lines.append(f"| {'all ' if not r['sample_pairs'] else ''}{k:,} | {k / r['of_train']:.1%} | {r['vocab']:,} "
                     f"| {r['valid_src_per_sent']:.2f} / {r['valid_tgt_per_sent']:.2f} "
                     f"| {r['train_src_per_sent']:.2f} / {r['train_tgt_per_sent']:.2f} "
                     f"| {r['valid_byte_share']:.3%} | {r['shared_pieces']:.1%} |")
    md.write_text("\n".join(lines) + "\n")


def work_dir(work: Path | None) -> Path:
    """``--work``, else a folder made for this run (``mkdtemp``: private, a name nobody could plant files at;
    a fixed /tmp path let another user of the machine put a corpus or a cache there first)."""
    return work if work is not None else Path(tempfile.mkdtemp(prefix="fastmt-data-scale-"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES_M)), help="corpus sizes in millions of pairs")
    p.add_argument("--from", dest="source", type=Path, help="repeat this jsonl corpus (else: synthetic)")
    p.add_argument("--work", type=Path, help="corpora and caches (default: a new private temporary folder)")
    p.add_argument("--code", type=Path, default=REPO, help="checkout whose data/ is measured")
    p.add_argument("--tag", default="after", help="label of this code in the table (e.g. before / after)")
    p.add_argument("--code-sha", help="the table's name of --code's version (default: its git sha; a tree exported "
                                      "with `git archive SHA data` has none)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers of the first-batch measure")
    p.add_argument("--warm-runs", type=int, default=2, help="warm starts per size (each a row)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of data-scale-cpu.{csv,md,png}")
    p.add_argument("--keep", action="store_true", help="keep the caches (corpora are always kept)")
    p.add_argument("--spm-sample", metavar="K,K", help="instead: tokenizer statistics per spm_sample_pairs on --from")
    p.add_argument("--vocab", default="8000", help="--spm-sample: vocabulary sizes (comma-separated)")
    a = p.parse_args(argv)
    a.work = work_dir(a.work)
    print(f"[data_scale] work folder {a.work}", flush=True)
    if a.spm_sample:
        if a.source is None:
            p.error("--spm-sample needs --from FILE")
        rows = [r for v in a.vocab.split(",") for r in
                spm_sample_rows(a.source, [int(k) for k in a.spm_sample.split(",")], a.work, int(v))]
        a.out.mkdir(parents=True, exist_ok=True)
        write_spm_table(rows, a.out / "data-spm-sample-cpu.md", a.source)
        print((a.out / "data-spm-sample-cpu.md").read_text())
        return 0
    sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    if a.source is not None and not a.source.is_file():
        p.error(f"--from {a.source}: no such file")
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    csv_path = a.out / "data-scale-cpu.csv"
    label = "stand-in corpus replicated" if a.source else "synthetic"
    code, mach = a.code_sha or git_sha(a.code), machine()
    cores = len(os.sched_getaffinity(0))
    for size in sizes:
        pairs = int(round(size * 1e6))
        corpus = a.work / (f"{'rep' if a.source else 'syn'}-{pairs}.jsonl")
        if not corpus.is_file():
            t0 = time.perf_counter()
            tmp = corpus.with_suffix(".tmp")
            replicate(a.source, tmp, pairs) if a.source else synthetic(tmp, pairs)
            tmp.replace(corpus)
            print(f"[data_scale] wrote {corpus} ({corpus.stat().st_size / 2**20:.0f} MB) in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        cache = a.work / f"cache-{a.tag}-{pairs}"
        shutil.rmtree(cache, ignore_errors=True)
        for phase in ["cold"] + ["warm"] * a.warm_runs:
            load0 = f"{os.getloadavg()[0]:.2f}"
            rec = run_child(a.code, corpus, cache, a.workers)
            row = {"date": date.today().isoformat(), "code": code, "tag": a.tag, "corpus": label,
                   "pairs": pairs, "phase": phase, "build_s": f"{rec['build_s']:.3f}",
                   "process_s": f"{rec['process_s']:.3f}", "first_batch_s": f"{rec['first_batch_s']:.4f}",
                   "pairs_per_s_core": f"{pairs / rec['build_s'] / cores:.0f}" if phase == "cold" else "",
                   "cores": cores, "rss_tree_mb": f"{rec['rss_tree_mb']:.0f}",
                   "pss_tree_mb": f"{rec['pss_tree_mb']:.0f}", "maxrss_self_mb": f"{rec['maxrss_self_mb']:.0f}",
                   "maxrss_child_mb": f"{rec['maxrss_child_mb']:.0f}", "load_before": load0,
                   "load_after": f"{os.getloadavg()[0]:.2f}", "machine": mach}
            row.update({f"{k}_s": f"{rec['phases'][k]:.2f}" if k in rec["phases"] else "" for k in BUILD_PHASES})
            row["cpu_s"] = f"{rec['cpu_s']:.2f}"
            print("[data_scale] " + json.dumps(row), flush=True)
            if rec["phases"]:
                print("[data_scale] phases (s): " + ", ".join(f"{k} {rec['phases'][k]:.1f}" for k in BUILD_PHASES
                                                              if k in rec["phases"]), flush=True)
            append_row(csv_path, row)
        if not a.keep:
            shutil.rmtree(cache, ignore_errors=True)
    rows = load_rows(csv_path)
    write_table(rows, a.out / "data-scale-cpu.md")
    plot(rows, a.out / "data-scale-cpu.png")
    print(f"[data_scale] table: {a.out / 'data-scale-cpu.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
