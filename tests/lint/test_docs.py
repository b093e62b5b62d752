"""docs/wire.md is generated from the code (docs/gen_wire.py): it must be what the generator writes now."""

from __future__ import annotations

import difflib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "gen_wire.py"
WIRE_MD = ROOT / "docs" / "wire.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen_wire", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wire_md_is_generated_from_the_code() -> None:
    gen = _generator()
    want = gen.render()
    have = WIRE_MD.read_text()
    if have != want:
        diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/wire.md (committed)",
                                            "docs/wire.md (generated)", n=1))
        raise AssertionError(f"docs/wire.md is out of date with the code; from the repo root run\n\n"
                             f"    {gen.COMMAND}\n\n{diff[:6000]}")


def test_the_generator_command_writes_the_page() -> None:
    """The documented command works as written (a script run from the repo root, not an import)."""
    gen = _generator()
    script, redirect, target = gen.COMMAND.split()[1:]
    assert (script, redirect, target) == ("docs/gen_wire.py", ">", "docs/wire.md")
    out = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == gen.render()


def test_the_page_covers_every_record_subject_stream_and_endpoint() -> None:
    import msgspec

    import wire
    from orchestrator import bus

    text = _generator().render()
    for name in dir(wire):
        obj = getattr(wire, name)
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
            assert f"#### {name}" in text, name
    for stream in (bus.STREAM_EVENTS, bus.STREAM_MARKET, bus.STREAM_AUDIT, bus.CONSUMER_EVENTS, bus.CONSUMER_MARKET,
                   bus.KV_STATE, bus.KV_OUTBOX):
        assert f"`{stream}`" in text, stream
    for resource, verb in wire.ADMIN_ENDPOINTS:
        assert f"`{wire.admin_subject(resource, verb)}`" in text
    assert "`orch.node.<node>.hb`" in text and "`orch.price.<cloud>.<region>`" in text
