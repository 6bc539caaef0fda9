//! Runs of wal2json (format version 2) insert messages of one table, encoded in one call: the
//! producer's hot path for that plugin.
//!
//! A leaf like the tuple decoder: the caller names the table, the column signature it expects
//! (each column's name, type oid, declared type and `optional` flag, as the last insert it
//! decoded itself had them) and a kind letter per column; this code knows wal2json's field
//! names and nothing of events. A message is taken only when it is an insert of that table
//! with exactly that signature and values this code converts the way the caller's slow path
//! does; the run stops before anything else (another message, a changed signature, a value of
//! an unexpected JSON type, invalid JSON or UTF-8, escapes serde refuses) and the caller decodes
//! that message the slow way, which decides and words the errors.

use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyString};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::{convert, push_event_head, push_json_string, InsertParts, BOOL, TEXT};

/// One column of a change, as wal2json prints it with `include-type-oids`, `include-typmod`
/// and `include-not-null`.
#[derive(Deserialize)]
struct Column<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(rename = "type", borrow, default)]
    declared: Option<Cow<'a, str>>,
    typeoid: u32,
    #[serde(default)]
    optional: Option<bool>,
    #[serde(borrow)]
    value: &'a RawValue,
}

/// The fields of a change this path reads; others (`xid`, `timestamp`, …) are skipped.
#[derive(Deserialize)]
struct Change<'a> {
    #[serde(borrow)]
    action: Cow<'a, str>,
    #[serde(borrow)]
    lsn: Cow<'a, str>,
    #[serde(borrow)]
    schema: Cow<'a, str>,
    #[serde(borrow)]
    table: Cow<'a, str>,
    #[serde(borrow, default)]
    columns: Vec<Column<'a>>,
}

/// A column signature as the caller spells it: name, type oid, declared type, optional.
type Signature = (String, u32, Option<String>, Option<bool>);

/// wal2json's `X/X` position.
fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.split_once('/')?;
    if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
        return None;
    }
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

/// A plain decimal number's text (what wal2json prints unquoted for a numeric type): the
/// caller's slow path keeps such text exactly, so anything fancier is left to it.
fn plain_number(raw: &[u8]) -> bool {
    let digits = raw.strip_prefix(b"-").unwrap_or(raw);
    let mut dots = 0;
    !digits.is_empty()
        && digits[0] != b'.'
        && digits.iter().all(|&b| {
            dots += usize::from(b == b'.');
            b.is_ascii_digit() || b == b'.'
        })
        && dots <= 1
}

/// One value, as the caller's slow path converts it; its JSON appended to `json`.
fn value<'py>(py: Python<'py>, kind: u8, raw: &RawValue, json: &mut Vec<u8>) -> Option<Bound<'py, PyAny>> {
    let text = raw.get();
    let bytes = text.as_bytes();
    match bytes.first()? {
        b'n' if text == "null" => {
            json.extend_from_slice(b"null");
            Some(py.None().into_bound(py))
        }
        b't' | b'f' if kind == BOOL => {
            let v = match text {
                "true" => true,
                "false" => false,
                _ => return None,
            };
            json.extend_from_slice(text.as_bytes());
            Some(PyBool::new(py, v).to_owned().into_any())
        }
        b'"' if kind == TEXT => {
            let s: Cow<'_, str> = serde_json::from_str(text).ok()?;
            push_json_string(json, &s);
            Some(PyString::new(py, &s).into_any())
        }
        // A number: an int or float column's text (the tuple converters take it as
        // pgoutput's), or a numeric's, kept as the text it is.
        b'-' | b'0'..=b'9' if kind != BOOL => {
            // (-0: the slow path reads the integer zero, for a float column with its sign)
            if kind == TEXT && (text == "-0" || !plain_number(bytes)) {
                return None;
            }
            convert(py, kind, bytes, json)
        }
        _ => None,
    }
}

/// The run of inserts into `schema`.`table` with column `signature` that starts at
/// `messages[start]` (at most `limit`), each as `(values, value)` with `value` made as
/// `encode_inserts` makes it (`parts`, `seq` counting up). `kinds`: a letter per column. The run
/// stops before the first message that is something else or that the slow path must decide.
#[pyfunction]
#[pyo3(signature = (messages, start, schema, table, signature, kinds, parts, seq, limit))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_wal2json_inserts<'py>(
    py: Python<'py>,
    messages: &Bound<'py, PyList>,
    start: usize,
    schema: &str,
    table: &str,
    signature: Vec<Signature>,
    kinds: &[u8],
    parts: InsertParts<'py>,
    seq: u64,
    limit: usize,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    if signature.len() != kinds.len() {
        return Ok(out);
    }
    let mut value_json: Vec<u8> = Vec::new();
    for i in start..messages.len().min(start.saturating_add(limit)) {
        let item = messages.get_item(i)?;
        let (_, payload): (u64, Bound<'py, PyBytes>) = item.extract()?;
        let buf = payload.as_bytes();
        if !buf.starts_with(b"{\"action\":\"I\"") {
            break;
        }
        let Ok(change) = serde_json::from_slice::<Change<'_>>(buf) else { break };
        if change.action != "I" || change.schema != schema || change.table != table || change.columns.len() != signature.len() {
            break;
        }
        let same = change.columns.iter().zip(&signature).all(|(c, s)| {
            c.name == s.0.as_str() && c.typeoid == s.1 && c.declared.as_deref() == s.2.as_deref() && c.optional == s.3
        });
        let Some(lsn) = parse_lsn(&change.lsn) else { break };
        if !same {
            break;
        }
        value_json.clear();
        push_event_head(&mut value_json, &parts, lsn, seq + (i - start) as u64);
        value_json.push(b'[');
        let mut values: Vec<Bound<'py, PyAny>> = Vec::with_capacity(kinds.len());
        for (n, (c, &kind)) in change.columns.iter().zip(kinds).enumerate() {
            if n > 0 {
                value_json.push(b',');
            }
            match value(py, kind, c.value, &mut value_json) {
                Some(v) => values.push(v),
                None => return Ok(out),
            }
        }
        value_json.push(b']');
        value_json.extend_from_slice(parts.3.as_bytes());
        out.append((PyList::new(py, values)?, PyBytes::new(py, &value_json)))?;
    }
    Ok(out)
}
