"""The user data a provider renders must start an agent that accepts it: flags, env file, env keys."""

import re
import shlex

from agent.config import load_config
from providers.base import NodeBootstrap
from providers.bootstrap import render_user_data


def test_rendered_bootstrap_starts_an_agent_that_parses_its_config() -> None:
    boot = NodeBootstrap(nats_urls=("nats://10.0.0.1:4222", "nats://10.0.0.2:4222"), agent_args=("--warm-ranks", "1"),
                         node_credentials={"job1-n1": "one-time-token"})
    script = render_user_data("job1-n1", boot, cloud="aws")
    env_block = re.search(r"cat > (\S+) <<'ORCH_ENV_EOF'\n(.*?)\nORCH_ENV_EOF", script, re.S)
    assert env_block is not None
    env_file, body = env_block.groups()
    assert f"EnvironmentFile={env_file}" in script or f"EnvironmentFile=-{env_file}" in script
    env = {k: shlex.split(v)[0] for k, v in (line.split("=", 1) for line in body.splitlines())}
    exec_line = re.search(r"^ExecStart=(.*)$", script, re.M)
    assert exec_line is not None
    argv = shlex.split(exec_line.group(1))[1:]
    config = load_config(argv, env=env)
    assert config.node_id == "job1-n1"
    assert config.nats_urls == ("nats://10.0.0.1:4222", "nats://10.0.0.2:4222")
    assert config.metadata == "aws"
    assert config.work_dir == "/var/lib/orch-agent"
