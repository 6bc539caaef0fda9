//! A compiled hot path for decoding logical-replication tuples.
//!
//! A leaf: it knows a tuple's wire layout (PostgreSQL's "TupleData": a column count, then per
//! column a kind byte `n`ull, `u`nchanged TOAST or `t`ext with a length and the text) and how
//! to turn the text of four kinds of column into values and into compact JSON. It knows
//! nothing of events, fields or topics: the caller passes one kind letter per column.
//!
//! Anything unusual (a malformed tuple, text the fast parsers refuse, a float that is not
//! finite) makes a call return `None`, and the caller decodes that tuple the slow way: the
//! slow path decides the errors, so both paths agree on every input.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyList, PyString};

mod copydata;
mod copytext;
mod event;
mod lanes;
mod messages;
mod records;
mod recordbatch;
mod wal2json;

use messages::{MessageSource, Messages};
use records::Records;

/// Column kinds, as the caller spells them.
const INT: u8 = b'i';
const FLOAT: u8 = b'f';
const BOOL: u8 = b'b';
const TEXT: u8 = b't';

/// Bounds-checked reads of a tuple: `None` when the buffer ends early.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn u16(&mut self) -> Option<usize> {
        let s = self.take(2)?;
        Some(u16::from_be_bytes([s[0], s[1]]) as usize)
    }

    fn u32(&mut self) -> Option<usize> {
        let s = self.take(4)?;
        Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
    }
}

/// `text` as a JSON string, escaped as orjson escapes (short forms for the usual
/// control characters, `\u00XX` for the others, everything else as UTF-8).
fn push_json_string(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[(b >> 4) as usize]);
            out.push(HEX[(b & 0xf) as usize]);
        } else {
            out.extend_from_slice(short);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A finite float as orjson writes it: Ryū's shortest form, with a `+` on positive exponents.
fn push_json_float(out: &mut Vec<u8>, value: f64) {
    let mut buf = ryu::Buffer::new();
    let text = buf.format_finite(value).as_bytes();
    match text.iter().position(|&b| b == b'e') {
        Some(e) if text.get(e + 1) != Some(&b'-') => {
            out.extend_from_slice(&text[..=e]);
            out.push(b'+');
            out.extend_from_slice(&text[e + 1..]);
        }
        _ => out.extend_from_slice(text),
    }
}

/// One column's text as a Python value, its JSON appended to `json`; `None`: leave it to the slow path.
fn convert<'py>(py: Python<'py>, kind: u8, raw: &[u8], json: &mut Vec<u8>) -> Option<Bound<'py, PyAny>> {
    convert_to(py, kind, raw, json, true)?
}

/// `convert`, making the Python value only when `make` (the JSON and the checks either way):
/// `Some(None)` is a value taken without one.
fn convert_to<'py>(py: Python<'py>, kind: u8, raw: &[u8], json: &mut Vec<u8>, make: bool) -> Option<Option<Bound<'py, PyAny>>> {
    Some(match kind {
        INT => {
            let text = std::str::from_utf8(raw).ok()?;
            let mut buf = itoa::Buffer::new();
            if let Ok(v) = text.parse::<i64>() {
                json.extend_from_slice(buf.format(v).as_bytes());
                if make { Some(v.into_pyobject(py).ok()?.into_any()) } else { None }
            } else {
                // orjson writes integers up to 2**64 - 1; larger ones fail there, on the slow path.
                let v = text.parse::<u64>().ok()?;
                json.extend_from_slice(buf.format(v).as_bytes());
                if make { Some(v.into_pyobject(py).ok()?.into_any()) } else { None }
            }
        }
        FLOAT => {
            // NaN and the infinities (which the caller keeps as text) are the slow path's.
            let v = std::str::from_utf8(raw).ok()?.parse::<f64>().ok()?;
            if !v.is_finite() {
                return None;
            }
            push_json_float(json, v);
            if make { Some(PyFloat::new(py, v).into_any()) } else { None }
        }
        BOOL => {
            let v = raw == b"t";
            json.extend_from_slice(if v { b"true" } else { b"false" });
            if make { Some(PyBool::new(py, v).to_owned().into_any()) } else { None }
        }
        TEXT => {
            let text = std::str::from_utf8(raw).ok()?;
            push_json_string(json, text);
            if make { Some(PyString::new(py, text).into_any()) } else { None }
        }
        _ => return None,
    })
}

/// A decoded tuple: its values (none unless made), the indexes of the unchanged ones, the
/// position after it.
struct Tuple<'py> {
    values: Vec<Bound<'py, PyAny>>,
    unchanged: Vec<usize>,
    end: usize,
}

