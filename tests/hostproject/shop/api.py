from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from .models import Product


class ProductApi(APIView):
    """A DRF view of the host's own: it takes the host's REST_FRAMEWORK defaults."""

    def get(self, request: Request) -> Response:
        return Response(list(Product._default_manager.values_list("name", flat=True)))
