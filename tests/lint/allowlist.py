"""An import-linter contract type the built-in ones lack: an allowlist.

``type = "allowlist"``: every module under ``source_modules`` may import only modules inside its own
package, and modules matching ``allowed_modules`` (each one a module name: it and its submodules are
allowed). Anything else - a new third-party package, the shell, the clock - breaks the contract, so a
new dependency of the pure core is a decision made in pyproject.toml, not an accident.
Registered in ``[tool.importlinter] contract_types``; run by ``lint-imports`` (tests/lint/test_lint.py).
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class AllowlistContract(Contract):
    type_name = "allowlist"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = [str(m) for m in self.source_modules]  # type: ignore[attr-defined]  # fields are set by Contract
        allowed = [str(m) for m in self.allowed_modules]  # type: ignore[attr-defined]
        broken: list[tuple[str, str, list[int]]] = []
        for src_pkg in sources:
            modules = {src_pkg} | graph.find_descendants(src_pkg)
            for importer in sorted(modules):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    if _inside(imported, [src_pkg, *allowed]):
                        continue
                    details = graph.get_import_details(importer=importer, imported=imported)
                    broken.append((importer, imported, [d["line_number"] for d in details]))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, lines in check.metadata["broken"]:
            where = ", ".join(f"l.{n}" for n in lines)
            output.print_error(f"{importer} imports {imported} ({where}): not in the allowlist")
            output.new_line()


def _inside(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)