/// The tuple whose column count is at `pos`; its values' JSON array appended to `json`, and
/// with `spans` where in `json` each value's JSON is (start, end).
fn read_tuple<'py>(
    py: Python<'py>,
    buf: &[u8],
    pos: usize,
    kinds: &[u8],
    json: &mut Vec<u8>,
    mut spans: Option<&mut Vec<(usize, usize)>>,
    make: bool,
) -> Option<Tuple<'py>> {
    let mut reader = Reader { buf, pos };
    let n = reader.u16()?;
    if n != kinds.len() {
        return None;
    }
    let mut values: Vec<Bound<'py, PyAny>> = Vec::with_capacity(n);
    let mut unchanged: Vec<usize> = Vec::new();
    json.push(b'[');
    for (i, &kind) in kinds.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        let start = json.len();
        match reader.byte()? {
            b't' => {
                let size = reader.u32()?;
                let raw = reader.take(size)?;
                if let Some(v) = convert_to(py, kind, raw, json, make)? {
                    values.push(v);
                }
            }
            tag @ (b'n' | b'u') => {
                if tag == b'u' {
                    unchanged.push(i);
                }
                json.extend_from_slice(b"null");
                if make {
                    values.push(py.None().into_bound(py));
                }
            }
            _ => return None,
        }
        if let Some(spans) = spans.as_deref_mut() {
            spans.push((start, json.len()));
        }
    }
    json.push(b']');
    Some(Tuple { values, unchanged, end: reader.pos })
}

type Decoded<'py> = (Bound<'py, PyList>, Vec<usize>, usize, Option<Bound<'py, PyBytes>>);

/// Decode the tuple whose column count is at `pos` in `buf`, a column of kind `kinds[i]` each.
///
/// Returns `(values, unchanged, end, json)`: a value per column (`None` for NULL and for an
/// unchanged TOAST value), the indexes of the unchanged ones, the position after the tuple,
/// and, when `render`, the values as a compact JSON array (unchanged ones as `null`).
/// `None` when the slow path must decide (see the module's comment).
#[pyfunction]
#[pyo3(signature = (buf, pos, kinds, render))]
fn decode_tuple<'py>(
    py: Python<'py>,
    buf: &[u8],
    pos: usize,
    kinds: &[u8],
    render: bool,
) -> PyResult<Option<Decoded<'py>>> {
    let mut json: Vec<u8> = Vec::with_capacity(if render { buf.len() + 2 * kinds.len() + 2 } else { 64 });
    let Some(t) = read_tuple(py, buf, pos, kinds, &mut json, None, true) else { return Ok(None) };
    let list = PyList::new(py, t.values)?;
    let rendered = if render { Some(PyBytes::new(py, &json)) } else { None };
    Ok(Some((list, t.unchanged, t.end, rendered)))
}

/// An insert value's fixed head: `head + lsn + mid + seq + tail` of the caller's
/// `(head, mid, tail, end)` (numbers in decimal); the values' JSON and `end` follow. Another
/// operation's event has another `tail` (`push_event_head_with`).
fn push_event_head(out: &mut Vec<u8>, parts: &InsertParts<'_>, lsn: u64, seq: u64) {
    push_event_head_with(out, parts, parts.2.as_bytes(), lsn, seq);
}

pub(crate) fn push_event_head_with(out: &mut Vec<u8>, parts: &InsertParts<'_>, tail: &[u8], lsn: u64, seq: u64) {
    let mut numbers = itoa::Buffer::new();
    out.extend_from_slice(parts.0.as_bytes());
    out.extend_from_slice(numbers.format(lsn).as_bytes());
    out.extend_from_slice(parts.1.as_bytes());
    out.extend_from_slice(numbers.format(seq).as_bytes());
    out.extend_from_slice(tail);
}

/// An insert event value's fixed parts, `(head, mid, tail, end)`.
pub(crate) type InsertParts<'py> = (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>);

/// A run's keys: `head` and then each seq in upper-case hex, zero-padded to `width` digits.
pub(crate) type KeyParts<'py> = (Bound<'py, PyBytes>, usize);

/// The key of event `seq`: `head` and its seq (`%0<width>X`).
pub(crate) fn event_key(key: &KeyParts<'_>, seq: u64, out: &mut Vec<u8>) {
    use std::io::Write;
    out.clear();
    out.extend_from_slice(key.0.as_bytes());
    let _ = write!(out, "{:0width$X}", seq, width = key.1);
}

