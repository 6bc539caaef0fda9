"""The settings every producer connection runs with.

Events carry PostgreSQL's text output of a value, and several settings change that text: a
database or role with ``extra_float_digits = 0`` printed the largest float8 rounded past its
range (an event said ``null`` for it, and an incremental snapshot's chunk bound skipped the
row), and ``bytea_output = escape`` made wal2json's values wrong (a types fuzz). The replication
connection (whose walsender writes the values), the snapshot's and the catalog's all set them,
after whatever the DSN's own ``options`` (or ``PGOPTIONS``) say.
"""

from __future__ import annotations

import os
from typing import Final

from psycopg.conninfo import conninfo_to_dict

# PostgreSQL's defaults, which the contract's value forms and the warehouse's parsers assume.
OUTPUT_SETTINGS: Final = (
    ("DateStyle", "ISO"),
    ("IntervalStyle", "postgres"),
    ("extra_float_digits", "1"),
    ("bytea_output", "hex"),
    # Text is read as UTF-8: a LATIN1 database's snapshot rows and pgoutput's values (which the
    # server converts to the client's encoding) stopped the producer with UnicodeDecodeError.
    ("client_encoding", "UTF8"),
    # timestamptz is written in the session's time zone: a database, role or server whose zone
    # changed gave one instant two texts, so a timestamptz key two keys (the demux's tombstone
    # missed the row, an update left its old version live). UTC: one text per instant.
    ("TimeZone", "UTC"),
    # reg* values (regclass, regtype, regproc…) name their object relative to search_path and
    # quote it under quote_all_identifiers: a database or role with `search_path = s, public`
    # wrote 't' for what the snapshot read as 's.t' (one regclass key, two keys). `public` is
    # PostgreSQL's default less "$user", so the text does not depend on the producer's login
    # role either; the producer's own queries name pg_catalog's objects (always searched) or
    # qualify their tables.
    ("search_path", "public"),
    ("quote_all_identifiers", "off"),
)


def session_options(dsn: str) -> str:
    """``options=`` for ``psycopg.connect(dsn, …)``: the DSN's own options, then ours."""
    try:
        own = str(conninfo_to_dict(dsn).get("options") or "")
    except Exception:  # a DSN libpq will refuse anyway: let connect() say why
        own = ""
    if not own:
        own = os.environ.get("PGOPTIONS", "")
    ours = " ".join(f"-c {name}={value}" for name, value in OUTPUT_SETTINGS)
    return f"{own} {ours}".strip()

