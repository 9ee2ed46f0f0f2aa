"""``fastmt COMMAND [ARGS ...]``: the one command-line entry point (``make setup`` installs it as
``.venv/bin/fastmt``; ``python -m train.commands`` is the same without installing).

Each command hands its arguments to a module's ``main(argv) -> int`` and exits with what it returns
(the codes of ``train/errors.py``: 0 finished, 1 bug, 2 user error, 3 non-finite, 75 interrupted).
``fastmt COMMAND --help`` shows the command's own flags.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train.cli.train", "train a translator: --preset P | --auto | --config FILE, then --section.field V"),
    "translate": ("train.cli.translate", "translate sentences (arguments, or lines on stdin) with a checkpoint"),
    "evaluate": ("train.cli.evaluate", "score a checkpoint (BLEU, chrF) on a split or on files"),
    "stats": ("train.cli.stats", "the rows, lengths and batches a training config makes of a corpus (train's flags)"),
    "model": ("train.cli.model", "parameters and FLOPs of the model a preset builds"),
    "export": ("train.cli.export", "a checkpoint as a CTranslate2 model or a Hugging Face folder: --ckpt C --to ct2|hf OUT"),
    "bench": ("", "benchmarks: fastmt bench NAME --help (names below)"),
}
# fastmt bench NAME -> module
BENCH: dict[str, tuple[str, str]] = {
    "kernels": ("bench.kernels", "kernel benchmarks: our Triton attention and LayerNorm against PyTorch's"),
    "ladder": ("bench.ladder", "the speedup ladder: each training technique switched on in turn"),
    "step": ("bench.step", "the step audit: compiled regions, eager ops, host syncs, CUDA graphs and ms per step"),
    "profile": ("bench.profile", "torch.profiler trace and graph-break report of the compiled training step"),
    "quality": ("bench.quality", "the time-to-BLEU record of a training run folder"),
    "frontier": ("bench.frontier", "validation BLEU against wall seconds, fastmt against the HF baseline (GPU)"),
    "sweep": ("bench.sweep", "the optimiser sweep on wall time to BLEU (GPU)"),
    "peers": ("bench.peers", "the Hugging Face baseline (MarianMT) on fastmt's data (needs the peers extra)"),
    "race": ("bench.race", "the CPU race: fastmt, the HF baseline and eole at the small size, seeds, one scoring"),
    "batch-sweep": ("bench.batch_sweep", "tokens a step x lr / warm-up: seconds to validation BLEU 15 and 20 (GPU)"),
    "vocab-sweep": ("bench.vocab_sweep", "vocabulary size and batching settings behind the data defaults"),
    "data-scale": ("bench.data_scale", "cold and warm start of the data layer on generated 0.02-5 M-pair corpora"),
    "readme-figures": ("bench.readme_figures", "re-measure the README's CPU figures (split table, epoch planning)"),
    "aot": ("bench.aot", "compile units per runbook step; Triton kernels compiled ahead of time for sm_90"),
    "packets": ("bench.packets", "the GPU runbook: run a packet on the device machine; plan, next, land and check its results"),
    "inference": ("bench.inference", "translation speed and BLEU: fastmt, CTranslate2 (float32, int8), HF generate"),
}


def usage() -> str:
    width = max(map(len, [*COMMANDS, *BENCH])) + 2
    lines = ["usage: fastmt COMMAND [ARGS ...]   (fastmt COMMAND --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}{text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "fastmt bench NAME:"]
    lines += [f"  {name:<{width}}{text}" for name, (_, text) in BENCH.items()]
    lines += ["", "exit codes: 0 finished, 1 bug (traceback), 2 user error (one line), 3 stopped on non-finite "
                  "values, 75 interrupted with a checkpoint (resume with --resume auto)",
              "example: fastmt train --preset tiny --data.dataset toy"]
    return "\n".join(lines)


def _unknown(kind: str, name: str, known: Sequence[str]) -> int:
    from train.fields import did_you_mean

    hint = did_you_mean(name, list(known)) or f"; choose one of {', '.join(known)}"
    print(f"fastmt: unknown {kind} {name!r}{hint}", file=sys.stderr)
    return 2


def run_module(module: str, prog: str, argv: list[str]) -> int:
    """``module.main(argv)``, its command name shown as ``prog`` where the module lets us set it."""
    mod = importlib.import_module(module)
    entry = getattr(mod, "main", None)
    if entry is None:
        print(f"{prog}: {module} has no main(argv) in this version of fastmt", file=sys.stderr)
        return 1
    if module not in ("train.cli.train", "train.cli.stats"):
        return int(entry(argv) or 0)
    from train.cli import flags as cli

    before, cli.PROG = cli.PROG, prog  # the parser's name in usage and errors
    try:
        return int(entry(argv) or 0)
    finally:
        cli.PROG = before


def main(argv: Sequence[str] | None = None) -> int:
    from train.cli import cpu_wait

    args = list(sys.argv[1:] if argv is None else argv)
    cpu_wait.choose(training=args[:1] == ["train"])  # before any command imports torch: train/cli/cpu_wait.py
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"fastmt {version('fastmt')}")
        except PackageNotFoundError:
            print("fastmt (not installed: run from a checkout)")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        return _unknown("command", name, list(COMMANDS))
    if name == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(usage(), file=sys.stdout if rest else sys.stderr)
            return 0 if rest else 2
        if rest[0] not in BENCH:
            return _unknown("benchmark", rest[0], list(BENCH))
        return run_module(BENCH[rest[0]][0], f"fastmt bench {rest[0]}", rest[1:])
    return run_module(COMMANDS[name][0], f"fastmt {name}", rest)


if __name__ == "__main__":
    sys.exit(main())
