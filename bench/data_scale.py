"""``python -m bench.data_scale``: cold and warm start of the data layer on corpora of 0.02-5 M pairs.

Per size it writes a corpus under ``--work`` (``--from FILE``: that corpus repeated with a numeric suffix per
copy, as issue 24 measured; else a seeded synthetic en-it corpus, Zipf words), then runs ``build_data`` in a
fresh child process on an empty cache (cold) and on the cache it left (warm), measuring: the build's wall and
CPU seconds (user + system, its workers included), the whole child's wall, the peak memory of the child's
process tree (RSS from /proc/PID/statm every 20 ms, PSS from smaps_rollup every 200 ms, ``getrusage``),
pairs/s per core, the seconds of each cold build phase (``data.build``'s meta.json) and the first-batch
latency. ``--code DIR`` measures another checkout. Rows are appended to ``bench/results/data-scale-cpu.csv``;
the ``.md`` table and ``.png`` plot are rewritten from all rows, labelled with the machine, the load average
and the code's git sha.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

from bench import harness as H
from data.files import read_json

REPO, RESULTS = H.REPO_ROOT, H.RESULTS_DIR
SIZES_M = (0.02, 0.2, 1.0, 5.0)
BUILD_PHASES = ("read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write")  # data.build.PHASES
COLUMNS = ("date", "code", "tag", "corpus", "pairs", "phase", "build_s", "process_s", "first_batch_s",
           "pairs_per_s_core", "cores", "rss_tree_mb", "pss_tree_mb", "maxrss_self_mb", "maxrss_child_mb",
           "load_before", "load_after", "machine") + tuple(f"{k}_s" for k in BUILD_PHASES) + ("cpu_s",)

# the CSV's cells of a child's record
REC_FORMATS = {"build_s": ".3f", "process_s": ".3f", "first_batch_s": ".4f", "rss_tree_mb": ".0f",
               "pss_tree_mb": ".0f", "maxrss_self_mb": ".0f", "maxrss_child_mb": ".0f", "cpu_s": ".2f"}

# The child: imports, build_data (timed), a marker so the parent stops sampling memory, then torch and the
# first training batch (timed). Writes one JSON record to argv[5].
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
open(sys.argv[5], "w").write(json.dumps({"phases": phases, "import_s": t1 - t0, "build_s": t2 - t1, "cpu_s": c2 - c1, "first_batch_s": t4 - t3, "pairs": pairs,
                  "rows": bundle.report.rows, "maxrss_self_mb": ru_self / 1024,
                  "maxrss_child_mb": ru_child / 1024, "pss_end_mb": pss_end}))
"""


# -- Corpora --
def replicate(source: Path, out: Path, pairs: int) -> None:
    """``pairs`` rows: ``source``'s rows repeated, copy k >= 1 with " k" appended to both sides."""
    rows = [json.loads(line)["translation"] for line in source.open(encoding="utf-8") if line.strip()]
    langs = list(rows[0])
    with out.open("w", encoding="utf-8") as f:
        for n in range(pairs):
            k, i = divmod(n, len(rows))
            tail = f" {k}" if k else ""
            f.write(json.dumps({"id": str(n), "translation": {g: rows[i][g] + tail for g in langs}},
                               ensure_ascii=False) + "\n")


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


# -- Measuring a child process tree --
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


def tree_memory(roots: list[int], pss: bool = True) -> tuple[float, float]:
    """(RSS, PSS) in MB summed over ``roots`` and their descendants. RSS comes from /proc/PID/statm (cheap); PSS
    from smaps_rollup, which walks the page tables under the process's mmap lock, so it is read only when
    ``pss`` (every 10th sample: reading it every 20 ms slowed a 2 GB build measurably)."""
    kids, todo, rss, pss_kb = _children_of(), list(roots), 0.0, 0
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


