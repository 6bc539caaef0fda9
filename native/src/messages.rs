//! A read's XLogData messages: payloads side by side in one buffer, with their positions.
//!
//! The reader made a `bytes`, an `int` and a tuple for every message, and a change run's
//! encoder read them back: three objects a row made, held and freed for nothing. `CopyReader`
//! now fills `Messages` and the run encoders read its buffer; Python code (the decoders' loop,
//! for the messages that start a run or are not changes) gets `(position, payload)` tuples
//! made on demand, through the sequence protocol.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::records::sequence_index;

#[pyclass(sequence, module = "walbus_native")]
#[derive(Default)]
pub struct Messages {
    data: Vec<u8>,
    /// Where each payload ends in `data` (the next one starts there).
    ends: Vec<usize>,
    starts: Vec<u64>,
}

impl Messages {
    pub(crate) fn push(&mut self, start: u64, payload: &[u8]) {
        self.data.extend_from_slice(payload);
        self.ends.push(self.data.len());
        self.starts.push(start);
    }

    pub(crate) fn count(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn get(&self, i: usize) -> (u64, &[u8]) {
        let from = if i == 0 { 0 } else { self.ends[i - 1] };
        (self.starts[i], &self.data[from..self.ends[i]])
    }

    fn item<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyTuple>> {
        let (start, payload) = self.get(i);
        (start, PyBytes::new(py, payload)).into_pyobject(py)
    }
}

#[pymethods]
impl Messages {
    /// Empty, or holding `items` (`(position, payload)` pairs: for tests).
    #[new]
    #[pyo3(signature = (items=Vec::new()))]
    fn new(items: Vec<(u64, Bound<'_, PyBytes>)>) -> Self {
        let mut messages = Messages::default();
        for (start, payload) in &items {
            messages.push(*start, payload.as_bytes());
        }
        messages
    }

    fn __len__(&self) -> usize {
        self.count()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyTuple>> {
        self.item(py, sequence_index(index, self.count(), "Messages")?)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let items = PyList::new(py, (0..self.count()).map(|i| self.item(py, i)).collect::<PyResult<Vec<_>>>()?)?;
        Ok(items.try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("<Messages: {} XLogData payloads, {} bytes>", self.count(), self.data.len())
    }
}

/// A payload borrowed from `Messages` or held by the `bytes` of a list's tuple.
pub(crate) enum Payload<'a, 'py> {
    Slice(&'a [u8]),
    Bytes(Bound<'py, PyBytes>),
}

impl Payload<'_, '_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Payload::Slice(s) => s,
            Payload::Bytes(b) => b.as_bytes(),
        }
    }
}

/// What the run encoders read messages from: a reader's `Messages`, or a list of
/// `(position, payload)` tuples (the pure-Python reader's, tests').
pub(crate) enum MessageSource<'py> {
    Native(PyRef<'py, Messages>),
    List(Bound<'py, PyList>),
}

impl<'py> MessageSource<'py> {
    pub(crate) fn of(messages: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(native) = messages.cast::<Messages>() {
            return Ok(MessageSource::Native(native.try_borrow()?));
        }
        Ok(MessageSource::List(messages.cast::<PyList>()?.clone()))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            MessageSource::Native(m) => m.count(),
            MessageSource::List(l) => l.len(),
        }
    }

    pub(crate) fn get(&self, i: usize) -> PyResult<(u64, Payload<'_, 'py>)> {
        match self {
            MessageSource::Native(m) => {
                let (start, payload) = m.get(i);
                Ok((start, Payload::Slice(payload)))
            }
            MessageSource::List(l) => {
                let (start, payload): (u64, Bound<'py, PyBytes>) = l.get_item(i)?.extract()?;
                Ok((start, Payload::Bytes(payload)))
            }
        }
    }
}
