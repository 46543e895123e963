"""The PostgreSQL server settings the project asks for at connect time (``project/settings.py``)
are kept when DATABASE_URL brings startup options of its own, unless those set them."""

from __future__ import annotations

import pytest

from ..conftest import python_in_project


def startup_options(url: str) -> str:
    """The ``options`` the project's settings give the connection for DATABASE_URL ``url``."""
    done = python_in_project(
        "-c",
        "from django.conf import settings; "
        "print(settings.DATABASES['default']['OPTIONS']['options'])",
        env={"DATABASE_URL": url},
        without=("TASKHOSTER_TEST_DB",),
        check=True,
    )
    return done.stdout.strip()


BASE = "postgres://u@127.0.0.1:5432/db"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", "-c synchronous_commit=off -c plan_cache_mode=force_custom_plan"),
        (
            "?currentSchema=app",  # made into options="-c search_path=app"
            "-c search_path=app -c synchronous_commit=off -c plan_cache_mode=force_custom_plan",
        ),
        (
            "?options=-c%20plan_cache_mode%3Dauto",
            "-c plan_cache_mode=auto -c synchronous_commit=off",
        ),
        (
            "?options=--synchronous-commit%3Don",
            "--synchronous-commit=on -c plan_cache_mode=force_custom_plan",
        ),
    ],
)
def test_startup_options_from_the_url_keep_the_projects_settings_they_do_not_set(
    query: str, expected: str
) -> None:
    assert startup_options(BASE + query) == expected
