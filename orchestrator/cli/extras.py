"""Which optional extra a command needs on this host, said before anything is run.

orchctl stays importable without torch or transformers (the control host installs neither); the commands
that run trainer code here (``orchctl demo``, ``orchctl checkpoint export``) check with
``importlib.util.find_spec`` (nothing is imported) and name the extra to install when a module is absent.
"""

from __future__ import annotations

import importlib.util

TRAINER_MODULES = ("torch",)
HF_MODULES = ("transformers", "tokenizers", "safetensors")
INSTALL = {"trainer": "pip install torch==2.13.0 && pip install -e '.[trainer]'",
           "hf": "pip install torch==2.13.0 && pip install -e '.[trainer,hf]'"}


def absent(modules: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here (not installed, or blocked)."""
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):  # a parent package that fails to import, or a blocked module
            found = False
        if not found:
            out.append(m)
    return out


def missing(what: str, *, hf: bool) -> str | None:
    """None when ``what`` (a command, for the message) can run here; else which extra to install and how."""
    gone = absent(TRAINER_MODULES)
    if gone:
        return f"{what} runs the trainer here: install the [trainer] extra first (missing here: " \
               f"{', '.join(gone)}), e.g.\n  {INSTALL['trainer']}\n"
    gone = absent(HF_MODULES) if hf else []
    if gone:
        return f"{what} needs the Hugging Face integration: install the [hf] extra first (missing here: " \
               f"{', '.join(gone)}), e.g.\n  {INSTALL['hf']}\n"
    return None
