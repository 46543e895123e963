"""Entry point of a committer process: ``python -m taskhoster.committer_process``.

Started by a server process (``engine.process.ChildCommitter``), never by hand. Django is
set up before the engine is imported.
"""

import django

if __name__ == "__main__":
    django.setup()

    from taskhoster.engine.process import run_child

    run_child()
