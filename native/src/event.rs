//! A database-topic value (one event's JSON object) decoded straight into the caller's event
//! objects: the consumers' hot path.
//!
//! A leaf like the tuple decoder: the caller names the wire fields and the object attributes
//! (in the orders documented at `EventDecoder::new`), the operations and the limits; this code
//! spells none of them. It accepts a strict subset of what the caller's reference decoder
//! accepts: anything else (an unknown or repeated field, a value of another JSON type, a
//! number out of its range, a nested value, a quoted table name, escapes it cannot decode)
//! makes `decode` return `None`, and the caller decodes that value the slow way, which
//! decides and words the errors. Both paths build equal objects (the caller's property tests).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple, PyType};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

// The wire fields, by the index of their name in `EventDecoder::new`'s `wire_names`.
const VERSION: usize = 0;
const INTS: [usize; 4] = [1, 2, 3, 4]; // lsn, commit_lsn, seq, xid
const OPERATION: usize = 5;
const TABLE: usize = 6;
const TIMESTAMP: usize = 7;
const PK: usize = 8;
const COLUMNS: usize = 9;
const TYPES: usize = 10;
const VALUES: usize = 11;
const IDENTITY: usize = 12;
const UNCHANGED: usize = 13;
const NOT_NULL: usize = 14;
const TYPMODS: usize = 15;
const WIRE_FIELDS: usize = 16;
const EVENT_ATTRS: usize = 13;
const IMAGE_FIELDS: usize = 3;

type Str<'a> = Cow<'a, str>;

/// A JSON string, borrowed from the input when it holds no escapes.
#[derive(Clone, Copy)]
struct StrSeed;

impl<'de> DeserializeSeed<'de> for StrSeed {
    type Value = Str<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(StrVisitor)
    }
}

struct StrVisitor;

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Str<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// A JSON array (not null) of what `S` reads.
#[derive(Clone, Copy)]
struct ListSeed<S>(S);

impl<'de, S: DeserializeSeed<'de> + Copy> DeserializeSeed<'de> for ListSeed<S> {
    type Value = Vec<S::Value>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, S: DeserializeSeed<'de> + Copy> Visitor<'de> for ListSeed<S> {
    type Value = Vec<S::Value>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(8));
        while let Some(v) = seq.next_element_seed(self.0)? {
            out.push(v);
        }
        Ok(out)
    }
}

const NAMES: ListSeed<StrSeed> = ListSeed(StrSeed);
const SCALARS: ListSeed<ScalarSeed> = ListSeed(ScalarSeed);

/// One column value: a JSON scalar.
enum Scalar<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(Str<'a>),
}

// Integers beyond 64 bits reach a visitor as floats (serde_json); the reference decoder and
// this one could read them differently, so floats this large, and zeros (1e-400 reads as
// 0.0), are the slow path's.
const FLOAT_LIMIT: f64 = 9.2e18;

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON scalar")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Scalar::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        i64::try_from(v).map(Scalar::Int).map_err(|_| E::custom(""))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        if v.is_finite() && v != 0.0 && v.abs() < FLOAT_LIMIT {
            Ok(Scalar::Float(v))
        } else {
            Err(E::custom(""))
        }
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Scalar::Text(Cow::Owned(v)))
    }
}

#[derive(Clone, Copy)]
struct ScalarSeed;

impl<'de> DeserializeSeed<'de> for ScalarSeed {
    type Value = Scalar<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

/// An unsigned integer (a negative zero reads as 0, as everywhere else).
struct UintSeed;

impl<'de> DeserializeSeed<'de> for UintSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_u64(UintVisitor)
    }
}

struct UintVisitor;

impl<'de> Visitor<'de> for UintVisitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an unsigned integer")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u64::try_from(v).map_err(|_| E::custom(""))
    }
}

/// A signed integer within ±`limit` (`-limit <= v < limit`).
struct BoundedIntVisitor(i64);

impl<'de> Visitor<'de> for BoundedIntVisitor {
    type Value = i64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a bounded integer")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        if -self.0 <= v && v < self.0 {
            Ok(v)
        } else {
            Err(E::custom(""))
        }
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        let v = i64::try_from(v).map_err(|_| E::custom(""))?;
        self.visit_i64(v)
    }
}

#[derive(Clone, Copy)]
struct BoundedIntSeed(i64);

