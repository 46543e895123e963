"""An ASGI module that fails at import (``tests/unit/test_checks.py``, taskhoster.E013)."""

raise RuntimeError("this module fails at import")
