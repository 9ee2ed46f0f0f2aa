"""``python -m bench.readme_figures --standin FILE [--big FILE]``: re-measures CPU figures the README quotes and
prints them as JSON lines (recorded, with machine and sha, in ``bench/results/cpu-readme-figures.md``):

- the split on ``--standin`` (sizes; valid/test sources and targets also in train, before/after grouping), for
  ``split_grouping`` source and source_target (the README's overlap table);
- with ``--big`` (a large corpus, e.g. ``python -m bench.data_scale --from FILE --sizes 1.16775 --keep``'s):
  the seconds to plan one epoch of its train split per batching mode (3 epochs each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from data import DataConfig, build_data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.readme_figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--standin", required=True, help="the stand-in corpus (jsonl)")
    p.add_argument("--big", help="a large corpus for the planning costs (jsonl)")
    p.add_argument("--cache", help="data cache folder (default: a temporary one)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = a.cache or tmp
        for grouping in ("source", "source_target"):
            b = build_data(DataConfig(data_files=(a.standin,), cache_dir=cache, split_grouping=grouping),
                           log=lambda m: None)
            r = b.split_record
            print(json.dumps({"grouping": grouping, "sizes": r["sizes"], "overlap": r["overlap"]}), flush=True)
        if a.big:
            b = build_data(DataConfig(data_files=(a.big,), cache_dir=cache, num_workers=0), log=lambda m: None)
            for mode in ("token_bucket", "sorted", "packed"):
                secs = []
                for epoch in range(3):
                    t = time.perf_counter()
                    b.plan("train", epoch=epoch, batching=mode)
                    secs.append(round(time.perf_counter() - t, 3))
                print(json.dumps({"plan": mode, "pairs": len(b.splits["train"]), "seconds_per_epoch": secs}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
