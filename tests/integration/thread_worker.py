"""A worker process for the mutual-exclusion test: claims and finishes items as fast as it
can over HTTP and logs each item's interval as one JSON line: from the moment the claim's
answer arrived (its lease was surely held by then) to the moment just before its result is
sent (still surely held), with a little work between. Two members of one thread handed out at
once give two intervals that overlap. Run: python thread_worker.py URL KEY LOGFILE
DEADLINE_EPOCH."""

from __future__ import annotations

import json
import sys
import time

import httpx


def main(url: str, key: str, log_path: str, deadline: float) -> None:
    idle_rounds = 0
    with (
        httpx.Client(base_url=url, headers={"Authorization": f"Token {key}"}, timeout=30) as http,
        open(log_path, "w") as log,
    ):
        while time.time() < deadline and idle_rounds < 20:
            items = http.post("/api/queues/q/claim", json={"max": 3, "wait": 0.2}).json()["items"]
            received = time.time()
            if not items:
                idle_rounds += 1
                continue
            idle_rounds = 0
            for item in items:
                time.sleep(0.002)  # the work: each interval has a width
                ended = time.time()
                log.write(
                    json.dumps(
                        {
                            "id": item["id"],
                            "thread": item["threadId"],
                            "start": received,
                            "end": ended,
                        }
                    )
                    + "\n"
                )
                log.flush()
                answer = http.post(f"/api/items/{item['id']}/result", json={"result": 1}).json()
                assert answer["accepted"], answer


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