def run_child(code: Path, corpus: Path, cache: Path, workers: int, timeout_s: float) -> dict:
    """One build in a fresh child (``bench.harness.run_in_group``: its own process group, killed past
    ``timeout_s``), the memory of this process's children sampled every 20 ms until the build's marker appears."""
    marker, result = cache.parent / f".built-{os.getpid()}", cache.parent / f".result-{os.getpid()}.json"
    marker.unlink(missing_ok=True)
    peak, stop = [0.0, 0.0], threading.Event()

    def sample():
        n = 0
        while not stop.is_set() and not marker.exists():
            rss, pss = tree_memory(_children_of().get(os.getpid(), []), pss=n % 10 == 0)
            peak[:] = max(peak[0], rss), max(peak[1], pss)
            n += 1
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    sampler.start()
    try:
        H.run_in_group([sys.executable, "-c", CHILD, str(corpus), str(cache), str(marker), str(workers), str(result)],
                       cache.parent / f"child-{os.getpid()}.log", timeout_s=timeout_s, cwd=str(code), tail_lines=20,
                       env=H.child_env(PYTHONPATH=str(code)))
    finally:
        stop.set()
        sampler.join()
        marker.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    rec = read_json(result, "data_scale child record")
    result.unlink()
    rec.update(process_s=wall, rss_tree_mb=max(peak[0], rec["maxrss_self_mb"]),
               pss_tree_mb=max(peak[1], rec["pss_end_mb"]))  # short (warm) builds end before a PSS sample
    return rec


# -- Table, plot --
def load_rows(path: Path) -> list[dict]:
    """The CSV's rows, every one with every column of `COLUMNS` (rows written before a column existed: "")."""
    return H.read_csv(path, COLUMNS)


def _num(v, spec: str) -> str:
    return "" if v in ("", None) else format(float(v), spec)


def _dash(v) -> str:
    return "—" if v in ("", None) else str(v)


def _table(rows: list[dict], cols: str, heads: list[str], right: str, cell=str) -> list[str]:
    """A markdown table of ``rows`` (``cols``, ``right``: space-separated keys), then a blank line."""
    return [H.markdown_table(rows, cols.split(), heads, right=right.split(), cell=cell), ""]


