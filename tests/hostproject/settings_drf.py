"""The host project, once it uses DRF and drf-spectacular for views of its own: its own
``REST_FRAMEWORK`` defaults (sessions, staff only, forms, the browsable API, throttling,
versioning, pretty ASCII JSON) and ``SPECTACULAR_SETTINGS``. Taskhoster's views must answer
exactly as without them (``tests/integration/test_embedding.py``)."""

from .settings import *  # noqa: F403

ROOT_URLCONF = "tests.hostproject.urls_drf"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.FormParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.BrowsableAPIRenderer"],
    "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.AnonRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"anon": "1/day"},
    "DEFAULT_VERSIONING_CLASS": "rest_framework.versioning.QueryParameterVersioning",
    "ALLOWED_VERSIONS": ["2"],
    "DEFAULT_VERSION": "2",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "UNICODE_JSON": False,
    "COMPACT_JSON": False,
    "URL_FORMAT_OVERRIDE": "fmt",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Shop API",
    "POSTPROCESSING_HOOKS": [],
    "COMPONENT_SPLIT_REQUEST": False,
}
