"""The `ray up` cluster files (cluster/ray-up/*.yaml) pass Ray's own validation, and the command
their head node runs is one `baton serve` accepts, with a Baton config file Baton accepts.

Oracles: Ray's `prepare_config` + `validate_config` (the checks `ray up` runs before it touches
a cloud), Baton's real argument parser, and BatonConfig.load.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.cli import _parser
from cluster.config import BatonConfig

ROOT = Path(__file__).resolve().parents[2]
RAY_UP = ROOT / "cluster" / "ray-up"
CLUSTER_FILES = ["aws.yaml", "gcp.yaml", "local.yaml"]
SHELL_OPERATORS = {">", ">>", "2>&1", "&", ";", "&&", "||", "|"}


def load(name: str) -> dict:
    return yaml.safe_load((RAY_UP / name).read_text())


def baton_serve_args(config: dict) -> list[str]:
    """The arguments of the one `baton serve` command among the head's start commands."""
    found = []
    for command in config["head_start_ray_commands"]:
        words = shlex.split(command)
        for i, word in enumerate(words):
            if word == "baton" and words[i + 1 : i + 2] == ["serve"]:
                end = next(
                    (
                        j
                        for j in range(i + 2, len(words))
                        if words[j] in SHELL_OPERATORS or words[j].startswith((">", "2>"))
                    ),
                    len(words),
                )
                found.append(words[i + 1 : end])
    assert len(found) == 1, f"expected one `baton serve` in head_start_ray_commands, found {found}"
    return found[0]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_passes_rays_validation(name):
    config = load(name)
    prepared = prepare_config(config)
    validate_config(prepared)
    # Ray starts on the head before Baton joins it.
    commands = prepared["head_start_ray_commands"]
    ray_start = next(i for i, c in enumerate(commands) if "ray start --head" in c)
    baton = next(i for i, c in enumerate(commands) if "baton serve" in c)
    assert ray_start < baton


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_files_have_a_cpu_head_and_gpu_pools_with_the_baton_resources(name):
    config = load(name)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert not any(k.startswith("baton_") for k in head["resources"])
    pools = {k: t for k, t in types.items() if t is not head}
    offered = {r: t for t in pools.values() for r in t["resources"] if r.startswith("baton_")}
    assert set(offered) == {"baton_prefill", "baton_decode"}
    for node_type in pools.values():
        res = node_type["resources"]
        [pool] = [r for r in res if r.startswith("baton_")]
        # One worker per GPU (gpus_per_worker: 1 in baton.yaml), and the pools exist from the start.
        assert res["GPU"] >= 1 and res[pool] == res["GPU"] and node_type["min_workers"] >= 1


def test_local_file_gives_each_machine_its_pool():
    config = load("local.yaml")
    start = " ".join(config["worker_start_ray_commands"])
    assert "baton_$POOL" in start and "POOL=prefill" in start and "POOL=decode" in start
    assert "--num-gpus=0" in " ".join(config["head_start_ray_commands"])


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_head_command_is_one_baton_serve_accepts(name):
    config = load(name)
    args = baton_serve_args(config)
    parsed = _parser().parse_args(args)  # exits (SystemExit) on a flag baton serve does not have
    assert parsed.command == "serve"
    assert parsed.address == "auto" and parsed.host == "0.0.0.0"
    # The config file it names is one that file_mounts copies there, and Baton reads it.
    [(remote, local)] = [(r, loc) for r, loc in config["file_mounts"].items() if parsed.config.startswith(r + "/")]
    assert local == "."  # ray up runs from the repository root
    baton = BatonConfig.load(ROOT / parsed.config[len(remote) + 1 :], {"address": parsed.address, "host": parsed.host})
    assert baton.placement.address == "auto" and baton.server.host == "0.0.0.0"
    assert (baton.placement.prefill_resource, baton.placement.decode_resource) == ("baton_prefill", "baton_decode")
    assert baton.placement.placement_timeout_s >= 600  # cloud nodes take minutes to come up


def test_a_flag_baton_serve_lacks_would_be_caught():
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--adress", "auto"])
