"""The host project's URLs, with a DRF view of its own."""

from django.urls import path

from .shop.api import ProductApi
from .urls import urlpatterns as host_urlpatterns

urlpatterns = [path("shop/api/products", ProductApi.as_view()), *host_urlpatterns]
