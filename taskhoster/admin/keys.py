"""API keys: created by ``keys.create_key`` (the secret is shown once, in a message, and only
its SHA-256 is stored), listed, and revoked by setting ``revoked_at``."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from ..errors import InvalidInput
from ..keys import SCOPES, create_key, revoke
from ..models import ApiKey
from ..store import QUEUE_NAME_PATTERN
from .common import time_column


class KeyForm(forms.ModelForm):
    scope_choices = forms.MultipleChoiceField(
        label="scopes",
        choices=[(s, s) for s in SCOPES],
        widget=forms.CheckboxSelectMultiple,
        help_text="produce: post and read items; work: claim and hand back; manage: queues, "
        "deletes and restarts.",
    )
    queue_names = forms.CharField(
        label="queues",
        required=False,
        help_text="Comma-separated queue names this key is limited to; empty = all queues.",
    )

    class Meta:
        model = ApiKey
        fields = ["name"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        names = [q.strip() for q in (data.get("queue_names") or "").split(",") if q.strip()]
        bad = [q for q in names if QUEUE_NAME_PATTERN.fullmatch(q) is None]
        if bad:
            raise forms.ValidationError(f"invalid queue name(s): {', '.join(bad)}")
        data["queue_list"] = names or None
        return data


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "scopes", "queues", "created", "revoked")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("name", "prefix")
    actions = ["revoke_keys"]
    readonly_fields = ("name", "prefix", "scopes", "queues", "created", "revoked")
    created = time_column("created_at")  # to the second, as every Taskhoster admin time
    revoked = time_column("revoked_at")

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kw: Any):  # type: ignore[no-untyped-def]
        if obj is None:
            kw["form"] = KeyForm
        return super().get_form(request, obj, change=change, **kw)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return self.readonly_fields if obj is not None else ()

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:  # type: ignore[override]
        if obj is None:
            return ["name", "scope_choices", "queue_names"]
        return list(self.readonly_fields)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a key is immutable; revoke it and make another

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        data = form.cleaned_data
        try:
            key, secret = create_key(
                name=data["name"], scopes=data["scope_choices"], queues=data["queue_list"]
            )
        except InvalidInput as exc:  # pragma: no cover - the form checks the same things
            raise ValueError(exc.message) from exc
        obj.pk = key.pk
        obj.created_at = key.created_at
        self.message_user(
            request,
            f"Key “{key.name}” created. Its secret is shown this once: {secret}",
            messages.WARNING,
        )

    @admin.action(description="Revoke selected keys", permissions=["revoke"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        n = revoke(queryset.values_list("id", flat=True))
        self.message_user(
            request, f"Revoked {n} key(s); their open sockets are closed.", messages.SUCCESS
        )

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        """Revoking changes a key: Django's change permission for API keys."""
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))
