"""decode_event against orjson.loads on realistic events, in the same run; prints JSON lines.

    python -m bench.contract [--number 20000] [--repeat 7]

Events: an insert of a 3-column row (pgkafka's ``transactions``), an insert of a 30-column
row of mixed types, an update with its identity, an update of the 30-column row with a
REPLICA IDENTITY FULL old row, a delete by key. Per event: µs per call of ``orjson.loads``
(the floor) and of ``decode_event`` in CPU time, the best of ``--repeat`` rounds, and their
ratio. No services.
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from typing import Any

import orjson

from bench.common import emit
from walbus.contract import decode_event, encode_event

TS = "2026-11-22T00:00:27.458750+00:00"
COLS3 = ["transaction_id", "user_id", "amount"]
TYPES3 = ["int4", "int4", "int4"]
_WIDE_TYPES = ("int8", "text", "numeric", "timestamptz", "bool", "float8")
COLS30 = [f"column_{i:02d}" for i in range(30)]
TYPES30 = [_WIDE_TYPES[i % len(_WIDE_TYPES)] for i in range(30)]
_WIDE_VALUES: dict[str, Any] = {
    "int8": 9_007_199_254_740_993, "text": "a short text value", "numeric": "12345.67",
    "timestamptz": "2024-01-02 01:04:05.678901+00", "bool": True, "float8": 0.125,
}
VALUES30 = [_WIDE_VALUES[t] for t in TYPES30]


def _event(operation: str, table: str, pk: list[str], new: dict[str, Any] | None, identity: dict[str, Any] | None) -> bytes:
    return encode_event(
        lsn=0x40A2_F398, commit_lsn=0x40A2_F400, seq=3, xid=10885, operation=operation, table=table,
        timestamp=TS, pk=pk, new=new, identity=identity,
    )


def events() -> dict[str, bytes]:
    row3 = {"columns": COLS3, "types": TYPES3, "values": [54441, 36036, 2000]}
    key3 = {"columns": COLS3[:1], "types": TYPES3[:1], "values": [54441]}
    row30 = {"columns": COLS30, "types": TYPES30, "values": VALUES30}
    return {
        "insert_3": _event("insert", "public.transactions", COLS3[:1], row3, None),
        "insert_30": _event("insert", "public.wide", COLS30[:1], row30, None),
        "update_3_identity": _event("update", "public.transactions", COLS3[:1], row3, key3),
        "update_30_full": _event("update", "public.wide", COLS30[:1], row30, row30),
        "delete_3": _event("delete", "public.transactions", COLS3[:1], None, key3),
    }


def per_call_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    # CPU time of this process: on shared cores, wall time counts the other processes' turns.
    return min(timeit.repeat(fn, number=number, repeat=repeat, timer=time.process_time)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=20000, help="calls per round (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds; the best counts (default: %(default)s)")
    args = ap.parse_args(argv)
    for name, raw in events().items():
        decode_event(raw)  # valid, or the benchmark measures nothing
        loads_us = per_call_us(lambda raw=raw: orjson.loads(raw), args.number, args.repeat)
        decode_us = per_call_us(lambda raw=raw: decode_event(raw), args.number, args.repeat)
        emit(
            event=name, bytes=len(raw), orjson_loads_us=round(loads_us, 3), decode_event_us=round(decode_us, 3),
            decode_over_loads=round(decode_us / loads_us, 2),
        )


if __name__ == "__main__":
    main()
