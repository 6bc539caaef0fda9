def decode_tuple(
    buf: bytes, pos: int, kinds: bytes, render: bool
) -> tuple[list[object], list[int], int, bytes | None] | None: ...
def encode_inserts(
    messages: list[tuple[int, bytes]],
    start: int,
    relid: int,
    kinds: bytes,
    parts: tuple[bytes, bytes, bytes, bytes],
    seq: int,
    limit: int,
) -> list[tuple[list[object], bytes]]: ...