/// What a change run gives the caller: each event's key, value, new row (None: a delete) and
/// old row (None: none was sent; else a value per column, None outside the key), and its
/// operation's letter (`I`, `U`, `D`).
pub(crate) type ChangeRun<'py> = (Bound<'py, Records>, Bound<'py, Records>, Bound<'py, PyList>, Bound<'py, PyList>, Bound<'py, PyBytes>);

/// An update's and a delete's parts beside an insert's `(head, mid, tail, end)`:
/// `(update_tail, delete_tail, identity_head, identity_end)`. An update's value is
/// `head lsn mid seq update_tail values identity_head key_values identity_end end`, a delete's
/// the same without `values` (and with `delete_tail`).
pub(crate) type ChangeParts<'py> = (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>);

/// A change run being built: the keys and values (side by side, no object each), the row
/// lists `ChangeRun` hands over, and the operations.
pub(crate) struct RunBuilder<'py> {
    /// Whether the new and old rows are handed over (else their lists stay empty).
    pub(crate) images: bool,
    py: Python<'py>,
    keys: Records,
    values: Records,
    rows: Bound<'py, PyList>,
    olds: Bound<'py, PyList>,
    ops: Vec<u8>,
    key_buf: Vec<u8>,
}

impl<'py> RunBuilder<'py> {
    pub(crate) fn new(py: Python<'py>) -> Self {
        let list = || PyList::empty(py);
        RunBuilder {
            images: true, py, keys: Records::default(), values: Records::default(), rows: list(), olds: list(),
            ops: Vec::new(), key_buf: Vec::new(),
        }
    }

    /// Append event `seq`: its operation, value, new row and old row.
    pub(crate) fn push(
        &mut self,
        key: &KeyParts<'py>,
        seq: u64,
        op: u8,
        value: &[u8],
        row: Option<Vec<Bound<'py, PyAny>>>,
        old: Option<Vec<Bound<'py, PyAny>>>,
    ) -> PyResult<()> {
        let py = self.py;
        event_key(key, seq, &mut self.key_buf);
        self.keys.push(&self.key_buf);
        self.values.push(value);
        if self.images {
            match row {
                Some(r) => self.rows.append(PyList::new(py, r)?)?,
                None => self.rows.append(py.None())?,
            }
            match old {
                Some(o) => self.olds.append(PyList::new(py, o)?)?,
                None => self.olds.append(py.None())?,
            }
        }
        self.ops.push(op);
        Ok(())
    }

    pub(crate) fn finish(self) -> PyResult<ChangeRun<'py>> {
        let py = self.py;
        let ops = PyBytes::new(py, &self.ops);
        Ok((Bound::new(py, self.keys)?, Bound::new(py, self.values)?, self.rows, self.olds, ops))
    }
}

/// The caller's key columns and update/delete parts, when it gives both and they fit `kinds`.
pub(crate) fn change_args<'a, 'py>(
    key: &'a Option<Vec<usize>>,
    parts: &'a Option<ChangeParts<'py>>,
    columns: usize,
) -> Option<(&'a [usize], &'a ChangeParts<'py>)> {
    match (key, parts) {
        (Some(k), Some(cp)) if !k.is_empty() && k.iter().all(|&i| i < columns) => Some((k.as_slice(), cp)),
        _ => None,
    }
}

/// `key`'s values' JSON array appended to `out`, each copied from `src` at its span.
fn push_key_json(out: &mut Vec<u8>, src: Option<&[u8]>, spans: &[(usize, usize)], key: &[usize]) {
    out.push(b'[');
    for (j, &c) in key.iter().enumerate() {
        if j > 0 {
            out.push(b',');
        }
        let (start, end) = spans[c];
        match src {
            Some(s) => out.extend_from_slice(&s[start..end]),
            None => out.extend_from_within(start..end), // from `out` itself
        }
    }
    out.push(b']');
}

