"""Settings of the host project: a plain Django project, plus what Taskhoster needs.

It follows ``DATABASE_URL`` (SQLite by default) and ``REDIS_URL`` (unset: news between
processes by a doorbell) like Taskhoster's own server, so the tests run it both ways. It sets
no ``CHANNEL_LAYERS``: Taskhoster needs none.
"""

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "hostproject-only-for-tests")
DEBUG = False
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "tests.hostproject.shop",
    # Taskhoster, and the two frameworks it is built on.
    "rest_framework",
    "channels",
    "taskhoster",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tests.hostproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "tests.hostproject.asgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # SQLite beside Taskhoster's committer: writers queue in order within a process, every
    # write transaction takes the lock at BEGIN, and readers run beside the writer.
    DATABASES["default"]["ENGINE"] = "taskhoster.db.sqlite"
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
# The host wraps each of its requests in a transaction; Taskhoster's views stay out of it.
DATABASES["default"]["ATOMIC_REQUESTS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

TASKHOSTER = {
    "ROOT": os.environ.get("TASKHOSTER_ROOT") or str(BASE_DIR / "taskhoster-state"),
    "REDIS_URL": os.environ.get("REDIS_URL", ""),
    "COMMITTER": "process",
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