impl<'de> DeserializeSeed<'de> for BoundedIntSeed {
    type Value = i64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_i64(BoundedIntVisitor(self.0))
    }
}

type Typmods<'a> = Vec<(Str<'a>, Vec<i64>)>;

/// An object of column name to a list of modifiers (null: see `Nullable`).
#[derive(Clone, Copy)]
struct TypmodsSeed(i64);

impl<'de> DeserializeSeed<'de> for TypmodsSeed {
    type Value = Typmods<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TypmodsSeed {
    type Value = Typmods<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of modifier lists")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(name) = map.next_key_seed(StrSeed)? {
            out.push((name, map.next_value_seed(ListSeed(BoundedIntSeed(self.0)))?));
        }
        Ok(out)
    }
}

/// What `S` reads, or JSON null.
struct Nullable<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value or null")
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(d).map(Some)
    }
}

/// A row image object: exactly the three named fields (the names as their raw JSON: cached).
struct Image<'a> {
    columns: &'a RawValue,
    types: &'a RawValue,
    values: Vec<Scalar<'a>>,
}

struct ImageSeed<'n>(&'n [String; IMAGE_FIELDS]);

impl<'de> DeserializeSeed<'de> for ImageSeed<'_> {
    type Value = Image<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ImageSeed<'_> {
    type Value = Image<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a row image")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut columns, mut types, mut values) = (None, None, None);
        while let Some(key) = map.next_key_seed(StrSeed)? {
            match self.0.iter().position(|n| *n == key) {
                Some(0) if columns.is_none() => columns = Some(map.next_value::<&'de RawValue>()?),
                Some(1) if types.is_none() => types = Some(map.next_value::<&'de RawValue>()?),
                Some(2) if values.is_none() => values = Some(map.next_value_seed(SCALARS)?),
                _ => return Err(de::Error::custom("")), // unknown or repeated
            }
        }
        match (columns, types, values) {
            (Some(columns), Some(types), Some(values)) => Ok(Image { columns, types, values }),
            _ => Err(de::Error::custom("")),
        }
    }
}

/// The fields of one value, as read. Names, the table and the timestamp stay raw JSON: they
/// repeat from event to event, and their Python objects come from a cache.
#[derive(Default)]
struct Wire<'a> {
    seen: [bool; WIRE_FIELDS],
    version: u64,
    ints: [u64; 4],
    operation: Str<'a>,
    table: Option<&'a RawValue>,
    timestamp: Option<&'a RawValue>,
    pk: Option<&'a RawValue>,
    columns: Option<&'a RawValue>,
    types: Option<&'a RawValue>,
    values: Vec<Scalar<'a>>,
    identity: Option<Image<'a>>,
    unchanged: Option<&'a RawValue>,
    not_null: Option<&'a RawValue>,
    typmods: Option<Typmods<'a>>,
}

struct WireSeed<'d>(&'d EventDecoder);

impl<'de> DeserializeSeed<'de> for WireSeed<'_> {
    type Value = Wire<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for WireSeed<'_> {
    type Value = Wire<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let decoder = self.0;
        let mut w = Wire::default();
        // The producer writes the fields in `wire_names`' order: the one after the last is
        // tried first, so a usual event needs one name comparison a field, not a search.
        let mut next = 0;
        while let Some(key) = map.next_key_seed(StrSeed)? {
            let i = if next < WIRE_FIELDS && decoder.wire_names[next] == key {
                next
            } else {
                let Some(i) = decoder.wire_names.iter().position(|n| *n == key) else {
                    return Err(de::Error::custom("")); // an unknown field
                };
                i
            };
            next = i + 1;
            if w.seen[i] {
                return Err(de::Error::custom("")); // a repeated field
            }
            w.seen[i] = true;
            match i {
                VERSION => w.version = map.next_value_seed(UintSeed)?,
                1..=4 => {
                    let v = map.next_value_seed(UintSeed)?;
                    if v > decoder.int_limits[i - 1] {
                        return Err(de::Error::custom(""));
                    }
                    w.ints[i - 1] = v;
                }
                OPERATION => w.operation = map.next_value_seed(StrSeed)?,
                TABLE => w.table = Some(map.next_value()?),
                TIMESTAMP => w.timestamp = Some(map.next_value()?),
                PK => w.pk = Some(map.next_value()?),
                COLUMNS => w.columns = Some(map.next_value()?),
                TYPES => w.types = Some(map.next_value()?),
                VALUES => w.values = map.next_value_seed(SCALARS)?,
                IDENTITY => w.identity = map.next_value_seed(Nullable(ImageSeed(&decoder.image_names)))?,
                UNCHANGED => w.unchanged = Some(map.next_value()?),
                NOT_NULL => w.not_null = Some(map.next_value()?),
                TYPMODS => w.typmods = map.next_value_seed(Nullable(TypmodsSeed(decoder.typmod_limit)))?,
                _ => return Err(de::Error::custom("")),
            }
        }
        Ok(w)
    }
}

