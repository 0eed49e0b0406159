"""PostgreSQL for the tests: the server CI started (``$CASCADE_TEST_POSTGRES_URL``), else a
throwaway one this session starts (``pgserver``), else the tests that need it skip, saying what
to install. Each test gets databases of its own, dropped after it."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pgserver
import pytest

BACKENDS = ("sqlite", "postgres")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The URL of a server's ``postgres`` database, as a superuser."""
    given = os.environ.get(pgserver.URL_VARIABLE)
    if given:
        yield given
        return
    try:
        server = pgserver.start(Path(tempfile.mkdtemp(prefix="cascade-pg-")))
    except pgserver.NoServer as exc:
        pytest.skip(str(exc))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def halting_postgres() -> Iterator[pgserver.Server]:
    """A PostgreSQL server of this test's own, which it may halt and resume (CI's shared one must
    stay up); its ``url`` is the ``postgres`` database's."""
    try:
        server = pgserver.start(Path(tempfile.mkdtemp(prefix="cascade-pg-halting-")))
    except pgserver.NoServer as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


class Databases:
    """Fresh databases on one server, made on demand and dropped at ``drop_all``."""

    def __init__(self, server: str) -> None:
        self.server, self.names = server, []

    def new(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.server, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        self.names.append(name)
        return with_database(self.server, name)

    def drop_all(self) -> None:
        import psycopg

        with psycopg.connect(self.server, autocommit=True) as conn:
            for name in self.names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def databases(postgres_server: str) -> Iterator[Databases]:
    made = Databases(postgres_server)
    try:
        yield made
    finally:
        made.drop_all()


@pytest.fixture
def postgres_url(databases: Databases) -> str:
    """A fresh, empty database's URL (with the password)."""
    return databases.new()


@pytest.fixture(params=BACKENDS)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``place(name)``: where a store called ``name`` lives on this test's backend, as the text a
    user gives ``--store``: a file in the test's folder, or a fresh database's URL."""
    if request.param == "sqlite":
        return lambda name: str(tmp_path / name)
    made: Databases = request.getfixturevalue("databases")
    urls: dict[str, str] = {}

    def database(name: str) -> str:
        if name not in urls:
            urls[name] = made.new()
        return urls[name]
    return database
