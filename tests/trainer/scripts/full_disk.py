"""``python -m trainer`` on a disk that is full for checkpoint data: every ``.distcp`` file DCP opens for
writing raises OSError(ENOSPC) (the extra-state and manifest files still fit). Used by the tests of
storage errors during a save; the trainer itself is unchanged."""

from __future__ import annotations

from trainer.signals import install_early

install_early()

import errno  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

from trainer import store  # noqa: E402

_real = store._HashingFS.create_stream


def _full(self: Any, path: Any, mode: str) -> Any:
    if "w" in mode and str(path).endswith(".distcp"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real(self, path, mode)


store._HashingFS.create_stream = _full  # type: ignore[method-assign]

if __name__ == "__main__":
    from trainer.gpt import main

    main()
