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
use crate::{change_args, convert_to, push_event_head_with, push_json_string, ChangeParts, ChangeRun, InsertParts, KeyParts, RunBuilder, BOOL, TEXT};

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

/// The fields of a change this path reads; others are skipped. `xid` and `timestamp` only
/// for where they lie (they vary from one transaction to the next: holes of a [`Shape`]).
#[derive(Deserialize)]
struct Change<'a> {
    #[serde(borrow)]
    action: Cow<'a, str>,
    #[serde(borrow, default)]
    xid: Option<&'a RawValue>,
    #[serde(borrow, default)]
    timestamp: Option<&'a RawValue>,
    #[serde(borrow)]
    lsn: &'a RawValue,
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
        // (memmem: a byte-window compare over each payload was ~5% of a wide table's producer)
        *self.found.get_or_insert_with(|| memchr::memmem::find(self.buf, EXACT_MARK).is_some())
    }
}

/// One value, as the caller's slow path converts it; its JSON appended to `json`. `text`: the
/// value's JSON text (valid UTF-8, no raw control character: serde or [`scan_value`] saw to
/// it). `exact`: whether the payload has `EXACT_MARK`. `Some(None)`: taken, without its Python
/// value (`make` false).
fn value<'py>(py: Python<'py>, kind: u8, text: &str, exact: &mut ExactMark<'_>, json: &mut Vec<u8>, make: bool) -> Option<Option<Bound<'py, PyAny>>> {
    let bytes = text.as_bytes();
    match bytes.first()? {
        b'n' if text == "null" => {
            json.extend_from_slice(b"null");
            Some(make.then(|| py.None().into_bound(py)))
        }
        b't' | b'f' if kind == BOOL => {
            let v = match text {
                "true" => true,
                "false" => false,
                _ => return None,
            };
            json.extend_from_slice(text.as_bytes());
            Some(make.then(|| PyBool::new(py, v).to_owned().into_any()))
        }
        b'"' if kind == TEXT => {
            if !make && bytes.len() >= 2 && escaped_as_we_escape(&bytes[1..bytes.len() - 1]) {
                json.extend_from_slice(bytes); // the same bytes as decoding and escaping again
                return Some(None);
            }
            let s = json_str(text)?;
            push_json_string(json, &s);
            Some(make.then(|| PyString::new(py, &s).into_any()))
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
            convert_to(py, kind, bytes, json, make)
        }
        _ => None,
    }
}

