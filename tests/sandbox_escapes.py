"""Standalone escape check for the code sandbox, run by tests/rewards/test_sandbox.py at several
privilege levels (root, an unprivileged uid, root without capabilities).

    python sandbox_escapes.py <dir holding the peergrade package>

It must be started with ``PEERGRADE_ESCAPE_SECRET`` in its environment and ``$HOME`` pointing
at a directory it may write. It asks the sandbox to pass its self-test (``require_sandbox``),
then runs every hostile program below through ``run_program`` (mechanism ``auto``, as the code
reward does) and checks from outside what each one managed: files written outside, secrets in
its output, a connection to our listener, a neighbour killed, a process left running. It
prints one JSON object: the mechanism (or the refusal message), and per program its status,
reason and ``escaped`` (a list of what it got away with; must be empty).
``PEERGRADE_ESCAPE_MECHANISM=none`` runs the harmless ones unsandboxed: the control that shows
the checks catch escapes.

It does not assert anything itself: the test reads the report.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, sys.argv[1])

from peergrade.rewards import sandbox  # noqa: E402

LIMITS = sandbox.SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=8)
# Unsandboxed as root a fork bomb is not capped (root ignores RLIMIT_NPROC) and a setsid child
# outlives the group kill: the control run leaves those out.
CONTROL_SAFE = (
    "write_outside",
    "read_home_and_parent_env",
    "network",
    "see_other_processes",
    "kill_others",
    "kill_launcher",
    "forge_report",
)


def cmdlines() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    out[int(name)] = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                pass
    return out


def main() -> None:
    secret = os.environ["PEERGRADE_ESCAPE_SECRET"]
    home = os.environ["HOME"]
    token = secrets.token_hex(8)
    home_secret = os.path.join(home, "secret.txt")
    with open(home_secret, "w") as f:
        f.write(f"home-secret-{token}")
    os.chmod(home_secret, 0o600)
    marker = f"pgsleep{token}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(120)", marker])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.05)
    port = listener.getsockname()[1]
    targets = [
        os.path.join(d, f"pg-escape-{token}")
        for d in (home, tempfile.gettempdir(), "/dev/shm", "/var/tmp", os.getcwd())
    ]
    with open("/proc/self/status") as f:
        cap_eff = next(ln.split()[1] for ln in f if ln.startswith("CapEff:"))
    report: dict = {"uid": os.geteuid(), "cap_eff": cap_eff, "programs": []}
    mechanism = os.environ.get("PEERGRADE_ESCAPE_MECHANISM", "auto")  # "none": a control run
    try:
        report["mechanism"] = sandbox.require_sandbox(mechanism)
        report["refused"] = None
    except sandbox.SandboxUnavailable as exc:
        report["mechanism"] = None
        report["refused"] = str(exc)

    if mechanism == "none":
        targets_to_kill = f"({sleeper.pid},)"
    else:
        targets_to_kill = f"(-1, {sleeper.pid}, {os.getpid()}, os.getppid(), 1)"
    hostile = {
        "write_outside": f"""
            for p in {targets!r}:
                try:
                    open(p, "w").write("escaped")
                except OSError as e:
                    print(e)
        """,
        "read_home_and_parent_env": f"""
            import os
            print(dict(os.environ))
            for p in ({home_secret!r}, "/proc/1/environ", "/proc/%d/environ" % os.getppid()):
                try:
                    print(open(p, "rb").read())
                except OSError as e:
                    print(e)
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        print(open("/proc/%s/environ" % pid, "rb").read())
                    except OSError:
                        pass
        """,
        "network": f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            s.sendall(b"escaped")
            print("CONNECTED")
        """,
        "see_other_processes": f"""
            import os
            needle = "pgsleep" + {token!r}
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        if needle in open("/proc/%s/cmdline" % pid).read():
                            print("SAW", pid)
                    except OSError:
                        pass
        """,
        # The control run (no sandbox) only aims at the sleeper: kill(-1) or our own pid
        # unsandboxed would really kill them (as root: every process on the machine).
        "kill_others": f"""
            import os, signal
            for target in {targets_to_kill}:
                try:
                    os.kill(target, signal.SIGKILL)
                    print("sent", target)
                except OSError as e:
                    print(e)
        """,
        # Its own sandbox: the launcher (its parent or in its process group) and the report
        # channel the launcher and init write to. Unsandboxed these are only our own children.
        "kill_launcher": """
            import os, signal
            try:
                os.kill(os.getppid(), signal.SIGKILL)
            except OSError as e:
                print(e)
            os.kill(0, signal.SIGKILL)
        """,
        "forge_report": """
            import marshal, os
            line = marshal.dumps({"setup_error": "forged"}).hex().encode() + b"\\n"
            for pid in {1, os.getppid()}:
                try:
                    fds = os.listdir("/proc/%d/fd" % pid)
                except OSError:
                    continue
                for fd in fds:
                    try:
                        w = os.open("/proc/%d/fd/%s" % (pid, fd), os.O_WRONLY | os.O_NONBLOCK)
                        os.write(w, line)
                        os.close(w)
                        print("FORGED", pid, fd)
                    except OSError:
                        pass
            raise SystemExit(3)
        """,
        "fork_bomb": """
            import os, time
            n = 0
            while True:
                try:
                    if os.fork() == 0:
                        time.sleep(60)
                        os._exit(0)
                    n += 1
                except OSError:
                    print("forks", n, flush=True)
                    time.sleep(60)
        """,
        "outlive_with_setsid": """
            import os, time
            if os.fork() == 0:
                os.setsid()
                time.sleep(60)
                os._exit(0)
            raise SystemExit("parent done")
        """,
        "memory_bomb": "x = bytearray(10 ** 10)\n",
        "infinite_loop": "while True:\n    pass\n",
    }
    if mechanism == "none":  # the control: only what is harmless when it really escapes
        hostile = {k: hostile[k] for k in CONTROL_SAFE}
    for name, code in hostile.items():
        argv_mark = f"pgrun{secrets.token_hex(6)}"
        res = sandbox.run_program(
            textwrap.dedent(code),
            args=[argv_mark],
            limits=LIMITS,
            mechanism=mechanism,
        )
        out = res.stdout + res.stderr
        escaped = []
        written = [p for p in targets if os.path.exists(p)]
        if written:
            escaped.append(f"wrote {written}")
        for p in written:
            os.remove(p)
        if secret in out:
            escaped.append("read the parent's secret environment variable")
        if f"home-secret-{token}" in out:
            escaped.append("read the secret file in $HOME")
        if "CONNECTED" in out:
            escaped.append("connected to the host network")
        try:
            listener.accept()[0].close()
            escaped.append("reached our listener")
        except OSError:
            pass
        if "SAW" in out:
            escaped.append("saw a process outside the sandbox")
        if sleeper.poll() is not None:
            escaped.append("killed a neighbouring process")
        time.sleep(0.05)
        left = [pid for pid, cmd in cmdlines().items() if argv_mark in cmd]
        if left:
            escaped.append(f"left processes running: {left}")
        if res.status == "sandbox_error" and report["refused"] is None:
            escaped.append(f"its own act reported as a sandbox failure: {res.reason}")
        if "FORGED" in out:
            escaped.append("wrote into the sandbox's report channel")
        if name == "fork_bomb" and res.stdout.startswith("forks"):
            n = int(res.stdout.split()[1])
            if n > 8:
                escaped.append(f"forked {n} processes under a limit of 8")
        report["programs"].append(
            {
                "name": name,
                "status": res.status,
                "reason": res.reason,
                "mechanism": res.enforced.get("mechanism"),
                "escaped": escaped,
                "stdout": res.stdout[:120],
            }
        )
    sleeper.kill()
    sleeper.wait()
    listener.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
