"""Our server's URLs: the admin and Taskhoster at the root, and JSON for every error."""

from django.contrib import admin
from django.urls import include, path

from . import views

# The admin is Taskhoster's own here (the index page's override is templates/admin/index.html).
admin.site.site_header = "Taskhoster"
admin.site.site_title = "Taskhoster admin"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", views.root),  # the front page: what the server is and where its parts are
    path("", include("taskhoster.urls")),
]

handler400 = "taskhoster.api.errors.json_400"
handler403 = "taskhoster.api.errors.json_403"
handler404 = "taskhoster.api.errors.json_404"
handler500 = "taskhoster.api.errors.json_500"
