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
    match kind {
        INT => {
            let text = std::str::from_utf8(raw).ok()?;
            let mut buf = itoa::Buffer::new();
            if let Ok(v) = text.parse::<i64>() {
                json.extend_from_slice(buf.format(v).as_bytes());
                Some(v.into_pyobject(py).ok()?.into_any())
            } else {
                // orjson writes integers up to 2**64 - 1; larger ones fail there, on the slow path.
                let v = text.parse::<u64>().ok()?;
                json.extend_from_slice(buf.format(v).as_bytes());
                Some(v.into_pyobject(py).ok()?.into_any())
            }
        }
        FLOAT => {
            // NaN and the infinities (which the caller keeps as text) are the slow path's.
            let v = std::str::from_utf8(raw).ok()?.parse::<f64>().ok()?;
            if !v.is_finite() {
                return None;
            }
            push_json_float(json, v);
            Some(PyFloat::new(py, v).into_any())
        }
        BOOL => {
            let v = raw == b"t";
            json.extend_from_slice(if v { b"true" } else { b"false" });
            Some(PyBool::new(py, v).to_owned().into_any())
        }
        TEXT => {
            let text = std::str::from_utf8(raw).ok()?;
            push_json_string(json, text);
            Some(PyString::new(py, text).into_any())
        }
        _ => None,
    }
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
    let mut reader = Reader { buf, pos };
    let Some(n) = reader.u16() else { return Ok(None) };
    if n != kinds.len() {
        return Ok(None);
    }
    let mut values: Vec<Bound<'py, PyAny>> = Vec::with_capacity(n);
    let mut unchanged: Vec<usize> = Vec::new();
    let mut json: Vec<u8> = Vec::with_capacity(if render { buf.len() + 2 * n + 2 } else { 0 });
    let mut scratch: Vec<u8> = Vec::new();
    json.push(b'[');
    for (i, &kind) in kinds.iter().enumerate() {
        if i > 0 {
            json.push(b',');
        }
        let Some(tag) = reader.byte() else { return Ok(None) };
        match tag {
            b't' => {
                let Some(size) = reader.u32() else { return Ok(None) };
                let Some(raw) = reader.take(size) else { return Ok(None) };
                let out = if render { &mut json } else { scratch.clear(); &mut scratch };
                let Some(value) = convert(py, kind, raw, out) else { return Ok(None) };
                values.push(value);
            }
            b'n' | b'u' => {
                if tag == b'u' {
                    unchanged.push(i);
                }
                json.extend_from_slice(b"null");
                values.push(py.None().into_bound(py));
            }
            _ => return Ok(None),
        }
    }
    json.push(b']');
    let list = PyList::new(py, values)?;
    let rendered = if render { Some(PyBytes::new(py, &json)) } else { None };
    Ok(Some((list, unchanged, reader.pos, rendered)))
}

#[pymodule]
fn walbus_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_tuple, m)?)?;
    Ok(())
}
