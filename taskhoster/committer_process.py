"""Entry point of a committer process: ``python -m taskhoster.committer_process``.

Started by a server process (the engine's ``ChildCommitter``), never by hand. Django is
set up before the engine is imported.
"""

import django
from django.conf import settings

#: What only a process that serves pages or runs commands needs: daphne's ``runserver``, and
#: the admin's discovery of every app's ``admin`` module (the admin itself, its models, stay).
_SERVING_ONLY = {
    "daphne": None,
    "daphne.apps.DaphneConfig": None,
    "django.contrib.admin": "django.contrib.admin.apps.SimpleAdminConfig",
    "django.contrib.admin.apps.AdminConfig": "django.contrib.admin.apps.SimpleAdminConfig",
}


def leave_out_serving_apps() -> None:
    """A committer process serves nothing and runs no command: it sets Django up without
    what only serving needs, which is about a third of its start (the server waits for it
    to be ready). Every model is loaded as in the server."""
    apps: list[str] = []
    for app in settings.INSTALLED_APPS:
        kept = _SERVING_ONLY.get(app, app)
        if kept is not None:
            apps.append(kept)
    settings.INSTALLED_APPS = apps


if __name__ == "__main__":
    leave_out_serving_apps()
    django.setup()

    from taskhoster import engine

    engine.run_child()
