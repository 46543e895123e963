from django.http import HttpRequest, HttpResponse

from .models import Product


def product_list(request: HttpRequest) -> HttpResponse:
    """A page of the host's own: its 404s and its pages are none of Taskhoster's business."""
    # _default_manager: mypy reads project.settings, where this app is not installed.
    products = Product._default_manager.order_by("name")
    names = ", ".join(products.values_list("name", flat=True))
    return HttpResponse(f"Products: {names or 'none yet'}", content_type="text/plain")
