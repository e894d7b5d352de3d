"""docs/serving.md's "three commands", run as written: `make quickstart` (the Makefile's recipe,
with a smaller model appended: later flags override the preset's), the `export` and `serve`
lines, then the `curl` line against that server. What a new user notices: the checkpoint is
where the doc says, the server comes up, and the curl gets a probability per example row."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import time
import urllib.request

from helpers import PYTHON, REPO, env_for_subprocess, explain, free_port, run
from test_quickstart import quickstart_command

SMALL = ["--num_embeddings", "1000", "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8",
         "--over_arch_layer_sizes", "16,1", "--batch_size", "256", "--num_batches_per_epoch", "4",
         "--eval_every", "0", "--eval_rows", "512", "--no-progress", "--no-tensorboard"]  # fmt: skip


def three_commands() -> list[str]:
    """The bash block under "## Serve a model: three commands"."""
    text = (REPO / "docs" / "serving.md").read_text()
    section = text[text.index("## Serve a model: three commands") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def ours(line: str, port: int) -> list[str]:
    """A documented line as argv: `.venv/bin/torchrec-cloud` is this checkout's, port 8080 a free one."""
    words = shlex.split(line.replace("8080", str(port)))
    return [PYTHON, "-m", "torchrec_cloud", *words[1:]] if words[0] == ".venv/bin/torchrec-cloud" else words


def test_make_quickstart_export_serve_and_the_curl_as_documented(tmp_path):
    make, export, serve, curl = three_commands()
    assert make == "make quickstart"
    (tmp_path / "examples").symlink_to(REPO / "examples")
    port = free_port()

    proc = run(quickstart_command("runs/quickstart") + SMALL, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, explain(proc)
    assert (tmp_path / "runs" / "quickstart" / "checkpoints").is_dir(), "make quickstart kept no checkpoint"
    proc = run(ours(export, port), cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, explain(proc)

    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(ours(serve, port), cwd=tmp_path, env=env_for_subprocess(), stdout=subprocess.DEVNULL,
                              stderr=log)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve was not ready in 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        proc = run(ours(curl, port), cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, explain(proc)
        answer = json.loads(proc.stdout)
        rows = json.loads((REPO / "examples" / "serve" / "criteo_rows.json").read_text())["instances"]
        assert len(answer["predictions"]) == len(rows) and all(0 < p < 1 for p in answer["predictions"]), answer
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        log.close()
