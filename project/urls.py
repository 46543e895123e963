from django.contrib import admin
from django.urls import include, path

from . import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", views.root),  # the front page: what the server is and where its parts are
    path("", include("taskhoster.urls")),
]

handler400 = "taskhoster.api.errors.json_400"
handler403 = "taskhoster.api.errors.json_403"
handler404 = "taskhoster.api.errors.json_404"
handler500 = "taskhoster.api.errors.json_500"
