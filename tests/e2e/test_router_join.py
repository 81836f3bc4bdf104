"""`baton router`: one more router process joining a running deployment from outside it (what
the Helm chart's router Deployment runs), found by the workers' actor names.

A deployment with its router in this process (testkit.cluster.serving, private Ray), then
`baton router --config ... --address <its GCS>` on another port: it must answer exactly what the
deployment's own router answers (greedy), name itself in x-baton-router, hold a lease on both
workers, and once SIGKILLed lose that lease (its requests ended) while the first router serves on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from testkit.cluster import serving
from testkit.harness import free_port, healthy, wait_until

pytestmark = pytest.mark.slow
BODY = {
    "messages": [{"role": "user", "content": "Describe the moon in one sentence."}],
    "max_tokens": 24,
    "temperature": 0,
}


def leases(url: str) -> dict[str, dict]:
    status = httpx.get(url + "/v1/status", timeout=30).json()
    return {lease["router_id"]: lease for lease in status["routers"]["leases"]}


def test_a_joining_router_serves_the_same_workers_and_its_death_frees_them(tmp_path, deployment_ray):
    import ray

    from cluster.config import BatonConfig

    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="96MiB", router_lease=3)
    with serving(config) as running:  # prefix "baton": what `baton router` looks for
        own = running.base_url
        joined_config = config.to_dict()
        joined_config["server"]["port"] = port = free_port()
        config_file = Path(tmp_path) / "config.yaml"
        config_file.write_text(yaml.safe_dump(joined_config))
        command = [
            str(Path(sys.executable).with_name("baton")),
            "router",
            "--config",
            str(config_file),
            "--address",
            ray.get_runtime_context().gcs_address,
            "--routers",
            "2",
            "--router-id",
            "router-pod-a",
        ]
        log = (Path(tmp_path) / "router.log").open("w")
        joined = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: healthy(url) or joined.poll() is not None, 120, "baton router to serve")
            assert joined.poll() is None, (Path(tmp_path) / "router.log").read_text()[-3000:]
            mine = httpx.post(own + "/v1/chat/completions", json=BODY, timeout=120)
            theirs = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=120)
            assert mine.headers["x-baton-router"] == "router-0"
            assert theirs.headers["x-baton-router"] == "router-pod-a"
            assert theirs.json()["choices"][0]["message"] == mine.json()["choices"][0]["message"]
            # Its share of the admission limits: half of what one router admits (2 routers).
            admission = httpx.get(url + "/v1/status", timeout=30).json()["admission"]
            assert admission["decode"]["capacity"] == config.engine.max_num_seqs // 2
            # It holds a lease on both workers (the workers' heartbeats say so).
            wait_until(
                lambda: len(leases(own).get("router-pod-a", {}).get("workers", [])) == 2,
                30,
                "the joined router's lease on both workers",
            )
            os.kill(joined.pid, signal.SIGKILL)
            joined.wait(10)
            wait_until(lambda: "router-pod-a" not in leases(own), 15, "the dead router's lease to end")
            again = httpx.post(own + "/v1/chat/completions", json=BODY, timeout=120)
            assert again.json()["choices"][0]["message"] == mine.json()["choices"][0]["message"]
        finally:
            if joined.poll() is None:
                joined.kill()
                joined.wait()
            log.close()
