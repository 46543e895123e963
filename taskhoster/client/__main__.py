"""``python -m taskhoster.client``: the ``taskhoster`` command."""

from .cli import main

raise SystemExit(main())