/// Whether a JSON string's text between its quotes (valid: no raw control character, quote or
/// backslash) has only the escapes `push_json_string` writes for the characters they stand
/// for: then decoding it and escaping it again gives the same bytes.
fn escaped_as_we_escape(inner: &[u8]) -> bool {
    let mut i = 0;
    while let Some(at) = memchr::memchr(b'\\', &inner[i..]) {
        let e = i + at;
        match inner.get(e + 1) {
            Some(b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f') => i = e + 2,
            Some(b'u') => {
                // \u00XX, lower-case hex, for a control character without a short form
                let Some(&[b'0', b'0', hi @ (b'0' | b'1'), lo]) = inner.get(e + 2..e + 6) else { return false };
                let Some(low) = (lo as char).to_digit(16).filter(|_| !lo.is_ascii_uppercase()) else { return false };
                if matches!((hi - b'0') * 16 + low as u8, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d) {
                    return false;
                }
                i = e + 6;
            }
            _ => return false,
        }
    }
    true
}

/// Where a change's parts vary: between its holes a change of the same shape repeats the
/// learned one byte for byte.
#[derive(Clone, Copy)]
enum Hole {
    /// `xid`, `timestamp`: read by nobody here, so held to plain ASCII text or a number.
    Skip,
    Lsn,
    /// The value of column `n` of `columns` (`New`) or `identity` (`Old`).
    New(usize),
    Old(usize),
}

/// The shape of a change (one per operation letter), learned from one that serde read and
/// this path took: its text, and the spans of its holes in order. A change that repeats the
/// text between the holes and has a JSON scalar in each is the same change as far as this
/// path reads (same action, table, column signature, identity columns), so it is taken
/// without a parse; any other goes through serde as before.
struct Shape {
    text: Vec<u8>,
    holes: Vec<(usize, usize, Hole)>,
}

/// Where one change's parts lie in its payload, as spans.
#[derive(Default)]
struct Spans {
    lsn: (usize, usize),
    new: Vec<(usize, usize)>,
    old: Vec<(usize, usize)>,
}

impl Spans {
    fn reset(&mut self, new: usize, old: usize) {
        self.new.clear();
        self.new.resize(new, (0, 0));
        self.old.clear();
        self.old.resize(old, (0, 0));
    }
}

/// The span of `raw` within `buf`, which it was borrowed from.
fn span_in(buf: &[u8], raw: &RawValue) -> (usize, usize) {
    let start = raw.get().as_ptr() as usize - buf.as_ptr() as usize;
    (start, start + raw.get().len())
}

impl Shape {
    /// The shape of `buf`, whose holes `spans` has (and `skip`: `xid`, `timestamp`).
    fn learn(buf: &[u8], spans: &Spans, skip: &[(usize, usize)]) -> Self {
        let mut holes: Vec<(usize, usize, Hole)> = skip.iter().map(|&(a, b)| (a, b, Hole::Skip)).collect();
        holes.push((spans.lsn.0, spans.lsn.1, Hole::Lsn));
        holes.extend(spans.new.iter().enumerate().map(|(n, &(a, b))| (a, b, Hole::New(n))));
        holes.extend(spans.old.iter().enumerate().map(|(n, &(a, b))| (a, b, Hole::Old(n))));
        holes.sort_unstable_by_key(|h| h.0);
        Shape { text: buf.to_vec(), holes }
    }

    /// Whether `buf` has this shape; its holes' spans into `spans` (sized for them already).
    fn fit(&self, buf: &[u8], spans: &mut Spans) -> bool {
        let (mut at, mut done) = (0, 0);
        for &(start, end, hole) in &self.holes {
            let between = &self.text[done..start];
            if buf.get(at..at + between.len()) != Some(between) {
                return false;
            }
            at += between.len();
            let Some((len, plain)) = scan_value(&buf[at..]) else { return false };
            let span = (at, at + len);
            match hole {
                Hole::Skip | Hole::Lsn if !plain => return false,
                Hole::Skip => {}
                Hole::Lsn => spans.lsn = span,
                Hole::New(n) => spans.new[n] = span,
                Hole::Old(n) => spans.old[n] = span,
            }
            at += len;
            done = end;
        }
        buf.get(at..) == Some(&self.text[done..])
    }
}

/// The length of the JSON scalar that `buf` starts with (a string, a number, `null`, `true`,
/// `false`; what serde would take, or else `None`), and whether it is plain: a number, or a
/// string of printable ASCII without escapes. A string's escapes and UTF-8 are its reader's to
/// check (serde, when the value is used); raw control characters are refused here.
fn scan_value(buf: &[u8]) -> Option<(usize, bool)> {
    match *buf.first()? {
        b'"' => {
            let mut plain = true;
            let mut i = 1;
            loop {
                match *buf.get(i)? {
                    b'"' => return Some((i + 1, plain)),
                    b'\\' => {
                        plain = false;
                        i += 2;
                    }
                    b if b < 0x20 => return None,
                    b => {
                        plain &= b < 0x7f;
                        i += 1;
                    }
                }
            }
        }
        b'n' if buf.starts_with(b"null") => Some((4, false)),
        b't' if buf.starts_with(b"true") => Some((4, false)),
        b'f' if buf.starts_with(b"false") => Some((5, false)),
        b'-' | b'0'..=b'9' => number_len(buf).map(|n| (n, true)),
        _ => None,
    }
}

/// The length of the JSON number `buf` starts with (JSON's grammar: no leading zeros, no
/// bare dot), `None` if it starts with none.
fn number_len(buf: &[u8]) -> Option<usize> {
    let digits = |from: usize| buf[from..].iter().take_while(|b| b.is_ascii_digit()).count();
    let mut i = usize::from(buf.first() == Some(&b'-'));
    match buf.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i += digits(i),
        _ => return None,
    }
    if buf.get(i) == Some(&b'.') {
        let n = digits(i + 1);
        if n == 0 {
            return None;
        }
        i += 1 + n;
    }
    if matches!(buf.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(buf.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let n = digits(i);
        if n == 0 {
            return None;
        }
        i += n;
    }
    Some(i)
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
/// unchanged TOAST value; an identity that is not exactly the key). Without `rows` the new and
/// old rows' lists stay empty, as `encode_changes`' do.
#[pyfunction]
#[pyo3(signature = (messages, start, schema, table, signature, kinds, parts, key_parts, seq, limit, key=None, change_parts=None, rows=true))]
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
    rows: bool,
) -> PyResult<ChangeRun<'py>> {
    let mut run = RunBuilder::new(py);
    run.images = rows;
    let changes = change_args(&key, &change_parts, kinds.len());
    if signature.len() == kinds.len() {
        let mut value_json: Vec<u8> = Vec::new();
        let mut spans = Spans::default();
        let mut shapes: [Option<Shape>; 3] = [None, None, None]; // I, U, D
        let messages = MessageSource::of(messages)?;
        for i in start..messages.len().min(start.saturating_add(limit)) {
            let (_, payload) = messages.get(i)?;
            let buf = payload.bytes();
            let (op, slot) = match buf.get(..13) {
                Some(b"{\"action\":\"I\"") => (b'I', 0),
                Some(b"{\"action\":\"U\"") if changes.is_some() => (b'U', 1),
                Some(b"{\"action\":\"D\"") if changes.is_some() => (b'D', 2),
                _ => break,
            };
            let identity = match (op, changes) {
                (b'I', _) => None,
                (_, Some(kc)) => Some(kc),
                _ => break,
            };
            spans.reset(if op == b'D' { 0 } else { kinds.len() }, identity.map_or(0, |(k, _)| k.len()));
            if !shapes[slot].as_ref().is_some_and(|shape| shape.fit(buf, &mut spans)) {
                let Some(shape) = read_change(buf, op, schema, table, &signature, identity.map(|(k, _)| k), &mut spans) else { break };
                shapes[slot] = Some(shape);
            }
            let Some(lsn) = text_at(buf, spans.lsn).and_then(json_str).and_then(|t| parse_lsn(&t)) else { break };
            let mut exact = ExactMark { buf, found: None };
            let event_seq = seq + (i - start) as u64;
            value_json.clear();
            let tail = match identity {
                None => parts.2.as_bytes(),
                Some((_, cp)) => if op == b'U' { cp.0.as_bytes() } else { cp.1.as_bytes() },
            };
            push_event_head_with(&mut value_json, &parts, tail, lsn, event_seq);
            let mut row: Option<Vec<Bound<'py, PyAny>>> = None;
            if op != b'D' {
                let mut new = Vec::with_capacity(if rows { kinds.len() } else { 0 });
                if !push_values(py, buf, spans.new.iter().copied().zip(kinds.iter().copied()), &mut exact, &mut value_json, &mut new, rows) {
                    break;
                }
                row = Some(new);
            }
            let mut old: Option<Vec<Bound<'py, PyAny>>> = None;
            if let Some((k, cp)) = identity {
                value_json.extend_from_slice(cp.2.as_bytes());
                let mut key_values = Vec::with_capacity(if rows { k.len() } else { 0 });
                if !push_values(py, buf, spans.old.iter().copied().zip(k.iter().map(|&c| kinds[c])), &mut exact, &mut value_json, &mut key_values, rows) {
                    break;
                }
                value_json.extend_from_slice(cp.3.as_bytes());
                if rows {
                    let mut whole_old: Vec<Bound<'py, PyAny>> = (0..kinds.len()).map(|_| py.None().into_bound(py)).collect();
                    for (&c, v) in k.iter().zip(key_values) {
                        whole_old[c] = v;
                    }
                    old = Some(whole_old);
                }
            }
            value_json.extend_from_slice(parts.3.as_bytes());
            run.push(&key_parts, event_seq, op, &value_json, row, old)?;
        }
    }
    run.finish()
}

