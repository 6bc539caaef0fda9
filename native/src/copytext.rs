//! Runs of COPY text lines (the initial snapshot's rows) encoded in one call.
//!
//! A leaf like the tuple decoder: a line is its fields, tab-separated, each a column's type
//! output text with COPY's backslash escapes (`\N` alone: NULL); the caller passes a kind
//! letter per column and the event's fixed parts. A line this code does not take (another
//! number of fields, text the converters refuse) ends the run, and the caller converts that
//! line the slow way, which decides.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::{convert, push_event_head, ChangeRun, InsertParts, KeyParts, RunBuilder};

/// `raw` with COPY's escapes undone, into `out`: `\b \f \n \r \t \v` are those characters, a
/// backslash before any other byte is that byte (COPY TO writes no octal or hex escapes).
fn unescape(raw: &[u8], out: &mut Vec<u8>) {
    out.clear();
    let mut bytes = raw.iter();
    while let Some(&b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        match bytes.next() {
            Some(b'b') => out.push(0x08),
            Some(b'f') => out.push(0x0c),
            Some(b'n') => out.push(b'\n'),
            Some(b'r') => out.push(b'\r'),
            Some(b't') => out.push(b'\t'),
            Some(b'v') => out.push(0x0b),
            Some(&c) => out.push(c),
            None => out.push(b'\\'), // a lone trailing backslash stays (the slow path's regex keeps it too)
        }
    }
}

/// The read events of `lines[start..]` (at most `limit`), COPY text lines each with its
/// newline: `value` is `head + lsn + mid + seq + tail + values' JSON + end` (the caller's
/// `(head, mid, tail, end)`), `seq` counting up, the key `key_parts`'s head and that seq.
#[pyfunction]
#[pyo3(signature = (lines, start, kinds, parts, key_parts, seq, lsn, limit))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_copy_rows<'py>(
    py: Python<'py>,
    lines: &Bound<'py, PyList>,
    start: usize,
    kinds: &[u8],
    parts: InsertParts<'py>,
    key_parts: KeyParts<'py>,
    seq: u64,
    lsn: u64,
    limit: usize,
) -> PyResult<ChangeRun<'py>> {
    let mut run = RunBuilder::new(py);
    let mut value: Vec<u8> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    'lines: for i in start..lines.len().min(start.saturating_add(limit)) {
        let line: Bound<'py, PyBytes> = lines.get_item(i)?.extract()?;
        let Some(body) = line.as_bytes().strip_suffix(b"\n") else { break };
        let event_seq = seq + (i - start) as u64;
        value.clear();
        push_event_head(&mut value, &parts, lsn, event_seq);
        value.push(b'[');
        let mut values: Vec<Bound<'py, PyAny>> = Vec::with_capacity(kinds.len());
        let mut fields = body.split(|&b| b == b'\t');
        for (n, &kind) in kinds.iter().enumerate() {
            let Some(raw) = fields.next() else { break 'lines };
            if n > 0 {
                value.push(b',');
            }
            if raw == b"\\N" {
                value.extend_from_slice(b"null");
                values.push(py.None().into_bound(py));
                continue;
            }
            let text = if raw.contains(&b'\\') {
                unescape(raw, &mut scratch);
                scratch.as_slice()
            } else {
                raw
            };
            let Some(v) = convert(py, kind, text, &mut value) else { break 'lines };
            values.push(v);
        }
        if kinds.is_empty() || fields.next().is_some() {
            break;
        }
        value.push(b']');
        value.extend_from_slice(parts.3.as_bytes());
        run.push(&key_parts, event_seq, b'R', &value, Some(values), None)?;
    }
    run.finish()
}
