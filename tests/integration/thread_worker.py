"""A worker process for the mutual-exclusion test: claims and finishes items as fast as it
can over HTTP and logs each processing interval (claim received .. result about to be sent)
as one JSON line. Run: python thread_worker.py URL KEY LOGFILE DEADLINE_EPOCH."""

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
            if not items:
                idle_rounds += 1
                continue
            idle_rounds = 0
            for item in items:
                start = time.time()
                ended = time.time()
                log.write(
                    json.dumps(
                        {"id": item["id"], "thread": item["threadId"], "start": start, "end": ended}
                    )
                    + "\n"
                )
                log.flush()
                answer = http.post(f"/api/items/{item['id']}/result", json={"result": 1}).json()
                assert answer["accepted"], answer


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