/// The run of changes of relation `relid` that starts at `messages[start]` (at most `limit`),
/// `seq` counting up: inserts (`value` is `head + lsn + mid + seq + tail + values' JSON +
/// end`, the key `key_parts`'s head and that seq), and when the caller gives the relation's
/// `key` (its replica identity's column indexes) and `change_parts`, updates and deletes with
/// that key as their old key (sent or not: an update that kept its key sends none). `messages`
/// holds `(lsn, payload)` pairs. The run stops before the first message that is something
/// else or that the slow path must decide (an unchanged TOAST value, a whole old row).
/// Without `rows` the new and old rows' lists stay empty (the values' JSON is made all the
/// same): the caller makes them again, with `rows`, when it needs them.
#[pyfunction]
#[pyo3(signature = (messages, start, relid, kinds, parts, key_parts, seq, limit, key=None, change_parts=None, rows=true))]
#[allow(clippy::too_many_arguments)]
fn encode_changes<'py>(
    py: Python<'py>,
    messages: &Bound<'py, PyAny>,
    start: usize,
    relid: u32,
    kinds: &[u8],
    parts: InsertParts<'py>,
    key_parts: KeyParts<'py>,
    seq: u64,
    limit: usize,
    key: Option<Vec<usize>>,
    change_parts: Option<ChangeParts<'py>>,
    rows: bool,
) -> PyResult<ChangeRun<'py>> {
    let mut run = RunBuilder::new(py);
    run.images = rows;
    let changes = change_args(&key, &change_parts, kinds.len());
    let mut value: Vec<u8> = Vec::new();
    let mut old_json: Vec<u8> = Vec::new();
    let mut new_spans: Vec<(usize, usize)> = Vec::new();
    let mut old_spans: Vec<(usize, usize)> = Vec::new();
    let messages = MessageSource::of(messages)?;
    for i in start..messages.len().min(start.saturating_add(limit)) {
        let (lsn, payload) = messages.get(i)?;
        let buf = payload.bytes();
        // the operation, the relation's id, then 'N' (a new tuple), 'K' (an old key) or 'O'
        if buf.len() < 6 || buf[1..5] != relid.to_be_bytes() {
            break;
        }
        let op = buf[0];
        let event_seq = seq + (i - start) as u64;
        value.clear();
        if op == b'I' && buf[5] == b'N' {
            push_event_head(&mut value, &parts, lsn, event_seq);
            let Some(t) = read_tuple(py, buf, 6, kinds, &mut value, None, rows) else { break };
            value.extend_from_slice(parts.3.as_bytes());
            run.push(&key_parts, event_seq, op, &value, Some(t.values), None)?;
            continue;
        }
        let Some((key, cp)) = changes else { break };
        // The old key, when sent: a tuple of every column, NULL outside the key.
        let mut old = None;
        let mut pos = 5;
        if buf[5] == b'K' {
            old_json.clear();
            old_spans.clear();
            let Some(t) = read_tuple(py, buf, 6, kinds, &mut old_json, Some(&mut old_spans), rows) else { break };
            if !t.unchanged.is_empty() {
                break;
            }
            old = Some(t.values);
            pos = t.end;
        }
        match op {
            b'U' if buf.get(pos) == Some(&b'N') => {
                push_event_head_with(&mut value, &parts, cp.0.as_bytes(), lsn, event_seq);
                new_spans.clear();
                let Some(t) = read_tuple(py, buf, pos + 1, kinds, &mut value, Some(&mut new_spans), rows) else { break };
                if !t.unchanged.is_empty() {
                    break; // an unchanged TOAST value: left out of the event, the slow path's
                }
                value.extend_from_slice(cp.2.as_bytes());
                match old {
                    Some(_) => push_key_json(&mut value, Some(&old_json), &old_spans, key),
                    None => push_key_json(&mut value, None, &new_spans, key),
                }
                value.extend_from_slice(cp.3.as_bytes());
                value.extend_from_slice(parts.3.as_bytes());
                run.push(&key_parts, event_seq, op, &value, Some(t.values), old)?;
            }
            b'D' if old.is_some() => {
                push_event_head_with(&mut value, &parts, cp.1.as_bytes(), lsn, event_seq);
                value.extend_from_slice(cp.2.as_bytes());
                push_key_json(&mut value, Some(&old_json), &old_spans, key);
                value.extend_from_slice(cp.3.as_bytes());
                value.extend_from_slice(parts.3.as_bytes());
                run.push(&key_parts, event_seq, op, &value, None, old)?;
            }
            _ => break,
        }
    }
    run.finish()
}

#[pymodule]
fn walbus_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_tuple, m)?)?;
    m.add_function(wrap_pyfunction!(encode_changes, m)?)?;
    m.add_function(wrap_pyfunction!(copytext::encode_copy_rows, m)?)?;
    m.add_class::<recordbatch::RecordBatchBuilder>()?;
    m.add_function(wrap_pyfunction!(wal2json::encode_wal2json_changes, m)?)?;
    m.add_function(wrap_pyfunction!(wal2json::loads_exact, m)?)?;
    m.add_class::<event::EventDecoder>()?;
    m.add_class::<copydata::CopyReader>()?;
    m.add_class::<lanes::OrderLanes>()?;
    m.add_class::<Records>()?;
    m.add_class::<Messages>()?;
    Ok(())
}
