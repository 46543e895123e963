"""Admin users for the admin's tests: a superuser's client, and a staff user's with only some
permissions (both logged in, with CSRF checks on, as a browser is)."""

from __future__ import annotations

from django.contrib.auth.models import Permission, User
from django.test import Client


def staff_client() -> Client:
    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    client = Client(enforce_csrf_checks=True)
    client.login(username="op", password="pw")
    return client


def staff_with(*codenames: str) -> Client:
    """A staff user holding only the permissions ``codenames``."""
    user = User.objects.create_user(
        f"s-{len(codenames)}-{'-'.join(codenames)}"[:150], password="pw", is_staff=True
    )
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client(enforce_csrf_checks=True)
    client.login(username=user.username, password="pw")
    return client
