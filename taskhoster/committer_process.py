"""Entry point of a committer process: ``python -m taskhoster.committer_process``.

Started by a server process (the engine's ``ChildCommitter``), never by hand. Django is
set up before the engine is imported.
"""

import django

if __name__ == "__main__":
    django.setup()

    from taskhoster import engine

    engine.run_child()
