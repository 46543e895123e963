"""The front page at ``/`` (project/views.py): where ``scripts/serve`` points and the admin's
"View site" leads. It names the server and links what it serves, every link answering."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from django.contrib.auth.models import User
from django.test import Client

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def hrefs(html: str) -> list[str]:
    parser = Links()
    parser.feed(html)
    return parser.hrefs


@pytest.mark.django_db
def test_root_answers_json_naming_the_server_and_linking_its_parts(client: Client) -> None:
    for accept in ("*/*", "application/json"):
        answer = client.get("/", HTTP_ACCEPT=accept)
        assert answer.status_code == 200
        assert answer["Content-Type"] == "application/json"
        body = answer.json()
        assert body["name"] == "Taskhoster"
        assert body["links"] == {
            "admin": "http://testserver/admin/",
            "apiSchema": "http://testserver/api/schema",
            "asyncApi": "http://testserver/api/asyncapi",
            "health": "http://testserver/healthz",
            "metrics": "http://testserver/metrics",
            "socket": "ws://testserver/work",
        }
        assert "docs/" in body["docs"]


@pytest.mark.slow
def test_every_link_of_the_root_answers_on_a_real_server(server_factory: Any, make_key) -> None:
    server = server_factory()
    links = httpx.get(f"{server.url}/", timeout=10).json()["links"]
    assert links["socket"] == f"ws://127.0.0.1:{server.port}/work"
    key = {"Authorization": f"Token {make_key()}"}
    for name, url in links.items():
        if name == "socket":
            continue
        assert url.startswith(f"{server.url}/")
        # The admin sends a visitor who is not logged in to its login page; /metrics needs a
        # key (any scope).
        answer = httpx.get(url, timeout=10, follow_redirects=True)
        if name == "metrics":
            assert answer.status_code == 401
            answer = httpx.get(url, timeout=10, headers=key)
        assert answer.status_code == 200, (name, answer.status_code)
        if name == "admin":
            assert urlsplit(str(answer.url)).path == "/admin/login/"


@pytest.mark.django_db
def test_a_browser_gets_an_html_page_with_the_same_links(client: Client) -> None:
    answer = client.get("/", HTTP_ACCEPT=BROWSER_ACCEPT)
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("text/html")
    page = answer.content.decode()
    assert "<h1>Taskhoster" in page
    json_links = client.get("/").json()["links"]
    assert set(hrefs(page)) == {url for name, url in json_links.items() if name != "socket"}
    assert "ws://testserver/work" in page


@pytest.mark.django_db
def test_head_answers_and_other_methods_get_a_json_405(client: Client) -> None:
    assert client.head("/").status_code == 200
    answer = client.post("/", data="{}", content_type="application/json")
    assert answer.status_code == 405
    assert answer["Allow"] == "GET, HEAD"
    assert answer.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.django_db
def test_the_admins_view_site_link_leads_to_the_front_page(client: Client) -> None:
    User.objects.create_user("op", password="pw", is_staff=True)
    client.login(username="op", password="pw")
    index = client.get("/admin/").content.decode()
    match = re.search(r'<a href="([^"]+)">View site</a>', index)
    assert match, "the admin shows a View site link"
    answer = client.get(match.group(1), HTTP_ACCEPT=BROWSER_ACCEPT)
    assert answer.status_code == 200
    assert "<h1>Taskhoster" in answer.content.decode()
