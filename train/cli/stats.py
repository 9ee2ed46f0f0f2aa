"""``fastmt stats`` (``python -m train.stats``): what the data pipeline makes of a corpus under a training
config — the cleaning report (every row training drops, by reason, with file:line examples), token
lengths, tokens per epoch, and padding / batches / shapes of every batching mode.

It resolves the same flags as ``fastmt train`` (``--preset``, ``--auto``, ``--config FILE``,
``--data-files``, ``--data.*`` and every other field), so a training command line with ``train`` replaced
by ``stats`` reports exactly the data that run trains on: with ``--init-from CKPT`` encoded by the checkpoint's
tokenizer; with ``--resume auto`` (or ``--resume PATH``) the data the run continues with (its checkpoint's
tokenizer, and its recorded data source when the command names none). The library functions are
``data.stats.collect`` and ``data.stats.format_table``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROG = "python -m train.stats"


def main(argv: list[str] | None = None) -> int:
    from train.cli import flags as cli

    parser = cli.build_parser(prog=PROG if cli.PROG == cli.DEFAULT_PROG else cli.PROG)
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--json", action="store_true", help="print one JSON object (data.stats.collect) instead")
    parser.add_argument("--epoch", type=int, default=0, action=cli.Once, help="the epoch whose batch plan is measured (default 0)")
    cfg, args = cli.resolve_config(argv, parser=parser, machine=False)
    if args.print_config:
        print(json.dumps(cfg.record(), indent=2, default=str))
        return 0
    from data import build_data
    from data.clean import DataInputError
    from data.sources import HubUnavailableError
    from data.stats import collect, format_table

    log = (lambda *x: print(*x, file=sys.stderr)) if args.json else print
    log(f"{parser.prog}: the data of {f'preset {args.preset!r}' if args.preset else args.config} as training "
        f"reads it (batching {cfg.data.batching}, max_len {cfg.data.max_len}, max_tokens {cfg.data.max_tokens})")
    from train.errors import EXIT_ABORTED, UserError

    try:
        cfg, tokenizer = continued_data(cfg, args, log)
        bundle = build_data(cfg.data, log=log, tokenizer=tokenizer)
    except (DataInputError, FileNotFoundError, HubUnavailableError, UserError) as e:  # the message, no traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during a cold build: its temp entry is already removed, nothing else written
        print(f"{parser.prog}: interrupted (Ctrl-C): stopped at once; an unfinished data build left nothing in the "
              f"cache", file=sys.stderr)
        return EXIT_ABORTED
    s = collect(bundle, args.epoch)
    print(json.dumps(s) if args.json else format_table(s))
    return 0


def continued_data(cfg, args, log):
    """(config, tokenizer or None) of the data the training command would read: a fine-tune's or a resumed
    run's checkpoint gives the tokenizer (train/runs/start.py decides the same for training). Reads only: no
    run folder is locked or written."""
    from train.preflight import tokenizer_of
    from train.runs.checkpoint import latest_loadable_checkpoint, read_checkpoint
    from train.runs.folder import check_usable, read_marker
    from train.runs.start import files_as_recorded, inherit_source, uses_own_tokenizer

    cfg = files_as_recorded(cfg, lambda *_: None)
    if args.init_from is not None and args.resume is None:
        path, how = Path(args.init_from), "init"
        ckpt = read_checkpoint(path, "--init-from")
    elif args.resume is None:
        return cfg, None
    elif args.resume == "auto":
        run = Path(cfg.run.out_dir) / cfg.run.name
        if check_usable(run) != "run":
            log(f"--resume auto: no run {run} yet: a new run reads this data")
            return cfg, None
        marker = read_marker(run)
        path, ckpt = latest_loadable_checkpoint(run / "checkpoints", log,
                                                run_id=marker["run_id"] if marker else None)
        if ckpt is None:
            if args.init_from is None:
                return cfg, None
            path, how, ckpt = Path(args.init_from), "init", read_checkpoint(args.init_from, "--init-from")
        else:
            how = "resume"
    else:
        path, how = Path(args.resume), "resume"
        ckpt = read_checkpoint(path)
    own = uses_own_tokenizer(ckpt, weights_only=how == "init")
    cfg = inherit_source(cfg, ckpt.get("config") or {}, source=how == "resume", tokenizer=own, log=log)
    log(f"tokenizer: that of {path}" if own else f"tokenizer: rebuilt from the data and compared with {path}'s "
        f"(a checkpoint of an earlier fastmt, as training does)")
    return cfg, tokenizer_of(ckpt, path) if own else None


if __name__ == "__main__":
    sys.exit(main())
