//! Runs of wal2json (format version 2) changes of one table, encoded in one call: the
//! producer's hot path for that plugin.
//!
//! A leaf like the tuple decoder: the caller names the table, the column signature it expects
//! (each column's name, type oid, declared type and `optional` flag, as the last whole row it
//! decoded itself had them), a kind letter per column and, for updates and deletes, the
//! columns of the table's key; this code knows wal2json's field names and nothing of events.
//! A message is taken only when it is an insert, an update with every column or a delete of
//! that table with exactly that signature, an identity that is exactly the key, and values
//! this code converts the way the caller's slow path does; the run stops before anything else
//! (another message, a changed signature, an unchanged TOAST column, a value of an unexpected
//! JSON type, invalid JSON or UTF-8, escapes serde refuses) and the caller decodes that
//! message the slow way, which decides and words the errors.

use std::borrow::Cow;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::messages::MessageSource;
use crate::{change_args, convert, push_event_head_with, push_json_string, ChangeParts, ChangeRun, InsertParts, KeyParts, RunBuilder, BOOL, TEXT};

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
    #[serde(borrow, default)]
    identity: Option<Vec<Column<'a>>>,
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

/// The mark of a payload the caller's slow path reads with every number's text (a numeric
/// column's type oid); it reads any other with a parser that takes 64-bit integers only and
/// turns fractions into floats.
const EXACT_MARK: &[u8] = b"\"typeoid\":1700,";

/// Whether `buf` has `EXACT_MARK`, looked for once, when a value first needs to know.
struct ExactMark<'a> {
    buf: &'a [u8],
    found: Option<bool>,
}

impl ExactMark<'_> {
    fn get(&mut self) -> bool {
        *self.found.get_or_insert_with(|| self.buf.windows(EXACT_MARK.len()).any(|w| w == EXACT_MARK))
    }
}

/// One value, as the caller's slow path converts it; its JSON appended to `json`. `exact`:
/// whether the payload has `EXACT_MARK`.
fn value<'py>(py: Python<'py>, kind: u8, raw: &RawValue, exact: &mut ExactMark<'_>, json: &mut Vec<u8>) -> Option<Bound<'py, PyAny>> {
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
            let fraction = bytes.iter().any(|&b| matches!(b, b'.' | b'e' | b'E'));
            let wide = !fraction && text.parse::<i64>().is_err() && text.parse::<u64>().is_err();
            // (-0: the slow path reads the integer zero, for a float column with its sign)
            if ((wide || (fraction && kind == TEXT)) && !exact.get()) || (kind == TEXT && (text == "-0" || !plain_number(bytes))) {
                return None;
            }
            convert(py, kind, bytes, json)
        }
        _ => None,
    }
}

/// Whether `identity` is the relation's key as the caller's slow path reads it: its columns
/// are `key`'s, in order, with the signature's type (wal2json prints no `optional` there).
fn is_key(identity: &[Column<'_>], key: &[usize], signature: &[Signature]) -> bool {
    identity.len() == key.len()
        && identity.iter().zip(key).all(|(c, &i)| {
            let s = &signature[i];
            c.name == s.0.as_str() && c.typeoid == s.1 && c.optional.is_none() && (c.declared.is_none() || c.declared.as_deref() == s.2.as_deref())
        })
}

/// The run of changes to `schema`.`table` with column `signature` that starts at
/// `messages[start]` (at most `limit`), `seq` counting up: inserts always (their value as
/// `encode_changes` makes it, from `parts`); updates with every column and deletes too when
/// the caller gives the relation's `key` (its replica identity's column indexes) and
/// `change_parts`. `kinds`: a letter per column. The run stops before the first message that
/// is something else or that the slow path must decide (an update without some column: an
/// unchanged TOAST value; an identity that is not exactly the key).
#[pyfunction]
#[pyo3(signature = (messages, start, schema, table, signature, kinds, parts, key_parts, seq, limit, key=None, change_parts=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_wal2json_changes<'py>(
    py: Python<'py>,
    messages: &Bound<'py, PyAny>,
    start: usize,
    schema: &str,
    table: &str,
    signature: Vec<Signature>,
    kinds: &[u8],
    parts: InsertParts<'py>,
    key_parts: KeyParts<'py>,
    seq: u64,
    limit: usize,
    key: Option<Vec<usize>>,
    change_parts: Option<ChangeParts<'py>>,
) -> PyResult<ChangeRun<'py>> {
    let mut run = RunBuilder::new(py);
    let changes = change_args(&key, &change_parts, kinds.len());
    if signature.len() == kinds.len() {
        let mut value_json: Vec<u8> = Vec::new();
        let messages = MessageSource::of(messages)?;
        for i in start..messages.len().min(start.saturating_add(limit)) {
            let (_, payload) = messages.get(i)?;
            let buf = payload.bytes();
            let op = match buf.get(..13) {
                Some(b"{\"action\":\"I\"") => b'I',
                Some(b"{\"action\":\"U\"") if changes.is_some() => b'U',
                Some(b"{\"action\":\"D\"") if changes.is_some() => b'D',
                _ => break,
            };
            let Ok(change) = serde_json::from_slice::<Change<'_>>(buf) else { break };
            if change.action.as_bytes() != [op] || change.schema != schema || change.table != table {
                break;
            }
            let whole = change.columns.len() == signature.len()
                && change.columns.iter().zip(&signature).all(|(c, s)| {
                    c.name == s.0.as_str() && c.typeoid == s.1 && c.declared.as_deref() == s.2.as_deref() && c.optional == s.3
                });
            if !(if op == b'D' { change.columns.is_empty() } else { whole }) {
                break;
            }
            let identity = match (op, changes, &change.identity) {
                (b'I', _, None) => None,
                (b'U' | b'D', Some((k, cp)), Some(ident)) if is_key(ident, k, &signature) => Some((k, cp, ident)),
                _ => break,
            };
            let Some(lsn) = parse_lsn(&change.lsn) else { break };
            let mut exact = ExactMark { buf, found: None };
            let event_seq = seq + (i - start) as u64;
            value_json.clear();
            let tail = match identity {
                None => parts.2.as_bytes(),
                Some((_, cp, _)) => if op == b'U' { cp.0.as_bytes() } else { cp.1.as_bytes() },
            };
            push_event_head_with(&mut value_json, &parts, tail, lsn, event_seq);
            let mut row: Option<Vec<Bound<'py, PyAny>>> = None;
            if op != b'D' {
                let mut new = Vec::with_capacity(kinds.len());
                if !push_values(py, change.columns.iter().zip(kinds.iter().copied()), &mut exact, &mut value_json, &mut new) {
                    break;
                }
                row = Some(new);
            }
            let mut old: Option<Vec<Bound<'py, PyAny>>> = None;
            if let Some((k, cp, ident)) = identity {
                value_json.extend_from_slice(cp.2.as_bytes());
                let mut key_values = Vec::with_capacity(k.len());
                if !push_values(py, ident.iter().zip(k.iter().map(|&c| kinds[c])), &mut exact, &mut value_json, &mut key_values) {
                    break;
                }
                value_json.extend_from_slice(cp.3.as_bytes());
                let mut whole_old: Vec<Bound<'py, PyAny>> = (0..kinds.len()).map(|_| py.None().into_bound(py)).collect();
                for (&c, v) in k.iter().zip(key_values) {
                    whole_old[c] = v;
                }
                old = Some(whole_old);
            }
            value_json.extend_from_slice(parts.3.as_bytes());
            run.push(&key_parts, event_seq, op, &value_json, row, old)?;
        }
    }
    run.finish()
}

