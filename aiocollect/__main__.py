"""``python -m aiocollect info`` and ``python -m aiocollect bench --env ENV_ID ...``: see
:mod:`aiocollect._cli.commands` (``python -m aiocollect --help``)."""

from __future__ import annotations

# (guarded: multiprocessing's "spawn" imports this module again, as __mp_main__, in the
# benchmark's processes)
if __name__ == "__main__":
    import sys

    from ._cli.commands import main

    sys.exit(main())
