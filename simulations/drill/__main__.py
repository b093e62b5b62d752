"""``python -m simulations.drill [--json] [--full | --scale F]``: the production drill (see __init__.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from simulations.drill import rules
from simulations.drill.run import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.drill", description=__doc__)
    p.add_argument("--json", action="store_true", help="print the figures as JSON (default: a summary)")
    p.add_argument("--full", action="store_true", help="the rules as shipped (scale 1, 15 s scrapes): hours")
    p.add_argument("--scale", type=float, default=None,
                   help="multiply every for: and range window of the rules by this (default: derived from the "
                        "rules file: the shortest range window holds 4 scrapes)")
    p.add_argument("--scrape-s", type=float, default=None, help="scrape and evaluation interval (default 1, --full 15)")
    p.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs of every service)")
    p.add_argument("--insecure", action="store_true",
                   help="an open NATS cluster: no TLS, no auth callout, no credentials (default: all of them)")
    args = p.parse_args(argv)
    scrape_s = args.scrape_s or (15.0 if args.full else 1.0)
    scale = 1.0 if args.full else args.scale if args.scale is not None else rules.auto_scale(scrape_s)
    if not 0 < scale <= 1:
        p.error(f"--scale must be within (0, 1], got {scale}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)  # run() closes every service on its way out

    for sig in (signal.SIGTERM, signal.SIGINT):  # also where a shell started it with SIGINT ignored
        signal.signal(sig, stop)

    out = run(scale, scrape_s, only=args.only, keep=args.keep, secure=not args.insecure, log=log)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        a, pn, m = out["alerts"], out["panels"], out["metrics"]
        print(f"alerts fired {a['fired']}/{a['expected']}, panels with data {pn['with_data']}/{pn['total']}, "
              f"metrics set {m['set']}/{m['declared']} (scale {scale:g}, {out['wall_s']} s)")
        if out["error"]:
            print(f"error: {out['error']}")
    ok = (out["alerts"]["fired"] == out["alerts"]["expected"] and out["panels"]["with_data"] == out["panels"]["total"]
          and out["metrics"]["set"] == out["metrics"]["declared"] and not out["error"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