/// The columns' values as a JSON array appended to `json`, each converted to `out` as the
/// slow path converts it (`kinds` beside them); false when one is the slow path's to decide.
fn push_values<'a, 'py>(
    py: Python<'py>,
    columns: impl Iterator<Item = (&'a Column<'a>, u8)>,
    exact: &mut ExactMark<'_>,
    json: &mut Vec<u8>,
    out: &mut Vec<Bound<'py, PyAny>>,
) -> bool {
    json.push(b'[');
    for (n, (c, kind)) in columns.enumerate() {
        if n > 0 {
            json.push(b',');
        }
        match value(py, kind, c.value, exact, json) {
            Some(v) => out.push(v),
            None => return false,
        }
    }
    json.push(b']');
    true
}

/// A JSON object's members in order, values unparsed (a repeated name: both, in order).
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> serde::de::Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((k, v)) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(MembersVisitor)
    }
}

/// `raw` as `json.loads(…, parse_float=str)` reads it, except that `-0` is the float -0.0;
/// `None` for what serde refuses or reads otherwise (the caller's parser then decides).
fn exact_value<'py>(py: Python<'py>, raw: &RawValue) -> Option<Bound<'py, PyAny>> {
    let text = raw.get();
    match text.as_bytes().first()? {
        b'{' => {
            let members: Members<'_> = serde_json::from_str(text).ok()?;
            let dict = PyDict::new(py);
            for (k, v) in members.0 {
                dict.set_item(k.as_ref(), exact_value(py, v)?).ok()?; // a repeated name: the last value wins
            }
            Some(dict.into_any())
        }
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(text).ok()?;
            let list = PyList::empty(py);
            for v in items {
                list.append(exact_value(py, v)?).ok()?;
            }
            Some(list.into_any())
        }
        b'"' => {
            let s: Cow<'_, str> = serde_json::from_str(text).ok()?;
            Some(PyString::new(py, &s).into_any())
        }
        b't' if text == "true" => Some(PyBool::new(py, true).to_owned().into_any()),
        b'f' if text == "false" => Some(PyBool::new(py, false).to_owned().into_any()),
        b'n' if text == "null" => Some(py.None().into_bound(py)),
        b'-' | b'0'..=b'9' => {
            if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
                Some(PyString::new(py, text).into_any()) // a fraction or exponent: its text
            } else if text == "-0" {
                Some(PyFloat::new(py, -0.0).into_any())
            } else if let Ok(v) = text.parse::<i64>() {
                Some(v.into_pyobject(py).ok()?.into_any())
            } else {
                py.get_type::<PyInt>().call1((text,)).ok() // beyond 64 bits
            }
        }
        _ => None,
    }
}

/// A wal2json payload with every number exact: integers as ints (-0 as the float -0.0),
/// fractions as their text, like `json.loads(buf, parse_float=str)`; `None` when the payload
/// is not JSON serde reads (the caller's parser decides then).
#[pyfunction]
pub(crate) fn loads_exact<'py>(py: Python<'py>, buf: &[u8]) -> Option<Bound<'py, PyAny>> {
    let raw: &RawValue = serde_json::from_slice(buf).ok()?;
    exact_value(py, raw)
}