/// A change read by serde, when it is one this path takes (operation `op` of `schema`.`table`,
/// every column with `signature`, an identity that is exactly `key`): its parts' spans into
/// `spans` (sized for them), and its shape, for the next ones.
fn read_change(
    buf: &[u8], op: u8, schema: &str, table: &str, signature: &[Signature], key: Option<&[usize]>, spans: &mut Spans,
) -> Option<Shape> {
    let change = serde_json::from_slice::<Change<'_>>(buf).ok()?;
    if change.action.as_bytes() != [op] || change.schema != schema || change.table != table {
        return None;
    }
    let whole = change.columns.len() == signature.len()
        && change.columns.iter().zip(signature).all(|(c, s)| {
            c.name == s.0.as_str() && c.typeoid == s.1 && c.declared.as_deref() == s.2.as_deref() && c.optional == s.3
        });
    if !(if op == b'D' { change.columns.is_empty() } else { whole }) {
        return None;
    }
    match (key, &change.identity) {
        (None, None) => {}
        (Some(k), Some(ident)) if is_key(ident, k, signature) => {
            for (n, c) in ident.iter().enumerate() {
                spans.old[n] = span_in(buf, c.value);
            }
        }
        _ => return None,
    }
    for (n, c) in change.columns.iter().enumerate() {
        spans.new[n] = span_in(buf, c.value);
    }
    spans.lsn = span_in(buf, change.lsn);
    let skip: Vec<(usize, usize)> = [change.xid, change.timestamp].into_iter().flatten().map(|r| span_in(buf, r)).collect();
    Some(Shape::learn(buf, spans, &skip))
}

/// The JSON text at `span` of `buf`.
fn text_at(buf: &[u8], span: (usize, usize)) -> Option<&str> {
    std::str::from_utf8(buf.get(span.0..span.1)?).ok()
}

/// A JSON string's value: its text between the quotes when it has no escape, else serde's.
fn json_str(text: &str) -> Option<Cow<'_, str>> {
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if !inner.contains(['\\', '"']) => Some(Cow::Borrowed(inner)),
        _ => serde_json::from_str(text).ok(),
    }
}

/// The values at `columns`' spans of `buf` as a JSON array appended to `json`, each converted
/// to `out` (when `make`) as the slow path converts it (`kinds` beside them); false when one is
/// the slow path's to decide.
fn push_values<'py>(
    py: Python<'py>,
    buf: &[u8],
    columns: impl Iterator<Item = ((usize, usize), u8)>,
    exact: &mut ExactMark<'_>,
    json: &mut Vec<u8>,
    out: &mut Vec<Bound<'py, PyAny>>,
    make: bool,
) -> bool {
    json.push(b'[');
    for (n, (span, kind)) in columns.enumerate() {
        if n > 0 {
            json.push(b',');
        }
        let Some(text) = text_at(buf, span) else { return false };
        match value(py, kind, text, exact, json, make) {
            Some(Some(v)) => out.push(v),
            Some(None) => {}
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
