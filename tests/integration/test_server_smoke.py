import httpx
import pytest


@pytest.mark.slow
def test_daphne_serves_post_claim_result(server_factory, make_key):
    server = server_factory()
    headers = {"Authorization": f"Token {make_key()}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
        assert http.put("/api/queues/q", json={}).status_code == 201
        item = http.post("/api/queues/q/items", json={"payload": 1}).json()
        claimed = http.post("/api/queues/q/claim", json={"max": 5}).json()["items"]
        assert [c["id"] for c in claimed] == [item["id"]]
        verdict = http.post(f"/api/items/{item['id']}/result", json={"result": 2}).json()
        assert verdict == {"accepted": True, "status": "finished"}
        assert http.get(f"/api/items/{item['id']}").json()["result"] == 2
