"""A throwaway PostgreSQL server on loopback: initdb in a temporary folder, started as a non-root
user, stopped and deleted at the end. Standard library only: ``.ci/run`` starts one with the
system Python before the virtual environment exists, and the tests start their own the same way
when CI gave them none (``$CASCADE_TEST_POSTGRES_URL``).

    python3 tests/pgserver.py start DIR   # prints `export CASCADE_TEST_POSTGRES_URL=...`
    python3 tests/pgserver.py stop DIR
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

URL_VARIABLE = "CASCADE_TEST_POSTGRES_URL"
USER = "cascade"
INSTALL = "apt-get install -y postgresql"


class NoServer(RuntimeError):
    """No PostgreSQL server can be started here; the message says why and what to install."""


def binaries() -> Path | None:
    """The folder of initdb and pg_ctl: Debian keeps them under /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def _runner() -> list[str]:
    """How to run the server's programs: as this user, or as ``postgres`` when this is root
    (initdb and postgres refuse to run as root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise NoServer("PostgreSQL refuses to run as root and there is no 'postgres' user to run it "
                       f"as: {INSTALL} creates one") from None
    return ["runuser", "-u", "postgres", "--"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Server:
    """A running throwaway cluster: ``url`` connects to its ``postgres`` database as superuser."""

    directory: Path
    url: str
    port: int

    def stop(self) -> None:
        stop(self.directory)

    def halt(self) -> None:
        """Stop the server as an operator or a failover does (fast shutdown: every session ended),
        keeping its cluster for ``resume``."""
        _pg_ctl(self.directory, "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Start a halted server again, on the same port."""
        _launch(self.directory, self.port)


def start(directory: Path) -> Server:
    """initdb into ``directory``/cluster, start on a free loopback port (password auth, unix socket
    inside ``directory``), and return it; raise ``NoServer`` where that cannot be done here."""
    bindir = binaries()
    if bindir is None:
        raise NoServer(f"PostgreSQL server programs (initdb) are not installed: {INSTALL}, or set "
                       f"{URL_VARIABLE} to a server's URL")
    run_as = _runner()
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(12)
    (directory / "pw").write_text(password + "\n")
    if run_as:
        os.chmod(directory, 0o755)
        shutil.chown(directory, "postgres")
        shutil.chown(directory / "pw", "postgres")
    cluster, port = directory / "cluster", _free_port()
    _run([*run_as, str(bindir / "initdb"), "-D", str(cluster), "-U", USER, f"--pwfile={directory / 'pw'}",
          "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"])
    (directory / "pw").unlink()
    _launch(directory, port)
    url = f"postgresql://{USER}:{password}@127.0.0.1:{port}/postgres"
    (directory / "url").write_text(url)
    return Server(directory, url, port)


def _launch(directory: Path, port: int) -> None:
    options = (f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={directory} "
               "-c max_connections=200")
    _pg_ctl(directory, "-l", str(directory / "server.log"), "-o", options, "-w", "-t", "60", "start")


def _pg_ctl(directory: Path, *arguments: str) -> None:
    bindir = binaries()
    assert bindir is not None
    _run([*_runner(), str(bindir / "pg_ctl"), "-D", str(directory / "cluster"), *arguments])


def stop(directory: Path) -> None:
    """Stop the cluster in ``directory`` (fast shutdown) and delete the folder."""
    directory = Path(directory).resolve()
    bindir = binaries()
    if bindir is not None and (directory / "cluster" / "postmaster.pid").exists():
        subprocess.run([*_runner(), str(bindir / "pg_ctl"), "-D", str(directory / "cluster"), "-m", "fast",
                        "-w", "stop"], capture_output=True, text=True, check=False)
    shutil.rmtree(directory, ignore_errors=True)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        program = Path(command[command.index("--") + 1] if "--" in command else command[0]).name
        raise RuntimeError(f"PostgreSQL: {program} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-800:]}")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "stop":
        stop(Path(argv[1]))
        return 0
    try:
        server = start(Path(argv[1]))
    except NoServer as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"export {URL_VARIABLE}={server.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
