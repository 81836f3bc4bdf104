"""The `ray up` cluster files (cluster/ray-up/*.yaml) pass Ray's own validation, and the command
their head node runs is one `baton serve` accepts, with a Baton config file Baton accepts.

Oracles: Ray's `prepare_config` + `validate_config` (the checks `ray up` runs before it touches
a cloud), Baton's real argument parser, and BatonConfig.load.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.cli import _load, _parser
from cluster.config import BatonConfig
from common.lora import LoRAModuleSpec

ROOT = Path(__file__).resolve().parents[2]
RAY_UP = ROOT / "cluster" / "ray-up"
CLUSTER_FILES = ["aws.yaml", "aws-lora.yaml", "gcp.yaml", "local.yaml"]
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


@pytest.mark.parametrize("name", ["aws.yaml", "aws-lora.yaml", "gcp.yaml"])
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


# -- LoRA adapters (aws-lora.yaml): aws.yaml plus the adapters' folder on every node and vLLM's flags

LORA_MOUNT = "~/lora-adapters"
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules"]


def test_the_lora_file_is_the_aws_file_plus_adapters():
    """Everything but the adapters' file mount and the serve command's LoRA flags is aws.yaml's,
    so the two files cannot drift apart."""
    aws, lora = load("aws.yaml"), load("aws-lora.yaml")
    assert lora["file_mounts"].pop(LORA_MOUNT) == LORA_MOUNT  # remote: local, both home folders
    serve = [i for i, c in enumerate(lora["head_start_ray_commands"]) if "baton serve" in c]
    assert serve == [i for i, c in enumerate(aws["head_start_ray_commands"]) if "baton serve" in c]
    base, extra = baton_serve_args(aws), baton_serve_args(lora)
    assert extra[: len(base)] == base
    assert extra[len(base) : len(base) + len(LORA_FLAGS)] == LORA_FLAGS
    assert [w.split("=")[0] for w in extra[len(base) + len(LORA_FLAGS) :]] == ["sql", "chat"]
    for config in (aws, lora):
        del config["head_start_ray_commands"][serve[0]]
    assert lora == aws


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_lora_serve_command_loads_adapters_from_the_file_mount(tmp_path):
    """Run the head's serve command in bash (as the node's ssh user, with a stand-in `baton`):
    its adapters are absolute paths inside the folder that file_mounts copies to every node, and
    `baton serve` reads them as its --lora-modules."""
    config = load("aws-lora.yaml")
    [command] = [c for c in config["head_start_ray_commands"] if "baton serve" in c]
    home = tmp_path / "home" / config["auth"]["ssh_user"]
    home.mkdir(parents=True)
    (home / "baton").symlink_to(ROOT)  # file_mounts "~/baton": "."
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "baton"
    stub.write_text(f'#!/bin/bash\nfor a in "$@"; do echo "$a"; done > {tmp_path}/baton.args\n')
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}
    result = subprocess.run(["bash", "-c", command + "\nwait"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "baton.args").read_text().split("\n")[:-1]
    engine = _load(_parser().parse_args(argv)).engine
    mount = Path(LORA_MOUNT.replace("~", str(home), 1))
    assert LORA_MOUNT in config["file_mounts"]
    assert engine.lora_enabled and engine.lora_specs == (
        LoRAModuleSpec("sql", str(mount / "sql-lora")),
        LoRAModuleSpec("chat", str(mount / "chat-lora")),
    )
    assert (engine.max_loras, engine.max_lora_rank) == (2, 16)
    assert (home / "baton-serve.log").exists()  # the redirect still applies to the whole command