/// Decodes database-topic values into the caller's (slotted, possibly frozen) event classes.
#[pyclass(frozen, module = "walbus_native")]
pub struct EventDecoder {
    wire_names: [String; WIRE_FIELDS],
    image_names: [String; IMAGE_FIELDS],
    int_limits: [u64; 4],
    version: u64,
    typmod_limit: i64,
    operations: Vec<(String, Py<PyString>, bool)>, // name, the caller's string, whether it needs a row
    event_attrs: Vec<Py<PyString>>,
    image_attrs: Vec<Py<PyString>>,
    image_class: Py<PyType>,
    image_layout: Layout,
    no_typmods: Py<PyAny>,
    layouts: Mutex<Vec<(Py<PyType>, Arc<Layout>)>>, // the event classes decoded into so far
    key_format: Option<KeyFormat>, // None: decode_keyed declines every record
    cache: Mutex<Cache>,
}

/// A record key's one text of a position: (commit_lsn, seq) in upper-case hex, zero-padded to
/// fixed widths, with a separator between them.
struct KeyFormat {
    widths: [usize; 2],
    separator: Vec<u8>,
}

impl KeyFormat {
    /// Whether `key` is the text of `(commit_lsn, seq)` (false too when a number is wider than
    /// its width: the caller's own formatting decides about those).
    fn matches(&self, key: &[u8], commit_lsn: u64, seq: u64) -> bool {
        let [a, b] = self.widths;
        let sep = self.separator.as_slice();
        key.len() == a + sep.len() + b
            && hex_is(&key[..a], commit_lsn)
            && &key[a..a + sep.len()] == sep
            && hex_is(&key[a + sep.len()..], seq)
    }
}

/// Whether `text` is `v` in upper-case hex, zero-padded to exactly `text.len()` digits.
fn hex_is(text: &[u8], v: u64) -> bool {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let n = text.len();
    if n < 16 && v >> (4 * n) != 0 {
        return false;
    }
    text.iter().enumerate().all(|(i, &c)| {
        let shift = 4 * (n - 1 - i);
        let nibble = if shift >= 64 { 0 } else { (v >> shift) & 0xF };
        c == DIGITS[nibble as usize]
    })
}

// Entries per map before it starts again empty: a table's names are a few entries, and
// a topic with thousands of tables or ever-changing names must not grow it without bound.
const CACHE_LIMIT: usize = 4096;

/// A multiply-rotate hash taking eight bytes a step (the keys are short JSON texts the caller's
/// own producer wrote, hashed a few times per event): SipHash's flood resistance is not needed
/// for a bounded cache, and a byte-at-a-time hash was a visible part of a decode.
#[derive(Default)]
struct WordHash(u64);

const WORD_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl WordHash {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(WORD_SEED);
    }
}

impl Hasher for WordHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.add(u64::from_le_bytes(word.try_into().unwrap_or_default()));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(last));
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64); // the slice's length: texts that differ only in trailing zeros differ here
    }
}

type Map<V> = HashMap<Box<[u8]>, V, BuildHasherDefault<WordHash>>;

/// Python objects of raw JSON that repeats from event to event. Tuples and strings only:
/// immutable, so events may share them.
#[derive(Default)]
struct Cache {
    names: Map<(Py<PyTuple>, usize)>, // a name array: the tuple, its length
    tables: Map<Py<PyString>>,         // a plain table name
    texts: Map<Py<PyString>>,          // any other string (a timestamp)
}

fn remember<V>(map: &mut Map<V>, raw: &[u8], value: V) {
    if map.len() >= CACHE_LIMIT {
        map.clear();
    }
    map.insert(raw.into(), value);
}

