"""``python -m syncbn``: see :mod:`syncbn.cli`."""

from .cli import main

raise SystemExit(main())