def write_table(rows: list[dict], md: Path) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["corpus"], int(r["pairs"]), r["phase"], f"{r['code']} ({r['tag']})"), []).append(r)
    summary = []
    for (corpus, pairs, phase, code), rs in sorted(groups.items()):
        def med(k, rs=rs):
            v = [float(r[k]) for r in rs if r[k] not in ("", None)]
            return float(np.median(v)) if v else None

        loads = [float(r["load_before"]) for r in rs] + [float(r["load_after"]) for r in rs]
        cpu = med("cpu_s")
        summary.append({"corpus": corpus, "pairs": f"{pairs:,}", "phase": phase, "code": code,
                        "build_s": f"{med('build_s'):.3f}", "cpu_s": _dash(_num(cpu, ".1f")),
                        "rss": f"{med('rss_tree_mb'):.0f}", "pss": f"{med('pss_tree_mb'):.0f}",
                        "pps": _num(med("pairs_per_s_core"), ",.0f"),
                        "per_cpu": _num(pairs / cpu if cpu and phase == "cold" else None, ",.0f"),
                        "runs": len(rs), "load": f"{min(loads):.1f}–{max(loads):.1f}"})
    phases = []
    for r in rows:
        sec = {k: float(r[f"{k}_s"] or 0) for k in BUILD_PHASES}
        if r["phase"] == "cold" and any(r.get(f"{k}_s") for k in BUILD_PHASES):
            phases.append({**r, "pairs": f"{int(r['pairs']):,}", "build_s": f"{float(r['build_s']):.1f}",
                           "cpu_s": _dash(_num(r["cpu_s"], ".1f")),
                           **{k: f"{sec[k]:.1f}" for k in BUILD_PHASES},
                           "slowest": max(sec, key=sec.get), "rss": f"{float(r['rss_tree_mb']):.0f}",
                           "load": f"{r['load_before']} → {r['load_after']}"})
    lines = ["# Data layer at scale: cold and warm start (CPU)", "",
             "`python -m bench.data_scale` (module docstring: what is measured and how). build = "
             "`build_data` wall; process = the whole child (interpreter, imports, build, torch import, first "
             "batch); memory = peak over the build, summed over the process tree (RSS counts shared pages "
             "once per process, PSS shares them); getrusage = max RSS of the child / of its largest child. "
             "The machine is shared: the load average before/after each run is given.", "",
             "## Summary: medians over the rows below, per corpus, size, code and phase", "",
             "CPU s: user + system seconds of the build's processes (a cost the machine's load does not "
             "change much; recorded since issue 37); pairs/CPU-s: pairs per such second.", "",
             *_table(summary, "corpus pairs phase code build_s cpu_s rss pss pps per_cpu runs load", [
                 "corpus", "pairs", "phase", "code (tag)", "build s", "CPU s", "peak RSS tree MB",
                 "peak PSS tree MB", "pairs/s/core", "pairs/CPU-s", "runs", "load"],
                    "pairs build_s cpu_s rss pss pps per_cpu runs")]
    if phases:
        lines += ["## Where a cold build's time goes (seconds per phase, `data.build`)", "",
                  "read/clean/hash/scratch: pass A (parse, clean, normalise + hash, scratch files), split from its "
                  "wall time by the workers' seconds in each step; group: the leakage-free split (streaming passes "
                  "over the hashes); tokenizer: its sample + SentencePiece training; encode: pass B; write: the "
                  "arrays and meta.json. Load = the 1-minute load average before → after (2 cores).", "",
                  *_table(phases, f"date code corpus pairs build_s cpu_s {' '.join(BUILD_PHASES)} slowest "
                                  "rss load",
                          ["date", "code", "corpus", "pairs", "build s", "CPU s", *BUILD_PHASES, "slowest",
                           "RSS tree MB", "load"], f"pairs build_s cpu_s {' '.join(BUILD_PHASES)} rss")]
    heads = ["date", "code", "tag", "corpus", "pairs", "phase", "build s", "process s", "first batch s",
             "pairs/s/core", "RSS tree MB", "PSS tree MB", "getrusage self / child MB", "load"]
    for mach in sorted({r["machine"] for r in rows}):
        table = [{**r, "pairs": f"{int(r['pairs']):,}", "build_s": _num(r["build_s"], ".2f"),
                  "process_s": _num(r["process_s"], ".2f"), "first_batch_s": _num(r["first_batch_s"], ".3f"),
                  "pps": _num(r["pairs_per_s_core"], ",.0f"), "rss": _num(r["rss_tree_mb"], ".0f"),
                  "pss": _num(r["pss_tree_mb"], ".0f"), "ru": f"{_dash(_num(r['maxrss_self_mb'], '.0f'))} / "
                  f"{_dash(_num(r['maxrss_child_mb'], '.0f'))}", "load": f"{r['load_before']} → {r['load_after']}"}
                 for r in rows if r["machine"] == mach]
        lines += [f"## {mach}", "", *_table(table, "date code tag corpus pairs phase build_s process_s "
                                            "first_batch_s pps rss pss ru load", heads,
                                            "pairs build_s process_s first_batch_s pps rss pss ru", _dash)]
    md.write_text("\n".join(lines))