fn array<const N: usize>(names: Vec<String>, what: &str) -> PyResult<[String; N]> {
    names.try_into().map_err(|_| PyValueError::new_err(format!("{what}: expected {N} names")))
}

/// How the decoder stores attributes on a new instance of a class.
enum Layout {
    /// The byte offset of each attribute's slot in an instance: a plain pointer store, as the
    /// slot's descriptor makes it, without looking the descriptor up (16 stores an event).
    Slots(Vec<usize>),
    /// Through the class's descriptors, `object.__setattr__`'s way (what `probe` did not prove plain).
    Generic,
}

// Event classes whose layout is kept; more start the list again (a caller uses one or two).
const LAYOUT_LIMIT: usize = 16;

/// Where `cls`'s instances keep `attrs`. Each must be a member descriptor (what `__slots__`
/// and slotted dataclasses make); its offset is found by storing a new object through the
/// descriptor on an empty instance and finding that object's address, once, among the
/// instance's words. Anything else (another descriptor, no match, two matches, a class with
/// its own `__new__`) gives `Layout::Generic`.
fn probe(cls: &Bound<'_, PyType>, attrs: &[Py<PyString>]) -> PyResult<Layout> {
    let py = cls.py();
    let member = py.import("types")?.getattr("MemberDescriptorType")?;
    let basicsize: usize = cls.getattr("__basicsize__")?.extract()?;
    let Some(instance) = alloc(cls)? else { return Ok(Layout::Generic) };
    let word = std::mem::size_of::<*mut ffi::PyObject>();
    let header = std::mem::size_of::<ffi::PyObject>();
    let mut offsets: Vec<usize> = Vec::with_capacity(attrs.len());
    for name in attrs {
        if !cls.getattr(name.bind(py))?.get_type().is(&member) {
            return Ok(Layout::Generic);
        }
        let marker = PyList::empty(py); // a new object: its address is nowhere else
        set(&instance, name, marker.as_any())?;
        let base = instance.as_ptr().cast::<u8>().cast_const();
        let mut hits = (header..=basicsize.saturating_sub(word)).step_by(word).filter(|&offset| {
            // SAFETY: offset + word <= basicsize: inside the instance; offsets are multiples of
            // the word size from an object's (word-aligned) address.
            unsafe { base.add(offset).cast::<*mut ffi::PyObject>().read() == marker.as_ptr() }
        });
        match (hits.next(), hits.next()) {
            (Some(offset), None) if !offsets.contains(&offset) => offsets.push(offset),
            _ => return Ok(Layout::Generic),
        }
    }
    Ok(Layout::Slots(offsets))
}

/// Attribute `i` (named `attrs[i]`) of a new instance `obj`, stored as `layout` says.
fn store(obj: &Bound<'_, PyAny>, layout: &Layout, attrs: &[Py<PyString>], i: usize, value: &Bound<'_, PyAny>) -> PyResult<()> {
    match layout {
        Layout::Slots(offsets) => {
            // SAFETY: obj is an instance of the class probed for `offsets`, which hold object
            // pointers (member slots); the slot takes a new reference and gives up its old one,
            // as the member descriptor's setter does.
            unsafe {
                let slot = obj.as_ptr().cast::<u8>().add(offsets[i]).cast::<*mut ffi::PyObject>();
                let old = slot.read();
                slot.write(value.clone().into_ptr());
                ffi::Py_XDECREF(old);
            }
            Ok(())
        }
        Layout::Generic => set(obj, &attrs[i], value),
    }
}

/// `obj.name = value` as `object.__setattr__` does it: through the class's slot descriptor,
/// past a frozen class's own `__setattr__`.
fn set(obj: &Bound<'_, PyAny>, name: &Py<PyString>, value: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: three valid object pointers, borrowed for the call; PyObject_GenericSetAttr
    // takes its own references.
    let rc = unsafe { ffi::PyObject_GenericSetAttr(obj.as_ptr(), name.as_ptr(), value.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(PyErr::fetch(obj.py()))
    }
}

/// A new, empty instance of `cls`, as `object.__new__(cls)` makes it; None for a class with
/// a `__new__` of its own (the slow path builds that one).
fn alloc<'py>(cls: &Bound<'py, PyType>) -> PyResult<Option<Bound<'py, PyAny>>> {
    // SAFETY: cls and object are live type objects; the slots read are their tp_new and
    // tp_alloc; tp_alloc returns a new reference, or NULL with an exception set.
    unsafe {
        let t = cls.as_ptr().cast::<ffi::PyTypeObject>();
        let object_new = ffi::PyType_GetSlot(std::ptr::addr_of_mut!(ffi::PyBaseObject_Type), ffi::Py_tp_new);
        if ffi::PyType_GetSlot(t, ffi::Py_tp_new) != object_new {
            return Ok(None);
        }
        let slot = ffi::PyType_GetSlot(t, ffi::Py_tp_alloc);
        if slot.is_null() {
            return Ok(None);
        }
        let tp_alloc: ffi::allocfunc = std::mem::transmute(slot);
        Bound::from_owned_ptr_or_err(cls.py(), tp_alloc(t, 0)).map(Some)
    }
}

