"""``fastmt stats`` (``python -m train.stats``): what the data pipeline makes of a corpus under a training
config — the cleaning report (every row training drops, by reason, with file:line examples), token
lengths, tokens per epoch, and padding / batches / shapes of every batching mode.

It resolves the same flags as ``fastmt train`` (``--preset``, ``--auto``, ``--config FILE``,
``--data-files``, ``--data.*`` and every other field), so a training command line with ``train`` replaced
by ``stats`` reports exactly the data that run trains on. The library functions are ``data.stats.collect``
and ``data.stats.format_table``.
"""

from __future__ import annotations

import json
import sys

PROG = "python -m train.stats"


def main(argv: list[str] | None = None) -> int:
    from train import cli

    parser = cli.build_parser(prog=PROG if cli.PROG == cli.DEFAULT_PROG else cli.PROG)
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--json", action="store_true", help="print one JSON object (data.stats.collect) instead")
    parser.add_argument("--epoch", type=int, default=0, help="the epoch whose batch plan is measured (default 0)")
    cfg, args = cli.resolve_config(argv, parser=parser, machine=False)
    if args.resume is not None:
        parser.error("--resume is a training flag; stats reads only the data settings")
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, default=str))
        return 0
    from data import build_data
    from data.clean import DataInputError
    from data.sources import HubUnavailableError
    from data.stats import collect, format_table

    log = (lambda *x: print(*x, file=sys.stderr)) if args.json else print
    log(f"{parser.prog}: the data of {f'preset {args.preset!r}' if args.preset else args.config} as training "
        f"reads it (batching {cfg.data.batching}, max_len {cfg.data.max_len}, max_tokens {cfg.data.max_tokens})")
    try:
        bundle = build_data(cfg.data, log=log)
    except (DataInputError, FileNotFoundError, HubUnavailableError) as e:  # bad input: the message, no traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    s = collect(bundle, args.epoch)
    print(json.dumps(s) if args.json else format_table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
