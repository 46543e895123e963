"""The host project's URLs: its own admin and shop, and Taskhoster under ``tasks/``."""

from django.contrib import admin
from django.urls import include, path

from .shop.views import product_list

urlpatterns = [
    path("admin/", admin.site.urls),
    path("shop/", product_list),
    path("tasks/", include("taskhoster.urls")),
]