/// The tuple of a raw name array (null: the empty tuple, when `nullable`) and its length;
/// None when it is not one (the slow path decides).
fn names<'py>(py: Python<'py>, cache: &mut Cache, raw: Option<&RawValue>, nullable: bool) -> PyResult<Option<(Bound<'py, PyTuple>, usize)>> {
    let Some(raw) = raw else { return Ok(Some((PyTuple::empty(py), 0))) };
    let text = raw.get().as_bytes();
    if nullable && text == b"null" {
        return Ok(Some((PyTuple::empty(py), 0))); // not cached: null is no name array where null is refused
    }
    if let Some((tuple, n)) = cache.names.get(text) {
        return Ok(Some((tuple.bind(py).clone(), *n)));
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    let Ok(list) = NAMES.deserialize(&mut de) else { return Ok(None) };
    let tuple = PyTuple::new(py, list.iter().map(|n| PyString::new(py, n)))?;
    remember(&mut cache.names, text, (tuple.clone().unbind(), list.len()));
    Ok(Some((tuple, list.len())))
}

/// The string of a raw JSON string, when `accept` takes it; None otherwise.
/// `cache` holds only strings `accept` took.
fn string<'py>(
    py: Python<'py>,
    cache: &mut Map<Py<PyString>>,
    raw: Option<&RawValue>,
    accept: fn(&str) -> bool,
) -> PyResult<Option<Bound<'py, PyString>>> {
    let Some(raw) = raw else { return Ok(None) };
    let text = raw.get().as_bytes();
    if let Some(s) = cache.get(text) {
        return Ok(Some(s.bind(py).clone()));
    }
    let mut de = serde_json::Deserializer::from_slice(text);
    let Ok(s) = StrSeed.deserialize(&mut de) else { return Ok(None) };
    if !accept(&s) {
        return Ok(None);
    }
    let out = PyString::new(py, &s);
    remember(cache, text, out.clone().unbind());
    Ok(Some(out))
}

fn any_text(_: &str) -> bool {
    true
}

fn scalar<'py>(py: Python<'py>, v: &Scalar<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Scalar::Null => py.None().into_bound(py),
        Scalar::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Scalar::Int(i) => i.into_pyobject(py)?.into_any(),
        Scalar::Float(f) => PyFloat::new(py, *f).into_any(),
        Scalar::Text(s) => PyString::new(py, s).into_any(),
    })
}

impl EventDecoder {
    /// A table name without quotes and with one dot inside: the plain `schema.table`.
    fn plain_table(table: &str) -> bool {
        !table.contains('"') && table.matches('.').count() == 1 && !table.starts_with('.') && !table.ends_with('.')
    }

    /// A row image, or None when its names are not name arrays of the values' length.
    fn image<'py>(
        &self,
        py: Python<'py>,
        cache: &mut Cache,
        columns: Option<&RawValue>,
        types: Option<&RawValue>,
        values: &[Scalar<'_>],
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some((columns, n)) = names(py, cache, columns, false)? else { return Ok(None) };
        let Some((types, m)) = names(py, cache, types, false)? else { return Ok(None) };
        if n != m || m != values.len() {
            return Ok(None);
        }
        let Some(image) = alloc(self.image_class.bind(py))? else { return Ok(None) };
        let (layout, attrs) = (&self.image_layout, &self.image_attrs);
        store(&image, layout, attrs, 0, columns.as_any())?;
        store(&image, layout, attrs, 1, types.as_any())?;
        let values = PyTuple::new(py, values.iter().map(|v| scalar(py, v)).collect::<PyResult<Vec<_>>>()?)?;
        store(&image, layout, attrs, 2, values.as_any())?;
        Ok(Some(image))
    }
}

