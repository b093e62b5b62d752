"""Run the core's liveness and deadline-safety properties (tests/core/test_policy_properties.py) with
many more examples than CI does, and print what was run.

    python benchmarks/properties.py --examples 5000          # both properties, 5000 examples each
    python benchmarks/properties.py --examples 500 --only deadline --json
    python benchmarks/properties.py --examples 2000 --only step_world

Exit status 1 when a property fails (hypothesis prints the shrunk counterexample).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings  # noqa: E402

# imported by name: the test tree is not type-checked with the product (pyproject [tool.mypy] files)
props: Any = importlib.import_module("tests.core.test_policy_properties")
steps: Any = importlib.import_module("tests.simulations.test_step_world_properties")

PROPERTIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "liveness": (props.check_liveness, props.liveness_args),
    "deadline": (props.check_deadline, props.deadline_args),
    # the decision-step world: any availability, steps 1 s-15 min, restarts 0-0.5 h, notices or none, 1-16 nodes
    "step_world": (steps.check_step_world, steps.step_world_args),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="examples per property (default 1000)")
    ap.add_argument("--only", choices=sorted(PROPERTIES), help="run one property")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.examples < 1:
        ap.error(f"--examples must be at least 1, got {args.examples}")
    out: dict[str, Any] = {"examples": args.examples}
    ok = True
    for name, (fn, strategies) in PROPERTIES.items():
        if args.only and name != args.only:
            continue
        runner: Any = settings(max_examples=args.examples, deadline=None, database=None,
                               suppress_health_check=list(HealthCheck))(given(**strategies)(fn))
        t0 = time.perf_counter()
        try:
            runner()
            result = "passed"
        except AssertionError as e:
            notes = "\n".join(getattr(e, "__notes__", []))  # hypothesis: the shrunk counterexample
            ok, result = False, f"FAILED: {e}\n{notes}"
        out[name] = {"result": result, "seconds": round(time.perf_counter() - t0, 2)}
        if not args.json:
            print(f"{name}: {result} ({args.examples} examples, {out[name]['seconds']} s)")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