def plot(rows: list[dict], png: Path) -> None:
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["tag"], r["code"], r["phase"], r["corpus"]), []).append(r)
    fig, axes = H.new_figure(1, 2, width=5.5, height=4.2)
    for (tag, code, phase, corpus), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: int(r["pairs"]))
        x = [int(r["pairs"]) for r in rs]
        style = "-o" if phase == "cold" else "--s"
        label = f"{tag} ({code}) {phase}, {corpus}"
        axes[0][0].plot(x, [float(r["build_s"]) for r in rs], style, label=label)
        axes[0][1].plot(x, [float(r["pss_tree_mb"]) for r in rs], style, label=label)
    for ax, title in zip(axes[0], ("build_data wall (s)", "peak PSS of the process tree (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("pairs")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    H.save_figure(fig, png, suptitle=f"bench.data_scale — {rows[-1]['machine']}")


SPM_HEADERS = ("sample pairs", "of train", "vocab", "valid src / tgt subwords per sentence",
               "train src / tgt", "valid byte-fallback share", "pieces shared with the all-pairs model")


def spm_sample_rows(source: Path, sizes: list[int], work: Path, vocab: int = 8000) -> list[dict]:
    """What a sampled tokenizer changes on one corpus, per ``spm_sample_pairs`` (0 = every train pair): the
    table's cells (``SPM_HEADERS``)."""
    from data import DataConfig, build_data

    rows, full = [], None
    for k in sizes:
        cfg = DataConfig(data_files=(str(source),), cache_dir=str(work / "cache-spm-sample"), spm_sample_pairs=k,
                         vocab_size=vocab, num_workers=0)
        b = build_data(cfg, log=lambda *_: None)
        tok, va, tr = b.tokenizer, b.splits["valid"], b.splits["train"]
        pieces = {tok.sp.id_to_piece(i) for i in range(tok.vocab_size)}
        full = pieces if full is None else full
        ids = np.concatenate([np.asarray(va.src_ids), np.asarray(va.tgt_ids)])
        is_byte = np.array([tok.sp.is_byte(i) for i in range(tok.vocab_size)])
        of_train = b.split_record["rows_before_length_filter"]["train"]
        n = min(k or of_train, of_train)
        offsets = (va.src_offsets, va.tgt_offsets, tr.src_offsets, tr.tgt_offsets)
        per = [float(np.diff(x).mean()) for x in offsets]
        rows.append(dict(zip(SPM_HEADERS, (f"{'all ' if not k else ''}{n:,}", f"{n / of_train:.1%}",
                                           f"{tok.vocab_size:,}", f"{per[0]:.2f} / {per[1]:.2f}",
                                           f"{per[2]:.2f} / {per[3]:.2f}",
                                           f"{float(is_byte[ids].mean()):.3%}",
                                           f"{len(pieces & full) / len(full):.1%}"))))
    return rows


def write_spm_table(rows: list[dict], md: Path, source: Path) -> None:
    lines = ["# SentencePiece on a seeded sample of the train split (stand-in corpus, CPU)", "",
             f"`python -m bench.data_scale --spm-sample K,... --vocab V,... --from {source}` "
             f"({date.today().isoformat()}, {H.machine()}). Stand-in corpus: real human translations in "
             "the OPUS Books row format, not OPUS Books. Split as `build_data` does (1000 valid, 1000 test, seed 0); "
             "BPE; subwords per sentence exclude EOS/BOS.", "",
             H.markdown_table(rows, SPM_HEADERS, SPM_HEADERS, cell=str, right=(
                 "sample pairs", "of train", "vocab", "valid byte-fallback share",
                 "pieces shared with the all-pairs model"))]
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
    p.add_argument("--timeout-s", type=float, default=7200.0, help="deadline of each build's child process (killed "
                                                                   "with its workers past it)")
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
    code, mach = a.code_sha or H.code_sha(a.code, "data"), H.machine()
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
            try:
                rec = run_child(a.code, corpus, cache, a.workers, a.timeout_s)
            except (RuntimeError, TimeoutError) as e:  # the rows of the builds before it are in the CSV
                raise SystemExit(f"bench.data_scale: the {phase} build of {pairs:,} pairs failed: {e}") from None
            row = {"date": date.today().isoformat(), "code": code, "tag": a.tag, "corpus": label,
                   "pairs": pairs, "phase": phase, "cores": cores, "load_before": load0,
                   "load_after": f"{os.getloadavg()[0]:.2f}",
                   "machine": mach, **{k: format(rec[k], spec) for k, spec in REC_FORMATS.items()},
                   "pairs_per_s_core": f"{pairs / rec['build_s'] / cores:.0f}" if phase == "cold" else "",
                   **{f"{k}_s": f"{rec['phases'][k]:.2f}" if k in rec["phases"] else ""
                      for k in BUILD_PHASES}}
            print("[data_scale] " + json.dumps(row), flush=True)
            if rec["phases"]:
                print("[data_scale] phases (s): " + ", ".join(f"{k} {rec['phases'][k]:.1f}" for k in BUILD_PHASES
                                                              if k in rec["phases"]), flush=True)
            H.append_csv(csv_path, [row], COLUMNS)
        if not a.keep:
            shutil.rmtree(cache, ignore_errors=True)
    rows = load_rows(csv_path)
    write_table(rows, a.out / "data-scale-cpu.md")
    plot(rows, a.out / "data-scale-cpu.png")
    print(f"[data_scale] table: {a.out / 'data-scale-cpu.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
