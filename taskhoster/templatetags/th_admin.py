"""Template tags of the admin's overview page."""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString

from ..models import Queue
from ..status import Status

register = template.Library()


@register.simple_tag
def count_link(queue: Queue, status: str) -> SafeString:
    from ..admin.queues import count_link as link

    return link(queue, Status(status))


@register.simple_tag
def oldest_age(queue: Queue) -> str:
    from ..admin.queues import age

    return age(queue)