#[pymethods]
impl EventDecoder {
    /// `wire_names`: the 16 wire fields, in this order: version, lsn, commit_lsn, seq, xid,
    /// operation, table, timestamp, pk, columns, types, values (the new row's three), identity,
    /// unchanged, not_null, typmods. `image_names`: an identity object's columns, types,
    /// values. `int_limits`: the largest lsn, commit_lsn, seq, xid. `operations`: each
    /// operation's name and whether it needs a new row. `event_attrs`: the 13 attributes set
    /// on an event, in this order: lsn, commit_lsn, seq, xid, operation, table, timestamp, pk,
    /// new, identity, unchanged, not_null, typmods; `image_attrs`: a row image's three.
    /// `key_widths` and `key_separator`: a record key's text of (commit_lsn, seq), each in
    /// upper-case hex zero-padded to its width (without them `decode_keyed` declines every
    /// record: a caller built before it constructs the decoder as before).
    #[new]
    #[pyo3(signature = (wire_names, image_names, int_limits, version, typmod_limit, operations, event_attrs, image_attrs, image_class, no_typmods, key_widths=None, key_separator=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        wire_names: Vec<String>,
        image_names: Vec<String>,
        int_limits: [u64; 4],
        version: u64,
        typmod_limit: i64,
        operations: Vec<(Bound<'_, PyString>, bool)>,
        event_attrs: Vec<Bound<'_, PyString>>,
        image_attrs: Vec<Bound<'_, PyString>>,
        image_class: Bound<'_, PyType>,
        no_typmods: Bound<'_, PyAny>,
        key_widths: Option<[usize; 2]>,
        key_separator: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        if event_attrs.len() != EVENT_ATTRS || image_attrs.len() != IMAGE_FIELDS {
            return Err(PyValueError::new_err("expected 13 event and 3 image attributes"));
        }
        let image_attrs: Vec<Py<PyString>> = image_attrs.into_iter().map(Bound::unbind).collect();
        let image_layout = probe(&image_class, &image_attrs)?;
        let operations = operations
            .into_iter()
            .map(|(name, row)| Ok((name.to_str()?.to_owned(), name.unbind(), row)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(EventDecoder {
            wire_names: array(wire_names, "wire_names")?,
            image_names: array(image_names, "image_names")?,
            int_limits,
            version,
            typmod_limit,
            operations,
            event_attrs: event_attrs.into_iter().map(Bound::unbind).collect(),
            image_attrs,
            image_layout,
            layouts: Mutex::new(Vec::new()),
            image_class: image_class.unbind(),
            no_typmods: no_typmods.unbind(),
            key_format: key_widths.zip(key_separator).map(|(widths, separator)| KeyFormat { widths, separator }),
            cache: Mutex::new(Cache::default()),
        })
    }

    /// The event of `value` as an instance of `cls` (its own further attributes left unset),
    /// or None when the slow path must decide.
    fn decode<'py>(&self, py: Python<'py>, value: &[u8], cls: &Bound<'py, PyType>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.decode_record(py, None, value, cls)
    }

    /// Whether events of `cls` get their attributes by plain slot stores (else through the
    /// class's descriptors): for tests and diagnostics.
    fn stores_directly(&self, cls: &Bound<'_, PyType>) -> PyResult<bool> {
        Ok(matches!(*self.layout(cls)?, Layout::Slots(_)) && matches!(self.image_layout, Layout::Slots(_)))
    }

    /// `decode` of a record whose key must be the event's own position: None also when the key
    /// or the value is not bytes, or the key is not the one text of the position (the slow path
    /// decides: it accepts no other key than the caller's own check does).
    fn decode_keyed<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        cls: &Bound<'py, PyType>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let (Ok(key), Ok(value)) = (key.cast::<PyBytes>(), value.cast::<PyBytes>()) else { return Ok(None) };
        self.decode_record(py, Some(key.as_bytes()), value.as_bytes(), cls)
    }
}

