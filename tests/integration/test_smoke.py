import pytest


@pytest.mark.django_db
def test_post_claim_result_read_round_trip(api, make_queue):
    assert api.put("/api/queues/q", {}, format="json").status_code == 201
    posted = api.post("/api/queues/q/items", {"payload": {"n": 1}}, format="json")
    assert posted.status_code == 201, posted.content
    item = posted.json()
    claimed = api.post("/api/queues/q/claim", {}, format="json").json()["items"]
    assert [c["id"] for c in claimed] == [item["id"]]
    assert claimed[0]["payload"] == {"n": 1}
    done = api.post(f"/api/items/{item['id']}/result", {"result": [1, 2]}, format="json").json()
    assert done == {"accepted": True, "status": "finished"}
    read = api.get(f"/api/items/{item['id']}").json()
    assert read["status"] == "finished"
    assert read["result"] == [1, 2]
