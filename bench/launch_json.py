"""Shared by the bench drivers: run a command (usually under hddp-run) and return the
JSON objects it printed, one per line (hddp-run's "[rank N] " prefix stripped)."""
import json
import subprocess


def run_json(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank ") else line
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows
