#!/usr/bin/env python3
"""The docs show what the tools print: every fenced block in docs/*.md that starts with
`$ hddp-probe ...` (a command that needs no GPU) is run with the built tool, and each
line the block shows after the command must be a line of the real output (a block may
leave lines out, never change one). Numbers may differ by up to 10%: the model's
activation memory is measured from the CPU allocator, whose use differs a little
between CPUs with and without native bf16. Usage: doc_outputs.py SOURCE_DIR TOOLS_DIR."""
import os
import re
import shlex
import subprocess
import sys
import tempfile


def blocks(text):
    for match in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = match.group(1).rstrip("\n").split("\n")
        if lines and lines[0].startswith("$ hddp-probe "):
            yield lines[0][2:], lines[1:]


def normalise(line):
    return " ".join(line.split())


NUMBER = re.compile(r"^-?\d+(\.\d+)?%?\)?,?$")


def same(shown, printed, tolerance=0.10):
    """The same words, and numbers within `tolerance` of each other."""
    a, b = shown.split(), printed.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if not (NUMBER.match(x) and NUMBER.match(y)):
            return False
        u, v = float(x.strip("%),")), float(y.strip("%),"))
        if abs(u - v) > tolerance * max(abs(u), abs(v)):
            return False
    return True


def main():
    source, tools = sys.argv[1], sys.argv[2]
    probe = os.path.join(tools, "hddp-probe", "hddp-probe")
    failures = 0
    checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(os.listdir(os.path.join(source, "docs"))):
            if not name.endswith(".md"):
                continue
            with open(os.path.join(source, "docs", name)) as f:
                text = f.read()
            for command, shown in blocks(text):
                args = shlex.split(command)[1:]
                # Files the command writes go to a temporary folder.
                for i, a in enumerate(args):
                    if i > 0 and args[i - 1] in ("--svg", "--save-profile"):
                        args[i] = os.path.join(tmp, os.path.basename(a))
                if "--calibrate" in args or "--profile" in args or "--model-file" in args:
                    continue  # needs a card or a file of the user's
                env = dict(os.environ, HDDP_LOG_LEVEL="warn")
                run = subprocess.run([probe] + args, capture_output=True, text=True,
                                     cwd=source, env=env, timeout=600)
                out = [normalise(l) for l in (run.stdout + run.stderr).split("\n")]
                checked += 1
                for line in shown:
                    if line.strip() and not any(same(normalise(line), o) for o in out):
                        failures += 1
                        print(f"docs/{name}: `{command}` no longer prints:\n  {line}")
                if run.returncode != 0:
                    failures += 1
                    print(f"docs/{name}: `{command}` exited {run.returncode}:\n{run.stderr}")
    print(f"{checked} documented hddp-probe command(s) checked, {failures} difference(s)")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