impl EventDecoder {
    /// How `cls` holds the event attributes: probed once per class (outside the cache's lock:
    /// the probe runs Python code).
    fn layout(&self, cls: &Bound<'_, PyType>) -> PyResult<Arc<Layout>> {
        let poisoned = || PyValueError::new_err("walbus_native: layouts poisoned");
        {
            let layouts = self.layouts.lock().map_err(|_| poisoned())?;
            if let Some((_, layout)) = layouts.iter().find(|(c, _)| c.as_ptr() == cls.as_ptr()) {
                return Ok(layout.clone());
            }
        }
        let layout = Arc::new(probe(cls, &self.event_attrs)?);
        let mut layouts = self.layouts.lock().map_err(|_| poisoned())?;
        if layouts.len() >= LAYOUT_LIMIT {
            layouts.clear();
        }
        layouts.push((cls.clone().unbind(), layout.clone()));
        Ok(layout)
    }

    fn decode_record<'py>(&self, py: Python<'py>, key: Option<&[u8]>, value: &[u8], cls: &Bound<'py, PyType>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let layout = self.layout(cls)?;
        let mut de = serde_json::Deserializer::from_slice(value);
        let Ok(w) = WireSeed(self).deserialize(&mut de) else { return Ok(None) };
        if de.end().is_err() || !w.seen[VERSION] || w.version != self.version || !INTS.iter().all(|&i| w.seen[i]) {
            return Ok(None);
        }
        if let Some(key) = key {
            let Some(format) = &self.key_format else { return Ok(None) };
            if !format.matches(key, w.ints[1], w.ints[2]) {
                return Ok(None);
            }
        }
        if !(w.seen[OPERATION] && w.seen[TABLE] && w.seen[TIMESTAMP]) {
            return Ok(None);
        }
        let Some((_, operation, needs_row)) = self.operations.iter().find(|(n, _, _)| *n == w.operation) else {
            return Ok(None);
        };
        let has_row = w.seen[COLUMNS];
        if !has_row && *needs_row || has_row && !(w.seen[TYPES] && w.seen[VALUES]) {
            return Ok(None);
        }
        let mut cache = self.cache.lock().map_err(|_| PyValueError::new_err("walbus_native: cache poisoned"))?;
        let cache = &mut *cache;
        let Some(table) = string(py, &mut cache.tables, w.table, Self::plain_table)? else { return Ok(None) };
        let Some(timestamp) = string(py, &mut cache.texts, w.timestamp, any_text)? else { return Ok(None) };
        let Some((pk, _)) = names(py, cache, w.pk, false)? else { return Ok(None) };
        let Some((unchanged, _)) = names(py, cache, w.unchanged, false)? else { return Ok(None) };
        let Some((not_null, _)) = names(py, cache, w.not_null, true)? else { return Ok(None) };
        if !has_row && w.types.is_some() && names(py, cache, w.types, false)?.is_none() {
            return Ok(None); // types without columns: no row, but still an array of names
        }
        let new = if has_row {
            let Some(image) = self.image(py, cache, w.columns, w.types, &w.values)? else { return Ok(None) };
            image
        } else {
            py.None().into_bound(py)
        };
        let identity = match &w.identity {
            Some(i) => {
                let Some(image) = self.image(py, cache, Some(i.columns), Some(i.types), &i.values)? else { return Ok(None) };
                image
            }
            None => py.None().into_bound(py),
        };
        let Some(event) = alloc(cls)? else { return Ok(None) };
        let (layout, attrs) = (&*layout, &self.event_attrs);
        for (k, v) in w.ints.iter().enumerate() {
            store(&event, layout, attrs, k, v.into_pyobject(py)?.as_any())?;
        }
        store(&event, layout, attrs, 4, operation.bind(py).as_any())?;
        store(&event, layout, attrs, 5, table.as_any())?;
        store(&event, layout, attrs, 6, timestamp.as_any())?;
        store(&event, layout, attrs, 7, pk.as_any())?;
        store(&event, layout, attrs, 8, &new)?;
        store(&event, layout, attrs, 9, &identity)?;
        store(&event, layout, attrs, 10, unchanged.as_any())?;
        store(&event, layout, attrs, 11, not_null.as_any())?;
        let typmods = match &w.typmods {
            None => self.no_typmods.bind(py).clone(),
            Some(entries) => {
                let dict = PyDict::new(py);
                for (name, mods) in entries {
                    dict.set_item(PyString::new(py, name), PyTuple::new(py, mods)?)?;
                }
                dict.into_any()
            }
        };
        store(&event, layout, attrs, 12, &typmods)?;
        Ok(Some(event))
    }
}
